//! Backward step 3 on tensor cores: `dQ`, one cube per (query block, batch·query head),
//! each plane owning 16 query rows, looping over the key blocks the rows see. Per key
//! block: `S = Q·Kᵀ` and `dP = dO·Vᵀ` on tensor cores into f32 tiles of shared memory,
//! `dS = exp(S − LSE) ⊙ (dP − D) · dS/d(q·k)` element-wise in the input dtype (`dP` times
//! the dropout's factor), and
//! `dQ += dS·K` into accumulators that stay in registers. No atomics: deterministic.

use cubecl::prelude::*;

use crate::bias::{BiasGradLine, BiasLine, ScoreTerms};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::{FRAGMENT, MmaConfig};
use crate::dropout::DropoutArgs;
use crate::mask::Mask;
use crate::mma::{
    Operand, PlaneRow, SHARED_ALIGN, accumulate, product_to_shared, store_accumulators,
    zero_accumulators,
};
use crate::score::{score, score_grad};
use crate::score_mod::ScoreCall;
use crate::sequence::Sequence;
use crate::tile::{Head, row_offset, stage_rows, write_rows};

/// Row stride of the f32 tile that holds `S`, then the final `dQ`.
fn result_stride(config: &MmaConfig) -> usize {
    MmaConfig::f32_stride(config.block_stream.max(config.dim_qk_padded()))
}

/// Bytes of shared memory the kernel uses for `config` with `elem`-byte inputs.
pub fn shared_bytes(config: &MmaConfig, elem: usize) -> usize {
    let queries = config.block_rows();
    let keys = config.block_stream;
    let qk = MmaConfig::half_stride(config.dim_qk_padded());
    let v = MmaConfig::half_stride(config.dim_v_padded());
    elem * ((queries + keys) * (qk + v) + queries * MmaConfig::half_stride(keys))
        + 4 * queries * (result_stride(config) + MmaConfig::f32_stride(keys))
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dq_cmma<F: Float, G: Numeric>(
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
    #[comptime] config: MmaConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
    #[define(G)] _cells: ElemType,
) {
    let block_q = comptime!(config.block_rows());
    let block_k = config.block_stream;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dv_p = comptime!(config.dim_v_padded());
    let qk_ld = comptime!(MmaConfig::half_stride(dqk));
    let v_ld = comptime!(MmaConfig::half_stride(dv_p));
    let s_ld = comptime!(result_stride(&config));
    let dp_ld = comptime!(MmaConfig::f32_stride(block_k));
    let ds_ld = comptime!(MmaConfig::half_stride(block_k));
    let per_row = comptime!(config.units_per_row());
    let cols = comptime!(block_k / config.units_per_row());

    let unit = PlaneRow::new(config);
    let (plane_row0, my_row, part) = (unit.plane_first, unit.row, unit.part);

    let head = Head::from_cube(q.shape(1), k.shape(1));
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let (q_first, kv_first) = (sequence.q_first, sequence.kv_first);
    let q_begin = CUBE_POS_X as usize * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let row = q_begin + my_row;
    let row_c = q_first + min(row, seq_q - 1);
    let row_lse = lse[row_offset(lse, batch, head.head_q, row_c)];
    let row_delta = delta[row_offset(delta, batch, head.head_q, row_c)];
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

    let mut q_tile = Shared::<[F]>::new_aligned_slice(block_q * qk_ld, SHARED_ALIGN);
    let mut do_tile = Shared::<[F]>::new_aligned_slice(block_q * v_ld, SHARED_ALIGN);
    let mut k_tile = Shared::<[F]>::new_aligned_slice(block_k * qk_ld, SHARED_ALIGN);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(block_k * v_ld, SHARED_ALIGN);
    let mut s_tile = Shared::<[f32]>::new_aligned_slice(block_q * s_ld, SHARED_ALIGN);
    let mut dp_tile = Shared::<[f32]>::new_aligned_slice(block_q * dp_ld, SHARED_ALIGN);
    let mut ds_tile = Shared::<[F]>::new_aligned_slice(block_q * ds_ld, SHARED_ALIGN);

    stage_rows(
        q,
        batch,
        head.head_q,
        q_first + q_begin,
        &mut q_tile,
        block_q,
        config.dim_qk,
        dqk,
        qk_ld,
        units,
    );
    stage_rows(
        d_out,
        batch,
        head.head_q,
        q_first + q_begin,
        &mut do_tile,
        block_q,
        config.dim_v,
        dv_p,
        v_ld,
        units,
    );
    let dq_acc = zero_accumulators(dqk / FRAGMENT);

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

    for block in 0..blocks.count {
        let k0 = sparse.start(block_words, &blocks, block, block_k, view);
        let k0_u = usize::cast_from(k0);
        let tile = sparse.tile(block_words, block, block_k, view);
        sync_cube();
        stage_rows(
            k,
            batch,
            head.head_kv,
            kv_first + k0_u,
            &mut k_tile,
            block_k,
            config.dim_qk,
            dqk,
            qk_ld,
            units,
        );
        stage_rows(
            v,
            batch,
            head.head_kv,
            kv_first + k0_u,
            &mut v_tile,
            block_k,
            config.dim_v,
            dv_p,
            v_ld,
            units,
        );
        sync_cube();

        // S = Q·Kᵀ and dP = dO·Vᵀ for the plane's 16 rows.
        product_to_shared(
            &q_tile,
            plane_row0 * qk_ld,
            qk_ld,
            &k_tile,
            0,
            comptime!(Operand::transposed(qk_ld)),
            &mut s_tile,
            plane_row0 * s_ld,
            s_ld,
            dqk / FRAGMENT,
            block_k / FRAGMENT,
        );
        product_to_shared(
            &do_tile,
            plane_row0 * v_ld,
            v_ld,
            &v_tile,
            0,
            comptime!(Operand::transposed(v_ld)),
            &mut dp_tile,
            plane_row0 * dp_ld,
            dp_ld,
            dv_p / FRAGMENT,
            block_k / FRAGMENT,
        );
        sync_plane();

        // dS, this unit's columns `part, part + per_row, …` of its row.
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_k),
            );
        #[unroll]
        for j in 0..cols {
            let col = j * per_row + part;
            let key = usize::cast_from(k0) + col;
            let s = score(s_tile[my_row * s_ld + col], scale, softcap, config.softcap);
            let logit = terms_line.add(bias, s, key, 1.0, terms);
            let modded = call.apply(logit, row, key, score_params, terms.score_mod);
            let visible = !needs_mask
                || (mask.is_visible(row_i, k0 + i32::cast_from(col))
                    && tile.keeps(block_words, row, key, view));
            let p = select(visible, (modded - row_lse).exp(), 0.0);
            let mut dp = dp_tile[my_row * dp_ld + col];
            if comptime!(terms.dropout) {
                dp *= dropout.factor(row, key);
            }
            // dS with respect to the score function's output, then to the logit: the bias's
            // gradient.
            let ds_modded = p * (dp - row_delta);
            let in_sequences = visible && row < seq_q && key < seq_kv;
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
            ds_tile[my_row * ds_ld + col] = F::cast_from(ds);
        }
        sync_plane();

        // dQ += dS·K.
        accumulate(
            &ds_tile,
            plane_row0 * ds_ld,
            ds_ld,
            &k_tile,
            0,
            comptime!(Operand::as_stored(qk_ld)),
            &dq_acc,
            block_k / FRAGMENT,
            dqk / FRAGMENT,
        );
    }

    sync_cube();
    store_accumulators(
        &dq_acc,
        &mut s_tile,
        plane_row0 * s_ld,
        s_ld,
        dqk / FRAGMENT,
    );
    sync_cube();
    write_rows(
        &s_tile,
        dq,
        batch,
        head.head_q,
        q_first + q_begin,
        q_first + seq_q,
        block_q,
        config.dim_qk,
        s_ld,
        units,
    );
}
