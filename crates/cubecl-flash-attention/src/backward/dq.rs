//! Backward step 3: `dQ`, one cube per (query block, batch·head) and one unit per query
//! row, looping over the visible key blocks like the forward pass. Each row's `dQ` is
//! accumulated in f32 registers and written once: no atomics, deterministic.
//!
//! Per key `j`: `P = exp(S − LSE)`, `dP = dO·Vⱼ` (times the dropout's factor),
//! `dS = P ⊙ (dP − D)`, `dQ += dS · dS/d(q·k) · Kⱼ`.

use cubecl::prelude::*;

use crate::bias::{BiasGradLine, BiasLine, ScoreTerms};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::TileConfig;
use crate::dropout::DropoutArgs;
use crate::mask::Mask;
use crate::score::{score, score_grad};
use crate::score_mod::ScoreCall;
use crate::sequence::Sequence;
use crate::tile::{
    Head, add_scaled_staged, dot_staged, load_key_value_block, read_row, write_row, zero_row,
};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dq<F: Float, G: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    cu_seqlens_q: &Tensor<i32>,
    cu_seqlens_kv: &Tensor<i32>,
    scale: f32,
    softcap: f32,
    window_left: i32,
    window_right: i32,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    dropout: DropoutArgs,
    block_words: &Tensor<u32>,
    block_view: ViewLayout,
    dbias: &mut Tensor<Atomic<G>>,
    score_params: &Tensor<f32>,
    score_grads: &mut Tensor<Atomic<G>>,
    #[comptime] config: TileConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
    #[define(G)] _cells: ElemType,
) {
    let block_q = config.block_rows;
    let block_k = config.block_stream;
    let dim_qk = config.dim_qk;
    let dim_v = config.dim_v;

    let len_qk = q.shape(3);
    let len_v = v.shape(3);
    let head = Head::from_cube(q.shape(1), k.shape(1));
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let q_begin = CUBE_POS_X as usize * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let row = q_begin + UNIT_POS as usize;
    // The row read: this unit's (the last one's past the end) in the tensors.
    let row_c = sequence.q_first + min(row, seq_q - 1);

    let mut q_row = Array::<f32>::new(dim_qk);
    read_row(
        q,
        batch,
        head.head_q,
        row_c,
        &mut q_row,
        dim_qk,
        config.columns,
    );
    let mut do_row = Array::<f32>::new(dim_v);
    read_row(
        d_out,
        batch,
        head.head_q,
        row_c,
        &mut do_row,
        dim_v,
        config.columns,
    );
    let row_lse = lse[batch * lse.stride(0) + head.head_q * lse.stride(1) + row_c * lse.stride(2)];
    let row_delta =
        delta[batch * delta.stride(0) + head.head_q * delta.stride(1) + row_c * delta.stride(2)];
    let mut dq_acc = Array::<f32>::new(dim_qk);
    zero_row(&mut dq_acc, len_qk, dim_qk, config.columns);

    let mut k_tile = Shared::<[f32]>::new_slice(block_k * dim_qk);
    let mut v_tile = Shared::<[f32]>::new_slice(block_k * dim_v);

    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    let view = comptime!(terms.view(false));
    let (sparse, blocks) = SparseBlocks::of(
        block_words,
        &block_view,
        &mask.key_blocks(q_begin, q_end, block_k, config.masked, false),
        sequence.index,
        head.head_q,
        q_begin,
        block_k,
        view,
    );
    let row_i = i32::cast_from(row);
    let terms_line = BiasLine::along_keys(
        bias,
        alibi_slopes,
        sequence.index,
        head.head_q,
        row,
        seq_q,
        seq_kv,
        terms,
    );
    let grad_line =
        BiasGradLine::along_keys(dbias, sequence.index, head.head_q, min(row, seq_q - 1));
    let call = ScoreCall::new(sequence.index, head.head_q, seq_q, seq_kv);
    let dropout = dropout.stream(sequence.index, q.shape(1), head.head_q);

    for block in 0..blocks.count {
        let k0 = sparse.start(block_words, &blocks, block, block_k, view);
        let tile = sparse.tile(block_words, block, block_k, view);
        sync_cube();
        load_key_value_block(
            k,
            v,
            batch,
            head.head_kv,
            sequence.kv_first + usize::cast_from(k0),
            &mut k_tile,
            &mut v_tile,
            block_k,
            dim_qk,
            dim_v,
            config.block_rows,
        );
        sync_cube();

        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_k),
            );
        for j in 0..block_k {
            let visible = mask.is_visible(row_i, k0 + i32::cast_from(j))
                && tile.keeps(block_words, row, usize::cast_from(k0) + j, view);
            if !needs_mask || visible {
                let key = usize::cast_from(k0) + j;
                let dot = dot_staged(&q_row, &k_tile, j * dim_qk, len_qk, dim_qk, config.columns);
                let s = score(dot, scale, softcap, config.softcap);
                let logit = terms_line.add(bias, s, key, 1.0, terms);
                let modded = call.apply(logit, row, key, score_params, terms.score_mod);
                let p = (modded - row_lse).exp();
                let mut dp = dot_staged(&do_row, &v_tile, j * dim_v, len_v, dim_v, config.columns);
                if comptime!(terms.dropout) {
                    dp *= dropout.factor(row, key);
                }
                // dS with respect to the score function's output, then to the logit: the
                // bias's gradient.
                let ds_modded = p * (dp - row_delta);
                let in_sequences = row < seq_q && key < seq_kv;
                let ds_logit = call.backward(
                    ds_modded,
                    logit,
                    modded,
                    row,
                    key,
                    in_sequences,
                    score_params,
                    score_grads,
                    terms,
                );
                if comptime!(terms.bias_grad) {
                    if in_sequences {
                        grad_line.add(dbias, key, ds_logit, terms);
                    }
                }
                let ds = ds_logit * score_grad(s, scale, softcap, config.softcap);
                add_scaled_staged(
                    &mut dq_acc,
                    ds,
                    &k_tile,
                    j * dim_qk,
                    len_qk,
                    dim_qk,
                    config.columns,
                );
            }
        }
    }

    if row < seq_q {
        write_row(
            dq,
            batch,
            head.head_q,
            sequence.q_first + row,
            &dq_acc,
            1.0,
            dim_qk,
            config.columns,
        );
    }
}
