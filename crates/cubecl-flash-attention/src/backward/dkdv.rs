//! Backward step 2: `dK` and `dV`, one cube per (key block, batch·key/value head) and one
//! unit per key row, looping over the query blocks that see the key block, for every query
//! head of the GQA group in turn. Each key row's gradients are accumulated in f32
//! registers and written once: no atomics, deterministic.
//!
//! Per query `i`: `P = exp(S − LSE)`, `dV += P · dOᵢ`, `dP = dOᵢ·V` (both times the
//! dropout's factor), `dS = P ⊙ (dP − Dᵢ)`, `dK += dS · dS/d(q·k) · Qᵢ`.

use cubecl::prelude::*;

use crate::bias::{BiasLine, ScoreTerms};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::TileConfig;
use crate::dropout::DropoutArgs;
use crate::mask::Mask;
use crate::score::{score, score_grad};
use crate::score_mod::ScoreCall;
use crate::sequence::Sequence;
use crate::tile::{
    add_scaled_and_dot_staged, add_scaled_staged, batch_head_index, dot_staged, load_rows,
    load_vector, read_row, write_row, zero_row,
};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dkdv<F: Float>(
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
    #[comptime] config: TileConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let block_k = config.block_rows;
    let block_q = config.block_stream;
    let dim_qk = config.dim_qk;
    let dim_v = config.dim_v;

    let len_qk = k.shape(3);
    let len_v = v.shape(3);
    let heads_kv = k.shape(1);
    let group = q.shape(1) / heads_kv;
    let pair = batch_head_index();
    let head_kv = pair % heads_kv;
    let sequence = Sequence::of(pair / heads_kv, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let k_begin = CUBE_POS_X as usize * block_k;
    if k_begin >= seq_kv {
        terminate!();
    }
    let k_end = min(k_begin + block_k, seq_kv);
    let key = k_begin + UNIT_POS as usize;
    let key_c = min(key, seq_kv - 1);

    let mut k_row = Array::<f32>::new(dim_qk);
    read_row(
        k,
        batch,
        head_kv,
        sequence.kv_first + key_c,
        &mut k_row,
        dim_qk,
        config.columns,
    );
    let mut v_row = Array::<f32>::new(dim_v);
    read_row(
        v,
        batch,
        head_kv,
        sequence.kv_first + key_c,
        &mut v_row,
        dim_v,
        config.columns,
    );
    let mut dk_acc = Array::<f32>::new(dim_qk);
    zero_row(&mut dk_acc, len_qk, dim_qk, config.columns);
    let mut dv_acc = Array::<f32>::new(dim_v);
    zero_row(&mut dv_acc, len_v, dim_v, config.columns);

    let mut q_tile = Shared::<[f32]>::new_slice(block_q * dim_qk);
    let mut do_tile = Shared::<[f32]>::new_slice(block_q * dim_v);
    let mut lse_tile = Shared::<[f32]>::new_slice(block_q);
    let mut delta_tile = Shared::<[f32]>::new_slice(block_q);

    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    let view = comptime!(terms.view(true));
    let mask_blocks = mask.query_blocks(k_begin, k_end, block_q, config.masked, false);
    let key_i = i32::cast_from(key);

    for g in 0..group {
        let head_q = head_kv * group + g;
        let terms_line = BiasLine::along_queries(
            bias,
            alibi_slopes,
            sequence.index,
            head_q,
            key,
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
            let tile = sparse.tile(block_words, block, block_q, view);
            let q0_u = usize::cast_from(q0);
            sync_cube();
            load_rows(
                q,
                batch,
                head_q,
                sequence.q_first + q0_u,
                &mut q_tile,
                block_q,
                dim_qk,
                config.block_rows,
            );
            load_rows(
                d_out,
                batch,
                head_q,
                sequence.q_first + q0_u,
                &mut do_tile,
                block_q,
                dim_v,
                config.block_rows,
            );
            load_vector(
                lse,
                batch,
                head_q,
                sequence.q_first + q0_u,
                &mut lse_tile,
                block_q,
                config.block_rows,
            );
            load_vector(
                delta,
                batch,
                head_q,
                sequence.q_first + q0_u,
                &mut delta_tile,
                block_q,
                config.block_rows,
            );
            sync_cube();

            let needs_mask = tile.partial
                || !mask.is_block_visible(
                    q0,
                    q0 + i32::cast_from(block_q),
                    i32::cast_from(k_begin),
                    i32::cast_from(k_end),
                );
            for i in 0..block_q {
                let visible = mask.is_visible(q0 + i32::cast_from(i), key_i)
                    && tile.keeps(block_words, key, usize::cast_from(q0) + i, view);
                if !needs_mask || visible {
                    let dot =
                        dot_staged(&k_row, &q_tile, i * dim_qk, len_qk, dim_qk, config.columns);
                    let s = score(dot, scale, softcap, config.softcap);
                    let logit = terms_line.add(bias, s, q0_u + i, 1.0, terms);
                    let query = q0_u + i;
                    let modded = call.apply(logit, query, key, score_params, terms.score_mod);
                    let p = (modded - lse_tile[i]).exp();
                    // dV += P·dOᵢ and dP = dOᵢ·V, reading the staged dO row once (the
                    // dropout's factor on both).
                    let mut p_kept = p;
                    let mut factor = 1.0f32;
                    if comptime!(terms.dropout) {
                        factor = dropout.factor(q0_u + i, key);
                        p_kept *= factor;
                    }
                    let mut dp = add_scaled_and_dot_staged(
                        &mut dv_acc,
                        p_kept,
                        &v_row,
                        &do_tile,
                        i * dim_v,
                        len_v,
                        dim_v,
                        config.columns,
                    );
                    if comptime!(terms.dropout) {
                        dp *= factor;
                    }
                    let ds_modded = p * (dp - delta_tile[i]);
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
                    add_scaled_staged(
                        &mut dk_acc,
                        ds,
                        &q_tile,
                        i * dim_qk,
                        len_qk,
                        dim_qk,
                        config.columns,
                    );
                }
            }
        }
    }

    if key < seq_kv {
        let key = sequence.kv_first + key;
        write_row(
            dk,
            batch,
            head_kv,
            key,
            &dk_acc,
            1.0,
            dim_qk,
            config.columns,
        );
        write_row(dv, batch, head_kv, key, &dv_acc, 1.0, dim_v, config.columns);
    }
}
