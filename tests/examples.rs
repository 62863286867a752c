//! The examples that check themselves, run as built by `cargo test` (which builds the
//! examples next to this binary) on the device `FLASH_DEVICE` selects.

use std::path::PathBuf;
use std::process::Command;

use crate::common;

/// The built example `name`, next to this test binary (`target/<profile>/examples`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is not built: run the tests with `cargo test` (which builds the examples)",
        path.display()
    );
    path
}

#[test]
fn generate_matches_recomputation_in_its_tiny_configuration() {
    // Trains a tiny LLaMA-style model, generates for four prompts of different lengths two
    // at a time through the paged cache (sequences joining and leaving, rotary inside the
    // op), writes and reloads its checkpoint, and checks every greedy token against the
    // whole sequence recomputed without a cache; it exits non-zero otherwise.
    let checkpoint = std::env::temp_dir().join(format!("generate-{}.bpk", std::process::id()));
    for run in ["trains and writes the checkpoint", "loads the checkpoint"] {
        let out = Command::new(example("generate"))
            .args(["--device", &common::device_name(), "--tiny", "--checkpoint"])
            .arg(&checkpoint)
            .output()
            .expect("running the example");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "generate ({run}) failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("greedy tokens equal to recomputing"),
            "generate ({run}): {stdout}"
        );
    }
    let _ = std::fs::remove_file(checkpoint);
}

/// `cold_start` warms up a tiny model's calls with the kernel cache switched on: the cache
/// directory holds CubeCL's environment afterwards, and a second process starts from it.
#[cfg(feature = "kernel-cache")]
#[test]
fn cold_start_keeps_its_environment_in_the_cache_directory() {
    let dir = std::env::temp_dir().join(format!("flash-kernels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for run in ["first process", "second process"] {
        let out = Command::new(example("cold_start"))
            .args([
                "--device",
                &common::device_name(),
                "--tiny",
                "--dtype",
                "f32",
            ])
            .arg("--cache-dir")
            .arg(&dir)
            .output()
            .expect("running the example");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "cold_start ({run}) failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("\"kernel_cache\":true"), "{run}: {stdout}");
        let entries = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
        assert!(
            entries > 0,
            "{run}: nothing was written under {}",
            dir.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn score_mod_learns_a_relative_position_bias() {
    // Trains a relative-position bias written as a `#[cube]` score function (the only way
    // the model can tell positions apart) to look three tokens back; the example exits
    // non-zero unless the loss fell and the bias peaks at that distance.
    let out = Command::new(example("score_mod"))
        .args(["--device", &common::device_name()])
        .output()
        .expect("running the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "score_mod failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("learned to look 3 tokens back"), "{stdout}");
}
