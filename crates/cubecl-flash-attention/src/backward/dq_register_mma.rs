//! Backward step 3 on register-level tensor-core instructions (CUDA sm_80+): `dQ`, one cube
//! per (batch·query head, query block). Each plane owns 16 queries, whose Q and dO rows stay
//! in shared memory and whose `dQ` accumulates in registers. The key blocks the queries see
//! stream through two shared-memory stages (K, V), the next block's copy in flight while
//! the current one is used. Per key block, all in registers:
//!
//! 1. `S = Q·Kᵀ` and `dP = dO·Vᵀ` (`mma.sync`, operands by `ldmatrix`);
//! 2. `dS = exp(S − LSE) ⊙ (dP − D) · dS/d(q·k)` element-wise on the accumulators, with the
//!    LSE and D of the lane's two rows read once;
//! 3. `dQ += dS·K`, `dS` converted to the input dtype in registers and used as the A operand
//!    directly (see [`crate::mma_sync`]).
//!
//! On sm_90, where the dK/dV kernel takes warpgroup products, so does this one (`S`, `dP`
//! from shared memory, `dQ += dS·K` with `dS` from registers; see the dK/dV kernel).
//!
//! The grid is ordered as the forward's (head-major, heaviest causal query blocks first).
//! The softmax scale multiplies `dQ` once, in the epilogue. No atomics: deterministic.

use cubecl::prelude::*;

use crate::bias::{
    BiasGradLine, BiasLine, BiasTile, ScoreTerms, add_grad_columns, add_to_columns, base2_scores,
    read_columns, read_staged_columns,
};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::{FRAGMENT, RegisterBackwardConfig, RegisterMmaConfig};
use crate::dropout::{DropoutArgs, apply_keep_bits};
use crate::mask::Mask;
use crate::mma_sync::{
    LoadAddress, Pair, accumulators_as_a, hide_columns, hide_unkept, load_b, mma, rows_times_rows,
    store_row, zeros,
};
use crate::problem::FloatDtype;
use crate::score_mod::{
    ColumnLine, ScoreCall, add_params_grad_columns, modify_columns_with_slopes,
};
use crate::sequence::Sequence;
use crate::softmax::{LOG2_E, exp2_approx};
use crate::stages::StageBarriers;
use crate::tile::{Head, RowLayout, last_first, row_offset, stage_rows_async};
use crate::wgmma::{
    WARPGROUP_COLS, accumulate_from_registers, fence_shared_for_products, score_products,
    warpgroup_rows,
};

/// Lanes sharing one row of an accumulator tile.
const LANES_PER_ROW: usize = 4;
/// Columns of one accumulator tile.
const TILE_COLS: usize = 8;
/// How the kernel's `ldmatrix` loads are addressed: this kernel runs faster with generic
/// pointers (see [`LoadAddress`]).
const LOADS: LoadAddress = LoadAddress::Generic;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_dq_mma<F: Float, G: Numeric>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_out: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    cu_seqlens_q: &Tensor<i32>,
    cu_seqlens_kv: &Tensor<i32>,
    q_rows: RowLayout,
    k_rows: RowLayout,
    v_rows: RowLayout,
    do_rows: RowLayout,
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
    #[comptime] config: RegisterBackwardConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
    #[define(G)] _cells: ElemType,
) {
    let block_q = comptime!(config.block_rows());
    let block_k = config.block_stream;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dvp = comptime!(config.dim_v_padded());
    let qk_ld = comptime!(RegisterMmaConfig::stride(dqk));
    let v_ld = comptime!(RegisterMmaConfig::stride(dvp));
    let s_tiles = comptime!(block_k / TILE_COLS);
    let dq_tiles = comptime!(dqk / TILE_COLS);
    // Warpgroup products read their shared operands as core matrices.
    let warpgroup = comptime!(config.warpgroup.is_some());
    let dtype = comptime!(config.warpgroup.unwrap_or(FloatDtype::BF16));
    let (qk_layout, v_layout, align) = comptime!(config.shared_layouts());
    let k_stage = comptime!(qk_layout.len(block_k));
    let v_stage = comptime!(v_layout.len(block_k));

    let scale_log2 = scale * LOG2_E;
    let pre_cap = scale / softcap;
    let cap_log2 = softcap * LOG2_E;

    let lane = UNIT_POS_PLANE as usize;
    let group = lane / LANES_PER_ROW;
    let in_group = lane % LANES_PER_ROW;

    // Neighbouring cubes share a head (its K and V in L2), heaviest causal blocks first.
    let head = Head::from_cube(q.shape(1), k.shape(1));
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (batch, seq_q, seq_kv) = (sequence.batch, sequence.seq_q, sequence.seq_kv);
    let (q_first, kv_first) = (sequence.q_first, sequence.kv_first);
    let q_block = last_first(CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let q_begin = q_block * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let plane_row = PLANE_POS as usize * FRAGMENT;

    let mut q_tile = Shared::<[F]>::new_aligned_slice(comptime!(qk_layout.len(block_q)), align);
    let mut do_tile = Shared::<[F]>::new_aligned_slice(comptime!(v_layout.len(block_q)), align);
    let mut k_tile = Shared::<[F]>::new_aligned_slice(2 * k_stage, align);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(2 * v_stage, align);
    // A key block's bias staged in shared memory with K and V ([`BiasTile`]).
    let bias_staged = comptime!(config.bias_staged && terms.bias);
    let bias_stage = comptime!(block_q * block_k);
    let mut bias_tile = Shared::<[F]>::new_aligned_slice(
        comptime!(if bias_staged { 2 * bias_stage } else { 8 }),
        align,
    );
    let landed = StageBarriers::new(2usize);

    let dropout = dropout.stream(sequence.index, q.shape(1), head.head_q);
    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    let view = comptime!(terms.view(false));
    let (sparse, blocks) = SparseBlocks::of(
        block_words,
        &block_view,
        &mask.key_blocks(q_begin, q_end, block_k, config.masked, terms.dropout),
        sequence.index,
        head.head_q,
        q_begin,
        block_k,
        view,
    );
    // The score terms of the lane's rows g and g + 8: where each starts in the bias and its
    // ALiBi center, kept across the key blocks (token arrays without terms).
    let terms_rows = comptime!(if terms.any() { 2usize } else { 1 });
    let mut line_offset = Array::<usize>::new(terms_rows);
    let mut line_center = Array::<f32>::new(terms_rows);
    let terms_line = BiasLine::along_keys(
        bias,
        alibi_slopes,
        sequence.index,
        head.head_q,
        q_begin + plane_row + group,
        seq_q,
        seq_kv,
        terms,
    );
    if comptime!(terms.any()) {
        #[unroll]
        for half in 0..2usize {
            let row = q_begin + plane_row + group + 8 * half;
            let line = BiasLine::along_keys(
                bias,
                alibi_slopes,
                sequence.index,
                head.head_q,
                row,
                seq_q,
                seq_kv,
                terms,
            );
            let (offset, center) = line.start();
            line_offset[half] = offset;
            line_center[half] = center;
        }
    }

    // A streamed block's bias at the lane's scores, read before the block's products (the
    // layout of the scores; a token array unless the bias is read ahead).
    let bias_ahead = comptime!(config.bias_ahead && terms.bias);
    let bias_in_registers = comptime!(bias_ahead || bias_staged);
    let mut bias_read =
        Array::<Pair<F>>::new(comptime!(if bias_in_registers { 2 * s_tiles } else { 1 }));
    let bias_rows = BiasTile::of(
        bias,
        sequence.index,
        head.head_q,
        q_begin,
        seq_q,
        seq_kv,
        bias_staged,
    );

    let call = ScoreCall::new(sequence.index, head.head_q, seq_q, seq_kv);
    let mut dq_acc = zeros(comptime!(2 * dq_tiles));
    let mut s_acc = zeros(comptime!(2 * s_tiles));
    let mut dp_acc = zeros(comptime!(2 * s_tiles));
    // LSE (base 2) and D of the lane's rows g and g + 8 (rows past the end read the last
    // row: their scores are masked).
    let mut lse_row = Array::<f32>::new(2usize);
    let mut delta_row = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        let row = q_first + min(q_begin + plane_row + group + 8 * half, seq_q - 1);
        lse_row[half] = lse[row_offset(lse, batch, head.head_q, row)] * LOG2_E;
        delta_row[half] = delta[row_offset(delta, batch, head.head_q, row)];
    }

    if blocks.count > 0 {
        let k0 = usize::cast_from(sparse.start(block_words, &blocks, 0, block_k, view));
        stage_rows_async(
            q,
            &q_rows,
            batch,
            head.head_q,
            q_first + q_begin,
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
            head.head_q,
            q_first + q_begin,
            &mut do_tile,
            0,
            block_q,
            config.dim_v,
            dvp,
            v_layout,
            units,
        );
        if comptime!(bias_staged) {
            bias_rows.stage(bias, k0, &mut bias_tile, 0, block_q, block_k, units);
        }
        stage_rows_async(
            k,
            &k_rows,
            batch,
            head.head_kv,
            kv_first + k0,
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
            head.head_kv,
            kv_first + k0,
            &mut v_tile,
            0,
            block_k,
            config.dim_v,
            dvp,
            v_layout,
            units,
        );
        landed.commit(0usize, 2usize);
    }

    for block in 0..blocks.count {
        let stage = usize::cast_from(block % 2);
        let next = 1 - stage;
        let k0 = sparse.start(block_words, &blocks, block, block_k, view);
        // Read before the wait: with a block mask it comes from the mask's list.
        let next_tile = min(block + 1, blocks.count - 1);
        let next_k0 =
            usize::cast_from(sparse.start(block_words, &blocks, next_tile, block_k, view));
        if comptime!(bias_ahead && !bias_staged) {
            #[unroll]
            for half in 0..2usize {
                let line = terms_line.moved_to((line_offset[half], line_center[half]));
                read_columns(
                    &mut bias_read,
                    0,
                    s_tiles,
                    half,
                    usize::cast_from(k0),
                    &line,
                    bias,
                );
            }
        }

        // K and V of this block (and Q, dO with the first) have landed; every unit is done
        // with the previous block, so the other stage may be refilled.
        landed.wait(stage, 2usize);
        if comptime!(warpgroup) {
            fence_shared_for_products();
            sync_cube();
        }
        if block + 1 < blocks.count {
            if comptime!(bias_staged) {
                let at = next * bias_stage;
                bias_rows.stage(bias, next_k0, &mut bias_tile, at, block_q, block_k, units);
            }
            stage_rows_async(
                k,
                &k_rows,
                batch,
                head.head_kv,
                kv_first + next_k0,
                &mut k_tile,
                next * k_stage,
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
                head.head_kv,
                kv_first + next_k0,
                &mut v_tile,
                next * v_stage,
                block_k,
                config.dim_v,
                dvp,
                v_layout,
                units,
            );
            landed.commit(next, 2usize);
        }

        // 1. S = Q·Kᵀ and dP = dO·Vᵀ for the plane's 16 queries.
        let k_base = stage * k_stage;
        let v_base = stage * v_stage;
        // (The warpgroup products write every pair.)
        #[unroll]
        for i in 0..comptime!(if warpgroup { 0 } else { 2 * s_tiles }) {
            s_acc[i] = Pair::<f32>::cast_from(0.0f32);
            dp_acc[i] = Pair::<f32>::cast_from(0.0f32);
        }
        if comptime!(warpgroup) {
            // One warpgroup product each: the warpgroup's 64 queries × the block's 64 keys.
            score_products(
                &q_tile,
                warpgroup_rows(qk_layout),
                &k_tile,
                k_base,
                &do_tile,
                warpgroup_rows(v_layout),
                &v_tile,
                v_base,
                qk_layout,
                v_layout,
                dtype,
                &mut s_acc,
                &mut dp_acc,
            );
        }
        rows_times_rows(
            &q_tile,
            plane_row * qk_ld,
            &k_tile,
            k_base,
            qk_ld,
            comptime!(if warpgroup { 0 } else { dqk / FRAGMENT }),
            s_tiles,
            LOADS,
            &mut s_acc,
        );
        rows_times_rows(
            &do_tile,
            plane_row * v_ld,
            &v_tile,
            v_base,
            v_ld,
            comptime!(if warpgroup { 0 } else { dvp / FRAGMENT }),
            s_tiles,
            LOADS,
            &mut dp_acc,
        );

        // Dropout: dP times the keep-mask's factor.
        if comptime!(terms.dropout) {
            let row = q_begin + plane_row + group;
            let keep = dropout.keep_bits(row, usize::cast_from(k0), s_tiles, false);
            #[unroll]
            for half in 0..2usize {
                apply_keep_bits(
                    &mut dp_acc,
                    0,
                    s_tiles,
                    half,
                    keep[half],
                    dropout.kept_scale,
                );
            }
        }

        // 2. P into `s_acc`, dS (without the softmax scale) into `dp_acc`; hidden
        // probabilities are zeroed only in the blocks that straddle the mask's edge or a
        // sequence end. The score terms are added in base 2, before the softcap's
        // derivative is taken (which reads the capped score).
        // With score terms, the logits (base 2, terms added) go to an array of their own,
        // since the softcap's derivative reads the capped score without them; once read,
        // it holds that derivative.
        let k0_u = usize::cast_from(k0);
        let mut logits = zeros(comptime!(if terms.any() { 2 * s_tiles } else { 1 }));
        // With a score function: its derivative at each score and, for its parameters'
        // gradient, its input.
        let with_fn = comptime!(terms.score_mod.is_some());
        let mut fn_slopes = zeros(comptime!(if with_fn { 2 * s_tiles } else { 1 }));
        let mut unmodded = zeros(comptime!(if terms.score_params_grad {
            2 * s_tiles
        } else {
            1
        }));
        if comptime!(terms.any()) {
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
                let line = terms_line.moved_to((line_offset[half], line_center[half]));
                if comptime!(bias_staged) {
                    let row = plane_row + group + 8 * half;
                    let at = stage * bias_stage;
                    read_staged_columns(
                        &mut bias_read,
                        0,
                        s_tiles,
                        half,
                        row,
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
                    k0_u,
                    &line,
                    bias,
                    &bias_read,
                    LOG2_E,
                    terms,
                    bias_in_registers,
                );
                if comptime!(with_fn) {
                    let row = q_begin + plane_row + group + 8 * half;
                    modify_columns_with_slopes(
                        &mut logits,
                        &mut fn_slopes,
                        &mut unmodded,
                        0,
                        s_tiles,
                        half,
                        &ColumnLine::new(row, k0_u),
                        &call,
                        score_params,
                        LOG2_E,
                        false,
                        terms.score_params_grad,
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
                let mut logit_pair = logits[comptime!(if terms.any() { at } else { 0 })];
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
                    let mut logit = s;
                    let mut dp_minus_d = ds_pair.extract(e) - delta_row[half];
                    if comptime!(terms.any()) {
                        logit = logit_pair.extract(e);
                        logit_pair.insert(e, grad);
                    } else {
                        dp_minus_d *= grad;
                    }
                    p_pair.insert(e, exp2_approx(logit - lse_row[half]));
                    ds_pair.insert(e, dp_minus_d);
                }
                s_acc[at] = p_pair;
                dp_acc[at] = ds_pair;
                if comptime!(terms.any()) {
                    logits[at] = logit_pair;
                }
            }
        }
        let tile = sparse.tile(block_words, block, block_k, view);
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_k),
            );
        if needs_mask {
            #[unroll]
            for half in 0..2usize {
                let row = i32::cast_from(q_begin + plane_row + group + 8 * half);
                let keys = mask.visible_keys(row);
                hide_columns(&mut s_acc, 0, s_tiles, half, k0, keys, 0.0);
                hide_unkept(
                    &mut s_acc,
                    0,
                    s_tiles,
                    half,
                    k0,
                    row,
                    &tile,
                    block_words,
                    0.0,
                    view,
                );
            }
        }
        // With terms, `dp_acc` holds `dP − D` and `logits` the softcap's derivative: the
        // score function's parameters' gradient is `P ⊙ (dP − D)`, the bias's that times
        // the function's derivative.
        if comptime!(with_fn) {
            if comptime!(terms.score_params_grad) {
                #[unroll]
                for half in 0..2usize {
                    let row = q_begin + plane_row + group + 8 * half;
                    add_params_grad_columns(
                        &s_acc,
                        &dp_acc,
                        &unmodded,
                        s_tiles,
                        half,
                        &ColumnLine::new(row, k0_u),
                        &call,
                        score_params,
                        score_grads,
                        LOG2_E,
                        comptime!(terms.score_mod.unwrap()),
                    );
                }
            }
            #[unroll]
            for i in 0..comptime!(2 * s_tiles) {
                dp_acc[i] = dp_acc[i] * fn_slopes[i];
            }
        }
        if comptime!(terms.bias_grad) {
            #[unroll]
            for half in 0..2usize {
                let row = q_begin + plane_row + group + 8 * half;
                if row < seq_q {
                    let line = BiasGradLine::along_keys(dbias, sequence.index, head.head_q, row);
                    add_grad_columns(
                        dbias, &s_acc, &dp_acc, s_tiles, half, k0_u, seq_kv, &line, terms,
                    );
                }
            }
        }
        #[unroll]
        for i in 0..comptime!(2 * s_tiles) {
            dp_acc[i] = s_acc[i] * dp_acc[i];
            if comptime!(terms.any() && config.softcap) {
                dp_acc[i] = dp_acc[i] * logits[i];
            }
        }

        // 3. dQ += dS·K, 16 keys per step (warpgroup products: all 64 keys, 64 columns of dQ
        // per product).
        if comptime!(warpgroup) {
            if comptime!(dqk == 128) {
                accumulate_from_registers::<F, Const<64>, Const<4>>(
                    &mut dq_acc,
                    &dp_acc,
                    &k_tile,
                    k_base,
                    qk_layout,
                    block_k,
                    WARPGROUP_COLS,
                    dtype,
                );
            } else {
                accumulate_from_registers::<F, Const<32>, Const<2>>(
                    &mut dq_acc,
                    &dp_acc,
                    &k_tile,
                    k_base,
                    qk_layout,
                    block_k,
                    WARPGROUP_COLS,
                    dtype,
                );
            }
        }
        #[unroll]
        for kk in 0..comptime!(if warpgroup { 0 } else { block_k / FRAGMENT }) {
            let dsf = accumulators_as_a::<F>(&dp_acc, 2 * kk);
            #[unroll]
            for n in 0..comptime!(dq_tiles / 2) {
                let kf = load_b(
                    &k_tile,
                    k_base + kk * FRAGMENT * qk_ld + n * FRAGMENT,
                    qk_ld,
                    LOADS,
                );
                mma(&dsf, 0, &kf, 0, &mut dq_acc, 2 * n);
                mma(&dsf, 0, &kf, 2, &mut dq_acc, 2 * n + 1);
            }
        }
    }

    // Epilogue: the plane's query rows of dQ, times the softmax scale.
    #[unroll]
    for half in 0..2usize {
        let row = q_begin + plane_row + group + 8 * half;
        if row < seq_q {
            store_row(
                dq,
                batch,
                head.head_q,
                q_first + row,
                &dq_acc,
                0,
                half,
                scale,
                in_group,
                config.dim_qk,
            );
        }
    }
}
