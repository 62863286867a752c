//! What the example models share: the device named on the command line and the training
//! text the repository ships.

use burn::tensor::Device;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The text the examples train on.
pub const TEXT: &str = include_str!("../data/lighthouse.txt");
/// Byte-level vocabulary.
pub const VOCAB: usize = 256;

/// The device `name` selects: cuda, rocm, wgpu, wgpu-cpu (lavapipe) or flex.
pub fn device(name: &str) -> Device {
    match name {
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(0),
        #[cfg(feature = "rocm")]
        "rocm" => Device::rocm(0),
        #[cfg(feature = "wgpu")]
        "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => {
            if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
                // SAFETY: no other thread runs yet.
                unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
            }
            Device::wgpu(burn::tensor::DeviceKind::Cpu)
        }
        "flex" => Device::flex(),
        other => {
            panic!("--device {other}: not compiled in (features: cuda, rocm, wgpu) or unknown")
        }
    }
}

/// The float dtype `name` selects: bf16, f16 or f32 (for the examples with `--dtype`).
#[allow(dead_code)]
pub fn dtype(name: &str) -> burn::tensor::DType {
    use burn::tensor::DType;
    match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => panic!("--dtype {other}: expected bf16, f16 or f32"),
    }
}

/// `steps` batches of `batch` random windows of `seq` bytes of the text: inputs and
/// next-byte targets, row-major.
pub fn batches(steps: usize, batch: usize, seq: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    assert!(
        seq < TEXT.len(),
        "the sequence length must be shorter than the text"
    );
    let bytes = TEXT.as_bytes();
    let mut rng = StdRng::seed_from_u64(7);
    (0..steps)
        .map(|_| {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for _ in 0..batch {
                let start = rng.random_range(0..bytes.len() - seq - 1);
                x.extend(bytes[start..start + seq].iter().map(|&c| c as i64));
                y.extend(bytes[start + 1..start + seq + 1].iter().map(|&c| c as i64));
            }
            (x, y)
        })
        .collect()
}
