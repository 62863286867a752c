//! FlashAttention forward and backward kernels, written once in CubeCL and compiled for
//! CUDA, ROCm HIP and WebGPU/Vulkan.
//!
//! - [`forward::forward`]: `O` and the LSE of `softmax(Q·Kᵀ·scale)·V`;
//! - [`backward::backward`]: `dQ`, `dK`, `dV` from `dO`, recomputing the scores;
//! - [`forward::forward_packed`], [`backward::backward_packed`]: the same for a packed batch
//!   of variable-length sequences ([`sequence`]);
//! - [`decode::decode`]: serving, new queries against a contiguous or paged KV cache
//!   (appended in place), the key range split over cubes;
//! - [`forward::forward_biased`], [`backward::backward_biased`]: with terms added to the
//!   scores ([`bias`]: a bias tensor, −∞ as a mask, ALiBi) and the bias's gradient;
//! - dropout on the probabilities in every training kernel ([`dropout`]), regenerated in the
//!   backward from a seed and an offset;
//! - [`reference`]: the f64 CPU oracle every kernel is tested against.
//!
//! Options: softmax scale, causal and sliding-window masks (bottom-right aligned), softcap,
//! GQA/MQA, `d_v ≠ d_qk`, any sequence lengths, arbitrary strides, f16/bf16/f32.

pub mod backward;
pub mod bias;
pub mod block_mask;
pub mod config;
pub mod decode;
pub mod dropout;
pub mod error;
pub mod forward;
#[cfg(feature = "kernel-cache")]
pub mod kernel_cache;
pub mod launch;
pub mod loop_budget;
pub mod mask;
pub mod mma;
pub mod mma_sync;
pub mod problem;
pub mod reference;
pub mod rotary;
pub mod score;
pub mod score_mod;
pub mod sequence;
pub mod softmax;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod sources;
pub mod stages;
pub mod tile;
pub mod wgmma;

pub use bias::{ScoreBias, ScoreTerms, TermsGrad};
pub use block_mask::{BlockMask, BlockShape, BlockState};
pub use config::{DeviceLimits, KernelPath, TileConfig};
pub use dropout::Dropout;
pub use error::FlashError;
pub use launch::DeviceTensor;
pub use mask::MaskSpec;
pub use problem::{AttentionOptions, AttentionProblem, FloatDtype};
pub use sequence::PackedSequences;

// The LLVM symbols of cubecl's unused LLVM code path (see docs/offline-build.md).
#[cfg(any(feature = "cuda", feature = "rocm"))]
use llvm_link_stubs as _;

/// Runtimes compiled into this build.
pub mod runtimes {
    #[cfg(feature = "cuda")]
    pub use cubecl::cuda;
    #[cfg(feature = "rocm")]
    pub use cubecl::hip;
    #[cfg(feature = "wgpu")]
    pub use cubecl::wgpu;
}
