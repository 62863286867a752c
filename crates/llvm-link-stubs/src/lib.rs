//! Link-time stand-ins for the LLVM C API and `cubecl_*` symbols that only cubecl's LLVM
//! code path (cubecl-llvm, llvm-sys) references.
//!
//! cubecl-cuda and cubecl-hip 0.11 always link cubecl-llvm, whose build script downloads an
//! LLVM bundle. Offline builds set `DOCS_RS=1` (in `.cargo/config.toml`), which skips the
//! download and leaves those symbols undefined. This crate's build script then compiles one
//! stub per symbol (listed in `symbols.txt`) that aborts with a clear message if it is ever
//! called; the project only uses the C++ compilers (NVRTC, hipRTC), which never call them.
//! Without `DOCS_RS` it compiles nothing, so a build with the real bundle has no duplicates.
