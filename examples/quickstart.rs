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

/// Whether the CubeCL runtime can open `device` (asked of CubeCL directly: a failed Burn
/// allocation on one device would leave Burn's fusion server unusable for the next).
fn usable(device: cubecl::Device) -> Option<cubecl::client::Client> {
    let result = std::panic::catch_unwind(|| device.client());
    if let Err(e) = &result
        && std::env::var_os("QUICKSTART_VERBOSE").is_some()
    {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
        eprintln!("unusable: {}", msg.unwrap_or_default());
    }
    result.ok()
}

/// The device to run on, its name, and whether it is a GPU (has plane operations; CPU
/// Vulkan drivers such as lavapipe have none).
fn best_device() -> (Device, String, bool) {
    // Quiet the panic messages of devices that are absent.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut candidates: Vec<(cubecl::Device, Device, &'static str)> = Vec::new();
    #[cfg(feature = "cuda")]
    candidates.push((
        cubecl::Device::Cuda(cubecl::cuda::CudaDevice { index: 0 }),
        Device::cuda(0),
        "CUDA",
    ));
    #[cfg(feature = "rocm")]
    candidates.push((
        cubecl::Device::Hip(cubecl::hip::AmdDevice { index: 0 }),
        Device::rocm(0),
        "ROCm",
    ));
    #[cfg(feature = "wgpu")]
    {
        use cubecl::wgpu::{WgpuDevice, WgpuDeviceKind};
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            // SAFETY: no other thread runs yet.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
        }
        // wgpu's default device is the best GPU adapter; it never picks a CPU adapter.
        candidates.push((
            cubecl::Device::Wgpu(WgpuDevice::new(WgpuDeviceKind::DefaultDevice)),
            Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            "wgpu",
        ));
        candidates.push((
            cubecl::Device::Wgpu(WgpuDevice::new(WgpuDeviceKind::Cpu)),
            Device::wgpu(burn::tensor::DeviceKind::Cpu),
            "wgpu CPU adapter",
        ));
    }
    let found = candidates.into_iter().find_map(|(cube, device, runtime)| {
        let client = usable(cube)?;
        let props = client.properties();
        let gpu = props
            .features
            .plane
            .contains(cubecl::ir::features::Plane::Ops);
        Some((device, format!("{runtime}: {}", client.name()), gpu))
    });
    std::panic::set_hook(hook);
    found.unwrap_or_else(|| {
        println!(
            "No CUDA, ROCm or Vulkan device found: running Burn's Flex CPU backend (the composed \
             fallback, not the kernels). For the kernels on this CPU: `apt-get install mesa-vulkan-drivers`; \
             on an NVIDIA GPU: `cargo run --release --features cuda --example quickstart`."
        );
        (Device::flex(), "Flex (fallback)".to_string(), false)
    })
}

fn tensor(data: &[f64], shape: [usize; 4], device: &Device, dtype: FloatDType) -> Tensor<4> {
    let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::<4>::from_data(TensorData::new(data, shape), device).cast(dtype)
}

fn main() {
    let (device, name, gpu) = best_device();
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
    let (b, h, s, d): (usize, usize, usize, usize) = if gpu {
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
    let rate = flops / median;
    let rate = if rate >= 1e12 {
        format!("{:.1} TFLOP/s", rate / 1e12)
    } else {
        format!("{:.2} GFLOP/s", rate / 1e9)
    };
    println!(
        "forward b={b} h={h} s={s} d={d}: {:.3} ms, {rate}",
        median * 1e3
    );
}
