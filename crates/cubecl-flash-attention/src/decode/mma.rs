//! The decode kernel on tensor cores (CUDA sm_80+, f16/bf16): the packed query rows of a
//! K/V head are one 16-row tile, and each key is scored and weighed by `mma.sync` products.
//!
//! Decode reads every cached byte once; what limits a kernel is how many bytes it keeps in
//! flight and how few instructions it spends per byte. Scoring a key row by lanes (dots
//! summed by plane shuffles, [`super::lanes`]) costs tens of instructions per key and row;
//! here the up to 16 packed rows ([`super::task`]) of the cube are the A operand of `Q·Kᵀ`
//! and the probabilities the A operand of `P·V`, so a key costs a fraction of one product
//! whatever the number of rows: the same speed at GQA 8:1 as at 4:1.
//!
//! A cube reads its split in steps of `planes · block` keys, copied asynchronously into
//! shared memory ([`super::stages`]), `stages − 1` steps in flight. Each plane takes its own
//! `block` keys of a step, runs `S = Q·Kᵀ`, the online softmax on the accumulator registers
//! and `O += P·V` (as the forward's [`crate::forward::register_mma`]), and keeps its own
//! softmax state; at the end the planes' partial results meet in shared memory and are
//! merged by their maxima, as splits are ([`super::task::write_merged`]).

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use super::cache::{CacheSlot, cache_slot};
use super::stages::step_count;
use super::task::{DecodeTask, write_merged};
use crate::bias::ScoreTerms;
use crate::config::FRAGMENT;
use crate::mma_sync::{
    LoadAddress, Pair, accumulators_as_a, load_a, load_b, load_b_transposed, mma, zeros,
};
use crate::rotary::RotaryConfig;
use crate::score::score;
use crate::softmax::{MASKED, RunningState, probability, row_reduce_max, row_reduce_sum};
use crate::stages::StageBarriers;
use crate::tile::RowLayout;

/// Lanes sharing one row of an accumulator tile.
const LANES_PER_ROW: usize = 4;
/// Columns of one accumulator tile.
const TILE_COLS: usize = 8;
/// Elements of one 16-byte copy (16-bit elements).
const COPY: usize = 8;
/// How the `ldmatrix` loads are addressed.
const LOADS: LoadAddress = LoadAddress::Window;

/// The compile-time configuration of one variant of [`flash_decode_mma`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaDecodeConfig {
    /// Packed query rows of the cube kept through the final merge (at most 16, the tile's
    /// rows; the products always run on all 16).
    pub rows: usize,
    /// Head dim of keys and values alike, a multiple of 16.
    pub dim: usize,
    pub planes: usize,
    /// Keys each plane takes per step, a multiple of 16.
    pub block: usize,
    /// Shared-memory stages (2 or 3).
    pub stages: usize,
    pub masked: bool,
    pub softcap: bool,
    /// The score terms ([`super::task::RowTerms`]): bias, ALiBi, score function.
    pub terms: ScoreTerms,
    pub paged: bool,
    pub split: bool,
}

impl MmaDecodeConfig {
    /// Rows of the product tile.
    pub const TILE_ROWS: usize = FRAGMENT;
    /// Units of a plane: the fragment layouts are PTX's.
    pub const PLANE: usize = 32;

    pub fn units(&self) -> usize {
        self.planes * Self::PLANE
    }

    /// Keys per step of the cube.
    pub fn step(&self) -> usize {
        self.planes * self.block
    }

    /// Row stride of the shared tiles in elements: 16 bytes of padding keep the 8 rows an
    /// `ldmatrix` reads in different banks.
    pub fn stride(&self) -> usize {
        self.dim + COPY
    }

    /// Block-table entries a unit holds for the next step's copies: one per copy of a paged
    /// cache (1 where contiguous, unused).
    pub fn block_lookups(&self) -> usize {
        if self.paged {
            (self.step() * self.dim / COPY).div_ceil(self.units())
        } else {
            1
        }
    }

    /// Shared memory of Q, the stages and the final merge, in bytes.
    pub fn shared_bytes(&self, elem: usize) -> usize {
        let tiles = (Self::TILE_ROWS + 2 * self.stages * self.step()) * self.stride() * elem;
        tiles + 4 * (self.planes * self.rows * (self.dim + 2) + 3 * self.rows)
    }
}

/// [`super::kernel::flash_decode`]'s results on tensor cores, for caches `k`/`v` whose rows
/// take 16-byte copies.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_decode_mma<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    seqlens: &Tensor<i32>,
    table: &Tensor<i32>,
    table_row: u32,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    partial_out: &mut Tensor<f32>,
    partial_lse: &mut Tensor<f32>,
    rotary_cos: &Tensor<F>,
    rotary_sin: &Tensor<F>,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    score_params: &Tensor<f32>,
    appended: u32,
    page_size: FastDivmod<u32>,
    scale: f32,
    softcap: f32,
    window_left: i32,
    window_right: i32,
    neg_inf: f32,
    #[comptime] config: MmaDecodeConfig,
    #[comptime] rotary: RotaryConfig,
    #[define(F)] _dtype: ElemType,
) {
    let dim = config.dim;
    let rows = config.rows;
    let block = config.block;
    let stages = config.stages;
    let units = comptime!(config.units());
    let step = comptime!(config.step());
    let ld = comptime!(config.stride());
    let stage_len = comptime!(config.step() * config.stride());
    let k_steps = comptime!(config.dim / FRAGMENT);
    let s_tiles = comptime!(config.block / TILE_COLS);
    let o_tiles = comptime!(config.dim / TILE_COLS);
    let table_row = table_row as usize;

    let task = DecodeTask::of_cube(
        q.shape(1),
        q.shape(2),
        k.shape(1),
        seqlens,
        appended,
        window_left,
        window_right,
        comptime!(MmaDecodeConfig::TILE_ROWS),
        step,
        config.masked,
    );
    if task.idle {
        terminate!();
    }
    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let group = lane / LANES_PER_ROW;
    let in_group = lane % LANES_PER_ROW;

    // The packed queries (turned by the rotary embedding, in the input dtype), then each
    // plane's A fragments of them, kept in registers.
    let mut q_tile =
        Shared::<[F]>::new_aligned_slice(comptime!(MmaDecodeConfig::TILE_ROWS * ld), 16usize);
    for n in 0..comptime!((MmaDecodeConfig::TILE_ROWS * config.dim).div_ceil(units)) {
        let idx = n * units + UNIT_POS as usize;
        if idx < comptime!(MmaDecodeConfig::TILE_ROWS * config.dim) {
            let (r, c) = (idx / dim, idx % dim);
            let value = task.query_value(q, r, c, rotary_cos, rotary_sin, rotary, config.masked);
            q_tile[r * ld + c] = F::cast_from(value);
        }
    }
    sync_cube();
    let mut q_frag = Array::<Pair<F>>::new(comptime!(4 * k_steps));
    #[unroll]
    for kk in 0..k_steps {
        let frag = load_a(&q_tile, kk * FRAGMENT, ld, LOADS);
        #[unroll]
        for i in 0..4usize {
            q_frag[kk * 4 + i] = frag[i];
        }
    }

    // The score terms of the lane's rows `group` and `group + 8`.
    let near_terms = task.row_terms(bias, alibi_slopes, group, config.terms);
    let far_terms = task.row_terms(bias, alibi_slopes, group + 8, config.terms);

    // The plane's output tile and the softmax state of the lane's rows `group` (0) and
    // `group + 8` (1); the row sums stay per lane until the end.
    let mut o_acc = zeros(comptime!(2 * o_tiles));
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        row_max[half] = f32::new(MASKED);
        row_sum[half] = 0.0;
    }

    let mut k_tile = Shared::<[F]>::new_aligned_slice(comptime!(stages * stage_len), 16usize);
    let mut v_tile = Shared::<[F]>::new_aligned_slice(comptime!(stages * stage_len), 16usize);
    let landed = StageBarriers::new(3usize);
    let steps = step_count(&task, step);
    // A paged cache's blocks of the next step to copy, looked up a step ahead.
    let mut blocks = Array::<u32>::new(comptime!(config.block_lookups()));
    look_up_blocks(
        table,
        table_row,
        page_size,
        &task,
        task.begin,
        &mut blocks,
        config,
    );
    #[unroll]
    for s in 0..comptime!(stages - 1) {
        let t = i32::cast_from(s);
        if t < steps {
            copy_step(
                k,
                v,
                k_rows,
                v_rows,
                page_size,
                &task,
                task.begin + t * i32::cast_from(step),
                &blocks,
                &mut k_tile,
                &mut v_tile,
                comptime!(s * stage_len),
                config,
            );
            landed.commit(s, stages);
            let next = task.begin + (t + 1) * i32::cast_from(step);
            look_up_blocks(
                table,
                table_row,
                page_size,
                &task,
                next,
                &mut blocks,
                config,
            );
        }
    }
    for t in 0..steps {
        let stage = usize::cast_from(t) % stages;
        landed.wait(stage, stages);
        let ahead = t + i32::cast_from(stages - 1);
        if ahead < steps {
            let refill = (stage + stages - 1) % stages;
            copy_step(
                k,
                v,
                k_rows,
                v_rows,
                page_size,
                &task,
                task.begin + ahead * i32::cast_from(step),
                &blocks,
                &mut k_tile,
                &mut v_tile,
                refill * stage_len,
                config,
            );
            landed.commit(refill, stages);
            let next = task.begin + (ahead + 1) * i32::cast_from(step);
            look_up_blocks(
                table,
                table_row,
                page_size,
                &task,
                next,
                &mut blocks,
                config,
            );
        }

        // The plane's keys: `block` rows of the stage from `first`, positions from `k0`.
        let first = stage * stage_len + plane * block * ld;
        let k0 = task.begin + t * i32::cast_from(step) + i32::cast_from(plane * block);

        // 1. S = Q·Kᵀ.
        let mut s_acc = zeros(comptime!(2 * s_tiles));
        #[unroll]
        for kk in 0..k_steps {
            #[unroll]
            for n in 0..comptime!(s_tiles / 2) {
                let kf = load_b_transposed(
                    &k_tile,
                    first + n * FRAGMENT * ld + kk * FRAGMENT,
                    ld,
                    LOADS,
                );
                mma(&q_frag, kk * 4, &kf, 0, &mut s_acc, 2 * n);
                mma(&q_frag, kk * 4, &kf, 2, &mut s_acc, 2 * n + 1);
            }
        }

        // 2. Scores (scale, softcap), hidden ones marked where the block straddles the
        // split's end or the mask's edge, and the online softmax of the lane's two rows.
        let k_end = k0 + i32::cast_from(block);
        let mut exact = k_end <= task.end;
        if comptime!(config.masked) {
            exact = exact
                && task
                    .mask
                    .is_block_visible(0, i32::cast_from(task.seq_q), k0, k_end);
        }
        #[unroll]
        for at in 0..comptime!(2 * s_tiles) {
            let mut pair = s_acc[at];
            #[unroll]
            for e in 0..2usize {
                let mut s = score(pair.extract(e), scale, softcap, config.softcap);
                if comptime!(config.terms.any()) {
                    let key = k0 + i32::cast_from((at / 2) * TILE_COLS + 2 * in_group + e);
                    if at % 2 == 0 {
                        s = near_terms.apply(bias, score_params, s, key, config.terms);
                    } else {
                        s = far_terms.apply(bias, score_params, s, key, config.terms);
                    }
                }
                pair.insert(e, s);
            }
            s_acc[at] = pair;
        }
        if !exact {
            #[unroll]
            for at in 0..comptime!(2 * s_tiles) {
                let row = group + 8 * (at % 2);
                let mut pair = s_acc[at];
                #[unroll]
                for e in 0..2usize {
                    let key = k0 + i32::cast_from((at / 2) * TILE_COLS + 2 * in_group + e);
                    let visible = task.sees(row, key, config.masked);
                    pair.insert(e, select(visible, pair.extract(e), f32::new(MASKED)));
                }
                s_acc[at] = pair;
            }
        }
        #[unroll]
        for half in 0..2usize {
            let mut block_max = f32::new(MASKED);
            #[unroll]
            for n in 0..s_tiles {
                let pair = s_acc[2 * n + half];
                block_max = max(block_max, max(pair.extract(0usize), pair.extract(1usize)));
            }
            let mut state = RunningState {
                m: row_max[half],
                l: row_sum[half],
            };
            let alpha = state.rescale(row_reduce_max(block_max, LANES_PER_ROW));
            #[unroll]
            for n in 0..s_tiles {
                let at = 2 * n + half;
                let mut pair = s_acc[at];
                #[unroll]
                for e in 0..2usize {
                    let p = probability(pair.extract(e), state.m);
                    state.l += p;
                    pair.insert(e, p);
                }
                s_acc[at] = pair;
            }
            row_max[half] = state.m;
            row_sum[half] = state.l;
            let alpha_pair = Pair::<f32>::cast_from(alpha);
            #[unroll]
            for n in 0..o_tiles {
                o_acc[2 * n + half] = o_acc[2 * n + half] * alpha_pair;
            }
        }

        // 3. O += P·V, the probabilities as the A operand straight from the accumulators.
        #[unroll]
        for kk in 0..comptime!(block / FRAGMENT) {
            let p = accumulators_as_a::<F>(&s_acc, 2 * kk);
            #[unroll]
            for n in 0..comptime!(o_tiles / 2) {
                let vf = load_b(
                    &v_tile,
                    first + kk * FRAGMENT * ld + n * FRAGMENT,
                    ld,
                    LOADS,
                );
                mma(&p, 0, &vf, 0, &mut o_acc, 2 * n);
                mma(&p, 0, &vf, 2, &mut o_acc, 2 * n + 1);
            }
        }
    }

    // The planes' partial results (the rows the cube keeps) meet in shared memory.
    let mut slot_state = Shared::<[f32]>::new_slice(comptime!(2 * config.planes * rows));
    let mut slot_out = Shared::<[f32]>::new_slice(comptime!(config.planes * rows * config.dim));
    #[unroll]
    for half in 0..2usize {
        let sum = row_reduce_sum(row_sum[half], LANES_PER_ROW);
        let row = group + 8 * half;
        if row < rows {
            let at = plane * rows + row;
            #[unroll]
            for n in 0..o_tiles {
                let pair = o_acc[2 * n + half];
                let c = at * dim + n * TILE_COLS + 2 * in_group;
                slot_out[c] = pair.extract(0usize);
                slot_out[c + 1] = pair.extract(1usize);
            }
            if in_group == 0 {
                slot_state[2 * at] = row_max[half];
                slot_state[2 * at + 1] = sum;
            }
        }
    }
    write_merged(
        &task,
        &slot_state,
        &slot_out,
        out,
        lse,
        partial_out,
        partial_lse,
        neg_inf,
        config.planes,
        rows,
        config.dim,
        units,
        config.split,
    );
}

/// Loads into `blocks` the cache block of each copy this unit issues for the step from
/// position `k0` (`blocks[n]` for its `n`-th copy): the block table's entries, for a paged
/// cache, loaded a step before the copies need them so that their latency hides behind the
/// step computed meanwhile. A contiguous cache has no table: nothing is loaded. Positions at
/// or past the split's end are never looked up (the table past a sequence's pages may hold
/// anything).
#[cube]
#[allow(clippy::too_many_arguments)]
fn look_up_blocks(
    table: &Tensor<i32>,
    table_row: usize,
    page_size: FastDivmod<u32>,
    task: &DecodeTask,
    k0: i32,
    blocks: &mut Array<u32>,
    #[comptime] config: MmaDecodeConfig,
) {
    if comptime!(config.paged) {
        let chunks = comptime!(config.dim / COPY);
        let units = comptime!(config.units());
        let copies = comptime!(config.step() * config.dim / COPY);
        #[unroll]
        for n in 0..comptime!(copies.div_ceil(units)) {
            let idx = n * units + UNIT_POS as usize;
            let position = k0 + i32::cast_from(idx / chunks);
            let mut block = 0u32;
            if (comptime!(copies.is_multiple_of(units)) || idx < copies) && position < task.end {
                let at = cache_slot(
                    table,
                    table_row,
                    task.batch,
                    usize::cast_from(position),
                    page_size,
                    true,
                );
                block = u32::cast_from(at.block);
            }
            blocks[n] = block;
        }
    }
}

/// Starts the copies of the `step` keys and values from position `k0` into a stage (from
/// `offset`, row `j` for key `k0 + j`, rows `stride` apart), a paged cache's blocks taken
/// from `blocks` ([`look_up_blocks`]). Positions at or past the
/// split's end are zeroed with plain stores (visible after the same wait) and never looked
/// up: a cache past a sequence's length may hold anything, NaN included, and a hidden
/// key's value still meets a zero probability in `P·V`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_step<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    page_size: FastDivmod<u32>,
    task: &DecodeTask,
    k0: i32,
    blocks: &Array<u32>,
    k_tile: &mut Shared<[F]>,
    v_tile: &mut Shared<[F]>,
    offset: usize,
    #[comptime] config: MmaDecodeConfig,
) {
    let chunks = comptime!(config.dim / COPY);
    let units = comptime!(config.units());
    let copies = comptime!(config.step() * config.dim / COPY);
    let ld = comptime!(config.stride());
    #[unroll]
    for n in 0..comptime!(copies.div_ceil(units)) {
        let idx = n * units + UNIT_POS as usize;
        if comptime!(copies.is_multiple_of(units)) || idx < copies {
            let key = idx / chunks;
            let c = (idx % chunks) * COPY;
            let position = k0 + i32::cast_from(key);
            let to = offset + key * ld + c;
            if position < task.end {
                let mut at = CacheSlot {
                    block: task.batch,
                    row: usize::cast_from(position),
                };
                if comptime!(config.paged) {
                    at.block = usize::cast_from(blocks[n]);
                    at.row = usize::cast_from(page_size.modulo(u32::cast_from(position)));
                }
                let from = k_rows.offset(at.block, task.head_kv, at.row) + c;
                copy_async(
                    &k[from..from + COPY],
                    &mut k_tile[to..to + COPY],
                    COPY as u32,
                );
                let from = v_rows.offset(at.block, task.head_kv, at.row) + c;
                copy_async(
                    &v[from..from + COPY],
                    &mut v_tile[to..to + COPY],
                    COPY as u32,
                );
            } else {
                #[unroll]
                for e in 0..COPY {
                    k_tile[to + e] = F::new(0.0);
                    v_tile[to + e] = F::new(0.0);
                }
            }
        }
    }
}
