//! The shared-memory stages the GPU decode kernels stream K and V through: a cube's split
//! is read in steps of a fixed number of keys, each step's keys copied asynchronously
//! (`cp.async`, CUDA sm_80+) into one of up to 3 stages ([`crate::stages`]), `stages − 1`
//! steps in flight while the cube computes on one.

use cubecl::prelude::*;

use super::task::DecodeTask;

/// The number of steps of `step` keys of the cube's split.
#[cube]
pub fn step_count(task: &DecodeTask, #[comptime] step: usize) -> i32 {
    let step = i32::cast_from(step);
    (max(task.end - task.begin, 0) + step - 1) / step
}
