//! The decode kernel: a few new queries against a long key/value cache (flash-decoding).
//!
//! Training kernels give each query head its own cube and one unit per query row; at decode
//! a query block then holds one live row, a (batch, head) pair is one cube on a device of a
//! hundred multiprocessors, and under GQA every query head reads its K/V again. Here:
//!
//! - a cube owns one K/V head of one sequence and packs the queries of every query head that
//!   reads it (`group · s_q` rows, `rows` per cube): each K/V byte is read once per K/V head;
//! - the sequence's key range is cut into `CUBE_COUNT_X` splits, one per cube, whose
//!   results [`super::merge`] combines by their LSE;
//! - K/V come from a contiguous or a paged cache ([`super::cache`]), up to the sequence's own
//!   length (`cache_seqlens[b]`, plus the keys appended by this call);
//! - the next key block's K and V are loaded into registers while the cube computes on the
//!   current one (staged in shared memory as f32): the loads' latency hides under the work;
//! - per key block the units compute the `rows × block_kv` scores (one pair per unit each
//!   step); the online softmax of a row runs on the plane that computed its scores (plane
//!   reductions, where the block is one plane wide), or on one unit per row where the device
//!   has no plane operations; then the units add `P·V` to the outputs, which they share
//!   column by column.
//!
//! No tensor cores and, on devices without them, no plane operations: it runs everywhere.

use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use super::cache::{load_cache_block, store_block};
use super::task::DecodeTask;
use crate::bias::ScoreTerms;
use crate::mask::Blocks;
use crate::rotary::RotaryConfig;
use crate::score::score;
use crate::softmax::{MASKED, RunningState, probability};
use crate::tile::{RowLayout, dot_shared};

/// The compile-time configuration of one decode kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeConfig {
    /// Packed query rows per cube (query heads of one K/V head × new tokens).
    pub rows: usize,
    /// Keys staged per step.
    pub block_kv: usize,
    /// Units per cube; at least `rows`.
    pub units: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    /// Columns the head-dim loops run per iteration ([`crate::tile`]).
    pub columns: usize,
    pub masked: bool,
    pub softcap: bool,
    /// The score terms ([`super::task::RowTerms`]): bias, ALiBi, score function.
    pub terms: ScoreTerms,
    /// The cache is paged (a block table names the pages).
    pub paged: bool,
    /// The key range is split over cubes: partial outputs in f32 and their LSE, merged after.
    pub split: bool,
    /// Each row's softmax on the plane that computed its scores (`block_kv` is the plane
    /// size); otherwise one unit per row.
    pub plane_softmax: bool,
    /// The loops over a unit's values unrolled, so that its registers hold them (GPUs);
    /// rolled on CPU drivers, which compile unrolled loops slowly.
    pub unrolled: bool,
}

impl DecodeConfig {
    /// Row stride of the staged keys: one more than the head dim, so that the units reading
    /// the keys of one block column by column fall in different shared-memory banks.
    pub fn key_stride(&self) -> usize {
        self.dim_qk + 1
    }

    /// Score pairs (row, key) each unit computes per block.
    pub fn pairs_per_unit(&self) -> usize {
        (self.rows * self.block_kv).div_ceil(self.units)
    }

    /// Values of a staged block of `dim` columns each unit loads.
    pub fn loads_per_unit(&self, dim: usize) -> usize {
        (self.block_kv * dim).div_ceil(self.units)
    }

    /// Outputs (row, column) each unit accumulates.
    pub fn outputs_per_unit(&self) -> usize {
        (self.rows * self.dim_v).div_ceil(self.units)
    }

    /// Shared memory of one cube, in bytes.
    pub fn shared_bytes(&self) -> usize {
        let floats = self.rows * self.dim_qk
            + self.block_kv * self.key_stride()
            + self.block_kv * self.dim_v
            + self.rows * self.block_kv
            + 2 * self.rows;
        floats * 4
    }
}

/// `O` (or, split, the partial outputs) and the LSE of `q` `[b, h_q, s_q, d_qk]` against
/// the cache `k`/`v` (`[blocks, h_kv, rows, d]`, see [`super::cache`]) over the first
/// `cache_seqlens[b] + appended` positions of each sequence, masks bottom-right aligned.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn flash_decode<F: Float>(
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
    #[comptime] config: DecodeConfig,
    #[comptime] rotary: RotaryConfig,
    #[define(F)] _dtype: ElemType,
) {
    let rows = config.rows;
    let block_kv = config.block_kv;
    let units = config.units;
    let dim_qk = config.dim_qk;
    let dim_v = config.dim_v;
    let key_stride = comptime!(config.key_stride());
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
        block_kv,
        config.masked,
    );
    if task.idle {
        terminate!();
    }
    let (batch, head_kv) = (task.batch, task.head_kv);
    let blocks = Blocks::covering(task.begin, task.end, block_kv);
    let end_u = usize::cast_from(task.end);

    let mut q_tile = Shared::<[f32]>::new_slice(rows * dim_qk);
    let mut k_tile = Shared::<[f32]>::new_slice(block_kv * key_stride);
    let mut v_tile = Shared::<[f32]>::new_slice(block_kv * dim_v);
    let mut p_tile = Shared::<[f32]>::new_slice(rows * block_kv);
    let mut row_factor = Shared::<[f32]>::new_slice(rows);
    let mut row_lse = Shared::<[f32]>::new_slice(rows);

    // The packed query rows ([`DecodeTask`]); rows past the group read as 0.
    for step in 0..(rows * dim_qk).div_ceil(units) {
        let idx = step * units + UNIT_POS as usize;
        if idx < rows * dim_qk {
            let value = task.query_value(
                q,
                idx / dim_qk,
                idx % dim_qk,
                rotary_cos,
                rotary_sin,
                rotary,
                config.masked,
            );
            q_tile[idx] = value;
        }
    }

    let outputs = comptime!(config.outputs_per_unit());
    let mut acc = Array::<f32>::new(outputs);
    #[unroll]
    for t in 0..outputs {
        acc[t] = 0.0;
    }
    // The softmax state of the rows this unit's plane (or, without plane softmax, this unit)
    // keeps: one per score step, or row `UNIT_POS`.
    let pairs = comptime!(config.pairs_per_unit());
    let mut row_max = Array::<f32>::new(pairs);
    let mut row_sum = Array::<f32>::new(pairs);
    #[unroll]
    for t in 0..pairs {
        row_max[t] = f32::new(MASKED);
        row_sum[t] = 0.0;
    }
    let mut state = RunningState::init();
    let own_row = UNIT_POS as usize;
    // K and V of the next block, in registers.
    let mut k_next = Array::<F>::new(comptime!(config.loads_per_unit(dim_qk)));
    let mut v_next = Array::<F>::new(comptime!(config.loads_per_unit(dim_v)));
    let first_key = usize::cast_from(blocks.start(0, block_kv));
    load_key_value_block(
        k,
        v,
        k_rows,
        v_rows,
        table,
        table_row,
        batch,
        head_kv,
        first_key,
        end_u,
        page_size,
        &mut k_next,
        &mut v_next,
        config,
    );

    for b in 0..blocks.count {
        let k0 = blocks.start(b, block_kv);
        sync_cube();
        store_block(
            &k_next,
            &mut k_tile,
            block_kv,
            dim_qk,
            key_stride,
            units,
            config.unrolled,
        );
        store_block(
            &v_next,
            &mut v_tile,
            block_kv,
            dim_v,
            dim_v,
            units,
            config.unrolled,
        );
        sync_cube();
        if b + 1 < blocks.count {
            let next = usize::cast_from(blocks.start(b + 1, block_kv));
            load_key_value_block(
                k,
                v,
                k_rows,
                v_rows,
                table,
                table_row,
                batch,
                head_kv,
                next,
                end_u,
                page_size,
                &mut k_next,
                &mut v_next,
                config,
            );
        }

        // S = Q·Kᵀ · scale (softcapped); hidden keys and rows past the group are MASKED.
        // With plane softmax, a plane holds one row's block of scores: it turns them into
        // probabilities at once.
        #[unroll]
        for step in 0..pairs {
            let idx = step * units + UNIT_POS as usize;
            let r = idx / block_kv;
            let j = idx % block_kv;
            let in_block = idx < rows * block_kv;
            let dot = dot_shared(
                &q_tile,
                min(r, rows - 1) * dim_qk,
                &k_tile,
                j * key_stride,
                q.shape(3),
                dim_qk,
                config.columns,
            );
            let key = k0 + i32::cast_from(j);
            let visible = in_block && task.sees(r, key, config.masked);
            let mut s = score(dot, scale, softcap, config.softcap);
            if comptime!(config.terms.any()) {
                let terms = task.row_terms(bias, alibi_slopes, r, config.terms);
                s = terms.apply(bias, score_params, s, key, config.terms);
            }
            let s = select(visible, s, f32::new(MASKED));
            if config.plane_softmax {
                let mut row = RunningState {
                    m: row_max[step],
                    l: row_sum[step],
                };
                let alpha = row.rescale(plane_max(s));
                let p = probability(s, row.m);
                row.l += plane_sum(p);
                row_max[step] = row.m;
                row_sum[step] = row.l;
                if in_block {
                    p_tile[idx] = p;
                    if j == 0 {
                        row_factor[r] = alpha;
                    }
                }
            } else if in_block {
                p_tile[idx] = s;
            }
        }
        sync_cube();

        if !config.plane_softmax {
            // Online softmax, one unit per row: the scores become probabilities in place.
            if own_row < rows {
                let row = own_row * block_kv;
                let mut block_max = f32::new(MASKED);
                for j in 0..block_kv {
                    block_max = max(block_max, p_tile[row + j]);
                }
                let alpha = state.rescale(block_max);
                let mut block_sum = 0.0f32;
                for j in 0..block_kv {
                    let p = probability(p_tile[row + j], state.m);
                    p_tile[row + j] = p;
                    block_sum += p;
                }
                state.l += block_sum;
                row_factor[own_row] = alpha;
            }
            sync_cube();
        }

        // O ← α·O + P·V, each unit on its (row, column) outputs.
        #[unroll]
        for t in 0..outputs {
            let idx = t * units + UNIT_POS as usize;
            if idx < rows * dim_v {
                let r = idx / dim_v;
                let c = idx % dim_v;
                let mut o = acc[t] * row_factor[r];
                for j in 0..block_kv {
                    o += p_tile[r * block_kv + j] * v_tile[j * dim_v + c];
                }
                acc[t] = o;
            }
        }
    }

    // Epilogue: normalize; write O and the LSE, or this split's partial results.
    sync_cube();
    if config.plane_softmax {
        #[unroll]
        for step in 0..pairs {
            let idx = step * units + UNIT_POS as usize;
            if idx < rows * block_kv && idx % block_kv == 0 {
                let row = RunningState {
                    m: row_max[step],
                    l: row_sum[step],
                };
                row_factor[idx / block_kv] = row.normalizer();
                row_lse[idx / block_kv] = row.lse(neg_inf);
            }
        }
    } else if own_row < rows {
        row_factor[own_row] = state.normalizer();
        row_lse[own_row] = state.lse(neg_inf);
    }
    sync_cube();
    #[unroll]
    for t in 0..outputs {
        let idx = t * units + UNIT_POS as usize;
        let r = idx / dim_v;
        if idx < rows * dim_v && task.has_row(r) {
            let o = acc[t] * row_factor[r];
            task.write_output(out, partial_out, r, idx % dim_v, o, config.split);
        }
    }
    if own_row < rows && task.has_row(own_row) {
        task.write_lse(lse, partial_lse, own_row, row_lse[own_row], config.split);
    }
}

/// Loads the key and value block starting at position `first` into the units' registers
/// ([`load_cache_block`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_key_value_block<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_rows: &RowLayout,
    v_rows: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    batch: usize,
    head_kv: usize,
    first: usize,
    end: usize,
    page_size: FastDivmod<u32>,
    k_regs: &mut Array<F>,
    v_regs: &mut Array<F>,
    #[comptime] config: DecodeConfig,
) {
    load_cache_block(
        k,
        k_rows,
        table,
        table_row,
        batch,
        head_kv,
        first,
        end,
        page_size,
        k_regs,
        config.block_kv,
        config.dim_qk,
        config.units,
        config.paged,
        config.unrolled,
    );
    load_cache_block(
        v,
        v_rows,
        table,
        table_row,
        batch,
        head_kv,
        first,
        end,
        page_size,
        v_regs,
        config.block_kv,
        config.dim_v,
        config.units,
        config.paged,
        config.unrolled,
    );
}
