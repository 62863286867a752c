//! Merging attention over parts of the key range by their LSE.
//!
//! A query row's attention over keys split into parts `s`, each with its normalized output
//! `O_s` and its `LSE_s`, is `O = Σ_s w_s · O_s` with `w_s = exp(LSE_s − LSE)` and
//! `LSE = log Σ_s exp(LSE_s)`. A part that sees no key has `LSE_s = −∞` and weight 0; a row
//! no part sees gives `O = 0`, `LSE = −∞`.

use cubecl::prelude::*;

/// `partial_out` `[parts, batch, heads, seq, d_v]` and `partial_lse` `[parts, batch, heads,
/// seq]` (f32, contiguous) into `out` `[batch, heads, seq, d_v]` (any strides, the input
/// dtype) and `lse` `[batch, heads, seq]`. One cube per row: the row is
/// `CUBE_POS_Y · CUBE_COUNT_X + CUBE_POS_X`; its units take the columns.
#[cube(launch_unchecked)]
pub fn merge_by_lse<F: Float>(
    partial_out: &Tensor<f32>,
    partial_lse: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[define(F)] _dtype: ElemType,
) {
    let parts = partial_lse.shape(0);
    let rows = partial_lse.stride(0);
    let dim = out.shape(3);
    let row = CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize;
    if row >= rows {
        terminate!();
    }
    let (heads, seq) = (out.shape(1), out.shape(2));
    let batch = row / (heads * seq);
    let head = (row / seq) % heads;
    let i = row % seq;

    let mut m = neg_inf;
    for s in 0..parts {
        m = max(m, partial_lse[s * rows + row]);
    }
    let mut total = 0.0f32;
    for s in 0..parts {
        let part = partial_lse[s * rows + row];
        total += select(part == neg_inf, 0.0, (part - m).exp());
    }
    let norm = select(total > 0.0, 1.0 / total, 0.0);

    let base = batch * out.stride(0) + head * out.stride(1) + i * out.stride(2);
    let mut c = UNIT_POS as usize;
    while c < dim {
        let mut o = 0.0f32;
        for s in 0..parts {
            let part = partial_lse[s * rows + row];
            let w = select(part == neg_inf, 0.0, (part - m).exp());
            o += w * partial_out[(s * rows + row) * dim + c];
        }
        let at = base + c * out.stride(3);
        out[at] = F::cast_from(o * norm);
        c += CUBE_DIM as usize;
    }
    if UNIT_POS == 0 {
        let at = batch * lse.stride(0) + head * lse.stride(1) + i * lse.stride(2);
        lse[at] = select(total > 0.0, m + total.ln(), neg_inf);
    }
}
