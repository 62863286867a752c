//! The shared-memory stages the GPU decode kernels stream K and V through: a cube's split
//! is read in steps of a fixed number of keys, each step's keys copied asynchronously
//! (`cp.async`, CUDA sm_80+) into one of up to 3 stages, `stages − 1` steps in flight while
//! the cube computes on one.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::task::DecodeTask;

/// The number of steps of `step` keys of the cube's split.
#[cube]
pub fn step_count(task: &DecodeTask, #[comptime] step: usize) -> i32 {
    let step = i32::cast_from(step);
    (max(task.end - task.begin, 0) + step - 1) / step
}

/// The barriers that track the copies into each stage (up to 3).
#[derive(CubeType)]
pub struct StageBarriers {
    stage_0: Shared<Barrier>,
    stage_1: Shared<Barrier>,
    stage_2: Shared<Barrier>,
}

#[cube]
impl StageBarriers {
    /// Barriers every unit of the cube arrives at.
    pub fn new() -> StageBarriers {
        StageBarriers {
            stage_0: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            stage_1: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
            stage_2: Barrier::shared(CUBE_DIM, UNIT_POS == 0),
        }
    }

    /// Tracks the copies this unit has issued into stage `stage`.
    pub fn commit(&self, stage: usize, #[comptime] stages: usize) {
        if stage == 0 {
            self.stage_0.commit_copy_async();
        } else if stage == 1 || comptime!(stages == 2) {
            self.stage_1.commit_copy_async();
        } else {
            self.stage_2.commit_copy_async();
        }
    }

    /// Waits until stage `stage`'s copies have landed and every unit has arrived: every unit
    /// is then done with the step before, whose stage may be refilled.
    pub fn wait(&self, stage: usize, #[comptime] stages: usize) {
        if stage == 0 {
            self.stage_0.arrive_and_wait();
        } else if stage == 1 || comptime!(stages == 2) {
            self.stage_1.arrive_and_wait();
        } else {
            self.stage_2.arrive_and_wait();
        }
    }
}
