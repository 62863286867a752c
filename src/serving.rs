//! Serving: attention of new queries against a key/value cache, contiguous or paged, with the
//! new keys and values appended in place.

use burn::backend::Dispatch;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cubecl_flash_attention::AttentionProblem;
use cubecl_flash_attention::decode::CacheGeometry;
use cubecl_flash_attention::rotary::RotaryConfig;

use crate::attention::{check_like_q, kernel_dtype, supports_flash_attention};
use crate::bias::{AttentionBias, DecodeTerms};
use crate::fallback;
use crate::ops::FlashAttentionOps;
use crate::options::{DecodeOptions, FlashAttentionOptions};

/// A key/value cache.
///
/// - Contiguous: `k` `[batch, heads_kv, capacity, d_qk]`, `v` `[batch, heads_kv, capacity,
///   d_v]` (a `[batch, capacity, heads_kv, d]` tensor through `swap_dims(1, 2)` is read in
///   place), `block_table` `None`;
/// - paged (vLLM's and FlashAttention's layout): `k` `[pages, page_size, heads_kv, d_qk]`,
///   `v` `[pages, page_size, heads_kv, d_v]`, and `block_table` `[batch, max_pages]` naming
///   the page of each `page_size` positions of each sequence; any page size. Entries past
///   a sequence's pages are never read.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub k: Tensor<4>,
    pub v: Tensor<4>,
    pub block_table: Option<Tensor<2, Int>>,
}

impl KvCache {
    /// An empty contiguous cache of `capacity` positions per sequence, on `device` in the
    /// default float dtype.
    pub fn contiguous(
        batch: usize,
        heads_kv: usize,
        capacity: usize,
        dims: [usize; 2],
        device: &Device,
    ) -> Self {
        let [d_qk, d_v] = dims;
        Self {
            k: Tensor::zeros([batch, heads_kv, capacity, d_qk], device),
            v: Tensor::zeros([batch, heads_kv, capacity, d_v], device),
            block_table: None,
        }
    }

    fn shapes(&self) -> (Vec<usize>, Vec<usize>, Option<Vec<usize>>) {
        (
            self.k.dims().to_vec(),
            self.v.dims().to_vec(),
            self.block_table.as_ref().map(|t| t.dims().to_vec()),
        )
    }
}

/// Rotary position embedding of a decode step's new queries and keys (FlashAttention's
/// `rotary_cos`, `rotary_sin`, `rotary_interleaved`): `cos`, `sin` `[positions, rotary_dim /
/// 2]` in the dtype of `q`, with `rotary_dim` even and at most the head dim. The first
/// `rotary_dim` columns of a row at position `p` turn by row `p`'s angles, pairs `(2i, 2i +
/// 1)` if `interleaved`, else `(i, i + rotary_dim / 2)` (GPT-NeoX); the rest pass unchanged.
/// New key `j` of sequence `b` is at position `cache_seqlens[b] + j`; query `i` likewise
/// under a causal or window mask, else every query at `cache_seqlens[b]`.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    pub cos: Tensor<2>,
    pub sin: Tensor<2>,
    pub interleaved: bool,
}

impl RotaryEmbedding {
    /// The usual tables: pair `i` of position `p` turns by `p · base^(−2i / rotary_dim)`
    /// (`base` 10 000 in LLaMA), for `positions` positions, in `dtype`.
    pub fn new(
        positions: usize,
        rotary_dim: usize,
        base: f64,
        interleaved: bool,
        dtype: burn::tensor::DType,
        device: &Device,
    ) -> Self {
        assert!(
            rotary_dim >= 2 && rotary_dim.is_multiple_of(2),
            "RotaryEmbedding: `rotary_dim` must be even and at least 2, got {rotary_dim}"
        );
        let half = rotary_dim / 2;
        let angle = |n: usize| {
            let (p, i) = (n / half, n % half);
            p as f64 * base.powf(-2.0 * i as f64 / rotary_dim as f64)
        };
        let table = |f: fn(f64) -> f64| {
            let values: Vec<f32> = (0..positions * half).map(|n| f(angle(n)) as f32).collect();
            Tensor::<2>::from_data(TensorData::new(values, [positions, half]), device).cast(dtype)
        };
        Self {
            cos: table(f64::cos),
            sin: table(f64::sin),
            interleaved,
        }
    }

    /// `x` `[b, h, s, d]` with row `(b, ·, i)` turned to `positions[b · s + i]`, from Burn
    /// ops (for a model's training forward; decode turns its new queries and keys inside
    /// [`flash_attention_with_kvcache`]).
    pub fn apply(&self, x: Tensor<4>, positions: &[usize]) -> Tensor<4> {
        let [b, h, s, d] = x.dims();
        assert_eq!(
            positions.len(),
            b * s,
            "RotaryEmbedding::apply: {} positions for {b} × {s} rows",
            positions.len()
        );
        let half = self.cos.dims()[1];
        let dim = 2 * half;
        let device = x.device();
        let ids: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [b * s]), &device);
        let angles = |t: &Tensor<2>| t.clone().select(0, ids.clone()).reshape([b, 1, s, half]);
        let (cos, sin) = (angles(&self.cos), angles(&self.sin));
        let turned = x.clone().slice([0..b, 0..h, 0..s, 0..dim]);
        let (first, second) = match self.interleaved {
            true => {
                let pairs = turned.reshape([b, h, s * half, 2]);
                let column = |c: usize| pairs.clone().slice([0..b, 0..h, 0..s * half, c..c + 1]);
                (
                    column(0).reshape([b, h, s, half]),
                    column(1).reshape([b, h, s, half]),
                )
            }
            false => (
                turned.clone().slice([0..b, 0..h, 0..s, 0..half]),
                turned.slice([0..b, 0..h, 0..s, half..dim]),
            ),
        };
        let a = first.clone() * cos.clone() - second.clone() * sin.clone();
        let c = second * cos + first * sin;
        let turned = match self.interleaved {
            true => Tensor::cat(
                vec![
                    a.reshape([b, h, s * half, 1]),
                    c.reshape([b, h, s * half, 1]),
                ],
                3,
            )
            .reshape([b, h, s, dim]),
            false => Tensor::cat(vec![a, c], 3),
        };
        match dim < d {
            true => Tensor::cat(vec![turned, x.slice([0..b, 0..h, 0..s, dim..d])], 3),
            false => turned,
        }
    }
}

/// Attention of `q` `[batch, heads_q, s_q, d_qk]` against each sequence's first
/// `cache_seqlens[b]` cached positions plus the new ones, FlashAttention's
/// `flash_attn_with_kvcache`:
///
/// - `new` (`k` `[batch, heads_kv, s_new, d_qk]`, `v` `[batch, heads_kv, s_new, d_v]`) is
///   first written at positions `cache_seqlens[b] ..` of each sequence and attended to;
///   the returned cache holds it (written in place where the cache's buffers are not shared
///   with another tensor, as Burn's in-place ops);
/// - `rotary` turns the new queries and keys to their positions first
///   ([`RotaryEmbedding`]);
/// - causal and window masks are bottom-right aligned: the last query sees its sequence's
///   last key; softcap, scale and GQA/MQA as [`flash_attention`](crate::flash_attention);
/// - sequences of any length share one call; a sequence with no visible key gets `O = 0`.
///
/// Returns `O` `[batch, heads_q, s_q, d_v]` and the cache. `cache_seqlens` is not updated
/// (add `s_new` for the next step). The lengths (and, paged, the block table) are read back
/// and checked before anything is written. On CUDA, ROCm and wgpu devices this runs the
/// decode kernels (GQA heads packed per K/V head, the key range split over the device's
/// multiprocessors); on other backends, the same function composed from Burn tensor ops.
/// Inference only: nothing is tracked by autodiff.
///
/// # Panics
/// On mismatched shapes, dtypes or devices, on a length whose append passes the cache's
/// capacity and on a block-table entry that names no page, with a message naming the
/// argument; the cache is left unchanged.
pub fn flash_attention_with_kvcache(
    q: Tensor<4>,
    cache: KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    rotary: Option<RotaryEmbedding>,
    options: FlashAttentionOptions,
) -> (Tensor<4>, KvCache) {
    let (out, _, cache) =
        flash_attention_with_kvcache_and_lse(q, cache, cache_seqlens, new, rotary, options);
    (out, cache)
}

/// [`flash_attention_with_kvcache`], also returning the LSE `[batch, heads_q, s_q]` (f32).
pub fn flash_attention_with_kvcache_and_lse(
    q: Tensor<4>,
    cache: KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    rotary: Option<RotaryEmbedding>,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>, KvCache) {
    flash_attention_with_kvcache_biased(
        q,
        cache,
        cache_seqlens,
        new,
        rotary,
        AttentionBias::new(),
        options,
    )
}

/// [`flash_attention_with_kvcache_and_lse`] with score terms ([`AttentionBias`]), added
/// to the score of new query `i` (of `s_q`) and key position `j` of a sequence holding
/// `seq_kv = cache_seqlens[b] + s_new` keys after the append, as the training op adds them
/// to a `[s_q, seq_kv]` problem (query `i` on the diagonal at key `i + seq_kv − s_q`):
/// - a bias or boolean mask `[batch | 1, heads_q | 1, s_q | 1, capacity | 1]`, indexed by
///   key position (`capacity`: the cache's length, or `max_pages · page_size`), as
///   `with_key_padding` `[batch, capacity]` builds it for left-padded prompts;
/// - ALiBi slopes `[batch | 1, heads_q]`: `−slope · |i + seq_kv − s_q − j|`, as
///   FlashAttention's `alibi_slopes`;
/// - a score function ([`AttentionBias::with_score_mod`]) and its parameters, called with
///   the sequence as batch, `query = i`, `key = j` and the lengths `s_q` and `seq_kv`:
///   the function a model trained with serves its decode steps. It runs on CUDA, ROCm and
///   wgpu devices.
///
/// # Panics
/// As [`flash_attention_with_kvcache`]; on terms of another shape or device, naming them;
/// on a block mask (pass the mask it summarises); on a score function where the decode
/// kernels do not run.
pub fn flash_attention_with_kvcache_biased(
    q: Tensor<4>,
    cache: KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    rotary: Option<RotaryEmbedding>,
    terms: AttentionBias,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>, KvCache) {
    const OP: &str = "flash_attention_with_kvcache";
    let (lengths, table, problem) = validate(
        &q,
        &cache,
        cache_seqlens.clone(),
        new.as_ref(),
        rotary.as_ref(),
        &options,
    );
    let DecodeTerms {
        bias,
        alibi_slopes,
        score_mod,
        score_params,
    } = terms.into_decode_terms(OP, &problem, &q);
    let device = q.device();
    if !supports_flash_attention(&device) {
        if let Some(score_mod) = score_mod {
            panic!(
                "{OP}: the score function {} is compiled into the decode kernels, which do not \
                 run on device {device:?} (they run on CUDA, ROCm and wgpu devices)",
                score_mod.name()
            );
        }
        let (q, new) = match &rotary {
            Some(rotary) => fallback::rotate_new(q, new, rotary, &lengths, &options),
            None => (q, new),
        };
        return fallback::decode(
            q,
            cache,
            &lengths,
            table.as_deref(),
            new,
            (bias, alibi_slopes),
            &options,
        );
    }
    let paged = cache.block_table.is_some();
    let append = new.is_some();
    // Tensors the options say are absent are never read: ones already at hand stand in for
    // them (no allocation per call).
    let block_table = cache
        .block_table
        .clone()
        .unwrap_or_else(|| cache_seqlens.clone().unsqueeze_dim(1));
    let (k_new, v_new) = new.unwrap_or_else(|| (q.clone(), q.clone()));
    let (rotary_cos, rotary_sin) = match &rotary {
        Some(r) => (r.cos.clone().into_dispatch(), r.sin.clone().into_dispatch()),
        None => (q.clone().into_dispatch(), q.clone().into_dispatch()),
    };
    let (has_bias, alibi, has_params) = (
        bias.is_some(),
        alibi_slopes.is_some(),
        score_params.is_some(),
    );
    // Absent terms are never read: `q` stands in for them.
    let absent = || q.clone().into_dispatch();
    let bias = bias.map_or_else(absent, Tensor::into_dispatch);
    let alibi_slopes = alibi_slopes.map_or_else(absent, Tensor::into_dispatch);
    let score_params = score_params.map_or_else(absent, Tensor::into_dispatch);
    let (o, lse, k, v) = <Dispatch as FlashAttentionOps>::flash_attention_decode(
        q.into_dispatch(),
        cache.k.into_dispatch(),
        cache.v.into_dispatch(),
        cache_seqlens.into_dispatch(),
        block_table.into_dispatch(),
        k_new.into_dispatch(),
        v_new.into_dispatch(),
        rotary_cos,
        rotary_sin,
        bias,
        alibi_slopes,
        score_params,
        DecodeOptions {
            attention: options,
            paged,
            append,
            lengths,
            rotary: rotary.map(|r| r.interleaved),
            bias: has_bias,
            alibi,
            score_mod,
            score_params: has_params,
        },
    );
    (
        Tensor::from_dispatch(o),
        Tensor::from_dispatch(lse),
        KvCache {
            k: Tensor::from_dispatch(k),
            v: Tensor::from_dispatch(v),
            block_table: cache.block_table,
        },
    )
}

/// Checks shapes, dtypes and devices, then the lengths and the pages they use (read to
/// the host: a lazy backend would otherwise report them only when the op runs); panics with
/// a message naming the argument. Returns the lengths, the block table (paged) and the
/// problem (its keys the cache's capacity).
fn validate(
    q: &Tensor<4>,
    cache: &KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<&(Tensor<4>, Tensor<4>)>,
    rotary: Option<&RotaryEmbedding>,
    options: &FlashAttentionOptions,
) -> (Vec<usize>, Option<Vec<i64>>, AttentionProblem) {
    const OP: &str = "flash_attention_with_kvcache";
    let dtype = q.dtype();
    let Some(kernel_dtype) = kernel_dtype(dtype) else {
        panic!("{OP}: `q` has dtype {dtype:?}, expected F32, F16 or BF16");
    };
    assert!(
        options.dropout.is_none_or(|d| !d.is_active()),
        "{OP}: `dropout` must be none: decode serves inference, dropout is for training"
    );
    let mut floats = vec![("k_cache", &cache.k), ("v_cache", &cache.v)];
    if let Some((k, v)) = new {
        floats.extend([("k", k), ("v", v)]);
    }
    if let Some(r) = rotary {
        for (arg, t) in [("rotary_cos", &r.cos), ("rotary_sin", &r.sin)] {
            assert!(
                t.dtype() == dtype && t.device() == q.device(),
                "{OP}: `{arg}` has dtype {:?} on device {:?}, expected {dtype:?} on {:?} \
                 (those of `q`)",
                t.dtype(),
                t.device(),
                q.device()
            );
        }
    }
    check_like_q(
        OP,
        (dtype, &q.device()),
        floats
            .into_iter()
            .map(|(arg, t)| (arg, t.dtype(), t.device())),
    );
    let (k, v, table) = cache.shapes();
    let (geometry, s_new, problem) =
        CacheGeometry::from_shapes(&k, &v, table.as_deref(), q.dims()[0])
            .and_then(|g| {
                let problem = g.problem(&q.dims(), kernel_dtype, options.kernel_options())?;
                let s_new = match new {
                    Some((k, v)) => g.check_new(&k.dims(), &v.dims())?,
                    None => 0,
                };
                Ok((g, s_new, problem))
            })
            .unwrap_or_else(|e| panic!("{OP}: {e}"));
    assert_eq!(
        cache_seqlens.dims(),
        [geometry.batch],
        "{OP}: `cache_seqlens` has shape {:?}, expected [{}] (one length per sequence)",
        cache_seqlens.dims(),
        geometry.batch
    );
    let lengths = host_ints(cache_seqlens);
    let table = cache.block_table.clone().map(host_ints);
    let lengths = geometry
        .check_lengths(&lengths, s_new, table.as_deref())
        .unwrap_or_else(|e| panic!("{OP}: {e}"));
    if let Some(r) = rotary {
        let positions = lengths
            .iter()
            .max()
            .map_or(0, |l| l + s_new.max(q.dims()[2]));
        RotaryConfig::from_shapes(
            &r.cos.dims(),
            &r.sin.dims(),
            r.interleaved,
            geometry.dim_qk,
            positions,
        )
        .unwrap_or_else(|e| panic!("{OP}: {e}"));
    }
    (lengths, table, problem)
}

/// Host copy of an Int tensor.
pub(crate) fn host_ints<const D: usize>(t: Tensor<D, Int>) -> Vec<i64> {
    let data: TensorData = t.into_data();
    data.convert::<i64>()
        .try_to_vec::<i64>()
        .expect("integer data")
}

/// A paged KV cache shared by sequences that join and leave a batch (continuous batching):
/// a pool of pages of `page_size` positions, handed to a sequence as it grows and taken back
/// when it leaves. The host keeps each sequence's pages and length, so a step needs no read
/// back to know them.
///
/// ```no_run
/// # use burn::tensor::{Device, Tensor};
/// # use burn_flash_attention::{FlashAttentionOptions, PagedKvCache};
/// # let device = Device::default();
/// let mut cache = PagedKvCache::new(1024, 16, 8, [128, 128], 64, &device);
/// let a = cache.add_sequence();
/// let b = cache.add_sequence();
/// // One decode step of both: q [2, 32, 1, 128], new k/v [2, 8, 1, 128].
/// # let (q, k, v) = (Tensor::<4>::zeros([2, 32, 1, 128], &device), Tensor::<4>::zeros([2, 8, 1, 128], &device), Tensor::<4>::zeros([2, 8, 1, 128], &device));
/// let out = cache.step(&[a, b], q, k, v, None, FlashAttentionOptions::default().with_causal(true));
/// cache.remove_sequence(a);
/// ```
#[derive(Debug)]
pub struct PagedKvCache {
    k: Option<Tensor<4>>,
    v: Option<Tensor<4>>,
    page_size: usize,
    max_pages: usize,
    free: Vec<usize>,
    sequences: Vec<Option<Sequence>>,
}

#[derive(Clone, Debug, Default)]
struct Sequence {
    pages: Vec<usize>,
    len: usize,
}

impl PagedKvCache {
    /// `pages` pages of `page_size` positions for `heads_kv` heads of `dims = [d_qk, d_v]`,
    /// in the default float dtype; a sequence may hold up to `max_pages` pages.
    pub fn new(
        pages: usize,
        page_size: usize,
        heads_kv: usize,
        dims: [usize; 2],
        max_pages: usize,
        device: &Device,
    ) -> Self {
        assert!(
            page_size > 0,
            "PagedKvCache: `page_size` must be at least 1"
        );
        let [d_qk, d_v] = dims;
        Self {
            k: Some(Tensor::zeros([pages, page_size, heads_kv, d_qk], device)),
            v: Some(Tensor::zeros([pages, page_size, heads_kv, d_v], device)),
            page_size,
            max_pages,
            free: (0..pages).rev().collect(),
            sequences: Vec::new(),
        }
    }

    /// A new empty sequence; returns its id.
    pub fn add_sequence(&mut self) -> usize {
        match self.sequences.iter().position(Option::is_none) {
            Some(id) => {
                self.sequences[id] = Some(Sequence::default());
                id
            }
            None => {
                self.sequences.push(Some(Sequence::default()));
                self.sequences.len() - 1
            }
        }
    }

    /// Ends sequence `id`: its pages return to the pool.
    pub fn remove_sequence(&mut self, id: usize) {
        let sequence = self.sequences.get_mut(id).and_then(Option::take);
        let sequence = sequence.unwrap_or_else(|| panic!("PagedKvCache: no sequence {id}"));
        self.free.extend(sequence.pages);
    }

    /// Positions sequence `id` holds.
    pub fn len(&self, id: usize) -> usize {
        self.sequence(id).len
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Checks a step's tensors against the pages before any page is handed out or the pages
    /// leave the pool for the op (a panic past that point would lose them).
    fn check_step(
        &self,
        n: usize,
        q: &Tensor<4>,
        k_new: &Tensor<4>,
        v_new: &Tensor<4>,
        options: &FlashAttentionOptions,
    ) {
        const OP: &str = "PagedKvCache::step";
        let pages = self
            .k
            .as_ref()
            .expect("the pages are present between steps");
        let values = self
            .v
            .as_ref()
            .expect("the pages are present between steps");
        for (arg, t) in [("q", q), ("k_new", k_new), ("v_new", v_new)] {
            assert!(
                t.dtype() == pages.dtype() && t.device() == pages.device(),
                "{OP}: `{arg}` has dtype {:?} on device {:?}, expected {:?} on {:?} (the pages')",
                t.dtype(),
                t.device(),
                pages.dtype(),
                pages.device()
            );
        }
        let dtype = kernel_dtype(q.dtype()).unwrap_or_else(|| {
            panic!(
                "{OP}: `q` has dtype {:?}, expected F32, F16 or BF16",
                q.dtype()
            )
        });
        CacheGeometry::from_shapes(&pages.dims(), &values.dims(), Some(&[n, self.max_pages]), n)
            .and_then(|g| {
                g.problem(&q.dims(), dtype, options.kernel_options())?;
                g.check_new(&k_new.dims(), &v_new.dims())
            })
            .unwrap_or_else(|e| panic!("{OP}: {e}"));
    }

    fn sequence(&self, id: usize) -> &Sequence {
        self.sequences
            .get(id)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("PagedKvCache: no sequence {id}"))
    }

    /// One step of the sequences `ids` (in the batch order of `q`): `k_new`/`v_new` `[n,
    /// heads_kv, s_new, d]` are appended to each (pages taken from the pool as needed, keys
    /// turned by `rotary` to their positions), then `q` `[n, heads_q, s_q, d_qk]` attends to
    /// each sequence's positions ([`flash_attention_with_kvcache`]). Returns `O` `[n,
    /// heads_q, s_q, d_v]`.
    ///
    /// # Panics
    /// When the pool or a sequence's `max_pages` runs out, on an unknown or repeated id, and
    /// on tensors whose shapes, dtypes or devices do not fit the pages; nothing changes then,
    /// and the cache serves the next step.
    pub fn step(
        &mut self,
        ids: &[usize],
        q: Tensor<4>,
        k_new: Tensor<4>,
        v_new: Tensor<4>,
        rotary: Option<&RotaryEmbedding>,
        options: FlashAttentionOptions,
    ) -> Tensor<4> {
        self.check_step(ids.len(), &q, &k_new, &v_new, &options);
        let s_new = k_new.dims()[2];
        let mut seen = std::collections::HashSet::new();
        let mut needed = 0;
        for &id in ids {
            assert!(
                seen.insert(id),
                "PagedKvCache: sequence {id} appears twice in one step"
            );
            let sequence = self.sequence(id);
            let pages = (sequence.len + s_new).div_ceil(self.page_size);
            assert!(
                pages <= self.max_pages,
                "PagedKvCache: sequence {id} would hold {} positions, past its {} pages of {}",
                sequence.len + s_new,
                self.max_pages,
                self.page_size
            );
            needed += pages.saturating_sub(sequence.pages.len());
        }
        assert!(
            needed <= self.free.len(),
            "PagedKvCache: the step needs {needed} more pages, {} are free",
            self.free.len()
        );
        let mut table = vec![0i64; ids.len() * self.max_pages];
        let mut lengths = Vec::with_capacity(ids.len());
        for (row, &id) in ids.iter().enumerate() {
            let page_size = self.page_size;
            let sequence = self.sequences[id].as_mut().expect("checked above");
            while sequence.pages.len() * page_size < sequence.len + s_new {
                sequence.pages.push(self.free.pop().expect("checked above"));
            }
            for (p, &page) in sequence.pages.iter().enumerate() {
                table[row * self.max_pages + p] = page as i64;
            }
            lengths.push(sequence.len as i64);
        }
        let device = q.device();
        let cache = KvCache {
            k: self.k.take().expect("the pages are present between steps"),
            v: self.v.take().expect("the pages are present between steps"),
            block_table: Some(Tensor::from_data(
                TensorData::new(table, [ids.len(), self.max_pages]),
                &device,
            )),
        };
        let seqlens = Tensor::from_data(TensorData::new(lengths, [ids.len()]), &device);
        let (out, cache) = flash_attention_with_kvcache(
            q,
            cache,
            seqlens,
            Some((k_new, v_new)),
            rotary.cloned(),
            options,
        );
        self.k = Some(cache.k);
        self.v = Some(cache.v);
        for &id in ids {
            self.sequences[id].as_mut().expect("checked above").len += s_new;
        }
        out
    }
}
