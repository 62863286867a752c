//! The FlashAttention-2 forward main loop, portable path.
//!
//! One cube per (query block, batch·head), one unit per query row. The row's query and
//! its output accumulator live in registers; key/value blocks are staged in shared memory
//! by the whole cube; the online softmax keeps the row's running max and sum. Key blocks
//! that the mask hides entirely are never visited (with a block mask, only its listed
//! blocks are), and mask arithmetic runs only in the blocks that straddle a mask boundary
//! or that the block mask marks partial.

use cubecl::prelude::*;

use crate::bias::{BiasLine, ScoreTerms};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::TileConfig;
use crate::dropout::DropoutArgs;
use crate::mask::Mask;
use crate::score::score;
use crate::score_mod::ScoreCall;
use crate::sequence::Sequence;
use crate::softmax::{MASKED, RunningState, probability};
use crate::tile::{
    Head, add_scaled_staged, dot_staged, load_key_value_block, read_row, scale_row, write_row,
    zero_row,
};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    cu_seqlens_q: &Tensor<i32>,
    cu_seqlens_kv: &Tensor<i32>,
    scale: f32,
    softcap: f32,
    window_left: i32,
    window_right: i32,
    neg_inf: f32,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    dropout: DropoutArgs,
    block_words: &Tensor<u32>,
    block_view: ViewLayout,
    score_params: &Tensor<f32>,
    #[comptime] config: TileConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let block_q = config.block_rows;
    let block_k = config.block_stream;
    let dim_qk = config.dim_qk;
    let dim_v = config.dim_v;

    let len_qk = q.shape(3);
    let len_v = v.shape(3);
    let head = Head::from_cube(q.shape(1), k.shape(1));
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (seq_q, seq_kv) = (sequence.seq_q, sequence.seq_kv);
    let q_begin = CUBE_POS_X as usize * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let row = q_begin + UNIT_POS as usize;
    let row_valid = row < seq_q;

    let mut q_row = Array::<f32>::new(dim_qk);
    read_row(
        q,
        sequence.batch,
        head.head_q,
        sequence.q_first + min(row, seq_q - 1),
        &mut q_row,
        dim_qk,
        config.columns,
    );
    let mut acc = Array::<f32>::new(dim_v);
    zero_row(&mut acc, len_v, dim_v, config.columns);
    let mut scores = Array::<f32>::new(block_k);
    let mut state = RunningState::init();

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
    let call = ScoreCall::new(sequence.index, head.head_q, seq_q, seq_kv);
    let dropout = dropout.stream(sequence.index, q.shape(1), head.head_q);

    for block in 0..blocks.count {
        let k0 = sparse.start(block_words, &blocks, block, block_k, view);
        let k0_u = usize::cast_from(k0);
        let tile = sparse.tile(block_words, block, block_k, view);

        sync_cube();
        load_key_value_block(
            k,
            v,
            sequence.batch,
            head.head_kv,
            sequence.kv_first + k0_u,
            &mut k_tile,
            &mut v_tile,
            block_k,
            dim_qk,
            dim_v,
            config.block_rows,
        );
        sync_cube();

        // S = Q·Kᵀ · scale (softcapped) + the terms, masked only in boundary blocks and the
        // block mask's partial ones.
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_k),
            );
        let mut block_max = f32::new(MASKED);
        for j in 0..block_k {
            let dot = dot_staged(&q_row, &k_tile, j * dim_qk, len_qk, dim_qk, config.columns);
            let mut s = score(dot, scale, softcap, config.softcap);
            s = terms_line.add(bias, s, k0_u + j, 1.0, terms);
            s = call.apply(s, row, k0_u + j, score_params, terms.score_mod);
            let visible = mask.is_visible(row_i, k0 + i32::cast_from(j))
                && tile.keeps(block_words, row, k0_u + j, view);
            if needs_mask && !visible {
                s = f32::new(MASKED);
            }
            scores[j] = s;
            block_max = max(block_max, s);
        }

        // Online softmax: rescale what was accumulated, then add P·V (P dropped, its sum
        // not).
        let alpha = state.rescale(block_max);
        scale_row(&mut acc, alpha, len_v, dim_v, config.columns);
        let mut block_sum = 0.0f32;
        for j in 0..block_k {
            let mut p = probability(scores[j], state.m);
            block_sum += p;
            if comptime!(terms.dropout) {
                p *= dropout.factor(row, k0_u + j);
            }
            add_scaled_staged(
                &mut acc,
                p,
                &v_tile,
                j * dim_v,
                len_v,
                dim_v,
                config.columns,
            );
        }
        state.l += block_sum;
    }

    // Epilogue: normalize, write O in the input dtype and the LSE in f32.
    if row_valid {
        let inv = state.normalizer();
        let row = sequence.q_first + row;
        write_row(
            out,
            sequence.batch,
            head.head_q,
            row,
            &acc,
            inv,
            dim_v,
            config.columns,
        );
        let lse_index =
            sequence.batch * lse.stride(0) + head.head_q * lse.stride(1) + row * lse.stride(2);
        lse[lse_index] = state.lse(neg_inf);
    }
}
