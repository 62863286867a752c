//! Backward step 1: `D = rowsum(dO ⊙ O)` in f32, one unit per query row.

use cubecl::prelude::*;

use crate::tile::row_offset;

#[cube(launch_unchecked)]
pub fn flash_backward_delta<F: Float>(
    out: &Tensor<F>,
    d_out: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] dim_v: usize,
    #[define(F)] _dtype: ElemType,
) {
    let (heads, seq) = (out.shape(1), out.shape(2));
    let row = ABSOLUTE_POS;
    if row >= out.shape(0) * heads * seq {
        terminate!();
    }
    let (batch, head, i) = (row / (heads * seq), (row / seq) % heads, row % seq);
    let o = row_offset(out, batch, head, i);
    let g = row_offset(d_out, batch, head, i);
    let mut sum = 0.0f32;
    for c in 0..dim_v {
        sum += f32::cast_from(out[o + c * out.stride(3)])
            * f32::cast_from(d_out[g + c * d_out.stride(3)]);
    }
    let index = batch * delta.stride(0) + head * delta.stride(1) + i * delta.stride(2);
    delta[index] = sum;
}
