//! Backward step 2 on register-level tensor-core instructions (CUDA sm_80+): `dK` and `dV`,
//! one cube per (key block, batch·key/value head). Each plane owns 16 keys, whose K and V
//! rows stay in shared memory and whose `dK`, `dV` accumulate in registers. The query blocks
//! that see the key block stream through two shared-memory stages (Q, dO), for every query
//! head of the GQA group in turn, the next block's copy in flight while the current one is
//! used. Per query block, all in registers:
//!
//! 1. `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ` (`mma.sync`, operands by `ldmatrix`);
//! 2. `Pᵀ = exp(Sᵀ − LSE)` and `dSᵀ = Pᵀ ⊙ (dPᵀ − D) · dS/d(q·k)`, element-wise on the
//!    accumulators, the LSE and D of the block's queries staged with it (with dropout, `dPᵀ`
//!    and then, for `dV`, `Pᵀ` times the keep-mask's factor);
//! 3. `dV += Pᵀ·dO` and `dK += dSᵀ·Q`, `Pᵀ` and `dSᵀ` converted to the input dtype in
//!    registers and used as A operands directly (see [`crate::mma_sync`]).
//!
//! With [`RegisterBackwardConfig::atomic_dq`], the kernel also adds each block's `dS·K` to
//! the f32 dQ sum (FA2's five products per block pair; [`super::dq_atomic`]): every plane
//! writes its rows of `dSᵀ` to shared memory, and after a cube barrier computes its share of
//! the block's dQ from them and the cube's K rows. Otherwise no atomics (dQ has its own
//! pass): deterministic.
//!
//! On sm_90, for `d_qk = d_v ∈ {64, 128}` with dQ in its own pass
//! ([`RegisterBackwardConfig::warpgroup`]), the products run on warpgroup instructions
//! ([`crate::wgmma`]) and the shared tiles are swizzled: `Sᵀ` and `dPᵀ` of a warpgroup's 64
//! keys are one product each, both operands read by the tensor cores from shared memory,
//! and `dV`, `dK` take `Pᵀ`, `dSᵀ` from registers against dO, Q in shared memory (one or two
//! warpgroups per cube share the streamed blocks). Every step in between is the same code.
//!
//! For large head dims a launch accumulates dK or dV alone ([`KeyGradients`]), the
//! launcher running both. The softmax scale multiplies `dK` once, in the epilogue.

use cubecl::prelude::*;

use crate::bias::{
    BiasLine, BiasTile, ScoreTerms, add_to_columns, base2_scores, read_columns, read_staged_rows,
};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::{FRAGMENT, KeyGradients, RegisterBackwardConfig, RegisterMmaConfig};
use crate::dropout::{DropoutArgs, apply_keep_bits};
use crate::mask::Mask;
use crate::mma_sync::{
    LoadAddress, Pair, accumulators_as_a, hide_columns, hide_unkept, load_b, mma, rows_times_rows,
    store_pair, store_row, zeros,
};
use crate::problem::FloatDtype;
use crate::score_mod::{ColumnLine, ScoreCall, modify_columns_with_slopes};
use crate::sequence::Sequence;
use crate::softmax::{LOG2_E, exp2_approx};
use crate::stages::StageBarriers;
use crate::tile::{
    RowLayout, SharedLayout, batch_head_index, stage_rows_async, stage_vectors_async,
};
use crate::wgmma::{
    ACCUMULATORS, Major, RegisterProducts, SharedOperand, WARPGROUP_COLS, descriptor,
    fence_shared_for_products, pack, pack_descriptor, pack_register_a, register_products,
    score_products, unpack, warpgroup_rows,
};

use super::dq_atomic::add_dq_share;

/// Lanes sharing one row of an accumulator tile.
const LANES_PER_ROW: usize = 4;
/// Columns of one accumulator tile.
const TILE_COLS: usize = 8;
/// How the kernel's `ldmatrix` loads are addressed (see [`LoadAddress`]).
const LOADS: LoadAddress = LoadAddress::Window;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dkdv_mma<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_sum: &mut Tensor<f32>,
    cu_seqlens_q: &Tensor<i32>,
    cu_seqlens_kv: &Tensor<i32>,
    q_rows: RowLayout,
    k_rows: RowLayout,
    v_rows: RowLayout,
    do_rows: RowLayout,
    lse_rows: RowLayout,
    delta_rows: RowLayout,
    dq_rows: RowLayout,
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
    #[comptime] config: RegisterBackwardConfig,
    #[comptime] gradients: KeyGradients,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let with_dk = comptime!(gradients != KeyGradients::Values);
    let with_dv = comptime!(gradients != KeyGradients::Keys);
    let with_dq = comptime!(config.atomic_dq && with_dk);
    let block_k = comptime!(config.block_rows());
    let block_q = config.block_stream;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dvp = comptime!(config.dim_v_padded());
    let qk_ld = comptime!(RegisterMmaConfig::stride(dqk));
    let v_ld = comptime!(RegisterMmaConfig::stride(dvp));
    let s_tiles = comptime!(block_q / TILE_COLS);
    // A launch without dK (dV) keeps a token accumulator of one tile.
    let dk_tiles = comptime!(if with_dk { dqk / TILE_COLS } else { 1 });
    let dv_tiles = comptime!(if with_dv { dvp / TILE_COLS } else { 1 });
    // Warpgroup products read their shared operands as core matrices.
    let warpgroup = comptime!(config.warpgroup.is_some());
    let dtype = comptime!(config.warpgroup.unwrap_or(FloatDtype::BF16));
    let (qk_layout, v_layout, align) = comptime!(config.shared_layouts());
    let q_stage = comptime!(qk_layout.len(block_q));
    let do_stage = comptime!(v_layout.len(block_q));
    // LSE then D of the block's queries.
    let stats_stage = comptime!(2 * block_q);
    // dSᵀ of the block, for dQ (a token tile without).
    let ds_ld = comptime!(RegisterMmaConfig::stride(block_q));
    let ds_len = comptime!(if with_dq { block_k * ds_ld } else { 8 });

    // Scores in base 2, as in the forward (whose LSE is natural-log: scaled by log2 e).
    let scale_log2 = scale * LOG2_E;
    let pre_cap = scale / softcap;
    let cap_log2 = softcap * LOG2_E;

    let lane = UNIT_POS_PLANE as usize;
    let group = lane / LANES_PER_ROW;
    let in_group = lane % LANES_PER_ROW;

    let heads_kv = k.shape(1);
    let group_size = q.shape(1) / heads_kv;
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
    let plane_row = PLANE_POS as usize * FRAGMENT;

    let mut k_tile = Shared::<[F]>::new_aligned_slice(comptime!(qk_layout.len(block_k)), align);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(comptime!(v_layout.len(block_k)), align);
    let mut q_tile = Shared::<[F]>::new_aligned_slice(2 * q_stage, align);
    let mut do_tile = Shared::<[F]>::new_aligned_slice(2 * do_stage, align);
    let mut stats_tile = Shared::<[f32]>::new_aligned_slice(2 * stats_stage, 16usize);
    let ds_tile = Shared::<[F]>::new_aligned_slice(ds_len, 16usize);
    // A query block's bias at the cube's keys, staged in shared memory with Q and dO
    // ([`BiasTile`]: the tile's rows are the block's queries, its columns the cube's keys).
    let bias_staged = comptime!(config.bias_staged && terms.bias);
    let bias_stage = comptime!(block_q * block_k);
    let mut bias_tile = Shared::<[F]>::new_aligned_slice(
        comptime!(if bias_staged { 2 * bias_stage } else { 8 }),
        align,
    );
    let landed = StageBarriers::new(2usize);

    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    // The block mask's blocks for the group's first head: the launcher sends here only block
    // masks that are the same for every head of a group.
    let view = comptime!(terms.view(true));
    let (sparse, blocks) = SparseBlocks::of(
        block_words,
        &block_view,
        &mask.query_blocks(k_begin, k_end, block_q, config.masked, terms.dropout),
        sequence.index,
        head_kv * group_size,
        k_begin,
        block_q,
        view,
    );
    // Every query head of the group, each over the same query blocks.
    let steps = blocks.count * i32::cast_from(group_size);

    let mut dk_acc = zeros(comptime!(2 * dk_tiles));
    let mut dv_acc = zeros(comptime!(2 * dv_tiles));
    let mut s_acc = zeros(comptime!(2 * s_tiles));
    let mut dp_acc = zeros(comptime!(2 * s_tiles));
    // The LSE (base 2) and D of the lane's query columns `8n + 2t + e`, at `2n + e`: held in
    // registers over a block's products where the head dims leave room (d ≤ 64, ~2% faster
    // on the H100), else read from the staged block where they are used (held at d = 128,
    // they made the packed form spill: 8–10% slower).
    let held_stats = comptime!(config.dim_qk.max(config.dim_v) <= 64);
    let stats_len = comptime!(if held_stats { 2 * s_tiles } else { 1 });
    let mut lse_col = Array::<f32>::new(stats_len);
    let mut delta_col = Array::<f32>::new(stats_len);

    if steps > 0 {
        stage_rows_async(
            k,
            &k_rows,
            batch,
            head_kv,
            kv_first + k_begin,
            &mut k_tile,
            0,
            block_k,
            config.dim_qk,
            dqk,
            qk_layout,
            units,
        );
        stage_rows_async(
            v,
            &v_rows,
            batch,
            head_kv,
            kv_first + k_begin,
            &mut v_tile,
            0,
            block_k,
            config.dim_v,
            dvp,
            v_layout,
            units,
        );
        let q0 = usize::cast_from(sparse.start(block_words, &blocks, 0, block_q, view));
        let head_q = head_kv * group_size;
        if comptime!(bias_staged) {
            let rows = BiasTile::of(bias, sequence.index, head_q, q0, seq_q, seq_kv, true);
            rows.stage(bias, k_begin, &mut bias_tile, 0, block_q, block_k, units);
        }
        stage_rows_async(
            q,
            &q_rows,
            batch,
            head_q,
            q_first + q0,
            &mut q_tile,
            0,
            block_q,
            config.dim_qk,
            dqk,
            qk_layout,
            units,
        );
        stage_rows_async(
            d_out,
            &do_rows,
            batch,
            head_q,
            q_first + q0,
            &mut do_tile,
            0,
            block_q,
            config.dim_v,
            dvp,
            v_layout,
            units,
        );
        stage_vectors_async(
            lse,
            delta,
            &lse_rows,
            &delta_rows,
            batch,
            head_q,
            q_first + q0,
            &mut stats_tile,
            0,
            block_q,
            units,
        );
        landed.commit(0usize, 2usize);
    }

    // A streamed block's bias at the lane's scores, read before the block's products (the
    // layout of the scores; a token array unless the bias is read ahead).
    let bias_ahead = comptime!(config.bias_ahead && terms.bias);
    let bias_in_registers = comptime!(bias_ahead || bias_staged);
    let mut bias_read =
        Array::<Pair<F>>::new(comptime!(if bias_in_registers { 2 * s_tiles } else { 1 }));

    for step in 0..steps {
        let stage = usize::cast_from(step % 2);
        let next = 1 - stage;
        let q0 = sparse.start(block_words, &blocks, step % blocks.count, block_q, view);
        let tile = sparse.tile(block_words, step % blocks.count, block_q, view);
        // Read before the wait: with a block mask it comes from the mask's list.
        let next_step = (step + 1) % blocks.count;
        let next_q0 =
            usize::cast_from(sparse.start(block_words, &blocks, next_step, block_q, view));
        if comptime!(bias_ahead && !bias_staged) {
            let head_q = head_kv * group_size + usize::cast_from(step / blocks.count);
            #[unroll]
            for half in 0..2usize {
                let line = BiasLine::along_queries(
                    bias,
                    alibi_slopes,
                    sequence.index,
                    head_q,
                    k_begin + plane_row + group + 8 * half,
                    seq_q,
                    seq_kv,
                    terms,
                );
                read_columns(
                    &mut bias_read,
                    0,
                    s_tiles,
                    half,
                    usize::cast_from(q0),
                    &line,
                    bias,
                );
            }
        }

        // Q and dO of this block (and K, V with the first) have landed; every unit is done
        // with the previous block, so the other stage may be refilled.
        landed.wait(stage, 2usize);
        if comptime!(warpgroup) {
            fence_shared_for_products();
            sync_cube();
        }
        if step + 1 < steps {
            let next_head = head_kv * group_size + usize::cast_from((step + 1) / blocks.count);
            if comptime!(bias_staged) {
                let rows = BiasTile::of(
                    bias,
                    sequence.index,
                    next_head,
                    next_q0,
                    seq_q,
                    seq_kv,
                    true,
                );
                let at = next * bias_stage;
                rows.stage(bias, k_begin, &mut bias_tile, at, block_q, block_k, units);
            }
            stage_rows_async(
                q,
                &q_rows,
                batch,
                next_head,
                q_first + next_q0,
                &mut q_tile,
                next * q_stage,
                block_q,
                config.dim_qk,
                dqk,
                qk_layout,
                units,
            );
            stage_rows_async(
                d_out,
                &do_rows,
                batch,
                next_head,
                q_first + next_q0,
                &mut do_tile,
                next * do_stage,
                block_q,
                config.dim_v,
                dvp,
                v_layout,
                units,
            );
            stage_vectors_async(
                lse,
                delta,
                &lse_rows,
                &delta_rows,
                batch,
                next_head,
                q_first + next_q0,
                &mut stats_tile,
                next * stats_stage,
                block_q,
                units,
            );
            landed.commit(next, 2usize);
        }

        // The block's LSE and D, staged with it (queries past the end repeat the last one:
        // their scores are masked).
        let stats = stage * stats_stage + 2 * in_group;
        if comptime!(held_stats) {
            #[unroll]
            for n in 0..s_tiles {
                #[unroll]
                for e in 0..2usize {
                    let col = stats + n * TILE_COLS + e;
                    lse_col[2 * n + e] = stats_tile[col] * LOG2_E;
                    delta_col[2 * n + e] = stats_tile[col + block_q];
                }
            }
        }

        // 1. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the plane's 16 keys.
        let q_base = stage * q_stage;
        let do_base = stage * do_stage;
        // (The warpgroup products write every pair.)
        #[unroll]
        for i in 0..comptime!(if warpgroup { 0 } else { 2 * s_tiles }) {
            s_acc[i] = Pair::<f32>::cast_from(0.0f32);
            if comptime!(with_dk) {
                dp_acc[i] = Pair::<f32>::cast_from(0.0f32);
            }
        }
        if comptime!(warpgroup) {
            // One warpgroup product each: the warpgroup's 64 keys × the block's 64 queries.
            score_products(
                &k_tile,
                warpgroup_rows(qk_layout),
                &q_tile,
                q_base,
                &v_tile,
                warpgroup_rows(v_layout),
                &do_tile,
                do_base,
                qk_layout,
                v_layout,
                dtype,
                &mut s_acc,
                &mut dp_acc,
            );
        }
        rows_times_rows(
            &k_tile,
            plane_row * qk_ld,
            &q_tile,
            q_base,
            qk_ld,
            comptime!(if warpgroup { 0 } else { dqk / FRAGMENT }),
            s_tiles,
            LOADS,
            &mut s_acc,
        );
        rows_times_rows(
            &v_tile,
            plane_row * v_ld,
            &do_tile,
            do_base,
            v_ld,
            comptime!(if with_dk && !warpgroup {
                dvp / FRAGMENT
            } else {
                0
            }),
            s_tiles,
            LOADS,
            &mut dp_acc,
        );

        // Dropout: the keep-mask of the lane's two keys, on dPᵀ now and on Pᵀ (for dV) once
        // dSᵀ has been formed from it.
        let mut keep = Array::<u32>::new(2usize);
        let mut kept_scale = 1.0f32;
        if comptime!(terms.dropout) {
            let head_q = head_kv * group_size + usize::cast_from(step / blocks.count);
            let stream = dropout.stream(sequence.index, q.shape(1), head_q);
            kept_scale = stream.kept_scale;
            let key = k_begin + plane_row + group;
            keep = stream.keep_bits(key, usize::cast_from(q0), s_tiles, true);
            if comptime!(with_dk) {
                #[unroll]
                for half in 0..2usize {
                    apply_keep_bits(&mut dp_acc, 0, s_tiles, half, keep[half], kept_scale);
                }
            }
        }

        // 2. Pᵀ into `s_acc`, dSᵀ (without the softmax scale) into `dp_acc`; hidden
        // probabilities are zeroed only in the blocks that straddle the mask's edge or a
        // sequence end. With score terms, the logits (base 2, terms added) go to an
        // array of their own: the softcap's derivative reads the capped score without them.
        let mut logits = zeros(comptime!(if terms.any() { 2 * s_tiles } else { 1 }));
        // With a score function, its derivative at each score.
        let with_fn = comptime!(terms.score_mod.is_some());
        let mut fn_slopes = zeros(comptime!(if with_fn { 2 * s_tiles } else { 1 }));
        if comptime!(terms.any()) {
            let head_q = head_kv * group_size + usize::cast_from(step / blocks.count);
            let call = ScoreCall::new(sequence.index, head_q, seq_q, seq_kv);
            base2_scores(
                &s_acc,
                &mut logits,
                comptime!(2 * s_tiles),
                scale_log2,
                pre_cap,
                cap_log2,
                config.softcap,
            );
            #[unroll]
            for half in 0..2usize {
                let key = k_begin + plane_row + group + 8 * half;
                let line = BiasLine::along_queries(
                    bias,
                    alibi_slopes,
                    sequence.index,
                    head_q,
                    key,
                    seq_q,
                    seq_kv,
                    terms,
                );
                let p0 = usize::cast_from(q0);
                if comptime!(bias_staged) {
                    let at = stage * bias_stage;
                    let key = plane_row + group + 8 * half;
                    read_staged_rows(
                        &mut bias_read,
                        0,
                        s_tiles,
                        half,
                        key,
                        &bias_tile,
                        at,
                        block_k,
                    );
                }
                add_to_columns(
                    &mut logits,
                    0,
                    s_tiles,
                    half,
                    p0,
                    &line,
                    bias,
                    &bias_read,
                    LOG2_E,
                    terms,
                    bias_in_registers,
                );
                if comptime!(with_fn) {
                    // The function's input is kept by the dQ kernel alone.
                    let mut no_input = zeros(1usize);
                    modify_columns_with_slopes(
                        &mut logits,
                        &mut fn_slopes,
                        &mut no_input,
                        0,
                        s_tiles,
                        half,
                        &ColumnLine::new(key, p0),
                        &call,
                        score_params,
                        LOG2_E,
                        true,
                        false,
                        comptime!(terms.score_mod.unwrap()),
                    );
                }
            }
        }
        #[unroll]
        for half in 0..2usize {
            #[unroll]
            for n in 0..s_tiles {
                let at = 2 * n + half;
                let mut p_pair = s_acc[at];
                let mut ds_pair = dp_acc[at];
                #[unroll]
                for e in 0..2usize {
                    let dot = p_pair.extract(e);
                    let mut s = dot * scale_log2;
                    let mut grad = 1.0f32;
                    if comptime!(config.softcap) {
                        let t = (dot * pre_cap).tanh();
                        s = cap_log2 * t;
                        grad = 1.0 - t * t;
                    }
                    let col = stats + n * TILE_COLS + e;
                    let lse = if comptime!(held_stats) {
                        lse_col[2 * n + e]
                    } else {
                        stats_tile[col] * LOG2_E
                    };
                    let delta = if comptime!(held_stats) {
                        delta_col[2 * n + e]
                    } else {
                        stats_tile[col + block_q]
                    };
                    let mut logit = s;
                    if comptime!(terms.any()) {
                        logit = logits[at].extract(e);
                    }
                    p_pair.insert(e, exp2_approx(logit - lse));
                    // (dPᵀ − D) · dS/d(q·k), times Pᵀ once the mask has been applied.
                    if comptime!(with_fn) {
                        grad *= fn_slopes[at].extract(e);
                    }
                    if comptime!(with_dk) {
                        ds_pair.insert(e, (ds_pair.extract(e) - delta) * grad);
                    }
                }
                s_acc[at] = p_pair;
                if comptime!(with_dk) {
                    dp_acc[at] = ds_pair;
                }
            }
        }
        // The cube's whole key block, past the sequence's end included: those rows hold the
        // next sequence's keys in a packed batch, and their scores must be hidden before
        // `dS·K` reaches the shared dQ sum.
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                q0,
                q0 + i32::cast_from(block_q),
                i32::cast_from(k_begin),
                i32::cast_from(k_begin + block_k),
            );
        if needs_mask {
            #[unroll]
            for half in 0..2usize {
                let key = i32::cast_from(k_begin + plane_row + group + 8 * half);
                let queries = mask.visible_queries(key);
                hide_columns(&mut s_acc, 0, s_tiles, half, q0, queries, 0.0);
                hide_unkept(
                    &mut s_acc,
                    0,
                    s_tiles,
                    half,
                    q0,
                    key,
                    &tile,
                    block_words,
                    0.0,
                    view,
                );
            }
        }
        if comptime!(with_dk) {
            #[unroll]
            for i in 0..comptime!(2 * s_tiles) {
                dp_acc[i] = s_acc[i] * dp_acc[i];
            }
        }
        if comptime!(terms.dropout && with_dv) {
            #[unroll]
            for half in 0..2usize {
                apply_keep_bits(&mut s_acc, 0, s_tiles, half, keep[half], kept_scale);
            }
        }
        if comptime!(with_dq) {
            #[unroll]
            for n in 0..s_tiles {
                #[unroll]
                for half in 0..2usize {
                    store_pair(&ds_tile, &dp_acc, n, half, plane_row, ds_ld);
                }
            }
        }

        // 3. dV += Pᵀ·dO and dK += dSᵀ·Q, 16 queries per step (warpgroup products: all 64
        // queries, 64 columns of dV or dK per product).
        if comptime!(warpgroup) {
            if comptime!(dvp == 128) {
                key_gradient_products::<F, Const<128>, Const<8>>(
                    &mut dv_acc,
                    &mut dk_acc,
                    &s_acc,
                    &dp_acc,
                    &do_tile,
                    do_base,
                    &q_tile,
                    q_base,
                    v_layout,
                    dtype,
                );
            } else {
                key_gradient_products::<F, Const<64>, Const<4>>(
                    &mut dv_acc,
                    &mut dk_acc,
                    &s_acc,
                    &dp_acc,
                    &do_tile,
                    do_base,
                    &q_tile,
                    q_base,
                    v_layout,
                    dtype,
                );
            }
        }
        #[unroll]
        for kk in 0..comptime!(if warpgroup { 0 } else { block_q / FRAGMENT }) {
            let pf = accumulators_as_a::<F>(&s_acc, 2 * kk);
            #[unroll]
            for n in 0..comptime!(if with_dv { dv_tiles / 2 } else { 0 }) {
                let of = load_b(
                    &do_tile,
                    do_base + kk * FRAGMENT * v_ld + n * FRAGMENT,
                    v_ld,
                    LOADS,
                );
                mma(&pf, 0, &of, 0, &mut dv_acc, 2 * n);
                mma(&pf, 0, &of, 2, &mut dv_acc, 2 * n + 1);
            }
            if comptime!(with_dk) {
                let dsf = accumulators_as_a::<F>(&dp_acc, 2 * kk);
                #[unroll]
                for n in 0..comptime!(dk_tiles / 2) {
                    let qf = load_b(
                        &q_tile,
                        q_base + kk * FRAGMENT * qk_ld + n * FRAGMENT,
                        qk_ld,
                        LOADS,
                    );
                    mma(&dsf, 0, &qf, 0, &mut dk_acc, 2 * n);
                    mma(&dsf, 0, &qf, 2, &mut dk_acc, 2 * n + 1);
                }
            }
        }

        // 4. dQ += dS·K for the block's queries, once every plane's dSᵀ is in place (the
        // next step's barrier keeps the tile until every plane has read it).
        if comptime!(with_dq) {
            sync_cube();
            let head_q = head_kv * group_size + usize::cast_from(step / blocks.count);
            add_dq_share(
                &ds_tile,
                &k_tile,
                dq_sum,
                &dq_rows,
                batch,
                head_q,
                q_first + usize::cast_from(q0),
                q_first + seq_q,
                config,
            );
        }
    }

    // Epilogue: the plane's key rows of dK (times the softmax scale) and dV.
    #[unroll]
    for half in 0..2usize {
        let key = k_begin + plane_row + group + 8 * half;
        if key < seq_kv {
            if comptime!(with_dk) {
                store_row(
                    dk,
                    batch,
                    head_kv,
                    kv_first + key,
                    &dk_acc,
                    0,
                    half,
                    scale,
                    in_group,
                    config.dim_qk,
                );
            }
            if comptime!(with_dv) {
                store_row(
                    dv,
                    batch,
                    head_kv,
                    kv_first + key,
                    &dv_acc,
                    0,
                    half,
                    1.0,
                    in_group,
                    config.dim_v,
                );
            }
        }
    }
}

/// `dV += Pᵀ·dO` and `dK += dSᵀ·Q` on warpgroup instructions, all 64 queries of the block at
/// once, in one PTX block: `Pᵀ` (`p_t`) and `dSᵀ` (`ds_t`) from registers, dO and Q staged as
/// core matrices. `N` is 32 accumulators per 64-column product (`dim / 64` each for dV and
/// dK), `M` two descriptor halves per product.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_gradient_products<F: Float, N: Size, M: Size>(
    dv_acc: &mut Array<Pair<f32>>,
    dk_acc: &mut Array<Pair<f32>>,
    p_t: &Array<Pair<f32>>,
    ds_t: &Array<Pair<f32>>,
    do_tile: &Shared<[F]>,
    do_base: usize,
    q_tile: &Shared<[F]>,
    q_base: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] dtype: FloatDtype,
) {
    let rows = comptime!(SharedOperand::new(layout, Major::MN));
    let chunks = comptime!(rows.cols / WARPGROUP_COLS);
    let pairs = comptime!(ACCUMULATORS / 2);
    let mut acc = Vector::<f32, N>::cast_from(0.0f32);
    let mut a = Vector::<u32, Const<32>>::cast_from(0u32);
    let mut b = Vector::<u32, M>::cast_from(0u32);
    pack_register_a::<F>(p_t, 0, &mut a, 0usize);
    pack_register_a::<F>(ds_t, 0, &mut a, 1usize);
    #[unroll]
    for j in 0..chunks {
        let at = comptime!(rows.element(j * WARPGROUP_COLS, 0));
        pack(&*dv_acc, j * pairs, &mut acc, comptime!(j * ACCUMULATORS));
        pack(
            &*dk_acc,
            j * pairs,
            &mut acc,
            comptime!((chunks + j) * ACCUMULATORS),
        );
        pack_descriptor(descriptor(do_tile, do_base + at, rows), &mut b, j);
        pack_descriptor(
            descriptor(q_tile, q_base + at, rows),
            &mut b,
            comptime!(chunks + j),
        );
    }
    let products = comptime!(RegisterProducts {
        count: 2 * chunks,
        a_of: [0, (chunks == 1) as usize, 1, 1],
        k_steps: 4,
        b: rows,
        n: WARPGROUP_COLS,
    });
    let acc = register_products(acc, a, b, products, dtype);
    #[unroll]
    for j in 0..chunks {
        unpack(acc, comptime!(j * ACCUMULATORS), dv_acc, j * pairs);
        unpack(
            acc,
            comptime!((chunks + j) * ACCUMULATORS),
            dk_acc,
            j * pairs,
        );
    }
}
