//! Shared-memory stages filled by asynchronous copies (`cp.async` on CUDA sm_80+), each
//! tracked by a barrier: a kernel commits the copies each unit issued into a stage to that
//! stage's barrier, and waits on it before reading the stage, which also tells every unit
//! that the others are done with the stage before (it may then be refilled). The training
//! kernels stream their blocks through two stages, the decode kernels through up to three.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

/// The barriers of up to three stages.
#[derive(CubeType)]
pub struct StageBarriers {
    stage_0: Shared<Barrier>,
    stage_1: Shared<Barrier>,
    stage_2: Shared<Barrier>,
}

#[cube]
impl StageBarriers {
    /// Barriers every unit of the cube arrives at, for `stages` stages (2 or 3; with two,
    /// the third is the second under another name).
    pub fn new(#[comptime] stages: usize) -> StageBarriers {
        let stage_0 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        let stage_1 = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
        let stage_2 = if comptime!(stages == 3) {
            Barrier::shared(CUBE_DIM, UNIT_POS == 0)
        } else {
            stage_1.clone()
        };
        StageBarriers {
            stage_0,
            stage_1,
            stage_2,
        }
    }

    /// Tracks the copies this unit has issued into stage `stage` (of `stages`). With two
    /// stages the comptime branch leaves `if stage == 0 { .. } else { .. }` in the kernel,
    /// the same code as two barriers written out.
    #[allow(clippy::if_same_then_else)]
    pub fn commit(&self, stage: usize, #[comptime] stages: usize) {
        if stage == 0 {
            self.stage_0.commit_copy_async();
        } else if comptime!(stages == 2) {
            self.stage_1.commit_copy_async();
        } else if stage == 1 {
            self.stage_1.commit_copy_async();
        } else {
            self.stage_2.commit_copy_async();
        }
    }

    /// Waits until stage `stage`'s copies have landed and every unit has arrived (compiled
    /// as [`StageBarriers::commit`] is).
    #[allow(clippy::if_same_then_else)]
    pub fn wait(&self, stage: usize, #[comptime] stages: usize) {
        if stage == 0 {
            self.stage_0.arrive_and_wait();
        } else if comptime!(stages == 2) {
            self.stage_1.arrive_and_wait();
        } else if stage == 1 {
            self.stage_1.arrive_and_wait();
        } else {
            self.stage_2.arrive_and_wait();
        }
    }
}
