//! Runs flash attention on the best device available (CUDA, then ROCm, then a Vulkan/Metal
//! GPU through wgpu, then the CPU through lavapipe; Burn's Flex backend where none exists),
//! checks it against the f64 reference and prints the error and the throughput.
//!
//!     cargo run --release --example quickstart [-- --features cuda]

use std::time::Instant;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use burn_flash_attention::kernels::MaskSpec;
use burn_flash_attention::kernels::reference::{self, Dims, ReferenceOptions};
use burn_flash_attention::{FlashAttentionOptions, flash_attention, supports_flash_attention};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Whether a device can be opened (allocating one value on it).
fn usable(device: &Device) -> bool {
    std::panic::catch_unwind(|| {
        let t = Tensor::<1>::zeros([1], device);
        t.into_data();
    })
    .is_ok()
}

fn best_device() -> (Device, &'static str) {
    // Quiet the panic messages of devices that are absent.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut candidates: Vec<(Device, &'static str)> = Vec::new();
    #[cfg(feature = "cuda")]
    candidates.push((Device::cuda(0), "CUDA"));
    #[cfg(feature = "rocm")]
    candidates.push((Device::rocm(0), "ROCm"));
    #[cfg(feature = "wgpu")]
    {
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            // SAFETY: no other thread runs yet.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
        }
        candidates.push((
            Device::wgpu(burn::tensor::DeviceKind::DiscreteGpu(0)),
            "wgpu discrete GPU",
        ));
        candidates.push((
            Device::wgpu(burn::tensor::DeviceKind::IntegratedGpu(0)),
            "wgpu integrated GPU",
        ));
        candidates.push((
            Device::wgpu(burn::tensor::DeviceKind::Cpu),
            "wgpu CPU adapter (lavapipe)",
        ));
    }
    let found = candidates.into_iter().find(|(d, _)| usable(d));
    std::panic::set_hook(hook);
    found.unwrap_or_else(|| {
        println!(
            "No CUDA, ROCm or Vulkan device found: running Burn's Flex CPU backend (the composed \
             fallback, not the kernels). For the kernels on this CPU: `apt-get install mesa-vulkan-drivers`; \
             on an NVIDIA GPU: `cargo run --release --features cuda --example quickstart`."
        );
        (Device::flex(), "Flex (fallback)")
    })
}

fn tensor(data: &[f64], shape: [usize; 4], device: &Device, dtype: FloatDType) -> Tensor<4> {
    let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::<4>::from_data(TensorData::new(data, shape), device).cast(dtype)
}

fn main() {
    let (device, name) = best_device();
    let gpu = matches!(
        name,
        "CUDA" | "ROCm" | "wgpu discrete GPU" | "wgpu integrated GPU"
    );
    let dtype = if gpu && device.supports_dtype(FloatDType::BF16) {
        FloatDType::BF16
    } else {
        FloatDType::F32
    };
    println!(
        "device: {name} ({device:?}), dtype {dtype:?}, fused kernels: {}",
        supports_flash_attention(&device)
    );

    // Correctness: causal GQA attention against the f64 reference.
    let dims = Dims {
        batch: 2,
        heads_q: 8,
        heads_kv: 2,
        seq_q: 300,
        seq_kv: 300,
        dim_qk: 64,
        dim_v: 64,
    };
    let mut rng = StdRng::seed_from_u64(0);
    let mut randn = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                let x: f64 = rng.random_range(-1.0..1.0);
                // round to the dtype the device computes in
                if dtype == FloatDType::BF16 {
                    half::bf16::from_f64(x).to_f64()
                } else {
                    x as f32 as f64
                }
            })
            .collect()
    };
    let (q, k, v) = (
        randn(dims.q_len()),
        randn(dims.k_len()),
        randn(dims.v_len()),
    );
    let options = FlashAttentionOptions::default().with_causal(true);
    let out = flash_attention(
        tensor(&q, [2, 8, 300, 64], &device, dtype),
        tensor(&k, [2, 2, 300, 64], &device, dtype),
        tensor(&v, [2, 2, 300, 64], &device, dtype),
        options,
    );
    let got = out
        .cast(FloatDType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let want = reference::forward(
        &dims,
        &ReferenceOptions {
            mask: MaskSpec::causal(),
            ..Default::default()
        },
        &q,
        &k,
        &v,
    );
    let err = got
        .iter()
        .zip(&want.out)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0.0, f64::max);
    println!("causal GQA 8/2, s=300, d=64: max |error| vs f64 reference = {err:.2e}");

    // Throughput of the forward pass.
    let (b, h, s, d) = if gpu {
        (4, 16, 2048, 128)
    } else {
        (1, 4, 512, 64)
    };
    let make = || {
        Tensor::<4>::random(
            [b, h, s, d],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        )
        .cast(dtype)
    };
    let (q, k, v) = (make(), make(), make());
    let run = || {
        flash_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            FlashAttentionOptions::default(),
        )
    };
    run();
    device.sync().unwrap();
    let mut times = Vec::new();
    for _ in 0..if gpu { 20 } else { 3 } {
        let t = Instant::now();
        run();
        device.sync().unwrap();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let flops = 4.0 * (b * h * s * s * d) as f64;
    println!(
        "forward b={b} h={h} s={s} d={d}: {:.3} ms, {:.2} TFLOP/s",
        median * 1e3,
        flops / median / 1e12
    );
}
