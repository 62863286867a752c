//! The FlashAttention-2 forward main loop on tensor cores (`cmma`).
//!
//! One cube per (query block, batch·head); each plane owns 16 query rows. Per key/value
//! block staged in shared memory:
//!
//! 1. `S = Q·Kᵀ` on tensor cores, 16×16 accumulator fragments stored to the plane's score
//!    tile in shared memory;
//! 2. the online softmax on that tile: each row is shared by `plane_size / 16` units, whose
//!    row max and sum meet through plane shuffles; `P` is written in the input dtype;
//! 3. `P·V` on tensor cores into the plane's f32 tile, which the units fold into their
//!    output rows held in registers (`O ← α·O + P·V`).
//!
//! Tiles of shared memory are padded (see [`MmaConfig::half_stride`]) so that fragment
//! loads and the row-wise softmax do not hit the same banks.

use cubecl::prelude::*;

use crate::bias::{BiasLine, ScoreTerms};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::{FRAGMENT, MmaConfig};
use crate::dropout::DropoutArgs;
use crate::mask::Mask;
use crate::mma::{Operand, PlaneRow, SHARED_ALIGN, product_to_shared};
use crate::score::score;
use crate::score_mod::ScoreCall;
use crate::sequence::Sequence;
use crate::softmax::{MASKED, RunningState, probability, row_reduce_max, row_reduce_sum};
use crate::tile::{Head, stage_rows};

/// Bytes of shared memory the kernel uses for `config` with `elem`-byte inputs.
pub fn shared_bytes(config: &MmaConfig, elem: usize) -> usize {
    let rows = config.block_rows();
    let stream = config.block_stream;
    let dqk = MmaConfig::half_stride(config.dim_qk_padded());
    let dv = MmaConfig::half_stride(config.dim_v_padded());
    elem * (rows * dqk + stream * dqk + stream * dv + rows * MmaConfig::half_stride(stream))
        + 4 * rows * (MmaConfig::f32_stride(stream) + MmaConfig::f32_stride(config.dim_v_padded()))
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_cmma<F: Float>(
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
    #[comptime] config: MmaConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let block_q = comptime!(config.block_rows());
    let block_k = config.block_stream;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dv = comptime!(config.dim_v_padded());
    let q_ld = comptime!(MmaConfig::half_stride(dqk));
    let k_ld = q_ld;
    let v_ld = comptime!(MmaConfig::half_stride(dv));
    let s_ld = comptime!(MmaConfig::f32_stride(block_k));
    let p_ld = comptime!(MmaConfig::half_stride(block_k));
    let o_ld = comptime!(MmaConfig::f32_stride(dv));
    // Each row of a plane's tile is shared by `per_row` units, each owning a slice of it.
    let per_row = comptime!(config.units_per_row());
    let s_cols = comptime!(block_k / config.units_per_row());
    let o_cols = comptime!(dv / config.units_per_row());

    let unit = PlaneRow::new(config);
    let (plane_row0, my_row, part) = (unit.plane_first, unit.row, unit.part);

    let head = Head::from_cube(q.shape(1), k.shape(1));
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let q_begin = CUBE_POS_X as usize * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let row = q_begin + my_row;

    let mut q_tile = Shared::<[F]>::new_aligned_slice(block_q * q_ld, SHARED_ALIGN);
    let mut k_tile = Shared::<[F]>::new_aligned_slice(block_k * k_ld, SHARED_ALIGN);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(block_k * v_ld, SHARED_ALIGN);
    let mut s_tile = Shared::<[f32]>::new_aligned_slice(block_q * s_ld, SHARED_ALIGN);
    let mut p_tile = Shared::<[F]>::new_aligned_slice(block_q * p_ld, SHARED_ALIGN);
    let mut o_tile = Shared::<[f32]>::new_aligned_slice(block_q * o_ld, SHARED_ALIGN);

    stage_rows(
        q,
        batch,
        head.head_q,
        sequence.q_first + q_begin,
        &mut q_tile,
        block_q,
        config.dim_qk,
        dqk,
        q_ld,
        units,
    );

    let mut acc = Array::<f32>::new(o_cols);
    #[unroll]
    for c in 0..o_cols {
        acc[c] = 0.0;
    }
    let mut state = RunningState::init();

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
        stage_rows(
            k,
            batch,
            head.head_kv,
            sequence.kv_first + k0_u,
            &mut k_tile,
            block_k,
            config.dim_qk,
            dqk,
            k_ld,
            units,
        );
        stage_rows(
            v,
            batch,
            head.head_kv,
            sequence.kv_first + k0_u,
            &mut v_tile,
            block_k,
            config.dim_v,
            dv,
            v_ld,
            units,
        );
        sync_cube();

        // 1. S = Q·Kᵀ for the plane's 16 rows (Kᵀ: K's tile read transposed).
        product_to_shared(
            &q_tile,
            plane_row0 * q_ld,
            q_ld,
            &k_tile,
            0,
            comptime!(Operand::transposed(k_ld)),
            &mut s_tile,
            plane_row0 * s_ld,
            s_ld,
            dqk / FRAGMENT,
            block_k / FRAGMENT,
        );
        sync_plane();

        // 2. Online softmax over the plane's rows; this unit holds columns
        //    `part, part + per_row, …` of its row.
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_k),
            );
        let s_row = my_row * s_ld;
        let mut block_max = f32::new(MASKED);
        #[unroll]
        for j in 0..s_cols {
            let col = j * per_row + part;
            let mut s = score(s_tile[s_row + col], scale, softcap, config.softcap);
            s = terms_line.add(bias, s, k0_u + col, 1.0, terms);
            s = call.apply(s, row, k0_u + col, score_params, terms.score_mod);
            let visible = mask.is_visible(row_i, k0 + i32::cast_from(col))
                && tile.keeps(block_words, row, k0_u + col, view);
            if needs_mask && !visible {
                s = f32::new(MASKED);
            }
            s_tile[s_row + col] = s;
            block_max = max(block_max, s);
        }
        block_max = row_reduce_max(block_max, per_row);
        let alpha = state.rescale(block_max);
        let p_row = my_row * p_ld;
        let mut block_sum = 0.0f32;
        #[unroll]
        for j in 0..s_cols {
            let col = j * per_row + part;
            let mut p = probability(s_tile[s_row + col], state.m);
            block_sum += p;
            if comptime!(terms.dropout) {
                p *= dropout.factor(row, k0_u + col);
            }
            p_tile[p_row + col] = F::cast_from(p);
        }
        state.l += row_reduce_sum(block_sum, per_row);
        sync_plane();

        // 3. P·V on tensor cores, then O ← α·O + P·V on this unit's slice of its row.
        product_to_shared(
            &p_tile,
            plane_row0 * p_ld,
            p_ld,
            &v_tile,
            0,
            comptime!(Operand::as_stored(v_ld)),
            &mut o_tile,
            plane_row0 * o_ld,
            o_ld,
            block_k / FRAGMENT,
            dv / FRAGMENT,
        );
        sync_plane();
        let o_row = my_row * o_ld + part * o_cols;
        #[unroll]
        for c in 0..o_cols {
            acc[c] = acc[c] * alpha + o_tile[o_row + c];
        }
    }

    // Epilogue: normalize, write O in the input dtype and the LSE in f32.
    if row < seq_q {
        let inv = state.normalizer();
        let row = sequence.q_first + row;
        let base = batch * out.stride(0) + head.head_q * out.stride(1) + row * out.stride(2);
        let col_stride = out.stride(3);
        #[unroll]
        for c in 0..o_cols {
            let col = part * o_cols + c;
            if col < config.dim_v {
                out[base + col * col_stride] = F::cast_from(acc[c] * inv);
            }
        }
        if part == 0 {
            let lse_index =
                batch * lse.stride(0) + head.head_q * lse.stride(1) + row * lse.stride(2);
            lse[lse_index] = state.lse(neg_inf);
        }
    }
}
