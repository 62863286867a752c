//! The FlashAttention-2 forward on register-level tensor-core instructions (CUDA sm_80+).
//!
//! One cube of `planes` planes per (query block, batch·head); each plane owns `m_tiles`
//! tiles of 16 query rows. K/V blocks are copied asynchronously into two shared-memory
//! stages, the next block's copy in flight while the current one is used. Per key block:
//!
//! 1. `S = Q·Kᵀ` into accumulator registers (`mma.sync`, operands by `ldmatrix`);
//! 2. the online softmax on those registers: a lane holds two rows of each query tile, whose
//!    four lanes meet through plane shuffles for the row maximum; `O` is rescaled in place;
//! 3. `O += P·V`, the probabilities converted to the input dtype in registers and used as the
//!    A operand directly (see [`crate::mma_sync`]).
//!
//! On sm_90, for `d_qk = d_v ∈ {64, 128}` ([`RegisterMmaConfig::warpgroup`]), both products
//! run on warpgroup instructions ([`crate::wgmma`]) over swizzled tiles: each warpgroup (4
//! planes) computes `S` of its 64 query rows in one product, Q and K read by the tensor
//! cores from shared memory, and `O += P·V` with `P` from registers against V in shared
//! memory. The softmax in between is the same code, as the accumulators keep the
//! `mma.sync` layout. There K and V of a block are awaited together at its start: each
//! arrival needs a proxy fence and a cube barrier before the products read it, and one per
//! block ran 3–8% faster than two ([`RegisterMmaConfig::kv_together`]). A 128-key block's
//! `S` may be one 128-column product, and `O += P·V` at d = 128 too
//! ([`RegisterMmaConfig::wide_products`], on request until tested on a GPU).
//!
//! The row sums stay per lane until the epilogue, where the four lanes of a row add them.
//! Mask arithmetic runs only in the key blocks that straddle the mask's edge or the
//! sequence ends; blocks no query of the cube sees are never visited.

use cubecl::prelude::*;

use crate::bias::{
    BiasLine, BiasTile, ScoreTerms, add_to_columns, read_columns, read_staged_columns,
};
use crate::block_mask::{SparseBlocks, ViewLayout};
use crate::config::{FRAGMENT, RegisterMmaConfig};
use crate::dropout::{DropoutArgs, apply_keep_bits};
use crate::mask::Mask;
use crate::mma_sync::{
    LoadAddress, Pair, accumulators_as_a, hide_columns, hide_unkept, load_a, load_b,
    load_b_transposed, mma, store_row, zeros,
};
use crate::problem::FloatDtype;
use crate::score_mod::{ColumnLine, ScoreCall, modify_columns};
use crate::sequence::Sequence;
use crate::softmax::{LOG2_E, MASKED, exp2_approx, row_reduce_max, row_reduce_sum};
use crate::stages::StageBarriers;
use crate::tile::{Head, RowLayout, SharedLayout, last_first, stage_rows_async};
use crate::wgmma::{
    Major, SharedOperand, WARPGROUP_COLS, accumulate_from_registers, fence_shared_for_products,
    scores_against_rows, unpack_all, warpgroup_rows,
};

/// Lanes sharing one row of an accumulator tile.
const LANES_PER_ROW: usize = 4;
/// Columns of one accumulator tile.
const TILE_COLS: usize = 8;
/// How the kernel's `ldmatrix` loads are addressed (see [`LoadAddress`]).
const LOADS: LoadAddress = LoadAddress::Window;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward_mma<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    cu_seqlens_q: &Tensor<i32>,
    cu_seqlens_kv: &Tensor<i32>,
    q_rows: RowLayout,
    k_rows: RowLayout,
    v_rows: RowLayout,
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
    #[comptime] config: RegisterMmaConfig,
    #[comptime] packed: bool,
    #[comptime] terms: ScoreTerms,
    #[define(F)] _dtype: ElemType,
) {
    let block_q = comptime!(config.block_rows());
    let block_kv = config.block_kv;
    let m_tiles = config.m_tiles;
    let units = comptime!(config.units());
    let dqk = comptime!(config.dim_qk_padded());
    let dv = comptime!(config.dim_v_padded());
    let qk_ld = comptime!(RegisterMmaConfig::stride(dqk));
    let v_ld = comptime!(RegisterMmaConfig::stride(dv));
    let k_steps = comptime!(dqk / FRAGMENT);
    let kv_steps = comptime!(block_kv / FRAGMENT);
    let s_tiles = comptime!(block_kv / TILE_COLS);
    let o_tiles = comptime!(dv / TILE_COLS);
    // Warpgroup products (sm_90) read swizzled tiles; `mma.sync` padded rows.
    let warpgroup = comptime!(config.warpgroup.is_some());
    let dtype = comptime!(config.warpgroup.unwrap_or(FloatDtype::BF16));
    let wide = comptime!(config.wide_products);
    let (qk_layout, v_layout, align) = comptime!(config.shared_layouts());
    let k_stage = comptime!(qk_layout.len(block_kv));
    let v_stage = comptime!(v_layout.len(block_kv));

    // Exponents in base 2 (`s · log2 e`), for the fast exponential; the softcap
    // `cap · tanh(s / cap)` is scaled the same way.
    let scale_log2 = scale * LOG2_E;
    let pre_cap = scale / softcap;
    let cap_log2 = softcap * LOG2_E;
    // What multiplies a stored score (and row maximum) into the base-2 exponent: the scale
    // is folded into the exponent's multiply-add unless a softcap was applied first.
    let mut exponent_scale = scale_log2;
    // What converts the terms into a stored score's units.
    let mut terms_unit = 1.0 / scale;
    if comptime!(config.softcap) {
        exponent_scale = 1.0;
        terms_unit = LOG2_E;
    }

    let lane = UNIT_POS_PLANE as usize;
    let group = lane / LANES_PER_ROW;
    let in_group = lane % LANES_PER_ROW;

    // The query blocks of one head are neighbours in the launch, so that the cubes running
    // together share their heads' K and V in L2; within a head the last blocks come first:
    // under a causal mask those see the most keys.
    let head = Head::from_cube_batch_inner(q.shape(1), k.shape(1), q.shape(0), config.batch_inner);
    let sequence = Sequence::of(head.batch, q, k, cu_seqlens_q, cu_seqlens_kv, packed);
    let (seq_q, seq_kv) = (sequence.seq_q, sequence.seq_kv);
    let q_block = last_first(CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let q_begin = q_block * block_q;
    if q_begin >= seq_q {
        terminate!();
    }
    let q_end = min(q_begin + block_q, seq_q);
    let plane_row = PLANE_POS as usize * FRAGMENT * m_tiles;

    let mut q_tile = Shared::<[F]>::new_aligned_slice(comptime!(qk_layout.len(block_q)), align);
    let mut k_tile = Shared::<[F]>::new_aligned_slice(2 * k_stage, align);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(2 * v_stage, align);
    // A key block's bias staged in shared memory with K and V, read from there after the
    // block's product ([`BiasTile`]).
    let bias_staged = comptime!(config.bias_staged && terms.bias);
    let bias_stage = comptime!(block_q * block_kv);
    let mut bias_tile = Shared::<[F]>::new_aligned_slice(
        comptime!(if bias_staged { 2 * bias_stage } else { 8 }),
        align,
    );
    let k_landed = StageBarriers::new(2usize);
    let v_landed = StageBarriers::new(2usize);

    let dropout = dropout.stream(sequence.index, q.shape(1), head.head_q);
    let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
    let view = comptime!(terms.view(false));
    let (sparse, blocks) = SparseBlocks::of(
        block_words,
        &block_view,
        &mask.key_blocks(q_begin, q_end, block_kv, config.masked, terms.dropout),
        sequence.index,
        head.head_q,
        q_begin,
        block_kv,
        view,
    );
    // The score terms of the lane's rows `2 · tile + half`: where each row starts in the
    // bias and its ALiBi center, kept across the key blocks (a token array without terms).
    let terms_rows = comptime!(if terms.any() { 2 * m_tiles } else { 1 });
    let mut line_offset = Array::<usize>::new(terms_rows);
    // A key block's bias at the lane's scores, read before the block's product (the layout
    // of the scores; a token array unless the bias is read ahead).
    let bias_ahead = comptime!(config.bias_ahead && terms.bias);
    let bias_in_registers = comptime!(bias_ahead || bias_staged);
    let mut bias_read = Array::<Pair<F>>::new(comptime!(if bias_in_registers {
        2 * m_tiles * s_tiles
    } else {
        1
    }));
    let mut line_center = Array::<f32>::new(terms_rows);
    let bias_rows = BiasTile::of(
        bias,
        sequence.index,
        head.head_q,
        q_begin,
        seq_q,
        seq_kv,
        bias_staged,
    );
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
        for r in 0..comptime!(2 * m_tiles) {
            let row = q_begin + plane_row + (r / 2) * FRAGMENT + group + 8 * (r % 2);
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
            line_offset[r] = offset;
            line_center[r] = center;
        }
    }

    // Accumulators: the output and the scores of the plane's query tiles, and the softmax
    // state of the lane's rows (`2 · tile + half`, half 0 for row g, 1 for row g + 8).
    let mut o_acc = zeros(comptime!(2 * m_tiles * o_tiles));
    let mut s_acc = zeros(comptime!(2 * m_tiles * s_tiles));
    let mut row_max = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut row_sum = Array::<f32>::new(comptime!(2 * m_tiles));
    #[unroll]
    for r in 0..comptime!(2 * m_tiles) {
        row_max[r] = f32::new(MASKED);
        row_sum[r] = 0.0;
    }
    // Q fragments: all of them, or those of one reduction step (re-read per key block).
    let q_pairs = comptime!(if config.q_in_registers {
        4 * m_tiles * k_steps
    } else {
        4 * m_tiles
    });
    let mut q_frag = Array::<Pair<F>>::new(q_pairs);

    if blocks.count > 0 {
        let k0 = usize::cast_from(sparse.start(block_words, &blocks, 0, block_kv, view));
        stage_rows_async(
            q,
            &q_rows,
            sequence.batch,
            head.head_q,
            sequence.q_first + q_begin,
            &mut q_tile,
            0,
            block_q,
            config.dim_qk,
            dqk,
            qk_layout,
            units,
        );
        // The bias copies go to K's barrier: it tracks every copy the unit issued before.
        if comptime!(bias_staged) {
            bias_rows.stage(bias, k0, &mut bias_tile, 0, block_q, block_kv, units);
        }
        stage_block(
            k,
            &k_rows,
            &head,
            &sequence,
            k0,
            &mut k_tile,
            0,
            &k_landed,
            block_kv,
            config.dim_qk,
            dqk,
            qk_layout,
            units,
        );
        stage_block(
            v,
            &v_rows,
            &head,
            &sequence,
            k0,
            &mut v_tile,
            0,
            &v_landed,
            block_kv,
            config.dim_v,
            dv,
            v_layout,
            units,
        );
    }

    // The next block's first key, read one block ahead: with a block mask it comes from the
    // mask's list, and the copy of that block cannot start before it arrives.
    let mut next_k0 = usize::cast_from(sparse.start(
        block_words,
        &blocks,
        min(1, max(blocks.count - 1, 0)),
        block_kv,
        view,
    ));
    for block in 0..blocks.count {
        let stage = usize::cast_from(block % 2);
        let next = 1 - stage;
        let k0 = sparse.start(block_words, &blocks, block, block_kv, view);
        let has_next = block + 1 < blocks.count;
        let ahead = sparse.start(
            block_words,
            &blocks,
            min(block + 2, blocks.count - 1),
            block_kv,
            view,
        );

        if comptime!(bias_ahead && !bias_staged) {
            #[unroll]
            for r in 0..comptime!(2 * m_tiles) {
                let line = terms_line.moved_to((line_offset[r], line_center[r]));
                read_columns(
                    &mut bias_read,
                    (r / 2) * s_tiles,
                    s_tiles,
                    r % 2,
                    usize::cast_from(k0),
                    &line,
                    bias,
                );
            }
        }

        // K of this block (and Q, with the first; and V, when awaited together) has landed;
        // every unit is done with the previous block, so the other stage may be refilled.
        k_landed.wait(stage, 2usize);
        if comptime!(config.kv_together) {
            v_landed.wait(stage, 2usize);
        }
        if comptime!(warpgroup) {
            fence_shared_for_products();
            sync_cube();
        }
        if comptime!(config.q_in_registers) && block == 0 {
            #[unroll]
            for t in 0..m_tiles {
                #[unroll]
                for kk in 0..k_steps {
                    let frag = load_a(
                        &q_tile,
                        (plane_row + t * FRAGMENT) * qk_ld + kk * FRAGMENT,
                        qk_ld,
                        LOADS,
                    );
                    #[unroll]
                    for i in 0..4usize {
                        q_frag[(t * k_steps + kk) * 4 + i] = frag[i];
                    }
                }
            }
        }
        if has_next {
            if comptime!(bias_staged) {
                let at = next * bias_stage;
                bias_rows.stage(bias, next_k0, &mut bias_tile, at, block_q, block_kv, units);
            }
            stage_block(
                k,
                &k_rows,
                &head,
                &sequence,
                next_k0,
                &mut k_tile,
                next,
                &k_landed,
                block_kv,
                config.dim_qk,
                dqk,
                qk_layout,
                units,
            );
            if comptime!(config.kv_together) {
                stage_block(
                    v,
                    &v_rows,
                    &head,
                    &sequence,
                    next_k0,
                    &mut v_tile,
                    next,
                    &v_landed,
                    block_kv,
                    config.dim_v,
                    dv,
                    v_layout,
                    units,
                );
            }
        }

        // 1. S = Q·Kᵀ (warpgroup products: the warpgroup's 64 queries × the block's keys,
        // writing every pair).
        let k_base = stage * k_stage;
        let q_at = warpgroup_rows(qk_layout);
        if comptime!(warpgroup) {
            if comptime!(block_kv == 128) {
                let s = scores_against_rows::<F, Const<64>, Const<8>>(
                    &q_tile, q_at, &k_tile, k_base, qk_layout, block_kv, wide, dtype,
                );
                unpack_all(s, &mut s_acc);
            } else {
                let s = scores_against_rows::<F, Const<32>, Const<4>>(
                    &q_tile, q_at, &k_tile, k_base, qk_layout, block_kv, wide, dtype,
                );
                unpack_all(s, &mut s_acc);
            }
        }
        #[unroll]
        for i in 0..comptime!(if warpgroup { 0 } else { 2 * m_tiles * s_tiles }) {
            s_acc[i] = Pair::<f32>::cast_from(0.0f32);
        }
        // Each K fragment serves every query tile of the plane.
        #[unroll]
        for kk in 0..comptime!(if warpgroup { 0 } else { k_steps }) {
            if comptime!(!config.q_in_registers) {
                #[unroll]
                for t in 0..m_tiles {
                    let frag = load_a(
                        &q_tile,
                        (plane_row + t * FRAGMENT) * qk_ld + kk * FRAGMENT,
                        qk_ld,
                        LOADS,
                    );
                    #[unroll]
                    for i in 0..4usize {
                        q_frag[t * 4 + i] = frag[i];
                    }
                }
            }
            #[unroll]
            for n in 0..comptime!(s_tiles / 2) {
                let kf = load_b_transposed(
                    &k_tile,
                    k_base + n * FRAGMENT * qk_ld + kk * FRAGMENT,
                    qk_ld,
                    LOADS,
                );
                #[unroll]
                for t in 0..m_tiles {
                    let q_at = if comptime!(config.q_in_registers) {
                        (t * k_steps + kk) * 4
                    } else {
                        t * 4
                    };
                    mma(&q_frag, q_at, &kf, 0, &mut s_acc, t * s_tiles + 2 * n);
                    mma(&q_frag, q_at, &kf, 2, &mut s_acc, t * s_tiles + 2 * n + 1);
                }
            }
        }

        // 2. Online softmax on the registers, hidden scores marked only in the blocks that
        // straddle the mask's edge or a sequence end. Without a softcap the scores stay
        // unscaled (the tile heuristic refuses scales that are not positive): maxima are
        // taken on them and the scale is applied inside the exponent,
        // `2^(s·scale_log2 − m·scale_log2)`, one multiply-add per score (see
        // `MIN_FOLDED_SCALE`). A softcap is applied here, in base 2.
        if comptime!(config.softcap) {
            #[unroll]
            for i in 0..comptime!(2 * m_tiles * s_tiles) {
                let mut pair = s_acc[i];
                #[unroll]
                for e in 0..2usize {
                    pair.insert(e, cap_log2 * (pair.extract(e) * pre_cap).tanh());
                }
                s_acc[i] = pair;
            }
        }

        if comptime!(terms.any()) {
            #[unroll]
            for r in 0..comptime!(2 * m_tiles) {
                let line = terms_line.moved_to((line_offset[r], line_center[r]));
                let p0 = usize::cast_from(k0);
                let (t, half) = (r / 2, r % 2);
                if comptime!(bias_staged) {
                    let row = plane_row + t * FRAGMENT + group + 8 * half;
                    let at = stage * bias_stage;
                    read_staged_columns(
                        &mut bias_read,
                        t * s_tiles,
                        s_tiles,
                        half,
                        row,
                        &bias_tile,
                        at,
                        block_kv,
                    );
                }
                add_to_columns(
                    &mut s_acc,
                    t * s_tiles,
                    s_tiles,
                    half,
                    p0,
                    &line,
                    bias,
                    &bias_read,
                    terms_unit,
                    terms,
                    bias_in_registers,
                );
            }
        }
        if comptime!(terms.score_mod.is_some()) {
            let call = ScoreCall::new(sequence.index, head.head_q, seq_q, seq_kv);
            #[unroll]
            for r in 0..comptime!(2 * m_tiles) {
                let (t, half) = (r / 2, r % 2);
                let row = q_begin + plane_row + t * FRAGMENT + group + 8 * half;
                let line = ColumnLine::new(row, usize::cast_from(k0));
                modify_columns(
                    &mut s_acc,
                    t * s_tiles,
                    s_tiles,
                    half,
                    &line,
                    &call,
                    score_params,
                    terms_unit,
                    false,
                    comptime!(terms.score_mod.unwrap()),
                );
            }
        }

        let tile = sparse.tile(block_words, block, block_kv, view);
        let needs_mask = tile.partial
            || !mask.is_block_visible(
                i32::cast_from(q_begin),
                i32::cast_from(q_end),
                k0,
                k0 + i32::cast_from(block_kv),
            );
        if needs_mask {
            #[unroll]
            for t in 0..m_tiles {
                #[unroll]
                for half in 0..2usize {
                    let row = i32::cast_from(q_begin + plane_row + t * FRAGMENT + group + 8 * half);
                    let keys = mask.visible_keys(row);
                    hide_columns(&mut s_acc, t * s_tiles, s_tiles, half, k0, keys, MASKED);
                    let (first, bits) = (t * s_tiles, block_words);
                    hide_unkept(
                        &mut s_acc, first, s_tiles, half, k0, row, &tile, bits, MASKED, view,
                    );
                }
            }
        }
        // The plane rescales only when some row's block maximum outgrew the maximum its
        // exponentials are taken against by more than `RESCALE_SLACK` (base 2): below that
        // the stale maximum is kept, probabilities may reach 2^RESCALE_SLACK, and sum and
        // output stay consistent with it. (The maxima are taken again in the rare rescale
        // rather than kept in registers through the common path.)
        let mut outgrown = false;
        #[unroll]
        for r in 0..comptime!(2 * m_tiles) {
            let m = block_row_max(&s_acc, r, s_tiles);
            outgrown = outgrown
                || m * exponent_scale > row_max[r] * exponent_scale + f32::new(RESCALE_SLACK);
        }
        if plane_any(outgrown) {
            #[unroll]
            for r in 0..comptime!(2 * m_tiles) {
                let m_new = max(row_max[r], block_row_max(&s_acc, r, s_tiles));
                let alpha =
                    exp2_approx(row_max[r] * exponent_scale - reference(m_new, exponent_scale));
                row_max[r] = m_new;
                row_sum[r] *= alpha;
                let alpha_pair = Pair::<f32>::cast_from(alpha);
                #[unroll]
                for n in 0..o_tiles {
                    let at = 2 * ((r / 2) * o_tiles + n) + r % 2;
                    o_acc[at] = o_acc[at] * alpha_pair;
                }
            }
        }
        #[unroll]
        for t in 0..m_tiles {
            #[unroll]
            for half in 0..2usize {
                let r = 2 * t + half;
                let m_ref = reference(row_max[r], exponent_scale);
                let mut block_sum = 0.0f32;
                #[unroll]
                for n in 0..s_tiles {
                    let at = 2 * (t * s_tiles + n) + half;
                    let mut pair = s_acc[at];
                    #[unroll]
                    for e in 0..2usize {
                        let p = exp2_approx(pair.extract(e) * exponent_scale - m_ref);
                        block_sum += p;
                        pair.insert(e, p);
                    }
                    s_acc[at] = pair;
                }
                row_sum[r] += block_sum;
            }
        }
        // Dropout on the probabilities that multiply V, after their sum was taken.
        if comptime!(terms.dropout) {
            #[unroll]
            for t in 0..m_tiles {
                let row = q_begin + plane_row + t * FRAGMENT + group;
                let keep = dropout.keep_bits(row, usize::cast_from(k0), s_tiles, false);
                #[unroll]
                for half in 0..2usize {
                    let scale = dropout.kept_scale;
                    apply_keep_bits(&mut s_acc, t * s_tiles, s_tiles, half, keep[half], scale);
                }
            }
        }

        // 3. O += P·V, once V of this block has landed.
        if comptime!(!config.kv_together) {
            v_landed.wait(stage, 2usize);
            if comptime!(warpgroup) {
                fence_shared_for_products();
                sync_cube();
            }
            if has_next {
                stage_block(
                    v,
                    &v_rows,
                    &head,
                    &sequence,
                    next_k0,
                    &mut v_tile,
                    next,
                    &v_landed,
                    block_kv,
                    config.dim_v,
                    dv,
                    v_layout,
                    units,
                );
            }
        }
        // Each V fragment serves every query tile of the plane (warpgroup products: all keys
        // of the block, 64 columns of O per product).
        let v_base = stage * v_stage;
        if comptime!(warpgroup) {
            accumulate_all(
                &mut o_acc, &s_acc, &v_tile, v_base, v_layout, block_kv, wide, dtype,
            );
        }
        #[unroll]
        for kk in 0..comptime!(if warpgroup { 0 } else { kv_steps }) {
            let mut p = Array::<Pair<F>>::new(comptime!(4 * m_tiles));
            #[unroll]
            for t in 0..m_tiles {
                let frag = accumulators_as_a::<F>(&s_acc, t * s_tiles + 2 * kk);
                #[unroll]
                for i in 0..4usize {
                    p[t * 4 + i] = frag[i];
                }
            }
            #[unroll]
            for n in 0..comptime!(o_tiles / 2) {
                let vf = load_b(
                    &v_tile,
                    v_base + kk * FRAGMENT * v_ld + n * FRAGMENT,
                    v_ld,
                    LOADS,
                );
                #[unroll]
                for t in 0..m_tiles {
                    mma(&p, t * 4, &vf, 0, &mut o_acc, t * o_tiles + 2 * n);
                    mma(&p, t * 4, &vf, 2, &mut o_acc, t * o_tiles + 2 * n + 1);
                }
            }
        }
        next_k0 = usize::cast_from(ahead);
    }

    // Epilogue: the four lanes of a row add their sums; normalize and write O and the LSE.
    #[unroll]
    for t in 0..m_tiles {
        #[unroll]
        for half in 0..2usize {
            let r = 2 * t + half;
            let sum = row_reduce_sum(row_sum[r], LANES_PER_ROW);
            let row = q_begin + plane_row + t * FRAGMENT + group + 8 * half;
            if row < seq_q {
                let inv = select(sum > 0.0, 1.0 / sum, 0.0);
                let row = sequence.q_first + row;
                store_row(
                    out,
                    sequence.batch,
                    head.head_q,
                    row,
                    &o_acc,
                    2 * t * o_tiles,
                    half,
                    inv,
                    in_group,
                    config.dim_v,
                );
                if in_group == 0 {
                    let lse_index = sequence.batch * lse.stride(0)
                        + head.head_q * lse.stride(1)
                        + row * lse.stride(2);
                    let lse_value =
                        reference(row_max[r], exponent_scale) * std::f32::consts::LN_2 + sum.ln();
                    lse[lse_index] = select(sum > 0.0, lse_value, neg_inf);
                }
            }
        }
    }
}

/// Copies the `rows` rows of `t` from key `first` of the cube's sequence and key/value head
/// into stage `stage` of `tile` asynchronously, their arrival tracked by that stage's barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_block<F: Float>(
    t: &Tensor<F>,
    rows_of: &RowLayout,
    head: &Head,
    sequence: &Sequence,
    first: usize,
    tile: &mut Shared<[F]>,
    stage: usize,
    landed: &StageBarriers,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] padded: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] units: usize,
) {
    let offset = stage * comptime!(layout.len(rows));
    stage_rows_async(
        t,
        rows_of,
        sequence.batch,
        head.head_kv,
        sequence.kv_first + first,
        tile,
        offset,
        rows,
        dim,
        padded,
        layout,
        units,
    );
    landed.commit(stage, 2usize);
}

/// `acc += A·B` on warpgroup products ([`accumulate_from_registers`]): `O += P·V` of a
/// block of `reduction` keys, each product 64 columns wide or (`wide`) as wide as `O`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_all<F: Float>(
    acc: &mut Array<Pair<f32>>,
    a: &Array<Pair<f32>>,
    tile: &Shared<[F]>,
    base: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] reduction: usize,
    #[comptime] wide: bool,
    #[comptime] dtype: FloatDtype,
) {
    let cols = comptime!(SharedOperand::new(layout, Major::MN).cols);
    let n = comptime!(if wide { cols } else { WARPGROUP_COLS });
    if comptime!(cols == 128) {
        accumulate_from_registers::<F, Const<64>, Const<4>>(
            acc, a, tile, base, layout, reduction, n, dtype,
        );
    } else {
        accumulate_from_registers::<F, Const<32>, Const<2>>(
            acc, a, tile, base, layout, reduction, n, dtype,
        );
    }
}

/// Headroom (base 2) a row's maximum may gain before the plane rescales its output.
const RESCALE_SLACK: f32 = 8.0;

/// The exponent a row's probabilities are taken against: its maximum, scaled; 0 while the
/// row has seen no visible key, so that masked scores (`MASKED`·scale − 0) still give
/// exactly 0.
#[cube]
fn reference(row_max: f32, exponent_scale: f32) -> f32 {
    select(row_max == f32::new(MASKED), 0.0, row_max * exponent_scale)
}

/// The maximum over the block of the lane's row `r` (`2 · tile + half`), shared by the four
/// lanes of the row.
#[cube]
fn block_row_max(
    s_acc: &Array<Pair<f32>>,
    #[comptime] r: usize,
    #[comptime] s_tiles: usize,
) -> f32 {
    let t = comptime!(r / 2);
    let half = comptime!(r % 2);
    let mut m = f32::new(MASKED);
    #[unroll]
    for n in 0..s_tiles {
        let pair = s_acc[2 * (t * s_tiles + n) + half];
        m = max(m, max(pair.extract(0usize), pair.extract(1usize)));
    }
    row_reduce_max(m, LANES_PER_ROW)
}
