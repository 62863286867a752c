//! FlashAttention for Burn: a fused attention op with a fused autodiff backward, written once
//! in CubeCL and run on CUDA, ROCm and wgpu devices.
//!
//! ```no_run
//! use burn::tensor::{Device, Distribution, Tensor};
//! use burn_flash_attention::{FlashAttentionOptions, flash_attention};
//!
//! let device = Device::default().autodiff();
//! let q = Tensor::<4>::random([2, 8, 1024, 64], Distribution::Normal(0.0, 1.0), &device).require_grad();
//! let k = Tensor::<4>::random([2, 2, 1024, 64], Distribution::Normal(0.0, 1.0), &device); // GQA 8/2
//! let v = Tensor::<4>::random([2, 2, 1024, 64], Distribution::Normal(0.0, 1.0), &device);
//! let out = flash_attention(q.clone(), k, v, FlashAttentionOptions::default().with_causal(true));
//! let grads = out.sum().backward();
//! let dq = q.grad(&grads).unwrap();
//! ```
//!
//! - [`flash_attention`] / [`flash_attention_with_lse`]: the op;
//! - [`flash_attention_with_kvcache`]: serving, new queries against a contiguous or paged
//!   [`KvCache`] (new keys and values appended in place); with ALiBi through
//!   [`flash_attention_with_kvcache_biased`];
//! - [`flash_attention_varlen`]: packed batches of variable-length sequences (no padding),
//!   forward and backward, delimited by [`PackedSequences`];
//! - [`warm_up`]: compiles the kernels a model will launch before the first request; with
//!   the `kernel-cache` feature, `enable_kernel_cache` keeps them on disk for later
//!   processes;
//! - [`flash_attention_fp8`]: attention on FP8 (E4M3) inputs held as Burn quantized tensors
//!   ([`quantize_fp8`]), and [`flash_attention_fp8_trained`] to train with it;
//! - [`FlashAttentionOptions`]: scale, causal, sliding window, softcap, dropout on the
//!   probabilities ([`Dropout`], streams from [`next_dropout`]);
//! - [`FlashMultiHeadAttention`]: a drop-in multi-head attention module;
//! - [`ops::FlashAttentionOps`]: the backend extension, for backend authors;
//! - [`kernels`]: the CubeCL kernels themselves (`cubecl-flash-attention`).

mod attention;
mod backends;
mod bias;
mod dropout;
mod fallback;
mod fp8;
pub mod module;
pub mod ops;
mod options;
mod serving;
mod varlen;
mod warm_up;

pub use attention::{flash_attention, flash_attention_with_lse, supports_flash_attention};
pub use bias::{AttentionBias, BlockMask, flash_attention_biased, flash_attention_biased_with_lse};
pub use dropout::{Dropout, next_dropout, seed_dropout};
pub use fp8::{
    Fp8Scaling, flash_attention_fp8, flash_attention_fp8_trained, fp8_scheme, quantize_fp8,
};
pub use module::{FlashMultiHeadAttention, FlashMultiHeadAttentionConfig};
pub use options::{
    BiasedOptions, DecodeOptions, FlashAttentionOptions, PackedLengths, VarlenOptions,
};
pub use serving::{
    KvCache, PagedKvCache, RotaryEmbedding, flash_attention_with_kvcache,
    flash_attention_with_kvcache_and_lse, flash_attention_with_kvcache_biased,
};

pub use varlen::{
    PackedSequences, flash_attention_varlen, flash_attention_varlen_biased,
    flash_attention_varlen_biased_with_lse, flash_attention_varlen_with_lse,
};
#[cfg(feature = "kernel-cache")]
pub use warm_up::enable_kernel_cache;
pub use warm_up::{WarmUp, warm_up};

/// The kernel crate, re-exported.
pub use cubecl_flash_attention as kernels;
