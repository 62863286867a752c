//! Serving: attention of new queries against a key/value cache, contiguous or paged, with the
//! new keys and values appended in place.

use burn::backend::Dispatch;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cubecl_flash_attention::decode::CacheGeometry;

use crate::attention::{kernel_dtype, supports_flash_attention};
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

/// Attention of `q` `[batch, heads_q, s_q, d_qk]` against each sequence's first
/// `cache_seqlens[b]` cached positions plus the new ones, FlashAttention's
/// `flash_attn_with_kvcache`:
///
/// - `new` (`k` `[batch, heads_kv, s_new, d_qk]`, `v` `[batch, heads_kv, s_new, d_v]`) is
///   first written at positions `cache_seqlens[b] ..` of each sequence and attended to;
///   the returned cache holds it (written in place where the cache's buffers are not shared
///   with another tensor, as Burn's in-place ops);
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
    options: FlashAttentionOptions,
) -> (Tensor<4>, KvCache) {
    let (out, _, cache) =
        flash_attention_with_kvcache_and_lse(q, cache, cache_seqlens, new, options);
    (out, cache)
}

/// [`flash_attention_with_kvcache`], also returning the LSE `[batch, heads_q, s_q]` (f32).
pub fn flash_attention_with_kvcache_and_lse(
    q: Tensor<4>,
    cache: KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>, KvCache) {
    let lengths = validate(&q, &cache, cache_seqlens.clone(), new.as_ref(), &options);
    let device = q.device();
    if !supports_flash_attention(&device) {
        return fallback::decode(q, cache, &lengths, new, &options);
    }
    let paged = cache.block_table.is_some();
    let batch = q.dims()[0];
    let block_table = cache
        .block_table
        .unwrap_or_else(|| Tensor::zeros([1, 1], &device));
    let append = new.is_some();
    let (k_new, v_new) = new.unwrap_or_else(|| {
        let placeholder = Tensor::<4>::zeros([batch.max(1), 1, 1, 1], &device).cast(q.dtype());
        (placeholder.clone(), placeholder)
    });
    let (o, lse, k, v) = <Dispatch as FlashAttentionOps>::flash_attention_decode(
        q.into_dispatch(),
        cache.k.into_dispatch(),
        cache.v.into_dispatch(),
        cache_seqlens.into_dispatch(),
        block_table.clone().into_dispatch(),
        k_new.into_dispatch(),
        v_new.into_dispatch(),
        DecodeOptions {
            attention: options,
            paged,
            append,
            lengths,
        },
    );
    (
        Tensor::from_dispatch(o),
        Tensor::from_dispatch(lse),
        KvCache {
            k: Tensor::from_dispatch(k),
            v: Tensor::from_dispatch(v),
            block_table: paged.then_some(block_table),
        },
    )
}

/// Checks shapes, dtypes and devices, then the lengths and the pages they use (read to
/// the host: a lazy backend would otherwise report them only when the op runs); panics with
/// a message naming the argument. Returns the lengths.
fn validate(
    q: &Tensor<4>,
    cache: &KvCache,
    cache_seqlens: Tensor<1, Int>,
    new: Option<&(Tensor<4>, Tensor<4>)>,
    options: &FlashAttentionOptions,
) -> Vec<usize> {
    const OP: &str = "flash_attention_with_kvcache";
    let dtype = q.dtype();
    let Some(kernel_dtype) = kernel_dtype(dtype) else {
        panic!("{OP}: `q` has dtype {dtype:?}, expected F32, F16 or BF16");
    };
    let mut floats = vec![("k_cache", &cache.k), ("v_cache", &cache.v)];
    if let Some((k, v)) = new {
        floats.extend([("k", k), ("v", v)]);
    }
    for (arg, t) in floats {
        assert_eq!(
            t.dtype(),
            dtype,
            "{OP}: `{arg}` has dtype {:?}, expected {dtype:?} (the dtype of `q`)",
            t.dtype()
        );
        assert!(
            t.device() == q.device(),
            "{OP}: `{arg}` is on device {:?}, expected {:?} (the device of `q`)",
            t.device(),
            q.device()
        );
    }
    let (k, v, table) = cache.shapes();
    let (geometry, s_new) = CacheGeometry::from_shapes(&k, &v, table.as_deref(), q.dims()[0])
        .and_then(|g| {
            g.problem(&q.dims(), kernel_dtype, options.kernel_options())?;
            let s_new = match new {
                Some((k, v)) => g.check_new(&k.dims(), &v.dims())?,
                None => 0,
            };
            Ok((g, s_new))
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
    geometry
        .check_lengths(&lengths, s_new, table.as_deref())
        .unwrap_or_else(|e| panic!("{OP}: {e}"))
}

/// Host copy of an Int tensor.
pub(crate) fn host_ints<const D: usize>(t: Tensor<D, Int>) -> Vec<i64> {
    let data: TensorData = t.into_data();
    data.convert::<i64>()
        .try_to_vec::<i64>()
        .expect("integer data")
}
