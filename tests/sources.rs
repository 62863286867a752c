//! Every shipped kernel variant generates for sm_80, sm_90, gfx90a and gfx942 without a
//! device, and (where the offline compilers are installed, see `tools/install_compilers.sh`)
//! compiles: NVRTC + ptxas for CUDA, hipcc/clang for HIP. `FLASH_REQUIRE_COMPILERS=1` (set in
//! CI) turns a missing compiler into a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_flash_attention::kernels::config::FRAGMENT;
use burn_flash_attention::kernels::sources::{Language, Target, generate, is_supported};
use burn_flash_attention::kernels::{DeviceLimits, FloatDtype};

fn out_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-sources")
}

/// Writes the sources of `target` into a fresh folder and returns it.
fn write_sources(target: Target) -> PathBuf {
    let dir = out_dir().join(target.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ext = match target.language() {
        Language::Cuda => "cu",
        Language::Hip => "hip",
    };
    let mut errors = Vec::new();
    let mut count = 0;
    for result in generate(target) {
        match result {
            Ok(k) => {
                std::fs::write(dir.join(format!("{}.{ext}", k.name)), &k.source).unwrap();
                count += 1;
            }
            Err(e) => errors.push(e),
        }
    }
    assert!(
        errors.is_empty(),
        "{} kernel variants failed to generate for {}:\n{}",
        errors.len(),
        target.name(),
        errors.join("\n")
    );
    eprintln!(
        "{}: {count} kernel sources in {}",
        target.name(),
        dir.display()
    );
    dir
}

fn require_compilers() -> bool {
    std::env::var_os("FLASH_REQUIRE_COMPILERS").is_some_and(|v| v != "0")
}

/// Runs `tools/compile_check.py` on one target's sources.
fn compile(target: Target, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/compile_check.py");
    let report = dir.with_extension("json");
    let mut cmd = Command::new("python3");
    cmd.arg(&script);
    match target.language() {
        Language::Cuda => cmd
            .arg("--cuda-dir")
            .arg(dir)
            .arg("--arch")
            .arg(target.name()),
        Language::Hip => cmd
            .arg("--hip-dir")
            .arg(dir)
            .arg("--offload-arch")
            .arg(target.name()),
    };
    cmd.arg("--json").arg(&report);
    let output = cmd.output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stdout}{stderr}");
    if output.status.code() == Some(3) {
        // The script's code for "no compiler for this target installed".
        assert!(
            !require_compilers(),
            "no offline compiler for {} (FLASH_REQUIRE_COMPILERS is set); run tools/install_compilers.sh",
            target.name()
        );
        eprintln!("{}: skipped, no offline compiler installed", target.name());
        return;
    }
    assert!(
        output.status.success(),
        "kernels failed to compile for {} (report: {})",
        target.name(),
        report.display()
    );
}

fn check_target(target: Target) {
    if !is_supported(target) {
        eprintln!("{}: this build lacks the runtime feature", target.name());
        return;
    }
    let dir = write_sources(target);
    compile(target, &dir);
}

/// Every target in one test, one after another (`tools/compile_check.py` compiles two
/// sources at once); a target that fails does not stop the others, and the failures are
/// listed together.
#[test]
fn kernels_compile_for_every_target() {
    let failed: Vec<&str> = Target::ALL
        .into_iter()
        .filter(|&target| std::panic::catch_unwind(|| check_target(target)).is_err())
        .map(|target| target.name())
        .collect();
    assert!(
        failed.is_empty(),
        "kernel sources failed for {failed:?} (messages above)"
    );
}

/// The tile heuristics on each target's properties: tensor cores where the runtime offers
/// fragments, planes of the target's width, and shared memory within its limit.
#[test]
fn tiles_fit_every_target() {
    for target in Target::ALL.into_iter().filter(|t| is_supported(*t)) {
        let props = target.properties();
        let limits = DeviceLimits::from_properties(&props);
        let plane = if target.language() == Language::Hip {
            64
        } else {
            32
        };
        assert_eq!(limits.plane_size, plane, "{target:?}");
        assert!(limits.plane_size % FRAGMENT == 0);
        for dtype in [FloatDtype::F16, FloatDtype::BF16] {
            assert!(limits.has_tensor_cores(dtype), "{target:?} {dtype:?}");
        }
        assert!(!limits.has_tensor_cores(FloatDtype::F32));
    }
}
