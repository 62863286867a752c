//! One integration-test binary (each test binary links all of Burn and CubeCL).
//!
//! Kernel tests run on the device `FLASH_DEVICE` selects (default `wgpu-cpu`: lavapipe, the
//! CPU Vulkan driver). See `tests/common/mod.rs`.

mod bias;
mod common;
mod decode;
mod dropout;
mod examples;
mod kernels;
mod op;
mod oracle;
mod score_mod;
// The offline compile checks are the longest tests: named to start early (libtest starts
// tests in name order), so that they overlap the others instead of ending the run alone.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[path = "sources.rs"]
mod compile_checks;
mod varlen;
