//! The decode kernel for GPUs: each cached key is read by a group of lanes, 16 bytes a lane.
//!
//! Decode reads every cached byte once and does little arithmetic on it: what counts is
//! how many bytes are in flight. Here the `dim / vector` lanes of a *key slot* hold one key
//! row between them, one 16-byte vector each (d = 128 in bf16: 16 lanes, two slots per
//! 32-lane plane), and a cube's slots take consecutive keys, so a plane's loads are whole
//! rows. Each lane keeps its slice of the query and of the output accumulator of up to 4
//! packed query rows ([`super::task`]) in registers; with more rows, `row_groups` groups of
//! lanes share a slot, each with its own rows. Per step a slot scores `unroll` keys (a dot
//! of the lane's slices, summed over the slot's lanes by plane shuffles) and folds them and
//! their values into its own online softmax. At the end the slots' partial results meet in
//! shared memory and are merged by their maxima, as splits are.
//!
//! K and V reach the lanes one of two ways: on CUDA sm_80+ through `stages` shared-memory
//! stages filled by asynchronous copies (`stages − 1` steps in flight while the cube
//! computes on one, without holding registers); elsewhere straight into registers, the
//! next step's loads issued before this step's arithmetic.
//!
//! It needs plane shuffles, `dim_qk = dim_v`, a head dim of whole vectors whose vector
//! count divides the plane, and caches readable by 16-byte loads; [`super::kernel`] takes
//! every other case.

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use super::cache::cache_slot;
use super::stages::step_count;
use super::task::{DecodeTask, write_merged};
use crate::bias::ScoreTerms;
use crate::rotary::RotaryConfig;
use crate::score::score;
use crate::softmax::{MASKED, RunningState, probability, row_reduce_sum};
use crate::stages::StageBarriers;
use crate::tile::RowLayout;

/// The compile-time configuration of one variant of [`flash_decode_lanes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LanesConfig {
    /// Packed query rows per cube.
    pub rows: usize,
    /// Head dim (of keys and values alike).
    pub dim: usize,
    /// Elements per load (16 bytes).
    pub vector: usize,
    pub plane_size: usize,
    pub planes: usize,
    /// Keys per slot per step.
    pub unroll: usize,
    /// K and V stream through shared memory by asynchronous copies (CUDA sm_80+) rather
    /// than through registers.
    pub async_copies: bool,
    /// Shared-memory stages of the asynchronous copies (2 or 3): `stages − 1` steps are in
    /// flight while the cube computes on one.
    pub stages: usize,
    /// Groups of lanes that share a key slot, each with `rows / row_groups` of the rows
    /// (a power of two dividing `rows`): more groups, less arithmetic per lane, the same
    /// key read by more lanes (from one load where they share a plane, else from L1).
    pub row_groups: usize,
    pub masked: bool,
    pub softcap: bool,
    /// The score terms ([`super::task::RowTerms`]): bias, ALiBi, score function.
    pub terms: ScoreTerms,
    pub paged: bool,
    pub split: bool,
}

impl LanesConfig {
    /// Lanes that hold one key row.
    pub fn lanes_per_key(&self) -> usize {
        self.dim / self.vector
    }

    pub fn units(&self) -> usize {
        self.planes * self.plane_size
    }

    /// Keys a cube reads at once.
    pub fn slots(&self) -> usize {
        self.units() / (self.lanes_per_key() * self.row_groups)
    }

    /// Packed rows each lane keeps.
    pub fn rows_per_lane(&self) -> usize {
        self.rows / self.row_groups
    }

    /// Keys per step of the cube.
    pub fn step(&self) -> usize {
        self.slots() * self.unroll
    }

    /// Shared memory of the stages (with asynchronous copies) and of the final merge, in
    /// bytes.
    pub fn shared_bytes(&self, elem: usize) -> usize {
        let stages = match self.async_copies {
            true => self.stages * 2 * self.step() * self.dim * elem,
            false => 0,
        };
        stages + 4 * (self.slots() * self.rows * (self.dim + 2) + 3 * self.rows)
    }
}

/// [`super::kernel::flash_decode`]'s results from caches `k`/`v` read `N` elements at a time
/// (`k_rows`, `v_rows` in vectors).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_decode_lanes<F: Float, N: Size>(
    q: &Tensor<F>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
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
    #[comptime] config: LanesConfig,
    #[comptime] rotary: RotaryConfig,
    #[define(F)] _dtype: ElemType,
) {
    let rows = config.rows;
    let vector = config.vector;
    let unroll = config.unroll;
    let lanes_per_key = comptime!(config.lanes_per_key());
    let slots = comptime!(config.slots());
    let step_keys = comptime!(config.step());
    let table_row = table_row as usize;

    let task = DecodeTask::of_cube(
        q.shape(1),
        q.shape(2),
        k.shape(1),
        seqlens,
        appended,
        window_left,
        window_right,
        rows,
        step_keys,
        config.masked,
    );
    if task.idle {
        terminate!();
    }
    let own = comptime!(config.rows_per_lane());
    let slot = UNIT_POS as usize / (lanes_per_key * config.row_groups);
    let first = (UNIT_POS as usize / lanes_per_key) % config.row_groups * own;
    let column = (UNIT_POS as usize % lanes_per_key) * vector;

    // This lane's slice of its packed query rows `first ..`, and of their outputs.
    let mut q_slice = Array::<Vector<f32, N>>::new(own);
    let mut acc = Array::<Vector<f32, N>>::new(own);
    let mut row_max = Array::<f32>::new(own);
    let mut row_sum = Array::<f32>::new(own);
    #[unroll]
    for r in 0..own {
        let mut slice = Vector::<f32, N>::new(0.0);
        #[unroll]
        for i in 0..vector {
            slice.insert(
                i,
                task.query_value(
                    q,
                    first + r,
                    column + i,
                    rotary_cos,
                    rotary_sin,
                    rotary,
                    config.masked,
                ),
            );
        }
        q_slice[r] = slice;
        acc[r] = Vector::<f32, N>::new(0.0);
        row_max[r] = f32::new(MASKED);
        row_sum[r] = 0.0;
    }

    let lane = Lane {
        slot,
        first,
        chunk: column / vector,
    };
    let mut scores = Array::<f32>::new(comptime!(unroll * own));
    if config.async_copies {
        stream_through_shared(
            k,
            v,
            k_rows,
            v_rows,
            table,
            table_row,
            page_size,
            &task,
            &lane,
            &q_slice,
            &mut acc,
            &mut row_max,
            &mut row_sum,
            &mut scores,
            bias,
            alibi_slopes,
            score_params,
            scale,
            softcap,
            config,
        );
    } else {
        stream_through_registers(
            k,
            v,
            k_rows,
            v_rows,
            table,
            table_row,
            page_size,
            &task,
            &lane,
            &q_slice,
            &mut acc,
            &mut row_max,
            &mut row_sum,
            &mut scores,
            bias,
            alibi_slopes,
            score_params,
            scale,
            softcap,
            config,
        );
    }

    // Merge the slots: each row's maximum over the slots rescales their sums and outputs.
    let mut slot_state = Shared::<[f32]>::new_slice(comptime!(2 * slots * rows));
    let mut slot_out = Shared::<[f32]>::new_slice(comptime!(slots * rows * config.dim));
    #[unroll]
    for r in 0..own {
        let row = slot * rows + first + r;
        #[unroll]
        for i in 0..vector {
            slot_out[row * config.dim + column + i] = acc[r].extract(i);
        }
        if column == 0 {
            slot_state[2 * row] = row_max[r];
            slot_state[2 * row + 1] = row_sum[r];
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
        slots,
        rows,
        config.dim,
        comptime!(config.units()),
        config.split,
    );
}

/// Where a lane works: its key slot, the first of its packed rows, and which vector of a
/// key row it holds.
#[derive(CubeType, Clone, Copy)]
pub struct Lane {
    pub slot: usize,
    pub first: usize,
    pub chunk: usize,
}

/// The main loop, K and V loaded into registers: the next step's loads are issued before
/// this step's arithmetic (GPUs without asynchronous copies).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stream_through_registers<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    page_size: FastDivmod<u32>,
    task: &DecodeTask,
    lane: &Lane,
    q_slice: &Array<Vector<f32, N>>,
    acc: &mut Array<Vector<f32, N>>,
    row_max: &mut Array<f32>,
    row_sum: &mut Array<f32>,
    scores: &mut Array<f32>,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    score_params: &Tensor<f32>,
    scale: f32,
    softcap: f32,
    #[comptime] config: LanesConfig,
) {
    let unroll = config.unroll;
    let step = comptime!(config.step());
    let steps = step_count(task, step);
    let mut k_next = Array::<Vector<F, N>>::new(unroll);
    let mut v_next = Array::<Vector<F, N>>::new(unroll);
    let mut keys = Array::<Vector<F, N>>::new(unroll);
    let mut values = Array::<Vector<F, N>>::new(unroll);
    load_keys(
        k,
        v,
        k_rows,
        v_rows,
        table,
        table_row,
        task,
        task.begin,
        lane,
        page_size,
        &mut k_next,
        &mut v_next,
        config,
    );
    for t in 0..steps {
        let k0 = task.begin + t * i32::cast_from(step);
        #[unroll]
        for u in 0..unroll {
            keys[u] = k_next[u];
            values[u] = v_next[u];
        }
        if t + 1 < steps {
            load_keys(
                k,
                v,
                k_rows,
                v_rows,
                table,
                table_row,
                task,
                k0 + i32::cast_from(step),
                lane,
                page_size,
                &mut k_next,
                &mut v_next,
                config,
            );
        }
        fold_step(
            task,
            lane,
            k0,
            &keys,
            &values,
            q_slice,
            acc,
            row_max,
            row_sum,
            scores,
            bias,
            alibi_slopes,
            score_params,
            scale,
            softcap,
            config,
        );
    }
}

/// The main loop, K and V copied asynchronously (`cp.async`) into `stages` stages of shared
/// memory: the next `stages − 1` steps' copies are in flight while the cube computes on one,
/// without holding registers.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stream_through_shared<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    page_size: FastDivmod<u32>,
    task: &DecodeTask,
    lane: &Lane,
    q_slice: &Array<Vector<f32, N>>,
    acc: &mut Array<Vector<f32, N>>,
    row_max: &mut Array<f32>,
    row_sum: &mut Array<f32>,
    scores: &mut Array<f32>,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    score_params: &Tensor<f32>,
    scale: f32,
    softcap: f32,
    #[comptime] config: LanesConfig,
) {
    let unroll = config.unroll;
    let step = comptime!(config.step());
    let stage_len = comptime!(config.step() * config.lanes_per_key());
    let slots = comptime!(config.slots());
    let lanes_per_key = comptime!(config.lanes_per_key());
    let steps = step_count(task, step);
    let stages = config.stages;
    let mut k_tile = Shared::<[Vector<F, N>]>::new_slice(comptime!(stages * stage_len));
    let mut v_tile = Shared::<[Vector<F, N>]>::new_slice(comptime!(stages * stage_len));
    let landed = StageBarriers::new(3usize);
    let mut keys = Array::<Vector<F, N>>::new(unroll);
    let mut values = Array::<Vector<F, N>>::new(unroll);
    #[unroll]
    for stage in 0..comptime!(stages - 1) {
        let t = i32::cast_from(stage);
        if t < steps {
            copy_step(
                k,
                v,
                k_rows,
                v_rows,
                table,
                table_row,
                page_size,
                task,
                task.begin + t * i32::cast_from(step),
                &mut k_tile,
                &mut v_tile,
                comptime!(stage * stage_len),
                config,
            );
            landed.commit(stage, stages);
        }
    }
    for t in 0..steps {
        let stage = usize::cast_from(t) % stages;
        landed.wait(stage, stages);
        // Every unit is past step t − 1 once the wait returns: its stage takes step
        // t + stages − 1.
        let ahead = t + i32::cast_from(stages - 1);
        if ahead < steps {
            let refill = (stage + stages - 1) % stages;
            copy_step(
                k,
                v,
                k_rows,
                v_rows,
                table,
                table_row,
                page_size,
                task,
                task.begin + ahead * i32::cast_from(step),
                &mut k_tile,
                &mut v_tile,
                refill * stage_len,
                config,
            );
            landed.commit(refill, stages);
        }
        let k0 = task.begin + t * i32::cast_from(step);
        let offset = stage * stage_len;
        #[unroll]
        for u in 0..unroll {
            let at = offset + (u * slots + lane.slot) * lanes_per_key + lane.chunk;
            keys[u] = k_tile[at];
            values[u] = v_tile[at];
        }
        fold_step(
            task,
            lane,
            k0,
            &keys,
            &values,
            q_slice,
            acc,
            row_max,
            row_sum,
            scores,
            bias,
            alibi_slopes,
            score_params,
            scale,
            softcap,
            config,
        );
    }
}

/// Starts the copies of the `step` keys and values from key `k0` into a stage (from
/// `offset`): key `j` of the step in row `j`, its `lanes_per_key` vectors side by side.
/// Keys at or past the split's end are zeroed with plain stores (visible after the same
/// wait) and never looked up.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_step<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    page_size: FastDivmod<u32>,
    task: &DecodeTask,
    k0: i32,
    k_tile: &mut Shared<[Vector<F, N>]>,
    v_tile: &mut Shared<[Vector<F, N>]>,
    offset: usize,
    #[comptime] config: LanesConfig,
) {
    let lanes_per_key = comptime!(config.lanes_per_key());
    let units = comptime!(config.units());
    let copies = comptime!(config.step() * config.lanes_per_key());
    #[unroll]
    for n in 0..comptime!(copies.div_ceil(units)) {
        let idx = n * units + UNIT_POS as usize;
        if idx < copies {
            let position = k0 + i32::cast_from(idx / lanes_per_key);
            let chunk = idx % lanes_per_key;
            let to = offset + idx;
            if position < task.end {
                let at = cache_slot(
                    table,
                    table_row,
                    task.batch,
                    usize::cast_from(position),
                    page_size,
                    config.paged,
                );
                let from = k_rows.offset(at.block, task.head_kv, at.row) + chunk;
                copy_async(
                    &k[from..from + 1],
                    &mut k_tile[to..to + 1],
                    config.vector as u32,
                );
                let from = v_rows.offset(at.block, task.head_kv, at.row) + chunk;
                copy_async(
                    &v[from..from + 1],
                    &mut v_tile[to..to + 1],
                    config.vector as u32,
                );
            } else {
                k_tile[to] = Vector::<F, N>::new(F::new(0.0));
                v_tile[to] = Vector::<F, N>::new(F::new(0.0));
            }
        }
    }
}

/// One step of a slot: the scores of its `unroll` keys (the lanes' partial dots summed over
/// the slot by plane shuffles), then each row's online softmax, `O ← α·O + Σ p·V`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_step<F: Float, N: Size>(
    task: &DecodeTask,
    lane: &Lane,
    k0: i32,
    keys: &Array<Vector<F, N>>,
    values: &Array<Vector<F, N>>,
    q_slice: &Array<Vector<f32, N>>,
    acc: &mut Array<Vector<f32, N>>,
    row_max: &mut Array<f32>,
    row_sum: &mut Array<f32>,
    scores: &mut Array<f32>,
    bias: &Tensor<F>,
    alibi_slopes: &Tensor<f32>,
    score_params: &Tensor<f32>,
    scale: f32,
    softcap: f32,
    #[comptime] config: LanesConfig,
) {
    let unroll = config.unroll;
    let own = comptime!(config.rows_per_lane());
    let slots = comptime!(config.slots());
    #[unroll]
    for u in 0..unroll {
        let key = Vector::<f32, N>::cast_from(keys[u]);
        let position = k0 + i32::cast_from(u * slots + lane.slot);
        #[unroll]
        for r in 0..own {
            let products = q_slice[r] * key;
            let mut dot = 0.0f32;
            #[unroll]
            for i in 0..config.vector {
                dot += products.extract(i);
            }
            let dot = row_reduce_sum(dot, comptime!(config.lanes_per_key()));
            let mut s = score(dot, scale, softcap, config.softcap);
            if comptime!(config.terms.any()) {
                let terms = task.row_terms(bias, alibi_slopes, lane.first + r, config.terms);
                s = terms.apply(bias, score_params, s, position, config.terms);
            }
            scores[u * own + r] = select(
                task.sees(lane.first + r, position, config.masked),
                s,
                f32::new(MASKED),
            );
        }
    }
    #[unroll]
    for r in 0..own {
        let mut row = RunningState {
            m: row_max[r],
            l: row_sum[r],
        };
        let mut block_max = f32::new(MASKED);
        #[unroll]
        for u in 0..unroll {
            block_max = max(block_max, scores[u * own + r]);
        }
        let alpha = row.rescale(block_max);
        let mut o = acc[r] * Vector::<f32, N>::new(alpha);
        #[unroll]
        for u in 0..unroll {
            let p = probability(scores[u * own + r], row.m);
            row.l += p;
            o += Vector::<f32, N>::cast_from(values[u]) * Vector::<f32, N>::new(p);
        }
        acc[r] = o;
        row_max[r] = row.m;
        row_sum[r] = row.l;
    }
}

/// Loads this slot's `unroll` keys and values of the step from key `k0` (slot `slot` takes
/// keys `k0 + u · slots + slot`), the lane's vector of each, into registers; keys at or past
/// the split's end read as 0 and are never looked up.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_keys<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    task: &DecodeTask,
    k0: i32,
    lane: &Lane,
    page_size: FastDivmod<u32>,
    keys: &mut Array<Vector<F, N>>,
    values: &mut Array<Vector<F, N>>,
    #[comptime] config: LanesConfig,
) {
    let slots = comptime!(config.slots());
    #[unroll]
    for u in 0..config.unroll {
        let position = k0 + i32::cast_from(u * slots + lane.slot);
        let mut key = Vector::<F, N>::new(F::new(0.0));
        let mut value = Vector::<F, N>::new(F::new(0.0));
        if position < task.end {
            let at = cache_slot(
                table,
                table_row,
                task.batch,
                usize::cast_from(position),
                page_size,
                config.paged,
            );
            key = k[k_rows.offset(at.block, task.head_kv, at.row) + lane.chunk];
            value = v[v_rows.offset(at.block, task.head_kv, at.row) + lane.chunk];
        }
        keys[u] = key;
        values[u] = value;
    }
}
