//! Terms added to the scores after masking: an additive bias tensor and ALiBi.
//!
//! - The **bias** `[b | 1, h_q | 1, s_q | 1, s_kv | 1]` broadcasts over each dimension of
//!   size 1. A bias of −∞ hides its key, which is how boolean masks reach the kernels; a
//!   row that every key's bias hides gives `O = 0` and `LSE = −∞`, as a row the causal
//!   mask hides.
//! - **ALiBi** adds `−slope · |i + s_kv − s_q − j|` (bottom-right aligned, as the masks and
//!   FlashAttention-2), with slopes `[b | 1, h_q]` in f32.
//!
//! The score the softmax sees is `softcap(q·k · scale) + bias + alibi`, as in the
//! [`crate::reference`] oracle. The gradient of the bias is `dS = P ⊙ (dP − D)`: the
//! backward's dQ kernels write it where they form `dS`, each element once, or add it up
//! atomically where the bias broadcasts ([`crate::score_mod::add_f32`]: a native float add
//! where the device has one, else a compare-and-swap loop on the bits).
//!
//! Each kernel reads the terms of one line of the score matrix at a time: a query row
//! against the keys ([`BiasLine::along_keys`]) or, in the dK/dV kernels that hold `Sᵀ`, a
//! key against the queries ([`BiasLine::along_queries`]).

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;
use serde::{Deserialize, Serialize};

use crate::block_mask::{BlockShape, DeviceBlockMask, ViewLayout, ViewShape};
use crate::error::FlashError;
use crate::launch::DeviceTensor;
use crate::mma_sync::Pair;
use crate::problem::AttentionProblem;
use crate::score_mod::{ScoreFn, add_f32_at, store_f32};
use crate::softmax::MASKED;
use crate::tile::{COPY, SharedLayout, shared_offset};

/// Which terms a kernel adds to the scores, and whether it drops probabilities
/// ([`crate::dropout`]): compiled in, nothing runs for an absent one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ScoreTerms {
    /// An additive bias tensor.
    pub bias: bool,
    /// ALiBi slopes.
    pub alibi: bool,
    /// The dQ kernels write `d(bias)`.
    pub bias_grad: bool,
    /// Some dimension of the bias broadcasts: `d(bias)` is a sum, added up atomically.
    pub bias_grad_sums: bool,
    /// Dropout on the probabilities.
    #[serde(default)]
    pub dropout: bool,
    /// A block mask of blocks of this shape ([`crate::block_mask`]).
    #[serde(default)]
    pub block_mask: Option<BlockShape>,
    /// A score function ([`crate::score_mod`]), applied after the other terms.
    #[serde(skip)]
    pub score_mod: Option<ScoreFn>,
    /// The dQ kernels add the gradient of the score function's parameters.
    #[serde(default)]
    pub score_params_grad: bool,
}

impl ScoreTerms {
    /// Whether any term is added.
    pub fn any(&self) -> bool {
        self.bias || self.alibi || self.score_mod.is_some()
    }

    /// The block mask as the kernels that own query rows (forward, dQ) or, with `by_key`,
    /// key rows (dK/dV) see it.
    pub fn view(&self, by_key: bool) -> ViewShape {
        ViewShape::of(self.block_mask, by_key)
    }

    /// These terms, with dropout as `problem`'s options ask.
    pub fn with_dropout_of(self, problem: &AttentionProblem) -> Self {
        Self {
            dropout: problem.options.dropout.is_some_and(|d| d.is_active()),
            ..self
        }
    }
}

/// The terms' tensors on the host. Absent ones are `None`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScoreBias<'a> {
    /// `[b | 1, h_q | 1, s_q | 1, s_kv | 1]` in the dtype of Q, any strides.
    pub bias: Option<&'a DeviceTensor>,
    /// `[b | 1, h_q]`, f32.
    pub alibi_slopes: Option<&'a DeviceTensor>,
    /// A block mask of `[b | 1, h_q | 1, s_q, s_kv]` scores.
    pub block_mask: Option<&'a DeviceBlockMask>,
    /// A score function ([`crate::score_mod`]).
    pub score_mod: Option<ScoreFn>,
    /// The score function's parameters, f32, any shape and strides (their gradient comes
    /// in the same layout, so that the function indexes both alike).
    pub score_params: Option<&'a DeviceTensor>,
}

/// Which gradients of the terms the backward computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TermsGrad {
    /// `d(bias)`.
    pub bias: bool,
    /// The gradient of the score function's parameters.
    pub score_params: bool,
}

impl ScoreBias<'_> {
    /// No terms.
    pub fn none() -> Self {
        Self::default()
    }

    /// The terms' tensors the kernels index by position (the bias and the score function's
    /// parameters), named, where present.
    pub(crate) fn indexed_tensors(&self) -> impl Iterator<Item = (&'static str, &DeviceTensor)> {
        [("bias", self.bias), ("score_params", self.score_params)]
            .into_iter()
            .filter_map(|(arg, t)| Some((arg, t?)))
    }

    /// The kernels' `bias`, `alibi_slopes` and `score_params` arguments: the tensors, or
    /// for an absent one a token the kernel never reads, `like_bias` (a tensor of the bias's
    /// dtype) or `like_f32`.
    pub(crate) fn args(
        &self,
        like_bias: &DeviceTensor,
        like_f32: &DeviceTensor,
    ) -> [DeviceTensor; 3] {
        [
            self.bias.unwrap_or(like_bias).clone(),
            self.alibi_slopes.unwrap_or(like_f32).clone(),
            self.score_params.unwrap_or(like_f32).clone(),
        ]
    }

    /// The kernels' block-mask arguments: the mask's words and its view by query or, with
    /// `by_key`, by key ([`crate::block_mask`]); without a block mask, a token the kernels
    /// never read (`like`) and an empty view.
    pub(crate) fn block_args(
        &self,
        like: &DeviceTensor,
        by_key: bool,
    ) -> (DeviceTensor, ViewLayout) {
        match self.block_mask {
            Some(mask) => (mask.words.clone(), mask.view(by_key)),
            None => (like.clone(), ViewLayout::default()),
        }
    }

    /// The terms, their tensors checked against `problem`; `grad` says which of their
    /// gradients the backward computes.
    pub fn terms(
        &self,
        problem: &AttentionProblem,
        grad: TermsGrad,
    ) -> Result<ScoreTerms, FlashError> {
        let bias_grad = grad.bias;
        let full = [
            problem.batch,
            problem.heads_q,
            problem.seq_q,
            problem.seq_kv,
        ];
        let mut terms = ScoreTerms::default();
        if let Some(bias) = self.bias {
            let fits = bias.shape.len() == 4
                && bias.shape.iter().zip(full).all(|(&n, f)| n == f || n == 1);
            if !fits {
                return Err(FlashError::Shape {
                    arg: "bias",
                    shape: bias.shape.clone(),
                    expected: format!(
                        "[{} | 1, {} | 1, {} | 1, {} | 1] (batch, query heads, queries, keys)",
                        full[0], full[1], full[2], full[3]
                    ),
                });
            }
            terms.bias = true;
            terms.bias_grad = bias_grad;
            terms.bias_grad_sums = bias_grad && bias.shape.iter().zip(full).any(|(&n, f)| n < f);
        } else if bias_grad {
            return Err(FlashError::Option {
                arg: "bias_grad",
                expected: "a bias tensor to differentiate".into(),
            });
        }
        if let Some(slopes) = self.alibi_slopes {
            check_alibi_slopes(slopes, problem)?;
            terms.alibi = true;
        }
        if let Some(mask) = self.block_mask {
            mask.check(full)?;
            terms.block_mask = Some(mask.layout.blocks);
        }
        terms.score_mod = self.score_mod;
        if self.score_params.is_some() && self.score_mod.is_none() {
            return Err(FlashError::Option {
                arg: "score_params",
                expected: "a score function to read them".into(),
            });
        }
        if grad.score_params {
            if self.score_params.is_none() || self.score_mod.is_none() {
                return Err(FlashError::Option {
                    arg: "score_params_grad",
                    expected: "a score function and its parameters to differentiate".into(),
                });
            }
            if problem.options.deterministic {
                return Err(FlashError::Option {
                    arg: "deterministic",
                    expected: "false: the gradient of a score function's parameters is added \
                               up atomically, in no fixed order"
                        .into(),
                });
            }
            terms.score_params_grad = true;
        }
        Ok(terms)
    }
}

/// Checks ALiBi slopes against `problem`: `[batch | 1, heads_q]`.
pub fn check_alibi_slopes(
    slopes: &DeviceTensor,
    problem: &AttentionProblem,
) -> Result<(), FlashError> {
    let fits = slopes.shape.len() == 2
        && (slopes.shape[0] == problem.batch || slopes.shape[0] == 1)
        && slopes.shape[1] == problem.heads_q;
    match fits {
        true => Ok(()),
        false => Err(FlashError::Shape {
            arg: "alibi_slopes",
            shape: slopes.shape.clone(),
            expected: format!(
                "[{} | 1, {}] (batch, query heads)",
                problem.batch, problem.heads_q
            ),
        }),
    }
}

/// The terms of one line of the score matrix of one (batch, query head): a query row
/// against every key, or a key against every query. Position `p` along the line reads the
/// bias at `offset + min(p, last) · stride` (clamped: positions past the sequence's end
/// are masked by the caller) and is `|p − center|` from the ALiBi diagonal.
#[derive(CubeType, Clone, Copy)]
pub struct BiasLine {
    offset: usize,
    stride: usize,
    last: usize,
    slope: f32,
    center: f32,
}

/// Index of `(batch, head, row, col)` in a tensor broadcast over its size-1 dimensions.
#[cube]
fn broadcast_index<E: CubePrimitive>(
    t: &Tensor<E>,
    batch: usize,
    head: usize,
    row: usize,
    col: usize,
) -> usize {
    broadcast_step(t.shape(0), t.stride(0), batch)
        + broadcast_step(t.shape(1), t.stride(1), head)
        + broadcast_step(t.shape(2), t.stride(2), row)
        + broadcast_step(t.shape(3), t.stride(3), col)
}

/// Offset of index `i` along a dimension of `size` and `stride` (0 where it broadcasts).
#[cube]
fn broadcast_step(size: usize, stride: usize, i: usize) -> usize {
    select(size == 1, 0usize, i) * stride
}

#[cube]
fn slope_of(slopes: &Tensor<f32>, batch: usize, head: usize, #[comptime] terms: ScoreTerms) -> f32 {
    let mut slope = 0.0f32;
    if comptime!(terms.alibi) {
        slope = alibi_slope(slopes, batch, head);
    }
    slope
}

/// The ALiBi slope of `(batch, head)` in slopes `[b | 1, h_q]`.
#[cube]
pub fn alibi_slope(slopes: &Tensor<f32>, batch: usize, head: usize) -> f32 {
    let b = select(slopes.shape(0) == 1, 0usize, batch);
    slopes[b * slopes.stride(0) + head * slopes.stride(1)]
}

/// ALiBi's term at `distance` keys from the diagonal: `−slope · |distance|`.
#[cube]
pub fn alibi_term(slope: f32, distance: f32) -> f32 {
    -slope * Abs::abs(distance)
}

#[cube]
impl BiasLine {
    /// Query `row` of `(batch, head)` against the keys.
    #[allow(clippy::too_many_arguments)]
    pub fn along_keys<E: CubePrimitive>(
        bias: &Tensor<E>,
        slopes: &Tensor<f32>,
        batch: usize,
        head: usize,
        row: usize,
        seq_q: usize,
        seq_kv: usize,
        #[comptime] terms: ScoreTerms,
    ) -> BiasLine {
        let mut line = BiasLine {
            offset: 0usize,
            stride: 0usize,
            last: 0usize,
            slope: slope_of(slopes, batch, head, terms),
            center: f32::cast_from(row + seq_kv) - f32::cast_from(seq_q),
        };
        if comptime!(terms.bias) {
            line.offset = broadcast_index(bias, batch, head, min(row, seq_q - 1), 0usize);
            line.stride = broadcast_step(bias.shape(3), bias.stride(3), 1usize);
            line.last = seq_kv - 1;
        }
        line
    }

    /// Key `key` of `(batch, head)` against the queries.
    #[allow(clippy::too_many_arguments)]
    pub fn along_queries<E: CubePrimitive>(
        bias: &Tensor<E>,
        slopes: &Tensor<f32>,
        batch: usize,
        head: usize,
        key: usize,
        seq_q: usize,
        seq_kv: usize,
        #[comptime] terms: ScoreTerms,
    ) -> BiasLine {
        let mut line = BiasLine {
            offset: 0usize,
            stride: 0usize,
            last: 0usize,
            slope: slope_of(slopes, batch, head, terms),
            center: f32::cast_from(key + seq_q) - f32::cast_from(seq_kv),
        };
        if comptime!(terms.bias) {
            line.offset = broadcast_index(bias, batch, head, 0usize, min(key, seq_kv - 1));
            line.stride = broadcast_step(bias.shape(2), bias.stride(2), 1usize);
            line.last = seq_q - 1;
        }
        line
    }

    /// Where the line starts in the bias and its ALiBi center: with [`BiasLine::moved_to`],
    /// what a kernel keeps per line across its loop (the rest is the same on every line of a
    /// head).
    pub fn start(&self) -> (usize, f32) {
        (self.offset, self.center)
    }

    /// This line's stride, bounds and slope at another start (from [`BiasLine::start`]).
    pub fn moved_to(&self, start: (usize, f32)) -> BiasLine {
        let (offset, center) = start;
        BiasLine {
            offset,
            stride: self.stride,
            last: self.last,
            slope: self.slope,
            center,
        }
    }

    /// The terms at position `p` of the line (0 without terms).
    pub fn at<F: Float>(&self, bias: &Tensor<F>, p: usize, #[comptime] terms: ScoreTerms) -> f32 {
        let mut value = 0.0f32;
        if comptime!(terms.bias) {
            value = f32::cast_from(bias[self.offset + min(p, self.last) * self.stride]);
        }
        if comptime!(terms.alibi) {
            value -= self.slope * Abs::abs(f32::cast_from(p) - self.center);
        }
        value
    }

    /// Score `s` plus the terms at position `p`, in units of `unit` per natural-log unit
    /// (1 for scores as the softmax sees them); a bias of −∞ gives [`MASKED`].
    pub fn add<F: Float>(
        &self,
        bias: &Tensor<F>,
        s: f32,
        p: usize,
        unit: f32,
        #[comptime] terms: ScoreTerms,
    ) -> f32 {
        let mut s = s;
        if comptime!(terms.any()) {
            s = max(s + self.at(bias, p, terms) * unit, f32::new(MASKED));
        }
        s
    }
}

/// Where one query row's `d(bias)` goes: `dbias` holds f32 cells (see
/// [`crate::score_mod::add_f32`]), zeroed, in the shape of the bias (contiguous).
#[derive(CubeType, Clone, Copy)]
pub struct BiasGradLine {
    offset: usize,
    stride: usize,
}

#[cube]
impl BiasGradLine {
    /// Query `row` of `(batch, head)`.
    pub fn along_keys<G: CubePrimitive>(
        dbias: &mut Tensor<Atomic<G>>,
        batch: usize,
        head: usize,
        row: usize,
    ) -> BiasGradLine {
        BiasGradLine {
            offset: broadcast_step(dbias.shape(0), dbias.stride(0), batch)
                + broadcast_step(dbias.shape(1), dbias.stride(1), head)
                + broadcast_step(dbias.shape(2), dbias.stride(2), row),
            stride: broadcast_step(dbias.shape(3), dbias.stride(3), 1usize),
        }
    }

    /// Adds `ds` at key `key` (stores it where nothing else lands there).
    pub fn add<G: CubePrimitive>(
        &self,
        dbias: &mut Tensor<Atomic<G>>,
        key: usize,
        ds: f32,
        #[comptime] terms: ScoreTerms,
    ) {
        let at = self.offset + key * self.stride;
        if comptime!(terms.bias_grad_sums) {
            add_f32_at(&mut dbias[at..at + 1], 0usize, ds);
        } else {
            store_f32(&dbias[at], ds);
        }
    }
}

/// `LSE` as the backward uses it: a row the forward found fully hidden (`LSE = −∞`)
/// becomes `+BIG`, so that `exp(s − LSE)` is 0 for every score, hidden or not; the terms can
/// hide a row whose keys the causal and window masks leave visible.
#[cube]
pub fn backward_lse(lse: f32) -> f32 {
    select(lse < f32::new(MASKED), f32::new(-MASKED), lse)
}

/// Which kernels stage the bias ([`BiasTile`]) where they can: by default the forward and
/// the dQ kernel, and the dK/dV kernel at head dims up to 64. Measured on the H100 (bf16,
/// s = 4096, causal, docs/benchmarks.md) against the bias read at the lanes' scores: the
/// forward staged ran 1.17× (d = 128) and 1.25× (d = 64) faster; the backward with both
/// kernels staged 1.14× faster at d = 64 but 1.10× slower at d = 128, and at d = 128 the dQ
/// kernel alone staged made forward+backward 1.04× faster (there the dK/dV kernel's two
/// stages of bias take the shared memory a second cube on the multiprocessor needed).
/// `FLASH_BIAS_STAGED=0` stages nowhere; `=fwd`, `=dq`, `=dkdv` in the forward alone or
/// also in that backward kernel; `=all` everywhere, for comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StagedBias {
    Forward,
    Dq,
    Dkdv { dim: usize },
}

impl StagedBias {
    /// Whether this kernel stages `bias`: a [`stageable`] one, where the rule above (or
    /// `FLASH_BIAS_STAGED`) asks for it.
    pub(crate) fn wanted(self, bias: Option<&DeviceTensor>, elem: usize) -> bool {
        let asked = match (std::env::var("FLASH_BIAS_STAGED").as_deref(), self) {
            (Ok("0"), _) => false,
            (Ok("all"), _) | (_, Self::Forward) => true,
            (Ok("dq"), Self::Dq) | (Ok("dkdv"), Self::Dkdv { .. }) => true,
            (Ok("fwd" | "dq" | "dkdv"), _) => false,
            (_, Self::Dq) => true,
            (_, Self::Dkdv { dim }) => dim <= 64,
        };
        asked && bias.is_some_and(|b| stageable(b, elem))
    }
}

/// Whether the kernels may stage `bias` tiles by 16-byte asynchronous copies
/// ([`BiasTile`]): every query row starts on a 16-byte boundary and its keys are contiguous
/// (a bias broadcast over the keys is read by [`read_columns`] instead). Dimensions of size
/// 1 broadcast whatever their stride.
pub(crate) fn stageable(bias: &DeviceTensor, elem: usize) -> bool {
    let offset = bias.handle.offset_start.unwrap_or(0) as usize;
    bias.shape[3] > 1
        && bias.strides[3] == 1
        && (0..3).all(|i| bias.shape[i] == 1 || (bias.strides[i] * elem).is_multiple_of(16))
        && offset.is_multiple_of(16)
}

/// The bias of one cube's query rows, copied a key block at a time into shared memory by
/// 16-byte asynchronous copies, a block ahead of its use as the kernels' K and V blocks are
/// ([`crate::stages`]), then read from there at the lanes' scores ([`read_staged_columns`]).
/// Coalesced and in flight a whole block ahead, the copies cost the loop little, where
/// loads at the lanes' scores ([`read_columns`]) are many small ones with less time to land.
/// A tile holds `rows` query rows of `cols` keys, [`SharedLayout::Swizzled`], so that the
/// lanes of a plane read their pairs from different banks. Needs [`stageable`].
#[derive(CubeType, Clone, Copy)]
pub struct BiasTile {
    /// Offset of the cube's first query row, key 0.
    first: usize,
    /// Between query rows (0 where the bias broadcasts over them).
    row_stride: usize,
    /// Query rows left in the sequence from the first.
    rows: usize,
    /// Keys of the sequence.
    keys: usize,
}

#[cube]
impl BiasTile {
    /// The tile of query rows `first_row..` of `(batch, head)`; unless `staged`, a token
    /// that reads nothing.
    pub fn of<F: Float>(
        bias: &Tensor<F>,
        batch: usize,
        head: usize,
        first_row: usize,
        seq_q: usize,
        seq_kv: usize,
        #[comptime] staged: bool,
    ) -> BiasTile {
        let mut tile = BiasTile {
            first: 0usize,
            row_stride: 0usize,
            rows: 0usize,
            keys: 0usize,
        };
        if comptime!(staged) {
            tile.first = broadcast_index(bias, batch, head, first_row, 0usize);
            tile.row_stride = broadcast_step(bias.shape(2), bias.stride(2), 1usize);
            tile.rows = seq_q - first_row;
            tile.keys = seq_kv;
        }
        tile
    }

    /// Copies the bias of keys `k0..k0 + cols` into `tile` at `offset`; visible after a
    /// wait on the barrier the unit's copies are next committed to (plain stores too: the
    /// zeros past the sequence's ends, and the keys of a 16-byte chunk the sequence ends in).
    #[allow(clippy::too_many_arguments)]
    pub fn stage<F: Float>(
        &self,
        bias: &Tensor<F>,
        k0: usize,
        tile: &mut Shared<[F]>,
        offset: usize,
        #[comptime] rows: usize,
        #[comptime] cols: usize,
        #[comptime] units: usize,
    ) {
        let per_row = comptime!(cols / COPY);
        let chunks = comptime!(rows * per_row);
        let layout = comptime!(SharedLayout::Swizzled { cols });
        #[unroll]
        for pass in 0..comptime!(chunks.div_ceil(units)) {
            let idx = pass * units + UNIT_POS as usize;
            if comptime!(chunks.is_multiple_of(units)) || idx < chunks {
                // Neighbouring units copy neighbouring 16 bytes of a row.
                let (r, c) = (idx / per_row, (idx % per_row) * COPY);
                let to = offset + shared_offset(r, c, layout);
                let from = self.first + r * self.row_stride + k0 + c;
                if r < self.rows && k0 + c + COPY <= self.keys {
                    copy_async(
                        &bias[from..from + COPY],
                        &mut tile[to..to + COPY],
                        COPY as u32,
                    );
                } else {
                    #[unroll]
                    for e in 0..COPY {
                        let mut value = F::new(0.0);
                        if r < self.rows && k0 + c + e < self.keys {
                            value = bias[from + e];
                        }
                        tile[to + e] = value;
                    }
                }
            }
        }
    }
}

/// [`read_columns`] from a staged tile ([`BiasTile::stage`], at `offset`, `cols` keys a
/// row): the lane's pairs of tile row `row`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn read_staged_columns<F: Float>(
    read: &mut Array<Pair<F>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    row: usize,
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] cols: usize,
) {
    let layout = comptime!(SharedLayout::Swizzled { cols });
    let lane_col = 2 * (UNIT_POS_PLANE as usize % 4);
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let from = offset + shared_offset(row, n * 8, layout) + lane_col;
        let mut pair = read[at];
        pair.insert(0usize, tile[from]);
        pair.insert(1usize, tile[from + 1]);
        read[at] = pair;
    }
}

/// [`read_staged_columns`] for kernels whose accumulators hold `Sᵀ` (keys as rows): the
/// lane's pairs of key `key` (a column of the staged tile, whose rows are queries).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn read_staged_rows<F: Float>(
    read: &mut Array<Pair<F>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    key: usize,
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] cols: usize,
) {
    let layout = comptime!(SharedLayout::Swizzled { cols });
    let lane_row = 2 * (UNIT_POS_PLANE as usize % 4);
    let (chunk_col, in_chunk) = (key - key % COPY, key % COPY);
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = read[at];
        #[unroll]
        for e in 0..2usize {
            let row = n * 8 + lane_row + e;
            pair.insert(
                e,
                tile[offset + shared_offset(row, chunk_col, layout) + in_chunk],
            );
        }
        read[at] = pair;
    }
}

/// Reads one line's bias at the lane's positions of accumulator tiles side by side (the
/// layout of [`add_to_columns`]) into pairs `2 · (first + n) + half` of `read`, one pair per
/// tile. Issued before a block's product, the loads run under it; [`add_to_columns`] then
/// adds them (`ahead`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn read_columns<F: Float>(
    read: &mut Array<Pair<F>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    p0: usize,
    line: &BiasLine,
    bias: &Tensor<F>,
) {
    let lane_p0 = p0 + 2 * (UNIT_POS_PLANE as usize % 4);
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = read[at];
        #[unroll]
        for e in 0..2usize {
            let p = lane_p0 + n * 8 + e;
            pair.insert(e, bias[line.offset + min(p, line.last) * line.stride]);
        }
        read[at] = pair;
    }
}

/// Adds one line's terms to the lane's elements of accumulator tiles side by side, in the
/// layout of [`crate::mma_sync::hide_columns`]: pairs `2 · (first + n) + half` hold
/// positions `p0 + 8n + 2 · (lane % 4)` and the next one. `unit` converts natural-log
/// units into the accumulator's. ALiBi costs an add and a multiply-add per score: the
/// distance from the diagonal is counted in f32 from the lane's first position. With
/// `ahead`, the bias comes from the same pairs of `read` ([`read_columns`]), else from
/// `bias` (`read` may then be a token array).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_to_columns<F: Float>(
    acc: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    p0: usize,
    line: &BiasLine,
    bias: &Tensor<F>,
    read: &Array<Pair<F>>,
    unit: f32,
    #[comptime] terms: ScoreTerms,
    #[comptime] ahead: bool,
) {
    let lane_p0 = p0 + 2 * (UNIT_POS_PLANE as usize % 4);
    let from_center = f32::cast_from(lane_p0) - line.center;
    let slope = line.slope * unit;
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = acc[at];
        #[unroll]
        for e in 0..2usize {
            let offset = n * 8 + e;
            let mut s = pair.extract(e);
            if comptime!(terms.bias) {
                let b = if comptime!(ahead) {
                    f32::cast_from(read[at].extract(e))
                } else {
                    let p = lane_p0 + offset;
                    f32::cast_from(bias[line.offset + min(p, line.last) * line.stride])
                };
                s = max(s + b * unit, f32::new(MASKED));
            }
            if comptime!(terms.alibi) {
                s -= slope * Abs::abs(from_center + f32::cast_from(offset));
            }
            pair.insert(e, s);
        }
        acc[at] = pair;
    }
}

/// The backward kernels' scores in base 2 (`q·k · scale · log2 e`, or the softcap
/// `cap · log2 e · tanh(q·k · scale / cap)`) from the products `dots`, into `logits`, where
/// the terms are added next ([`add_to_columns`]).
#[cube]
pub fn base2_scores(
    dots: &Array<Pair<f32>>,
    logits: &mut Array<Pair<f32>>,
    #[comptime] pairs: usize,
    scale_log2: f32,
    pre_cap: f32,
    cap_log2: f32,
    #[comptime] softcap: bool,
) {
    #[unroll]
    for i in 0..pairs {
        let mut pair = dots[i];
        #[unroll]
        for e in 0..2usize {
            let dot = pair.extract(e);
            let mut s = dot * scale_log2;
            if comptime!(softcap) {
                s = cap_log2 * (dot * pre_cap).tanh();
            }
            pair.insert(e, s);
        }
        logits[i] = pair;
    }
}

/// Adds `P ⊙ (dP − D)`, the lane's elements of accumulator tiles side by side (the layout
/// of [`add_to_columns`]) of one query row, to `d(bias)` at keys `p0 + …` below `end`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_grad_columns<G: CubePrimitive>(
    dbias: &mut Tensor<Atomic<G>>,
    p: &Array<Pair<f32>>,
    dp_minus_d: &Array<Pair<f32>>,
    #[comptime] tiles: usize,
    half: usize,
    p0: usize,
    end: usize,
    line: &BiasGradLine,
    #[comptime] terms: ScoreTerms,
) {
    let in_group = UNIT_POS_PLANE as usize % 4;
    #[unroll]
    for n in 0..tiles {
        let at = 2 * n + half;
        #[unroll]
        for e in 0..2usize {
            let key = p0 + n * 8 + 2 * in_group + e;
            if key < end {
                let ds = p[at].extract(e) * dp_minus_d[at].extract(e);
                line.add(dbias, key, ds, terms);
            }
        }
    }
}

/// `d(bias)` of a deterministic backward where the bias broadcasts: the dQ kernels store the
/// whole `[b, h_q, s_q, s_kv]` gradient (`full`, f32) and this kernel adds it up into `out`
/// (f32, the bias's shape, contiguous), one unit per element of `out`, always in the same
/// order.
#[cube(launch_unchecked)]
pub fn sum_bias_grad(full: &Tensor<f32>, out: &mut Tensor<f32>) {
    let at = ABSOLUTE_POS;
    if at >= out.len() {
        terminate!();
    }
    // The element's coordinates in `out`, and how many positions of `full` fold into it.
    let mut rest = at;
    let mut coords = Array::<usize>::new(4usize);
    let mut folded = 1usize;
    #[unroll]
    for dim in 0..4usize {
        let d = 3 - dim;
        coords[d] = rest % out.shape(d);
        rest /= out.shape(d);
        if out.shape(d) == 1 {
            folded *= full.shape(d);
        }
    }
    let mut sum = 0.0f32;
    for n in 0..folded {
        // The `n`-th combination of the folded dimensions' indices.
        let mut left = n;
        let mut index = 0usize;
        #[unroll]
        for dim in 0..4usize {
            let d = 3 - dim;
            let mut i = coords[d];
            if out.shape(d) == 1 {
                i = left % full.shape(d);
                left /= full.shape(d);
            }
            index += i * full.stride(d);
        }
        sum += full[index];
    }
    out[at] = sum;
}
