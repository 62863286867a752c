//! What one decode cube works on, and where its results go; shared by the decode kernels.
//!
//! A cube owns one K/V head of one sequence (`CUBE_POS_Y`, then `CUBE_POS_Z`, enumerate
//! sequence · K/V head · block of packed rows, as [`crate::launch::blocks_by_pairs`] lays
//! them out) and one split of its key range (`CUBE_POS_X` of `CUBE_COUNT_X`).
//! Its queries are packed: the `group · s_q` queries of the query heads that read the K/V
//! head are rows `0 .. group · s_q`, row `r` being query `r % s_q` of query head
//! `head_kv · group + r / s_q`; a cube takes `rows` of them from `first_row`.

use cubecl::prelude::*;

use crate::bias::{BiasLine, ScoreTerms};
use crate::mask::Mask;
use crate::rotary::{RotaryConfig, rotated};
use crate::score_mod::ScoreCall;
use crate::softmax::{MASKED, RunningState};
use crate::tile::batch_head_index;

#[derive(CubeType, Clone, Copy)]
pub struct DecodeTask {
    /// The cube lies past the launch's last (sequence, K/V head, row block): it has nothing
    /// to do (its kernel ends at once).
    pub idle: bool,
    pub batch: usize,
    pub head_kv: usize,
    /// First packed row of the cube.
    pub first_row: usize,
    /// Query heads per K/V head.
    pub group: usize,
    /// Packed rows of the K/V head, `group · s_q`.
    pub packed: usize,
    pub heads_q: usize,
    pub seq_q: usize,
    /// Positions in the cache before this call's append (`cache_seqlens[b]`).
    pub cached: usize,
    /// The sequence's keys: `cached` and the appended ones.
    pub seq_kv: usize,
    /// The mask against the sequence's keys (`cache_seqlens[b]` plus the appended ones).
    pub mask: Mask,
    /// The keys of this cube's split, `[begin, end)`: a multiple of `step` keys from the
    /// first key any of the sequence's queries sees.
    pub begin: i32,
    pub end: i32,
}

#[cube]
impl DecodeTask {
    #[allow(clippy::too_many_arguments)]
    pub fn of_cube(
        heads_q: usize,
        seq_q: usize,
        heads_kv: usize,
        seqlens: &Tensor<i32>,
        appended: u32,
        window_left: i32,
        window_right: i32,
        #[comptime] rows: usize,
        #[comptime] step: usize,
        #[comptime] masked: bool,
    ) -> DecodeTask {
        let group = heads_q / heads_kv;
        let packed = group * seq_q;
        let row_blocks = packed.div_ceil(rows);
        let cube = batch_head_index();
        let batches = seqlens.shape(0);
        let idle = cube / row_blocks / heads_kv >= batches;
        let batch = min(cube / row_blocks / heads_kv, batches - 1);

        // The keys the sequence's queries see, then this split's share of them.
        let cached = usize::cast_from(seqlens[batch * seqlens.stride(0)]);
        let seq_kv = cached + appended as usize;
        let mask = Mask::new(seq_q, seq_kv, window_left, window_right);
        let mut key_first = 0i32;
        let mut key_last = i32::cast_from(seq_kv);
        if masked {
            key_first = mask.key_begin(0i32);
            key_last = mask.key_end(i32::cast_from(seq_q));
        }
        let splits = CUBE_COUNT_X as i32;
        let span = max(key_last - key_first, 0);
        let step = i32::cast_from(step);
        let share = ((span + splits - 1) / splits + step - 1) / step * step;
        let begin = min(key_first + CUBE_POS_X as i32 * share, key_last);
        DecodeTask {
            idle,
            batch,
            head_kv: (cube / row_blocks) % heads_kv,
            first_row: (cube % row_blocks) * rows,
            group,
            packed,
            heads_q,
            seq_q,
            cached,
            seq_kv,
            mask,
            begin,
            end: min(begin + share, key_last),
        }
    }

    /// Whether packed row `r` of the cube (from `first_row`) is one of the K/V head's.
    pub fn has_row(&self, r: usize) -> bool {
        self.first_row + r < self.packed
    }

    /// Whether row `r` sees `key` (a key of the split); `masked`: the mask is not trivial.
    pub fn sees(&self, r: usize, key: i32, #[comptime] masked: bool) -> bool {
        let mut visible = key < self.end && self.has_row(r);
        if masked {
            visible = visible && self.mask.is_visible(i32::cast_from(self.query(r)), key);
        }
        visible
    }

    /// The query head of row `r`.
    pub fn head_q(&self, r: usize) -> usize {
        self.head_kv * self.group + (self.first_row + r) / self.seq_q
    }

    /// The query (new token) of row `r`.
    pub fn query(&self, r: usize) -> usize {
        (self.first_row + r) % self.seq_q
    }

    /// Element `c` of row `r`'s query, in f32 (0 for a row past the group), turned by the
    /// rotary embedding: to position `cached + i` for query `i` under a causal or window
    /// mask (`masked`), else to `cached` for every query, as FlashAttention's
    /// `flash_attn_with_kvcache`.
    #[allow(clippy::too_many_arguments)]
    pub fn query_value<F: Float>(
        &self,
        q: &Tensor<F>,
        r: usize,
        c: usize,
        cos: &Tensor<F>,
        sin: &Tensor<F>,
        #[comptime] rotary: RotaryConfig,
        #[comptime] masked: bool,
    ) -> f32 {
        let mut value = 0.0f32;
        if self.has_row(r) {
            let at = self.batch * q.stride(0)
                + self.head_q(r) * q.stride(1)
                + self.query(r) * q.stride(2);
            let mut position = self.cached;
            if masked {
                position += self.query(r);
            }
            value = rotated(q, at, q.stride(3), c, position, cos, sin, rotary);
        }
        value
    }

    /// Row `r`'s score terms ([`RowTerms`]); a row past the K/V head's rows takes the last
    /// row's (its scores are hidden).
    pub fn row_terms<F: Float>(
        &self,
        bias: &Tensor<F>,
        slopes: &Tensor<f32>,
        r: usize,
        #[comptime] terms: ScoreTerms,
    ) -> RowTerms {
        let row = min(self.first_row + r, self.packed - 1);
        let head = self.head_kv * self.group + row / self.seq_q;
        let query = row % self.seq_q;
        // An empty sequence scores no key: its terms only need to be well defined.
        let seq_kv = max(self.seq_kv, 1usize);
        RowTerms {
            line: BiasLine::along_keys(
                bias, slopes, self.batch, head, query, self.seq_q, seq_kv, terms,
            ),
            call: ScoreCall::new(self.batch, head, self.seq_q, seq_kv),
            query,
        }
    }

    /// Row `r`'s index among the `[batch, heads_q, seq_q]` rows of the output (the row of
    /// the splits' partial results).
    pub fn row_index(&self, r: usize) -> usize {
        (self.batch * self.heads_q + self.head_q(r)) * self.seq_q + self.query(r)
    }

    /// Writes column `c` of row `r`'s output, normalized: to `out` in the input dtype, or
    /// (`split`) to this split's partial outputs `[splits, rows, d_v]` in f32.
    pub fn write_output<F: Float>(
        &self,
        out: &mut Tensor<F>,
        partial_out: &mut Tensor<f32>,
        r: usize,
        c: usize,
        value: f32,
        #[comptime] split: bool,
    ) {
        let (head_q, i) = (self.head_q(r), self.query(r));
        if split {
            let row = self.row_index(r);
            let at = CUBE_POS_X as usize * partial_out.stride(0) + row * partial_out.stride(1) + c;
            partial_out[at] = value;
        } else {
            let at = self.batch * out.stride(0)
                + head_q * out.stride(1)
                + i * out.stride(2)
                + c * out.stride(3);
            out[at] = F::cast_from(value);
        }
    }

    /// Writes row `r`'s LSE: to `lse`, or (`split`) to this split's `[splits, rows]`.
    pub fn write_lse(
        &self,
        lse: &mut Tensor<f32>,
        partial_lse: &mut Tensor<f32>,
        r: usize,
        value: f32,
        #[comptime] split: bool,
    ) {
        let (head_q, i) = (self.head_q(r), self.query(r));
        if split {
            let row = self.row_index(r);
            let at = CUBE_POS_X as usize * partial_lse.stride(0) + row;
            partial_lse[at] = value;
        } else {
            let at = self.batch * lse.stride(0) + head_q * lse.stride(1) + i * lse.stride(2);
            lse[at] = value;
        }
    }
}

/// One packed row's score terms, as the training kernels add them ([`crate::bias`],
/// [`crate::score_mod`]): the bias and ALiBi along the row's keys, then the score function
/// at the row's query head and query (counted from the first new query, the keys from the
/// sequence's first position: `seq_kv − s_q` apart on the diagonal).
#[derive(CubeType, Clone, Copy)]
pub struct RowTerms {
    line: BiasLine,
    call: ScoreCall,
    query: usize,
}

#[cube]
impl RowTerms {
    /// Score `s` of `key` with the terms `terms` compiles in: [`MASKED`] where the bias is
    /// −∞ or the score function hides the key; `s` as is without terms.
    pub fn apply<F: Float>(
        &self,
        bias: &Tensor<F>,
        params: &Tensor<f32>,
        s: f32,
        key: i32,
        #[comptime] terms: ScoreTerms,
    ) -> f32 {
        let key = usize::cast_from(max(key, 0i32));
        let s = self.line.add(bias, s, key, 1.0f32, terms);
        self.call.apply(s, self.query, key, params, terms.score_mod)
    }
}

/// Merges the partial results of a cube's `slots` (key slots or planes, each over its own
/// keys) and writes them: `slot_state` holds each slot's `(m, l)` per row (`2 · (slot · rows
/// + r)`), `slot_out` its unnormalized output rows (`(slot · rows + r) · dim`). Each row's
/// largest maximum rescales the slots' sums and outputs, as splits are merged.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_merged<F: Float>(
    task: &DecodeTask,
    slot_state: &Shared<[f32]>,
    slot_out: &Shared<[f32]>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    partial_out: &mut Tensor<f32>,
    partial_lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[comptime] slots: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
    #[comptime] split: bool,
) {
    let mut row_top = Shared::<[f32]>::new_slice(rows);
    let mut row_factor = Shared::<[f32]>::new_slice(rows);
    let mut row_lse = Shared::<[f32]>::new_slice(rows);
    sync_cube();
    let own_row = UNIT_POS as usize;
    if own_row < rows {
        let mut m = f32::new(MASKED);
        for s in 0..slots {
            m = max(m, slot_state[2 * (s * rows + own_row)]);
        }
        let mut merged = RunningState { m, l: 0.0 };
        for s in 0..slots {
            let at = 2 * (s * rows + own_row);
            merged.l += slot_state[at + 1] * (slot_state[at] - m).exp();
        }
        row_top[own_row] = m;
        row_factor[own_row] = merged.normalizer();
        row_lse[own_row] = merged.lse(neg_inf);
    }
    sync_cube();
    for n in 0..comptime!((rows * dim).div_ceil(units)) {
        let idx = n * units + UNIT_POS as usize;
        let r = idx / dim;
        if idx < rows * dim && task.has_row(r) {
            let c = idx % dim;
            let top = row_top[r];
            let mut o = 0.0f32;
            for s in 0..slots {
                let weight = (slot_state[2 * (s * rows + r)] - top).exp();
                o += weight * slot_out[(s * rows + r) * dim + c];
            }
            task.write_output(out, partial_out, r, c, o * row_factor[r], split);
        }
    }
    if own_row < rows && task.has_row(own_row) {
        task.write_lse(lse, partial_lse, own_row, row_lse[own_row], split);
    }
}
