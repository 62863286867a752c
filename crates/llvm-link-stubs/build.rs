//! Compiles abort-stubs for the LLVM symbols of cubecl's LLVM code path, but only when that
//! path's LLVM bundle was not built (`DOCS_RS` set, see docs/offline-build.md). With the real
//! bundle nothing is compiled, so no symbol is defined twice.

use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    println!("cargo:rerun-if-changed=symbols.txt");
    if env::var_os("DOCS_RS").is_none() {
        return;
    }
    let symbols = fs::read_to_string("symbols.txt").expect("symbols.txt beside build.rs");
    let mut source = String::from(
        "#include <stdio.h>\n#include <stdlib.h>\n\
         static void unavailable(const char *symbol) {\n\
         \tfprintf(stderr, \"cubecl's LLVM code path is not linked in this build (called %s); \
         use the CUDA C++ / HIP C++ compilers (cubecl features cuda-cpp, hip-cpp)\\n\", symbol);\n\
         \tabort();\n}\n",
    );
    for symbol in symbols
        .lines()
        .map(str::trim)
        .filter(|s| !s.is_empty() && !s.starts_with('#'))
    {
        source.push_str(&format!(
            "void {symbol}(void) {{ unavailable(\"{symbol}\"); }}\n"
        ));
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let c_file = out.join("llvm_stubs.c");
    fs::write(&c_file, source).unwrap();
    // Linked whole: the referencing crates (llvm-sys, cubecl-llvm) may come after this one on
    // the link line, where a plain static library would no longer be searched.
    cc::Build::new()
        .file(&c_file)
        .warnings(false)
        .link_lib_modifier("+whole-archive")
        .compile("llvm_link_stubs");
}
