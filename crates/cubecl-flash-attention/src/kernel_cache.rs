//! Compiled kernels kept on disk across processes: CubeCL's compilation cache, switched on.
//!
//! A kernel variant (head dim, dtype, options, tiles) is compiled the first time it is
//! launched: NVRTC or hipRTC turn its generated C++ into PTX or a code object, seconds per
//! variant. With the cache on, each compiled variant is written to a database under the
//! cache directory and a later process loads it instead of compiling it again (CUDA: the
//! PTX, which the driver still turns into machine code, cached by the driver itself under
//! `~/.nv/ComputeCache`). Entries are keyed by the kernel's expanded code, the device and
//! the binary's build, so a rebuilt program or another GPU never loads a stale kernel.
//! WebGPU caches SPIR-V only (not the WGSL this crate's CPU tests use).

use std::path::PathBuf;

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

use crate::error::FlashError;

/// Keeps compiled kernels under `dir` (created if missing) for every later process that
/// calls this with the same directory. Call it first thing in `main`, before any device is
/// used: CubeCL reads its configuration once (a `cubecl.toml` found from the working
/// directory is kept, with the cache switched on).
pub fn enable_kernel_cache(dir: impl Into<PathBuf>) -> Result<(), FlashError> {
    let dir = dir.into();
    std::fs::create_dir_all(&dir).map_err(|e| FlashError::Option {
        arg: "dir",
        expected: format!("a directory that can be created ({}: {e})", dir.display()),
    })?;
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = true;
    config.environment.path = CacheConfig::Directory(dir);
    if CubeClRuntimeConfig::try_set(config) {
        Ok(())
    } else {
        Err(FlashError::Unavailable(
            "CubeCL's configuration was already read or set (a device was used first): call \
             enable_kernel_cache before anything touches a device"
                .into(),
        ))
    }
}
