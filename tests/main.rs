//! One integration-test binary (each test binary links all of Burn and CubeCL).
//!
//! Kernel tests run on the device `FLASH_DEVICE` selects (default `wgpu-cpu`: lavapipe, the
//! CPU Vulkan driver). See `tests/common/mod.rs`.

mod bias;
mod common;
mod decode;
mod dropout;
mod examples;
mod fp8;
mod fuzz;
mod huge;
mod kernels;
mod misuse;
mod op;
mod oracle;
mod score_mod;
mod soak;
// The offline (ahead-of-time) compile checks, the longest test (tests run one at a time:
// `.cargo/config.toml`).
#[cfg(any(feature = "cuda", feature = "rocm"))]
#[path = "sources.rs"]
mod ahead_of_time;
mod varlen;
