//! Block sparsity: a mask summarised per block of `block_q × block_kv` scores (as
//! FlexAttention's `BlockMask`), for each (batch, query head) or broadcast over either.
//!
//! Each block is **empty** (never visited: its keys are not even loaded), **full** (run
//! without any mask arithmetic) or **partial** (its elements are kept as bits, one per
//! score, and the kernels hide the scores whose bit is clear). A block mask therefore
//! describes its mask exactly: there is no separate dense mask it could disagree with. It
//! combines with the other masks (causal, window, a −∞ bias) by intersection.
//!
//! The kernels walk their own tiles, which divide [`BLOCK_GRANULE`]; block sizes are
//! multiples of it, so each kernel tile lies in one block. On the device a block mask is one
//! buffer of 32-bit words holding two views, one per side a kernel's cube owns:
//! - **by query** (the forward and dQ kernels): for each query block, the key blocks to
//!   visit in ascending order;
//! - **by key** (the dK/dV kernels): for each key block, the query blocks to visit, with the
//!   partial blocks' bits transposed.
//!
//! Each view ([`ViewLayout`]) is `lists` `[b | 1, h | 1, rows, 1 + cols]` (the count, then
//! the column blocks), `tiles` `[b | 1, h | 1, rows, cols]` (0 for a full block, `t + 1` for
//! partial block `t`) and `bits` `[partial blocks, row_block · col_block / 32]` (row-major),
//! each at an offset in the buffer.

use cubecl::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::FlashError;
use crate::launch::DeviceTensor;
use crate::mask::{Blocks, MaskSpec};

/// Block sizes are multiples of this: every kernel's query and key tiles divide it.
pub const BLOCK_GRANULE: usize = 128;

/// What a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BlockState {
    /// No visible score: the block is skipped.
    Empty,
    /// Some visible scores: their bits are kept.
    Partial,
    /// Every score visible: no mask arithmetic.
    Full,
}

/// The sizes of the blocks of a block mask, as the kernels compile them in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockShape {
    pub block_q: usize,
    pub block_kv: usize,
}

/// One query-block row of a mask being built: its blocks' states and its partial blocks'
/// bits.
type BlockRow = (Vec<BlockState>, Vec<Vec<u32>>);

impl BlockShape {
    /// Checks that kernel tiles of `queries × keys` each lie in one block, as the kernels'
    /// walk needs: the shipped tiles divide [`BLOCK_GRANULE`], a tuning override's may not.
    pub(crate) fn check_tiles(&self, queries: usize, keys: usize) -> Result<(), FlashError> {
        if self.block_q.is_multiple_of(queries) && self.block_kv.is_multiple_of(keys) {
            return Ok(());
        }
        Err(FlashError::InvalidConfig(format!(
            "a block mask of {} × {} blocks needs kernel tiles that divide them, these are \
             {queries} × {keys} (queries × keys; set by a FLASH_*_TILES override?)",
            self.block_q, self.block_kv
        )))
    }
}

/// A block mask on the host ([module docs](self)).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockMask {
    /// `[batch, heads, seq_q, seq_kv]`; batch and heads may be 1 (broadcast).
    shape: [usize; 4],
    blocks: BlockShape,
    /// Per (batch, head, query block, key block).
    states: Vec<BlockState>,
    /// Per block: the index of its bits among the partial blocks (`u32::MAX` if none).
    partial: Vec<u32>,
    /// The partial blocks' bits, `block_q · block_kv / 32` words each, row-major by query.
    bits: Vec<u32>,
}

impl BlockMask {
    /// The mask `visible(b, h, i, j)` of `[batch | 1, heads | 1, seq_q, seq_kv]` scores,
    /// summarised in blocks of `block_q × block_kv` (multiples of [`BLOCK_GRANULE`]). The
    /// predicate runs once per score, here and never again: build a mask once and pass it to
    /// every call (and every layer) that shares it.
    pub fn from_fn(
        [batch, heads, seq_q, seq_kv]: [usize; 4],
        blocks: BlockShape,
        visible: impl Fn(usize, usize, usize, usize) -> bool + Sync,
    ) -> Result<Self, FlashError> {
        Self::from_block_fn(
            [batch, heads, seq_q, seq_kv],
            blocks,
            |_, _, _, _| None,
            visible,
        )
    }

    /// As [`BlockMask::from_fn`], with `classify(b, h, queries, keys)` naming the state of
    /// a block where it knows it without looking at its scores (`None` where it does not):
    /// `visible` then runs only in the blocks it leaves open. Debug builds check each block
    /// `classify` names against `visible` and panic where they disagree
    /// ([`BlockMask::disagreement`]).
    pub fn from_block_fn(
        [batch, heads, seq_q, seq_kv]: [usize; 4],
        blocks: BlockShape,
        classify: impl Fn(
            usize,
            usize,
            std::ops::Range<usize>,
            std::ops::Range<usize>,
        ) -> Option<BlockState>
        + Sync,
        visible: impl Fn(usize, usize, usize, usize) -> bool + Sync,
    ) -> Result<Self, FlashError> {
        for (arg, size) in [("block_q", blocks.block_q), ("block_kv", blocks.block_kv)] {
            if size == 0 || !size.is_multiple_of(BLOCK_GRANULE) {
                return Err(FlashError::Option {
                    arg,
                    expected: format!("a positive multiple of {BLOCK_GRANULE}, got {size}"),
                });
            }
        }
        if batch == 0 || heads == 0 {
            return Err(FlashError::Shape {
                arg: "block_mask",
                shape: vec![batch, heads, seq_q, seq_kv],
                expected: "at least one batch and one head (1 broadcasts)".into(),
            });
        }
        let (rows, cols) = (
            seq_q.div_ceil(blocks.block_q),
            seq_kv.div_ceil(blocks.block_kv),
        );
        let words = blocks.block_q * blocks.block_kv / 32;
        // One query-block row of one (batch, head) at a time, spread over the host's cores.
        let row_of = |index: usize| -> BlockRow {
            let (bh, qb) = (index / rows, index % rows);
            let (b, h) = (bh / heads, bh % heads);
            let queries = qb * blocks.block_q..((qb + 1) * blocks.block_q).min(seq_q);
            let mut states = Vec::with_capacity(cols);
            let mut bits = Vec::new();
            for kb in 0..cols {
                let keys = kb * blocks.block_kv..((kb + 1) * blocks.block_kv).min(seq_kv);
                if let Some(state) = classify(b, h, queries.clone(), keys.clone())
                    && state != BlockState::Partial
                {
                    if cfg!(debug_assertions) {
                        let wrong = queries
                            .clone()
                            .flat_map(|i| keys.clone().map(move |j| (i, j)));
                        let full = state == BlockState::Full;
                        if let Some((i, j)) = wrong
                            .into_iter()
                            .find(|&(i, j)| visible(b, h, i, j) != full)
                        {
                            panic!(
                                "block mask: block ({qb}, {kb}) of (batch {b}, head {h}) is classified \
                                 {state:?}, but the mask's predicate says score ({i}, {j}) is {}",
                                if full { "hidden" } else { "visible" }
                            );
                        }
                    }
                    states.push(state);
                    continue;
                }
                let mut tile = vec![0u32; words];
                let mut seen = 0usize;
                for i in queries.clone() {
                    for j in keys.clone() {
                        if visible(b, h, i, j) {
                            let at = (i - queries.start) * blocks.block_kv + (j - keys.start);
                            tile[at / 32] |= 1 << (at % 32);
                            seen += 1;
                        }
                    }
                }
                let state = match seen {
                    0 => BlockState::Empty,
                    n if n == queries.len() * keys.len() => BlockState::Full,
                    _ => BlockState::Partial,
                };
                if state == BlockState::Partial {
                    bits.push(tile);
                }
                states.push(state);
            }
            (states, bits)
        };
        let total_rows = batch * heads * rows;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunk = total_rows.div_ceil(threads).max(1);
        let row_of = &row_of;
        let done: Vec<Vec<BlockRow>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..total_rows)
                .step_by(chunk)
                .map(|start| {
                    scope.spawn(move || {
                        (start..(start + chunk).min(total_rows))
                            .map(row_of)
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("block mask worker"))
                .collect()
        });
        let mut mask = BlockMask {
            shape: [batch, heads, seq_q, seq_kv],
            blocks,
            states: Vec::with_capacity(total_rows * cols),
            partial: Vec::with_capacity(total_rows * cols),
            bits: Vec::new(),
        };
        for (states, bits) in done.into_iter().flatten() {
            let mut tiles = bits.into_iter();
            for state in states {
                let index = match state {
                    BlockState::Partial => {
                        mask.bits
                            .extend(tiles.next().expect("a partial block's bits"));
                        (mask.bits.len() / words - 1) as u32
                    }
                    _ => u32::MAX,
                };
                mask.states.push(state);
                mask.partial.push(index);
            }
        }
        Ok(mask)
    }

    /// Packed documents: query `i` of batch `b` sees key `j` when both belong to the same
    /// document (`documents_q[b][i] == documents_kv[b][j]`) and, with `causal`, `j` is not
    /// after `i` (bottom-right aligned). Blocks within one document are found without
    /// looking at their scores when the ids of each batch never decrease.
    pub fn documents(
        documents_q: &[Vec<u32>],
        documents_kv: &[Vec<u32>],
        causal: bool,
        blocks: BlockShape,
    ) -> Result<Self, FlashError> {
        let batch = documents_q.len();
        let seq_q = documents_q.first().map_or(0, Vec::len);
        let seq_kv = documents_kv.first().map_or(0, Vec::len);
        let ragged = documents_q.iter().any(|d| d.len() != seq_q)
            || documents_kv.iter().any(|d| d.len() != seq_kv);
        if documents_kv.len() != batch || ragged {
            return Err(FlashError::Shape {
                arg: "documents_kv",
                shape: vec![documents_kv.len(), seq_kv],
                expected: format!(
                    "one id per token of every sequence, as many sequences as documents_q ({batch})"
                ),
            });
        }
        let sorted = |d: &Vec<u32>| d.windows(2).all(|w| w[0] <= w[1]);
        let monotone = documents_q.iter().chain(documents_kv).all(sorted);
        let diagonal = seq_kv as i64 - seq_q as i64;
        let causal_mask = MaskSpec {
            causal,
            ..MaskSpec::default()
        };
        let classify =
            |b: usize, _h: usize, q: std::ops::Range<usize>, k: std::ops::Range<usize>| {
                if !monotone {
                    return None;
                }
                let (dq, dk) = (&documents_q[b], &documents_kv[b]);
                let (q_first, q_last) = (dq[q.start], dq[q.end - 1]);
                let (k_first, k_last) = (dk[k.start], dk[k.end - 1]);
                let hidden_by_causal = causal && (k.start as i64) > q.end as i64 - 1 + diagonal;
                if q_last < k_first || k_last < q_first || hidden_by_causal {
                    return Some(BlockState::Empty);
                }
                let one_document = q_first == q_last && k_first == k_last && q_first == k_first;
                let causal_full = !causal || (k.end as i64 - 1) <= q.start as i64 + diagonal;
                (one_document && causal_full).then_some(BlockState::Full)
            };
        Self::from_block_fn(
            [batch.max(1), 1, seq_q, seq_kv],
            blocks,
            classify,
            |b, _, i, j| {
                documents_q[b][i] == documents_kv[b][j]
                    && causal_mask.is_visible(i, j, seq_q, seq_kv)
            },
        )
    }

    /// Prefix-LM: every query sees the first `prefix[b]` keys of its batch and, after them,
    /// the keys up to its diagonal (causal, bottom-right aligned).
    pub fn prefix_lm(
        prefix: &[usize],
        seq_q: usize,
        seq_kv: usize,
        blocks: BlockShape,
    ) -> Result<Self, FlashError> {
        let causal = MaskSpec::causal();
        let diagonal = seq_kv as i64 - seq_q as i64;
        Self::from_block_fn(
            [prefix.len().max(1), 1, seq_q, seq_kv],
            blocks,
            |b, _, q, k| {
                let all_prefix = k.end <= prefix[b];
                let all_causal = (k.end as i64 - 1) <= q.start as i64 + diagonal;
                let none_causal = (k.start as i64) > q.end as i64 - 1 + diagonal;
                if all_prefix || all_causal {
                    Some(BlockState::Full)
                } else if none_causal && k.start >= prefix[b] {
                    Some(BlockState::Empty)
                } else {
                    None
                }
            },
            |b, _, i, j| j < prefix[b] || causal.is_visible(i, j, seq_q, seq_kv),
        )
    }

    /// A causal and/or sliding-window mask ([`MaskSpec`]) as a block mask: what the kernels
    /// also do from the options alone, here to be combined or compared.
    pub fn from_mask(
        mask: MaskSpec,
        seq_q: usize,
        seq_kv: usize,
        blocks: BlockShape,
    ) -> Result<Self, FlashError> {
        let (left, right) = mask.window();
        let diagonal = seq_kv as i64 - seq_q as i64;
        Self::from_block_fn(
            [1, 1, seq_q, seq_kv],
            blocks,
            |_, _, q, k| {
                // Offsets from the diagonal of the block's nearest and farthest scores.
                let (q0, q1) = (q.start as i64 + diagonal, q.end as i64 - 1 + diagonal);
                let (k0, k1) = (k.start as i64, k.end as i64 - 1);
                let right_ok = |d: i64| right.is_none_or(|r| d <= r as i64);
                let left_ok = |d: i64| left.is_none_or(|l| d >= -(l as i64));
                if !right_ok(k0 - q1) || !left_ok(k1 - q0) {
                    Some(BlockState::Empty)
                } else if right_ok(k1 - q0) && left_ok(k0 - q1) {
                    Some(BlockState::Full)
                } else {
                    None
                }
            },
            |_, _, i, j| mask.is_visible(i, j, seq_q, seq_kv),
        )
    }

    /// `[batch | 1, heads | 1, seq_q, seq_kv]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    pub fn block_shape(&self) -> BlockShape {
        self.blocks
    }

    /// Query blocks and key blocks.
    pub fn block_counts(&self) -> (usize, usize) {
        (
            self.shape[2].div_ceil(self.blocks.block_q),
            self.shape[3].div_ceil(self.blocks.block_kv),
        )
    }

    /// The state of block `(q_block, kv_block)` of `(b, h)` (either broadcasts).
    pub fn state(&self, b: usize, h: usize, q_block: usize, kv_block: usize) -> BlockState {
        self.states[self.block_index(b, h, q_block, kv_block)]
    }

    /// The share of blocks that are not empty.
    pub fn density(&self) -> f64 {
        let visited = self
            .states
            .iter()
            .filter(|&&s| s != BlockState::Empty)
            .count();
        visited as f64 / self.states.len().max(1) as f64
    }

    /// The visible scores of each of the mask's own `(b, h)`, summed (a broadcast dimension
    /// counted once).
    pub fn visible_pairs(&self) -> u64 {
        let [batch, heads, seq_q, seq_kv] = self.shape;
        let (rows, cols) = self.block_counts();
        let words = self.blocks.block_q * self.blocks.block_kv / 32;
        let mut pairs = 0u64;
        for bh in 0..batch * heads {
            for qb in 0..rows {
                for kb in 0..cols {
                    let index = (bh * rows + qb) * cols + kb;
                    let queries = (seq_q - qb * self.blocks.block_q).min(self.blocks.block_q);
                    let keys = (seq_kv - kb * self.blocks.block_kv).min(self.blocks.block_kv);
                    pairs += match self.states[index] {
                        BlockState::Empty => 0,
                        BlockState::Full => (queries * keys) as u64,
                        BlockState::Partial => {
                            let start = self.partial[index] as usize * words;
                            let tile = &self.bits[start..start + words];
                            tile.iter().map(|w| u64::from(w.count_ones())).sum()
                        }
                    };
                }
            }
        }
        pairs
    }

    /// The first score `(b, h, i, j)` where this mask and `visible` disagree, if any: a
    /// check of a mask against the predicate it summarises (debug builds run it on every
    /// block a classifier names).
    pub fn disagreement(
        &self,
        visible: impl Fn(usize, usize, usize, usize) -> bool,
    ) -> Option<[usize; 4]> {
        let [batch, heads, seq_q, seq_kv] = self.shape;
        (0..batch)
            .flat_map(|b| (0..heads).map(move |h| (b, h)))
            .flat_map(|(b, h)| (0..seq_q).map(move |i| (b, h, i)))
            .flat_map(|(b, h, i)| (0..seq_kv).map(move |j| [b, h, i, j]))
            .find(|&[b, h, i, j]| self.is_visible(b, h, i, j) != visible(b, h, i, j))
    }

    /// Whether query `i` of `(b, h)` sees key `j`.
    pub fn is_visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (qb, kb) = (i / self.blocks.block_q, j / self.blocks.block_kv);
        let index = self.block_index(b, h, qb, kb);
        match self.states[index] {
            BlockState::Empty => false,
            BlockState::Full => true,
            BlockState::Partial => {
                let words = self.blocks.block_q * self.blocks.block_kv / 32;
                let at =
                    (i % self.blocks.block_q) * self.blocks.block_kv + j % self.blocks.block_kv;
                let word = self.bits[self.partial[index] as usize * words + at / 32];
                word >> (at % 32) & 1 == 1
            }
        }
    }

    fn block_index(&self, b: usize, h: usize, q_block: usize, kv_block: usize) -> usize {
        let [batch, heads, ..] = self.shape;
        let (rows, cols) = self.block_counts();
        let (b, h) = (
            if batch == 1 { 0 } else { b },
            if heads == 1 { 0 } else { h },
        );
        ((b * heads + h) * rows + q_block) * cols + kv_block
    }

    /// Checks the mask against a problem of `[batch, heads_q, seq_q, seq_kv]` scores.
    pub fn check(&self, problem: [usize; 4]) -> Result<(), FlashError> {
        check_shape(self.shape, problem)
    }

    /// The mask's device form: its words and where each view lies in them ([module
    /// docs](self)).
    pub fn words(&self) -> (Vec<u32>, BlockMaskLayout) {
        let (rows, cols) = self.block_counts();
        let mut words = Vec::new();
        let by_query = self.view(
            &mut words,
            rows,
            cols,
            |bh, r, c| (bh * rows + r) * cols + c,
            false,
        );
        let by_key = self.view(
            &mut words,
            cols,
            rows,
            |bh, r, c| (bh * rows + c) * cols + r,
            true,
        );
        let layout = BlockMaskLayout {
            shape: self.shape,
            blocks: self.blocks,
            by_query,
            by_key,
        };
        (words, layout)
    }

    /// The mask on `client`'s device.
    pub fn upload(&self, client: &Client) -> DeviceBlockMask {
        let (words, layout) = self.words();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        DeviceBlockMask {
            words: DeviceTensor::from_bytes(client, &[words.len()], &bytes),
            layout,
        }
    }

    /// Appends one view to `words`: `rows` blocks on the cube's side, `cols` streamed;
    /// `index(bh, r, c)` is the block's index in `states`; `transpose` stores the bits
    /// key-major.
    fn view(
        &self,
        words: &mut Vec<u32>,
        rows: usize,
        cols: usize,
        index: impl Fn(usize, usize, usize) -> usize,
        transpose: bool,
    ) -> ViewLayout {
        let [batch, heads, ..] = self.shape;
        let lists_at = words.len();
        let tiles_at = lists_at + batch * heads * rows * (1 + cols);
        let bits_at = tiles_at + batch * heads * rows * cols;
        words.resize(bits_at, 0);
        for bh in 0..batch * heads {
            for r in 0..rows {
                let list = lists_at + (bh * rows + r) * (1 + cols);
                let tile = tiles_at + (bh * rows + r) * cols;
                let mut count = 0;
                for c in 0..cols {
                    let i = index(bh, r, c);
                    if self.states[i] != BlockState::Empty {
                        words[list + 1 + count] = c as u32;
                        words[tile + count] = self.partial[i].wrapping_add(1);
                        count += 1;
                    }
                }
                words[list] = count as u32;
            }
        }
        let (bq, bk) = (self.blocks.block_q, self.blocks.block_kv);
        let per_tile = bq * bk / 32;
        if transpose {
            let mut t = vec![0u32; self.bits.len()];
            for (p, tile) in self.bits.chunks(per_tile).enumerate() {
                for i in 0..bq {
                    for j in 0..bk {
                        let at = i * bk + j;
                        if tile[at / 32] >> (at % 32) & 1 == 1 {
                            let to = j * bq + i;
                            t[p * per_tile + to / 32] |= 1 << (to % 32);
                        }
                    }
                }
            }
            words.extend(t);
        } else {
            words.extend(&self.bits);
        }
        ViewLayout {
            lists: lists_at as u32,
            tiles: tiles_at as u32,
            bits: bits_at as u32,
            batch: batch as u32,
            heads: heads as u32,
            rows: rows as u32,
            cols: cols as u32,
        }
    }
}

fn check_shape(
    shape: [usize; 4],
    [batch, heads, seq_q, seq_kv]: [usize; 4],
) -> Result<(), FlashError> {
    let [b, h, q, k] = shape;
    if (b != batch && b != 1) || (h != heads && h != 1) || q != seq_q || k != seq_kv {
        return Err(FlashError::Shape {
            arg: "block_mask",
            shape: shape.to_vec(),
            expected: format!(
                "[{batch} | 1, {heads} | 1, {seq_q}, {seq_kv}] (batch, query heads, queries, keys)"
            ),
        });
    }
    Ok(())
}

/// Where a block mask's views lie in its words, and its shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockMaskLayout {
    /// `[batch | 1, heads | 1, seq_q, seq_kv]`.
    pub shape: [usize; 4],
    pub blocks: BlockShape,
    pub by_query: ViewLayout,
    pub by_key: ViewLayout,
}

impl BlockMaskLayout {
    /// Checks the mask against a problem of `[batch, heads_q, seq_q, seq_kv]` scores.
    pub fn check(&self, problem: [usize; 4]) -> Result<(), FlashError> {
        check_shape(self.shape, problem)
    }
}

/// One view in a block mask's words: offsets of its `lists`, `tiles` and `bits`, and the
/// sizes that index them. The kernels' argument.
#[derive(
    CubeType, CubeLaunch, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize,
)]
pub struct ViewLayout {
    pub lists: u32,
    pub tiles: u32,
    pub bits: u32,
    /// 1 where the mask broadcasts over batches (or heads).
    pub batch: u32,
    pub heads: u32,
    /// Blocks along the cube's side and along the streamed side.
    pub rows: u32,
    pub cols: u32,
}

impl ViewLayout {
    /// The kernels' argument.
    pub(crate) fn arg(&self) -> ViewLayoutLaunch {
        ViewLayoutLaunch::new(
            self.lists, self.tiles, self.bits, self.batch, self.heads, self.rows, self.cols,
        )
    }
}

/// A block mask on the device: its words and their layout ([module docs](self)).
#[derive(Clone, Debug)]
pub struct DeviceBlockMask {
    pub words: DeviceTensor,
    pub layout: BlockMaskLayout,
}

impl DeviceBlockMask {
    /// Checks the mask against a problem of `[batch, heads_q, seq_q, seq_kv]` scores.
    pub fn check(&self, problem: [usize; 4]) -> Result<(), FlashError> {
        self.layout.check(problem)
    }

    /// The kernels' view by query or, with `by_key`, by key.
    pub(crate) fn view(&self, by_key: bool) -> ViewLayout {
        match by_key {
            true => self.layout.by_key,
            false => self.layout.by_query,
        }
    }
}

/// The block sizes a kernel's view compiles in: `rows` along the side its cubes own, `cols`
/// along the side it streams; `rows = 0` without a block mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ViewShape {
    pub rows: usize,
    pub cols: usize,
}

impl ViewShape {
    /// No block mask.
    pub const NONE: ViewShape = ViewShape { rows: 0, cols: 0 };

    /// The view by query (`by_key` false) or by key of blocks of `shape`.
    pub fn of(shape: Option<BlockShape>, by_key: bool) -> Self {
        match shape {
            None => Self::NONE,
            Some(s) if by_key => ViewShape {
                rows: s.block_kv,
                cols: s.block_q,
            },
            Some(s) => ViewShape {
                rows: s.block_q,
                cols: s.block_kv,
            },
        }
    }

    pub fn is_sparse(&self) -> bool {
        self.rows > 0
    }
}

/// The blocks one cube visits, in a kernel: its tiles of `size` positions along the
/// streamed side run over the listed blocks of its row block, `cols / size` tiles to a
/// block.
#[derive(CubeType, Clone, Copy)]
pub struct SparseBlocks {
    /// Where the row block's list starts in the words (at its count).
    list: usize,
    /// Where its tile indices start.
    tiles: usize,
    /// Where the partial blocks' bits start.
    bits: usize,
    /// The first row of the cube's row block.
    row0: usize,
}

/// One kernel tile's block: partial or not, and where its bits start.
#[derive(CubeType, Clone, Copy)]
pub struct BlockTile {
    pub partial: bool,
    /// Offset of the block's bits in the words.
    offset: usize,
    /// First row of the block.
    row0: usize,
}

#[cube]
impl SparseBlocks {
    /// The blocks of the row block holding row `row` of `(batch, head)`, and the tiles of
    /// `size` positions the cube walks: `blocks` itself without a block mask.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        words: &Tensor<u32>,
        layout: &ViewLayout,
        blocks: &Blocks,
        batch: usize,
        head: usize,
        row: usize,
        #[comptime] size: usize,
        #[comptime] view: ViewShape,
    ) -> (SparseBlocks, Blocks) {
        let mut sparse = SparseBlocks {
            list: 0usize,
            tiles: 0usize,
            bits: 0usize,
            row0: 0usize,
        };
        let mut first = blocks.first;
        let mut count = blocks.count;
        if comptime!(view.is_sparse()) {
            let row_block = row / view.rows;
            let b = select(layout.batch == 1, 0usize, batch);
            let h = select(layout.heads == 1, 0usize, head);
            let line = (b * usize::cast_from(layout.heads) + h) * usize::cast_from(layout.rows)
                + row_block;
            let cols = usize::cast_from(layout.cols);
            sparse.list = usize::cast_from(layout.lists) + line * (1 + cols);
            sparse.tiles = usize::cast_from(layout.tiles) + line * cols;
            sparse.bits = usize::cast_from(layout.bits);
            sparse.row0 = row_block * view.rows;
            first = 0i32;
            count =
                i32::cast_from(words[sparse.list]) * i32::cast_from(comptime!(view.cols / size));
        }
        (sparse, Blocks { first, count })
    }

    /// First streamed position of tile `n` (`blocks`' own without a block mask).
    pub fn start(
        &self,
        words: &Tensor<u32>,
        blocks: &Blocks,
        n: i32,
        #[comptime] size: usize,
        #[comptime] view: ViewShape,
    ) -> i32 {
        let mut start = blocks.start(n, size);
        if comptime!(view.is_sparse()) {
            let per_block = i32::cast_from(comptime!(view.cols / size));
            let block = i32::cast_from(words[self.list + 1 + usize::cast_from(n / per_block)]);
            start = block * i32::cast_from(view.cols) + (n % per_block) * i32::cast_from(size);
        }
        start
    }

    /// Tile `n`'s block: partial, with its bits, or not (always without a block mask).
    pub fn tile(
        &self,
        words: &Tensor<u32>,
        n: i32,
        #[comptime] size: usize,
        #[comptime] view: ViewShape,
    ) -> BlockTile {
        let mut tile = BlockTile {
            partial: false,
            offset: 0usize,
            row0: self.row0,
        };
        if comptime!(view.is_sparse()) {
            let per_block = i32::cast_from(comptime!(view.cols / size));
            let entry = words[self.tiles + usize::cast_from(n / per_block)];
            tile.partial = entry != 0;
            tile.offset = self.bits
                + usize::cast_from(select(entry == 0, 0u32, entry - 1))
                    * comptime!(view.rows * view.cols / 32);
        }
        tile
    }
}

#[cube]
impl BlockTile {
    /// The word of the block's bits holding row `row`'s streamed positions from `col`, a
    /// multiple of 32 (absolute, within the block); every bit set in a full block or
    /// without a block mask.
    pub fn word(
        &self,
        words: &Tensor<u32>,
        row: usize,
        col: usize,
        #[comptime] view: ViewShape,
    ) -> u32 {
        let mut word = u32::new(comptime!(u32::MAX as i64));
        if comptime!(view.is_sparse()) {
            if self.partial {
                let at = (row - self.row0) * view.cols + col % view.cols;
                word = words[self.offset + at / 32];
            }
        }
        word
    }

    /// Whether row `row` sees streamed position `col` (both absolute, within the block):
    /// always in a full block or without a block mask.
    pub fn keeps(
        &self,
        words: &Tensor<u32>,
        row: usize,
        col: usize,
        #[comptime] view: ViewShape,
    ) -> bool {
        let mut keep = true;
        if comptime!(view.is_sparse()) {
            if self.partial {
                let at = (row - self.row0) * view.cols + col % view.cols;
                keep = (words[self.offset + at / 32] >> u32::cast_from(at % 32)) & 1 == 1;
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B128: BlockShape = BlockShape {
        block_q: 128,
        block_kv: 128,
    };

    #[test]
    fn constructors_agree_with_their_predicates() {
        let docs: Vec<u32> = (0..300).map(|t| (t / 70) as u32).collect();
        let mask = BlockMask::documents(&[docs.clone()], &[docs.clone()], true, B128).unwrap();
        for i in 0..300 {
            for j in 0..300 {
                let want = docs[i] == docs[j] && j <= i;
                assert_eq!(mask.is_visible(0, 0, i, j), want, "({i}, {j})");
            }
        }
        let prefix = BlockMask::prefix_lm(&[150, 3], 200, 260, B128).unwrap();
        for b in 0..2 {
            for i in 0..200 {
                for j in 0..260 {
                    let want = j < [150, 3][b] || j <= i + 60;
                    assert_eq!(prefix.is_visible(b, 0, i, j), want);
                }
            }
        }
        let window = MaskSpec {
            causal: false,
            window_left: Some(100),
            window_right: Some(5),
        };
        let banded = BlockMask::from_mask(window, 500, 390, B128).unwrap();
        for i in 0..500 {
            for j in 0..390 {
                assert_eq!(
                    banded.is_visible(0, 0, i, j),
                    window.is_visible(i, j, 500, 390)
                );
            }
        }
        assert_eq!(banded.state(0, 0, 0, 3), BlockState::Empty);
    }

    #[test]
    fn a_classifier_that_disagrees_with_its_predicate_is_caught() {
        let causal = |_: usize, _: usize, i: usize, j: usize| j <= i;
        // Claims every block full: wrong above the diagonal.
        let wrong = std::panic::catch_unwind(|| {
            BlockMask::from_block_fn(
                [1, 1, 256, 256],
                B128,
                |_, _, _, _| Some(BlockState::Full),
                causal,
            )
        });
        if cfg!(debug_assertions) {
            let message = *wrong.unwrap_err().downcast::<String>().unwrap();
            assert!(message.contains("classified Full"), "{message}");
        } else {
            let mask = wrong.unwrap().unwrap();
            assert_eq!(mask.disagreement(causal), Some([0, 0, 0, 1]));
        }
        let right = BlockMask::from_fn([1, 1, 256, 256], B128, causal).unwrap();
        assert_eq!(right.disagreement(causal), None);
    }

    #[test]
    fn block_sizes_must_be_multiples_of_the_granule() {
        let bad = BlockShape {
            block_q: 64,
            block_kv: 128,
        };
        let err = BlockMask::from_fn([1, 1, 10, 10], bad, |_, _, _, _| true).unwrap_err();
        assert!(err.to_string().contains("block_q"), "{err}");
    }
}
