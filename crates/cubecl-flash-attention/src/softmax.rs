//! The online softmax: a running maximum `m` and sum `l` per query row, updated one key
//! block at a time, so that the `[s_q, s_kv]` probabilities never exist in memory.
//!
//! Masked scores are marked with [`MASKED`], a finite stand-in for −∞ (WGSL has no
//! infinity literal); their probability is exactly 0. A row that has seen no visible
//! key keeps `m = MASKED`, `l = 0`.

use cubecl::prelude::*;

/// Score of a hidden key.
pub const MASKED: f32 = -1.0e30;

/// Softmax state of one query row.
#[derive(CubeType, Clone, Copy)]
pub struct RunningState {
    /// Largest visible score so far (`MASKED` if none).
    pub m: f32,
    /// `Σ exp(s − m)` over the visible scores so far.
    pub l: f32,
}

#[cube]
impl RunningState {
    pub fn init() -> RunningState {
        RunningState {
            m: f32::new(MASKED),
            l: f32::new(0.0),
        }
    }

    /// Takes in a block whose largest score is `block_max`. Returns the factor by which
    /// the output accumulator must be rescaled; the caller then adds `Σ p·V` and the
    /// block's `Σ p` (see [`probability`]).
    pub fn rescale(&mut self, block_max: f32) -> f32 {
        let m_new = max(self.m, block_max);
        let alpha = (self.m - m_new).exp();
        self.m = m_new;
        self.l *= alpha;
        alpha
    }

    /// Natural-log sum of exponentials of the row, `neg_inf` when no key was visible.
    pub fn lse(&self, neg_inf: f32) -> f32 {
        select(self.l > 0.0, self.m + self.l.ln(), neg_inf)
    }

    /// `1 / l`, or 0 for a row with no visible key (its output is then 0).
    pub fn normalizer(&self) -> f32 {
        select(self.l > 0.0, 1.0 / self.l, 0.0)
    }
}

/// `exp(s − m)` for a visible score, 0 for a masked one.
#[cube]
pub fn probability(score: f32, m: f32) -> f32 {
    select(score == f32::new(MASKED), f32::new(0.0), (score - m).exp())
}

/// Maximum over the `per_row` neighbouring units of a plane that share a row (a power of
/// two; units `i` and `i ^ offset` meet through plane shuffles).
#[cube]
pub fn row_reduce_max(value: f32, #[comptime] per_row: usize) -> f32 {
    let mut v = value;
    #[unroll]
    for i in 0..comptime!(per_row.trailing_zeros() as usize) {
        v = max(v, plane_shuffle_xor(v, 1u32 << u32::cast_from(i)));
    }
    v
}

/// Sum over the `per_row` neighbouring units of a plane that share a row.
#[cube]
pub fn row_reduce_sum(value: f32, #[comptime] per_row: usize) -> f32 {
    let mut v = value;
    #[unroll]
    for i in 0..comptime!(per_row.trailing_zeros() as usize) {
        v += plane_shuffle_xor(v, 1u32 << u32::cast_from(i));
    }
    v
}

/// `log2(e)`: scores scaled by it let the softmax use base-2 exponentials.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// `2^x` by the PTX instruction `ex2.approx.ftz.f32` (CUDA only; relative error 2⁻²²,
/// very negative inputs give 0): one special-function-unit operation where `exp` compiles
/// to several.
#[cube]
pub fn exp2_approx(x: f32) -> f32 {
    let y: f32;
    gpu_asm!("ex2.approx.ftz.f32 {y}, {x};", x = in(_) x, y = out(_) y, options(pure, nomem));
    y
}
