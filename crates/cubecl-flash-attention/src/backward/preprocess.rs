//! Backward step 1: `D = rowsum(dO ⊙ O)` in f32; with score terms, also the LSE as the
//! backward reads it ([`crate::bias::backward_lse`]).
//!
//! [`DELTA_LANES`] consecutive units share a row: unit `l` multiplies columns `l`,
//! `l + DELTA_LANES`, …, so neighbouring units read neighbouring elements (one 32-byte
//! sector per 16 units in half precision), and the row's partial sums are added in shared
//! memory, always in the same order. A cube of `rows · DELTA_LANES` units covers `rows` rows.

use cubecl::prelude::*;

use crate::bias::backward_lse;
use crate::tile::row_offset;

/// Units sharing one row.
pub const DELTA_LANES: usize = 16;

#[cube(launch_unchecked)]
pub fn flash_backward_delta<F: Float>(
    out: &Tensor<F>,
    d_out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    lse: &Tensor<f32>,
    lse_out: &mut Tensor<f32>,
    #[comptime] dim_v: usize,
    #[comptime] rows: usize,
    #[comptime] guard_lse: bool,
    #[define(F)] _dtype: ElemType,
) {
    let mut partial = Shared::<[f32]>::new_slice(comptime!(rows * DELTA_LANES));
    let (heads, seq) = (out.shape(1), out.shape(2));
    let lane = UNIT_POS as usize % DELTA_LANES;
    let local = UNIT_POS as usize / DELTA_LANES;
    let row = CUBE_POS * rows + local;
    let inside = row < out.shape(0) * heads * seq;
    let (batch, head, i) = (row / (heads * seq), (row / seq) % heads, row % seq);

    let mut sum = 0.0f32;
    if inside {
        let o = row_offset(out, batch, head, i);
        let g = row_offset(d_out, batch, head, i);
        let (o_col, g_col) = (out.stride(3), d_out.stride(3));
        #[unroll]
        for j in 0..comptime!(dim_v.div_ceil(DELTA_LANES)) {
            let c = j * DELTA_LANES + lane;
            if comptime!(dim_v.is_multiple_of(DELTA_LANES)) || c < dim_v {
                sum += f32::cast_from(out[o + c * o_col]) * f32::cast_from(d_out[g + c * g_col]);
            }
        }
    }
    partial[UNIT_POS as usize] = sum;
    sync_cube();

    if inside && lane == 0 {
        let first = local * DELTA_LANES;
        let mut total = 0.0f32;
        #[unroll]
        for l in 0..DELTA_LANES {
            total += partial[first + l];
        }
        let index = batch * delta.stride(0) + head * delta.stride(1) + i * delta.stride(2);
        delta[index] = total;
        if comptime!(guard_lse) {
            let at = batch * lse.stride(0) + head * lse.stride(1) + i * lse.stride(2);
            let out = batch * lse_out.stride(0) + head * lse_out.stride(1) + i * lse_out.stride(2);
            lse_out[out] = backward_lse(lse[at]);
        }
    }
}
