//! Implementations of [`FlashAttentionOps`](crate::ops::FlashAttentionOps) per backend.

mod autodiff;
#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
mod cube;
