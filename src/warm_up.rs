//! Cold start: compiling, before the first request, the kernels a model will launch, and
//! (with the `kernel-cache` feature) keeping them on disk for the next process.
//!
//! Kernels are compiled the first time each variant launches (head dims, dtype, options,
//! tiles, split or not): seconds per variant on CUDA and ROCm. [`warm_up`] runs every call
//! a model will make once, on zeros of its shapes, so that the compilation happens at
//! start-up; [`enable_kernel_cache`] makes a later process load them from disk.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::options::FlashAttentionOptions;
use crate::serving::{KvCache, RotaryEmbedding, flash_attention_with_kvcache};
use crate::varlen::{PackedSequences, flash_attention_varlen};

#[cfg(feature = "kernel-cache")]
pub use cubecl_flash_attention::kernel_cache::enable_kernel_cache;

/// One kind of call a model makes, for [`warm_up`]. The kernels depend on the head counts
/// and dims, the dtype, the options and the lengths: give the shapes the model runs.
#[derive(Clone, Debug)]
pub enum WarmUp {
    /// [`flash_attention`](crate::flash_attention) on `q`, `k`, `v` of these shapes, and its
    /// fused backward with `backward`.
    Attention {
        q: [usize; 4],
        k: [usize; 4],
        v: [usize; 4],
        options: FlashAttentionOptions,
        backward: bool,
    },
    /// [`flash_attention_varlen`] on sequences of these lengths (queries, keys), `heads`
    /// `[q, kv]` and head `dims` `[qk, v]`, and its fused backward with `backward`.
    Varlen {
        lengths_q: Vec<usize>,
        lengths_k: Vec<usize>,
        heads: [usize; 2],
        dims: [usize; 2],
        options: FlashAttentionOptions,
        backward: bool,
    },
    /// [`flash_attention_with_kvcache`] for `batch` sequences of `new_tokens` new queries
    /// (appended as new keys with `append`) over caches of `capacity` positions, paged in
    /// pages of `page_size` or contiguous, with `heads` `[q, kv]` and head `dims` `[qk, v]`;
    /// `rotary` `(rotary_dim, interleaved)` turns the new queries and keys. Both a short and
    /// a full cache run (the key range is split over cubes, or not, by length).
    Decode {
        batch: usize,
        new_tokens: usize,
        capacity: usize,
        page_size: Option<usize>,
        heads: [usize; 2],
        dims: [usize; 2],
        append: bool,
        rotary: Option<(usize, bool)>,
        options: FlashAttentionOptions,
    },
}

/// Runs each of `calls` once on zeros of its shapes in `dtype` on `device`, so that every
/// kernel variant they launch is compiled (or, with [`enable_kernel_cache`], loaded) now,
/// and waits for the device.
///
/// # Panics
/// As the calls themselves would, on shapes or options they refuse.
pub fn warm_up(device: &Device, dtype: DType, calls: &[WarmUp]) {
    let zeros = |shape: [usize; 4], device: &Device| Tensor::<4>::zeros(shape, device).cast(dtype);
    for call in calls {
        match call {
            WarmUp::Attention {
                q,
                k,
                v,
                options,
                backward,
            } => {
                if *backward {
                    let device = device.clone().autodiff();
                    let q = zeros(*q, &device).require_grad();
                    let (k, v) = (zeros(*k, &device), zeros(*v, &device));
                    let out = crate::flash_attention(q.clone(), k, v, *options);
                    let grads = out.backward();
                    drop(q.grad(&grads));
                } else {
                    let (q, k, v) = (zeros(*q, device), zeros(*k, device), zeros(*v, device));
                    drop(crate::flash_attention(q, k, v, *options));
                }
            }
            WarmUp::Varlen {
                lengths_q,
                lengths_k,
                heads: [heads_q, heads_kv],
                dims: [dim_qk, dim_v],
                options,
                backward,
            } => {
                let device = match backward {
                    true => device.clone().autodiff(),
                    false => device.clone(),
                };
                let sequences_q = PackedSequences::from_lengths(lengths_q, &device);
                let sequences_k = PackedSequences::from_lengths(lengths_k, &device);
                let packed = |total: usize, heads: usize, dim: usize| {
                    Tensor::<3>::zeros([total, heads, dim], &device).cast(dtype)
                };
                let q = packed(sequences_q.total(), *heads_q, *dim_qk);
                let q = if *backward { q.require_grad() } else { q };
                let k = packed(sequences_k.total(), *heads_kv, *dim_qk);
                let v = packed(sequences_k.total(), *heads_kv, *dim_v);
                let out =
                    flash_attention_varlen(q.clone(), k, v, &sequences_q, &sequences_k, *options);
                if *backward {
                    let grads = out.backward();
                    drop(q.grad(&grads));
                }
            }
            WarmUp::Decode {
                batch,
                new_tokens,
                capacity,
                page_size,
                heads: [heads_q, heads_kv],
                dims: [dim_qk, dim_v],
                append,
                rotary,
                options,
            } => {
                let batch = *batch;
                let cache = match page_size {
                    None => KvCache {
                        k: zeros([batch, *heads_kv, *capacity, *dim_qk], device),
                        v: zeros([batch, *heads_kv, *capacity, *dim_v], device),
                        block_table: None,
                    },
                    Some(page_size) => {
                        let per_sequence = capacity.div_ceil(*page_size);
                        let pages = batch * per_sequence;
                        let ids: Vec<i64> = (0..pages as i64).collect();
                        KvCache {
                            k: zeros([pages, *page_size, *heads_kv, *dim_qk], device),
                            v: zeros([pages, *page_size, *heads_kv, *dim_v], device),
                            block_table: Some(Tensor::<2, Int>::from_data(
                                TensorData::new(ids, [batch, per_sequence]),
                                device,
                            )),
                        }
                    }
                };
                let rotary = rotary.map(|(rotary_dim, interleaved)| {
                    RotaryEmbedding::new(
                        capacity + new_tokens,
                        rotary_dim,
                        10_000.0,
                        interleaved,
                        dtype,
                        device,
                    )
                });
                // A short cache and a full one: the key range is split, or not, by length.
                let appended = if *append { *new_tokens } else { 0 };
                for length in [0, capacity.saturating_sub(appended)] {
                    let q = zeros([batch, *heads_q, *new_tokens, *dim_qk], device);
                    let new = append.then(|| {
                        (
                            zeros([batch, *heads_kv, *new_tokens, *dim_qk], device),
                            zeros([batch, *heads_kv, *new_tokens, *dim_v], device),
                        )
                    });
                    let lengths = vec![length as i64; batch];
                    let seqlens =
                        Tensor::<1, Int>::from_data(TensorData::new(lengths, [batch]), device);
                    let (out, _) = flash_attention_with_kvcache(
                        q,
                        cache.clone(),
                        seqlens,
                        new,
                        rotary.clone(),
                        *options,
                    );
                    drop(out);
                }
            }
        }
    }
    device
        .sync()
        .unwrap_or_else(|e| panic!("warm_up: the device failed: {e:?}"));
}
