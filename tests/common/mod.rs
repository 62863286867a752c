//! Test harness: device selection, seeded inputs, the problem catalogue, host/device
//! transfers and the tolerance rule.

pub mod naive;

use burn_flash_attention::kernels::{
    DeviceLimits, DeviceTensor, FloatDtype, KernelPath,
    reference::{self, Dims},
};
use cubecl::prelude::*;
use rand::{SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, StandardNormal};

/// The device the kernel tests run on, from `FLASH_DEVICE`:
/// `wgpu-cpu` (default; lavapipe, `apt-get install mesa-vulkan-drivers`), `wgpu` (default
/// wgpu adapter), `cuda` (build with `--features cuda`), `rocm` (`--features rocm`).
pub fn device_name() -> String {
    std::env::var("FLASH_DEVICE").unwrap_or_else(|_| "wgpu-cpu".into())
}

fn missing(what: &str) -> ! {
    panic!(
        "FLASH_DEVICE={} needs {what}. Kernel tests never skip: provide the device or pick another \
         (FLASH_DEVICE=wgpu-cpu with `apt-get install mesa-vulkan-drivers` runs on any CPU).",
        device_name()
    )
}

/// Whether the selected device is the CPU (lavapipe).
pub fn is_cpu_device() -> bool {
    device_name() == "wgpu-cpu"
}

/// The CubeCL device selected by `FLASH_DEVICE`.
pub fn cube_device() -> cubecl::Device {
    match device_name().as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => {
            use cubecl::wgpu::{WgpuDevice, WgpuDeviceKind};
            ensure_runtime_dir();
            cubecl::Device::Wgpu(WgpuDevice::new(WgpuDeviceKind::Cpu))
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => cubecl::Device::Wgpu(Default::default()),
        #[cfg(feature = "cuda")]
        "cuda" => cubecl::Device::Cuda(cubecl::cuda::CudaDevice { index: 0 }),
        #[cfg(feature = "rocm")]
        "rocm" => cubecl::Device::Hip(cubecl::hip::AmdDevice { index: 0 }),
        other => missing(&format!(
            "a build with its runtime feature (`{other}` is not compiled in; features: wgpu, cuda, rocm)"
        )),
    }
}

/// The Burn device matching [`cube_device`].
pub fn burn_device() -> burn::tensor::Device {
    use burn::tensor::Device;
    match device_name().as_str() {
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => {
            ensure_runtime_dir();
            Device::wgpu(burn::tensor::DeviceKind::Cpu)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(0),
        #[cfg(feature = "rocm")]
        "rocm" => Device::rocm(0),
        other => missing(&format!("a build with the `{other}` feature")),
    }
}

/// Vulkan loaders want `XDG_RUNTIME_DIR`; CI containers often lack it.
fn ensure_runtime_dir() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join("flash-xdg");
        std::fs::create_dir_all(&dir).ok();
        // SAFETY: set once, before any device thread exists that reads the environment.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", dir) };
    }
}

/// A client for the selected device; fails with instructions when the device is missing.
pub fn client() -> cubecl::client::Client {
    let device = cube_device();
    match std::panic::catch_unwind(|| device.client()) {
        Ok(client) => client,
        Err(_) => missing("that device to exist on this machine"),
    }
}

/// The dtypes the selected device computes in (f32 always).
pub fn dtypes(client: &cubecl::client::Client) -> Vec<FloatDtype> {
    [FloatDtype::F32, FloatDtype::F16, FloatDtype::BF16]
        .into_iter()
        .filter(|d| client.properties().supports_type(d.elem_type()))
        .collect()
}

/// The kernel paths the device runs `dtype` on: portable everywhere, tensor cores (`cmma`,
/// and register-level `mma.sync`) where the device has them.
/// `FLASH_PATH=portable|tensor-core|register-mma` keeps one.
pub fn paths(client: &cubecl::client::Client, dtype: FloatDtype) -> Vec<KernelPath> {
    let limits = DeviceLimits::from_properties(client.properties());
    let mut paths = vec![KernelPath::Portable];
    if limits.has_tensor_cores(dtype) {
        paths.push(KernelPath::TensorCore);
    }
    if limits.has_register_mma(dtype) {
        paths.push(KernelPath::RegisterMma);
    }
    match std::env::var("FLASH_PATH").as_deref() {
        Ok("portable") => paths.retain(|p| *p == KernelPath::Portable),
        Ok("tensor-core") => paths.retain(|p| *p == KernelPath::TensorCore),
        Ok("register-mma") => paths.retain(|p| *p == KernelPath::RegisterMma),
        _ => {}
    }
    paths
}

/// A seeded generator: `FLASH_SEED` if set, else a fresh seed. Failures print it.
pub fn rng() -> (u64, StdRng) {
    let seed = std::env::var("FLASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    (seed, StdRng::seed_from_u64(seed))
}

/// Standard normal values, rounded to `dtype`.
pub fn randn(rng: &mut StdRng, n: usize, dtype: FloatDtype) -> Vec<f64> {
    (0..n)
        .map(|_| round(StandardNormal.sample(rng), dtype))
        .collect()
}

/// `x` rounded to `dtype`.
pub fn round(x: f64, dtype: FloatDtype) -> f64 {
    match dtype {
        FloatDtype::F32 => x as f32 as f64,
        FloatDtype::F16 => half::f16::from_f64(x).to_f64(),
        FloatDtype::BF16 => half::bf16::from_f64(x).to_f64(),
    }
}

pub fn to_bytes(data: &[f64], dtype: FloatDtype) -> Vec<u8> {
    match dtype {
        FloatDtype::F32 => data
            .iter()
            .flat_map(|&x| (x as f32).to_le_bytes())
            .collect(),
        FloatDtype::F16 => data
            .iter()
            .flat_map(|&x| half::f16::from_f64(x).to_le_bytes())
            .collect(),
        FloatDtype::BF16 => data
            .iter()
            .flat_map(|&x| half::bf16::from_f64(x).to_le_bytes())
            .collect(),
    }
}

pub fn from_bytes(bytes: &[u8], dtype: FloatDtype) -> Vec<f64> {
    match dtype {
        FloatDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        FloatDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        FloatDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
    }
}

/// Uploads contiguous `[b, h, s, d]` data.
pub fn upload(client: &Client, data: &[f64], shape: &[usize], dtype: FloatDtype) -> DeviceTensor {
    DeviceTensor::from_bytes(client, shape, &to_bytes(data, dtype))
}

/// Uploads contiguous `[b, h, s, d]` data stored as `[b, s, h, d]` in memory and viewed
/// back as `[b, h, s, d]` through strides (what `swap_dims(1, 2)` gives a kernel).
pub fn upload_bshd(
    client: &Client,
    data: &[f64],
    shape: &[usize],
    dtype: FloatDtype,
) -> DeviceTensor {
    let [b, h, s, d] = shape.try_into().unwrap();
    let mut bshd = vec![0.0; data.len()];
    for (n, &x) in data.iter().enumerate() {
        let (bi, hi, si, di) = (n / (h * s * d), (n / (s * d)) % h, (n / d) % s, n % d);
        bshd[((bi * s + si) * h + hi) * d + di] = x;
    }
    let mut t = DeviceTensor::from_bytes(client, &[b, s, h, d], &to_bytes(&bshd, dtype));
    t.shape = shape.to_vec();
    t.strides = vec![s * h * d, d, h * d, 1];
    t
}

/// Uploads contiguous `[b, h, s, d]` data into rows of `d + pad` elements, viewed back as
/// `[b, h, s, d]` through strides: with an odd `pad`, rows are not 16-byte aligned.
pub fn upload_padded_rows(
    client: &Client,
    data: &[f64],
    shape: &[usize],
    dtype: FloatDtype,
    pad: usize,
) -> DeviceTensor {
    let [b, h, s, d] = shape.try_into().unwrap();
    let row = d + pad;
    let mut padded = vec![0.0; b * h * s * row];
    for (n, &x) in data.iter().enumerate() {
        padded[(n / d) * row + n % d] = x;
    }
    let mut t = DeviceTensor::from_bytes(client, &[b, h, s, row], &to_bytes(&padded, dtype));
    t.shape = shape.to_vec();
    t.strides = vec![h * s * row, s * row, row, 1];
    t
}

/// A contiguous tensor filled with NaN, so that anything a kernel fails to write shows.
pub fn poisoned(client: &Client, shape: &[usize], dtype: FloatDtype) -> DeviceTensor {
    let n: usize = shape.iter().product();
    upload(client, &vec![f64::NAN; n], shape, dtype)
}

/// Reads a tensor back (contiguous tensors only).
pub fn download(client: &Client, t: &DeviceTensor, dtype: FloatDtype) -> Vec<f64> {
    let bytes = client.read_one(t.handle.clone()).expect("read back");
    let n: usize = t.shape.iter().product();
    from_bytes(&bytes[..n * dtype.size()], dtype)
}

/// One problem of the catalogue.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub dims: Dims,
    pub causal: bool,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: Option<f64>,
    pub scale: Option<f64>,
    /// Ask for a bitwise-deterministic backward (on CUDA sm_80+: dQ in its own pass instead
    /// of by atomics).
    pub deterministic: bool,
    /// Dropout on the probabilities.
    pub dropout: Option<burn_flash_attention::kernels::Dropout>,
    /// The index the dropout gives batch entry 0 (a sequence's in a packed batch).
    pub dropout_batch: usize,
}

pub const fn dims(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_kv: usize,
    dim_qk: usize,
    dim_v: usize,
) -> Dims {
    Dims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_kv,
        dim_qk,
        dim_v,
    }
}

pub const fn case(dims: Dims) -> Case {
    Case {
        dims,
        causal: false,
        window: (None, None),
        softcap: None,
        scale: None,
        deterministic: false,
        dropout: None,
        dropout_batch: 0,
    }
}

/// The problem catalogue: odd sizes (s ∈ {1, 3, 33, 97, 128, 1025}, d ∈ {40, 64, 72, 80, 96,
/// 111, 128, 136, 192, 200, 256}), s_q ≠ s_kv both ways, GQA ratios 1, 3, 4 and all (MQA),
/// every option. Every problem runs on every device, the CPU test device (lavapipe) included.
pub fn catalogue() -> Vec<Case> {
    vec![
        case(dims(1, 1, 1, 1, 1, 64, 64)),
        Case {
            causal: true,
            ..case(dims(2, 2, 2, 1, 97, 40, 40))
        },
        Case {
            causal: true,
            ..case(dims(2, 4, 4, 97, 97, 40, 40))
        },
        // s_q > s_kv, causal: the first rows see no key at all.
        Case {
            causal: true,
            ..case(dims(1, 4, 1, 128, 97, 80, 80))
        },
        Case {
            causal: true,
            ..case(dims(1, 4, 1, 128, 97, 64, 64))
        },
        case(dims(1, 4, 1, 97, 1025, 96, 96)),
        Case {
            causal: true,
            ..case(dims(1, 2, 2, 1025, 1025, 64, 64))
        },
        Case {
            window: (Some(16), Some(8)),
            softcap: Some(5.0),
            scale: Some(0.3),
            ..case(dims(2, 4, 2, 97, 128, 111, 111))
        },
        Case {
            causal: true,
            window: (Some(33), None),
            ..case(dims(1, 8, 2, 128, 200, 128, 64))
        },
        Case {
            softcap: Some(2.0),
            ..case(dims(1, 2, 1, 128, 97, 256, 256))
        },
        // d = 128 both ways (on sm_90 the backward's warpgroup products): GQA with a
        // softcap, and causal with s_q > s_kv.
        Case {
            softcap: Some(5.0),
            ..case(dims(2, 4, 2, 97, 300, 128, 128))
        },
        Case {
            causal: true,
            ..case(dims(1, 2, 1, 200, 129, 128, 128))
        },
        // Head dims the portable path walks in steps of columns on CPU devices (several key
        // blocks each): GQA 3:1 at d = 72; causal with s_q > s_kv at d = 136; a few new
        // tokens against a longer cache with d_qk = 192, d_v = 128; one token at d = 200.
        case(dims(1, 3, 1, 33, 150, 72, 72)),
        Case {
            causal: true,
            ..case(dims(1, 2, 2, 100, 77, 136, 136))
        },
        Case {
            causal: true,
            ..case(dims(2, 2, 1, 3, 300, 192, 128))
        },
        case(dims(1, 4, 2, 1, 333, 200, 200)),
    ]
}

/// The catalogue, or only its entry `FLASH_CASE=<index>` when set (to debug one problem).
pub fn selected_cases() -> Vec<Case> {
    selected(catalogue())
}

/// `all`, or only its entry `FLASH_CASE=<index>` when set (to debug one problem).
pub fn selected<T>(all: Vec<T>) -> Vec<T> {
    match std::env::var("FLASH_CASE")
        .ok()
        .and_then(|i| i.parse::<usize>().ok())
    {
        Some(i) => all.into_iter().nth(i).into_iter().collect(),
        None => all,
    }
}

impl Case {
    /// Sequences of a thousand or more.
    pub fn is_long(&self) -> bool {
        self.dims.seq_q.max(self.dims.seq_kv) > 1000
    }

    pub fn options(&self) -> burn_flash_attention::kernels::AttentionOptions {
        burn_flash_attention::kernels::AttentionOptions {
            scale: self.scale.map(|s| s as f32),
            mask: self.mask(),
            softcap: self.softcap.map(|c| c as f32),
            deterministic: self.deterministic,
            dropout: self.dropout,
        }
    }

    pub fn mask(&self) -> burn_flash_attention::kernels::MaskSpec {
        burn_flash_attention::kernels::MaskSpec {
            causal: self.causal,
            window_left: self.window.0,
            window_right: self.window.1,
        }
    }

    pub fn reference_options(&self) -> burn_flash_attention::kernels::reference::ReferenceOptions {
        burn_flash_attention::kernels::reference::ReferenceOptions {
            scale: self.scale,
            mask: self.mask(),
            softcap: self.softcap,
            dropout: self.dropout.map(|dropout| {
                let d = &self.dims;
                let shape = [d.batch, d.heads_q, d.seq_q, d.seq_kv];
                burn_flash_attention::kernels::reference::Dropout {
                    keep: burn_flash_attention::kernels::reference::Broadcast4 {
                        data: (0..shape.iter().product())
                            .map(|n| {
                                let (j, i) = (n % d.seq_kv, n / d.seq_kv % d.seq_q);
                                let (h, b) = (
                                    n / (d.seq_kv * d.seq_q) % d.heads_q,
                                    n / (d.seq_kv * d.seq_q * d.heads_q),
                                );
                                dropout.keeps(self.dropout_batch + b, d.heads_q, h, i, j)
                            })
                            .collect(),
                        shape,
                    },
                    p: dropout.effective_p(),
                }
            }),
            ..Default::default()
        }
    }

    /// The dropout's factor of probability `(b, h, i, j)`: 0, `1/(1 − p)`, or 1 without.
    pub fn dropout_factor(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        match self.dropout {
            None => 1.0,
            Some(d) if d.keeps(self.dropout_batch + b, self.dims.heads_q, h, i, j) => {
                f64::from(d.kept_scale())
            }
            Some(_) => 0.0,
        }
    }
}

/// Half the distance from 1 to the next value of `dtype`: the relative error of one
/// rounding.
pub fn unit_roundoff(dtype: FloatDtype) -> f64 {
    match dtype {
        FloatDtype::F32 => f64::from(f32::EPSILON) / 2.0,
        FloatDtype::F16 => 2f64.powi(-11),
        FloatDtype::BF16 => 2f64.powi(-8),
    }
}

/// Largest absolute difference; NaN counts as infinitely wrong, equal infinities as exact.
pub fn max_abs_diff(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g == w {
                0.0
            } else if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// FlashAttention-3's tests' absolute floor for a tensor of reference values `want`: twice
/// the largest `|((x + 0.3) − 0.3) − x|` with `x` and each step rounded to `dtype`, about
/// two units in the last place of the values' magnitude (0 in f64 terms for f32 inputs'
/// typical sizes, ~1e-3 for f16 values near 1).
pub fn rounding_floor(want: &[f64], dtype: FloatDtype) -> f64 {
    2.0 * want
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| {
            let x = round(x, dtype);
            (round(round(x + 0.3, dtype) - 0.3, dtype) - x).abs()
        })
        .fold(0.0, f64::max)
}

/// FlashAttention's rule: the kernel's error against the f64 reference is at most twice the
/// error of naive attention computed in the input dtype, plus a small absolute floor: the
/// larger of `floor` relative to the reference's magnitude and FlashAttention-3's tests'
/// floor, twice the rounding error of the reference's values in the dtype
/// ([`rounding_floor`]). On few terms (a row that sees one or two keys) the naive error can
/// land near zero by chance while the kernel's rounds at other points (P and dS in the
/// dtype before their products, D from the stored O): the dtype's floor keeps such a case
/// from failing on a few units in the last place, and stays far below any real fault.
pub fn assert_close(
    dtype: FloatDtype,
    what: &str,
    got: &[f64],
    want: &[f64],
    naive: &[f64],
    floor: f64,
    context: &str,
) {
    let err = max_abs_diff(got, want);
    // The worst element, for the message.
    let worst = (0..got.len())
        .max_by(|&a, &b| {
            (got[a] - want[a])
                .abs()
                .total_cmp(&(got[b] - want[b]).abs())
        })
        .unwrap_or(0);
    let naive_err = max_abs_diff(naive, want);
    let magnitude = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(x.abs()));
    let bound = 2.0 * naive_err + (floor * magnitude).max(rounding_floor(want, dtype));
    assert!(
        err <= bound,
        "{what}: max error {err:.3e} > bound {bound:.3e} (naive-in-dtype error {naive_err:.3e}; \
         worst at {worst}: {} against {}, naive {}) — {context}",
        got[worst],
        want[worst],
        naive[worst]
    );
}

/// The forward's results by the tolerance rule: `O` in `dtype`, `LSE` (computed in f32).
pub fn assert_forward_close(
    dtype: FloatDtype,
    (out, lse): (&[f64], &[f64]),
    want: &reference::ReferenceForward,
    naive: &naive::Naive,
    context: &str,
) {
    assert_close(dtype, "O", out, &want.out, &naive.out, 2e-5, context);
    assert_close(
        FloatDtype::F32,
        "LSE",
        lse,
        &want.lse,
        &naive.lse,
        2e-5,
        context,
    );
}

/// `dQ`, `dK` and `dV` in `dtype` by the tolerance rule.
pub fn assert_grads_close(
    dtype: FloatDtype,
    [dq, dk, dv]: [&[f64]; 3],
    want: &reference::ReferenceBackward,
    naive: &naive::Naive,
    context: &str,
) {
    assert_close(dtype, "dQ", dq, &want.dq, &naive.dq, 1e-4, context);
    assert_close(dtype, "dK", dk, &want.dk, &naive.dk, 1e-4, context);
    assert_close(dtype, "dV", dv, &want.dv, &naive.dv, 1e-4, context);
}

/// [`assert_close`] for values that are each a sum of many scores' contributions (a score
/// function's parameter gradients, a broadcast bias's gradient): compared one number at a
/// time, twice the naive error can land near 0 by chance, so entry `n` is also allowed the
/// rounding bound of its sum, the dtype's unit roundoff times `abs_sums[n]` (`Σ
/// |contribution|`).
#[allow(clippy::too_many_arguments)]
pub fn assert_close_sums(
    what: &str,
    got: &[f64],
    want: &[f64],
    naive: &[f64],
    abs_sums: &[f64],
    dtype: FloatDtype,
    floor: f64,
    context: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: length — {context}");
    let naive_err = max_abs_diff(naive, want);
    let magnitude = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(x.abs()));
    for (n, (g, w)) in got.iter().zip(want).enumerate() {
        let sum_bound = unit_roundoff(dtype) * abs_sums[n];
        let bound = 2.0 * naive_err + floor * magnitude + sum_bound;
        assert!(
            (g - w).abs() <= bound,
            "{what}[{n}]: error {:.3e} > bound {bound:.3e} (naive-in-dtype error \
             {naive_err:.3e}, the sum's rounding bound {sum_bound:.3e}) — {context}",
            (g - w).abs()
        );
    }
}

/// Rows the reference hides completely (`LSE = −∞`) came back exactly `O = 0`,
/// `LSE = −∞` and `dQ = 0`, never NaN.
pub fn assert_hidden_rows(
    want_lse: &[f64],
    [got_lse, got_out, got_dq]: [&[f64]; 3],
    [dim_v, dim_qk]: [usize; 2],
    context: &str,
) {
    for (row, &l) in want_lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(
                got_lse[row],
                f64::NEG_INFINITY,
                "LSE of hidden row {row} — {context}"
            );
            let o = &got_out[row * dim_v..][..dim_v];
            assert!(
                o.iter().all(|&x| x == 0.0),
                "O of hidden row {row}: {o:?} — {context}"
            );
            let dq = &got_dq[row * dim_qk..][..dim_qk];
            assert!(
                dq.iter().all(|&x| x == 0.0),
                "dQ of hidden row {row}: {dq:?} — {context}"
            );
        }
    }
}

/// Device memory in use once the queued work is done (CubeCL's memory report).
pub fn bytes_in_use(client: &Client) -> u64 {
    cubecl::future::block_on(client.sync()).expect("device synced");
    client
        .memory_report(cubecl::MemoryScope::Device)
        .usage()
        .bytes_in_use
}

/// A Burn f32 tensor of `shape` from f64 values.
pub fn tensor<const D: usize>(
    data: &[f64],
    shape: [usize; D],
    device: &burn::tensor::Device,
) -> burn::tensor::Tensor<D> {
    let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    burn::tensor::Tensor::from_data(burn::tensor::TensorData::new(data, shape), device)
}

/// A Burn float tensor's values, as f64.
pub fn values<const D: usize>(t: burn::tensor::Tensor<D>) -> Vec<f64> {
    let data = t.into_data().convert::<f32>();
    data.try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}
