//! Backward step 2 on tensor cores: `dK` and `dV`, one cube per (key block, batch·key/value
//! head), each plane owning 16 key rows, looping over the query blocks that see the key
//! block, for every query head of the GQA group in turn. Per query block:
//!
//! 1. `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` on tensor cores, into f32 tiles of shared memory;
//! 2. element-wise, `Pᵀ = exp(Sᵀ − LSE)` and `dSᵀ = Pᵀ ⊙ (dPᵀ − D) · dS/d(q·k)`, written in
//!    the input dtype (`Pᵀ` for `dV` and `dPᵀ` times the dropout's factor);
//! 3. `dV += Pᵀ·dO` and `dK += dSᵀ·Q` into accumulators that stay in registers.
//!
//! No atomics: deterministic.

use cubecl::prelude::*;

use crate::bias::{BiasLine, ScoreTerms};
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
use crate::tile::{batch_head_index, load_vector, stage_rows, write_rows};

/// Row stride of the f32 tile that holds `Sᵀ`, then the final `dK` and `dV`.
fn result_stride(config: &MmaConfig) -> usize {
    MmaConfig::f32_stride(
        config
            .block_stream
            .max(config.dim_qk_padded())
            .max(config.dim_v_padded()),
    )
}

/// Bytes of shared memory the kernel uses for `config` with `elem`-byte inputs.
pub fn shared_bytes(config: &MmaConfig, elem: usize) -> usize {
    let keys = config.block_rows();
    let queries = config.block_stream;
    let qk = MmaConfig::half_stride(config.dim_qk_padded());
    let v = MmaConfig::half_stride(config.dim_v_padded());
    let p = MmaConfig::half_stride(queries);
    elem * ((keys + queries) * (qk + v) + 2 * keys * p)
        + 4 * (2 * queries + keys * (result_stride(config) + MmaConfig::f32_stride(queries)))
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dkdv_cmma<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
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
    score_params: &Tensor<f32>,
    #[comptime] config: MmaConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let block_k = comptime!(config.block_rows());
    let block_q = config.block_stream;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dv_p = comptime!(config.dim_v_padded());
    let qk_ld = comptime!(MmaConfig::half_stride(dqk));
    let v_ld = comptime!(MmaConfig::half_stride(dv_p));
    let s_ld = comptime!(result_stride(&config));
    let dp_ld = comptime!(MmaConfig::f32_stride(block_q));
    let p_ld = comptime!(MmaConfig::half_stride(block_q));
    let per_row = comptime!(config.units_per_row());
    let cols = comptime!(block_q / config.units_per_row());

    let unit = PlaneRow::new(config);
    let (plane_row0, my_key, part) = (unit.plane_first, unit.row, unit.part);

    let heads_kv = k.shape(1);
    let group = q.shape(1) / heads_kv;
    let pair = batch_head_index();
    let head_kv = pair % heads_kv;
    let sequence = Sequence::of(pair / heads_kv, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let (q_first, kv_first) = (sequence.q_first, sequence.kv_first);
    let k_begin = CUBE_POS_X as usize * block_k;
    if k_begin >= seq_kv {
        terminate!();
    }
    let k_end = min(k_begin + block_k, seq_kv);
    let key_i = i32::cast_from(k_begin + my_key);

    let mut k_tile = Shared::<[F]>::new_aligned_slice(block_k * qk_ld, SHARED_ALIGN);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(block_k * v_ld, SHARED_ALIGN);
    let mut q_tile = Shared::<[F]>::new_aligned_slice(block_q * qk_ld, SHARED_ALIGN);
    let mut do_tile = Shared::<[F]>::new_aligned_slice(block_q * v_ld, SHARED_ALIGN);
    let mut lse_tile = Shared::<[f32]>::new_slice(block_q);
    let mut delta_tile = Shared::<[f32]>::new_slice(block_q);
    let mut s_tile = Shared::<[f32]>::new_aligned_slice(block_k * s_ld, SHARED_ALIGN);
    let mut dp_tile = Shared::<[f32]>::new_aligned_slice(block_k * dp_ld, SHARED_ALIGN);
    let mut p_tile = Shared::<[F]>::new_aligned_slice(block_k * p_ld, SHARED_ALIGN);
    let mut ds_tile = Shared::<[F]>::new_aligned_slice(block_k * p_ld, SHARED_ALIGN);

    stage_rows(
        k,
        batch,
        head_kv,
        kv_first + k_begin,
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
        head_kv,
        kv_first + k_begin,
        &mut v_tile,
        block_k,
        config.dim_v,
        dv_p,
        v_ld,
        units,
    );
    let dk_acc = zero_accumulators(dqk / FRAGMENT);
    let dv_acc = zero_accumulators(dv_p / FRAGMENT);

    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    let view = comptime!(terms.view(true));
    let mask_blocks = mask.query_blocks(k_begin, k_end, block_q, config.masked, false);

    for g in 0..group {
        let head_q = head_kv * group + g;
        let terms_line = BiasLine::along_queries(
            bias,
            alibi_slopes,
            sequence.index,
            head_q,
            k_begin + my_key,
            seq_q,
            seq_kv,
            terms,
        );
        let call = ScoreCall::new(sequence.index, head_q, seq_q, seq_kv);
        let dropout = dropout.stream(sequence.index, q.shape(1), head_q);
        let (sparse, blocks) = SparseBlocks::of(
            block_words,
            &block_view,
            &mask_blocks,
            sequence.index,
            head_q,
            k_begin,
            block_q,
            view,
        );
        for block in 0..blocks.count {
            let q0 = sparse.start(block_words, &blocks, block, block_q, view);
            let q0_u = usize::cast_from(q0);
            let tile = sparse.tile(block_words, block, block_q, view);
            sync_cube();
            stage_rows(
                q,
                batch,
                head_q,
                q_first + q0_u,
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
                head_q,
                q_first + q0_u,
                &mut do_tile,
                block_q,
                config.dim_v,
                dv_p,
                v_ld,
                units,
            );
            let first_row = q_first + q0_u;
            load_vector(lse, batch, head_q, first_row, &mut lse_tile, block_q, units);
            load_vector(
                delta,
                batch,
                head_q,
                first_row,
                &mut delta_tile,
                block_q,
                units,
            );
            sync_cube();

            // 1. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the plane's 16 keys.
            product_to_shared(
                &k_tile,
                plane_row0 * qk_ld,
                qk_ld,
                &q_tile,
                0,
                comptime!(Operand::transposed(qk_ld)),
                &mut s_tile,
                plane_row0 * s_ld,
                s_ld,
                dqk / FRAGMENT,
                block_q / FRAGMENT,
            );
            product_to_shared(
                &v_tile,
                plane_row0 * v_ld,
                v_ld,
                &do_tile,
                0,
                comptime!(Operand::transposed(v_ld)),
                &mut dp_tile,
                plane_row0 * dp_ld,
                dp_ld,
                dv_p / FRAGMENT,
                block_q / FRAGMENT,
            );
            sync_plane();

            // 2. Pᵀ and dSᵀ, this unit's columns `part, part + per_row, …` of its key row.
            let needs_mask = tile.partial
                || !mask.is_block_visible(
                    q0,
                    q0 + i32::cast_from(block_q),
                    i32::cast_from(k_begin),
                    i32::cast_from(k_end),
                );
            #[unroll]
            for j in 0..cols {
                let col = j * per_row + part;
                let s = score(s_tile[my_key * s_ld + col], scale, softcap, config.softcap);
                let logit = terms_line.add(bias, s, q0_u + col, 1.0, terms);
                let (query, key) = (q0_u + col, k_begin + my_key);
                let modded = call.apply(logit, query, key, score_params, terms.score_mod);
                let visible = !needs_mask
                    || (mask.is_visible(q0 + i32::cast_from(col), key_i)
                        && tile.keeps(block_words, key, query, view));
                let p = select(visible, (modded - lse_tile[col]).exp(), 0.0);
                let mut dp = dp_tile[my_key * dp_ld + col];
                let mut p_kept = p;
                if comptime!(terms.dropout) {
                    let factor = dropout.factor(q0_u + col, k_begin + my_key);
                    dp *= factor;
                    p_kept *= factor;
                }
                let ds_modded = p * (dp - delta_tile[col]);
                let ds_logit = call.grad(
                    ds_modded,
                    logit,
                    modded,
                    query,
                    key,
                    score_params,
                    terms.score_mod,
                );
                let ds = ds_logit * score_grad(s, scale, softcap, config.softcap);
                p_tile[my_key * p_ld + col] = F::cast_from(p_kept);
                ds_tile[my_key * p_ld + col] = F::cast_from(ds);
            }
            sync_plane();

            // 3. dV += Pᵀ·dO, dK += dSᵀ·Q.
            accumulate(
                &p_tile,
                plane_row0 * p_ld,
                p_ld,
                &do_tile,
                0,
                comptime!(Operand::as_stored(v_ld)),
                &dv_acc,
                block_q / FRAGMENT,
                dv_p / FRAGMENT,
            );
            accumulate(
                &ds_tile,
                plane_row0 * p_ld,
                p_ld,
                &q_tile,
                0,
                comptime!(Operand::as_stored(qk_ld)),
                &dk_acc,
                block_q / FRAGMENT,
                dqk / FRAGMENT,
            );
        }
    }

    // Epilogue: the accumulators through shared memory to the key rows of dK and dV.
    sync_cube();
    store_accumulators(
        &dk_acc,
        &mut s_tile,
        plane_row0 * s_ld,
        s_ld,
        dqk / FRAGMENT,
    );
    sync_cube();
    write_rows(
        &s_tile,
        dk,
        batch,
        head_kv,
        kv_first + k_begin,
        kv_first + seq_kv,
        block_k,
        config.dim_qk,
        s_ld,
        units,
    );
    sync_cube();
    store_accumulators(
        &dv_acc,
        &mut s_tile,
        plane_row0 * s_ld,
        s_ld,
        dv_p / FRAGMENT,
    );
    sync_cube();
    write_rows(
        &s_tile,
        dv,
        batch,
        head_kv,
        kv_first + k_begin,
        kv_first + seq_kv,
        block_k,
        config.dim_v,
        s_ld,
        units,
    );
}
