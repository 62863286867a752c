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
// The offline (ahead-of-time) compile checks are the longest test: named to start first
// (libtest starts tests in name order), so that it overlaps the others instead of ending
// the run alone.
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[path = "sources.rs"]
mod ahead_of_time;
mod varlen;
