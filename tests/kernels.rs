//! The CubeCL kernels against the f64 oracle on the device `FLASH_DEVICE` selects, every
//! catalogue problem and every dtype the device has.

use burn_flash_attention::kernels::{
    AttentionProblem, DeviceLimits, DeviceTensor, FlashError, FloatDtype, KernelPath,
    backward::{Gradients, Saved, backward, backward_into},
    config::{ATOMIC_DQ_MIN_SEQ_Q, choose_register_backward_tiles, choose_register_mma_tiles},
    forward::{forward, forward_into},
    reference,
};
use cubecl::client::Client;

use crate::common::{
    self, Case, assert_forward_close, assert_grads_close, download, naive, poisoned, upload,
    upload_bshd, upload_padded_rows,
};

struct Inputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_out: Vec<f64>,
}

fn inputs(case: &Case, dtype: FloatDtype, rng: &mut rand::rngs::StdRng) -> Inputs {
    let d = &case.dims;
    Inputs {
        q: common::randn(rng, d.q_len(), dtype),
        k: common::randn(rng, d.k_len(), dtype),
        v: common::randn(rng, d.v_len(), dtype),
        d_out: common::randn(rng, d.o_len(), dtype),
    }
}

fn shapes(case: &Case) -> ([usize; 4], [usize; 4], [usize; 4], [usize; 4]) {
    let d = &case.dims;
    (
        [d.batch, d.heads_q, d.seq_q, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_v],
        [d.batch, d.heads_q, d.seq_q, d.dim_v],
    )
}

/// How the inputs (Q, K, V, dO) sit in memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Layout {
    /// Contiguous `[b, h, s, d]`.
    Contiguous,
    /// `[b, s, h, d]` in memory, viewed as `[b, h, s, d]` (`swap_dims(1, 2)`).
    Bshd,
    /// Rows of `d + 1` elements: not 16-byte aligned.
    PaddedRows,
}

/// Runs forward and backward on the device (outputs poisoned with NaN first) and checks
/// everything against the oracle, on inputs of a fresh seed ([`common::rng`]).
pub(crate) fn check_case(
    client: &Client,
    case: &Case,
    dtype: FloatDtype,
    layout: Layout,
    path: KernelPath,
) {
    if let Err(e) = check_case_seeded(client, case, dtype, layout, path, common::rng()) {
        panic!("{path:?} refused {case:?} in {dtype:?}: {e}");
    }
}

/// [`check_case`] on the inputs `seed` draws from `rng`; `Err` where the path refuses the
/// problem on this device (`FlashError::Unavailable`: a head dim, scale or size it does not
/// take), before anything runs.
pub(crate) fn check_case_seeded(
    client: &Client,
    case: &Case,
    dtype: FloatDtype,
    layout: Layout,
    path: KernelPath,
    (seed, mut rng): (u64, rand::rngs::StdRng),
) -> Result<(), FlashError> {
    if path == KernelPath::RegisterMma && !(case.dims.dim_qk % 8 == 0 && case.dims.dim_v % 8 == 0) {
        // 16-byte copies: `Auto` runs these head dims on the cmma path (tested there).
        eprintln!(
            "RegisterMma skips head dims {}/{}",
            case.dims.dim_qk, case.dims.dim_v
        );
        return Ok(());
    }
    let context = format!(
        "seed {seed} (FLASH_SEED={seed} reproduces), {path:?}, {dtype:?}, {layout:?}, {case:?}"
    );
    let start = std::time::Instant::now();
    let x = inputs(case, dtype, &mut rng);
    let (qs, ks, vs, os) = shapes(case);
    let up = |client: &Client, data: &[f64], shape: &[usize], dtype| match layout {
        Layout::Contiguous => upload(client, data, shape, dtype),
        Layout::Bshd => upload_bshd(client, data, shape, dtype),
        Layout::PaddedRows => upload_padded_rows(client, data, shape, dtype, 1),
    };
    let (q, k, v) = (
        up(client, &x.q, &qs, dtype),
        up(client, &x.k, &ks, dtype),
        up(client, &x.v, &vs, dtype),
    );
    let d_out = up(client, &x.d_out, &os, dtype);

    let out = poisoned(client, &os, dtype);
    let lse = poisoned(client, &os[..3], FloatDtype::F32);
    match forward_into(client, &q, &k, &v, &out, &lse, dtype, case.options(), path) {
        Err(e @ FlashError::Unavailable(_)) => return Err(e),
        result => result.unwrap_or_else(|e| panic!("forward: {e} — {context}")),
    }

    let grads = Gradients {
        dq: poisoned(client, &qs, dtype),
        dk: poisoned(client, &ks, dtype),
        dv: poisoned(client, &vs, dtype),
    };
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
    };
    match backward_into(client, saved, &d_out, &grads, dtype, case.options(), path) {
        Err(e @ FlashError::Unavailable(_)) => return Err(e),
        result => result.unwrap_or_else(|e| panic!("backward: {e} — {context}")),
    }

    client
        .read_one(grads.dq.handle.clone())
        .expect("kernels ran");
    let device_time = start.elapsed();
    let opts = case.reference_options();
    let want = reference::forward(&case.dims, &opts, &x.q, &x.k, &x.v);
    let want_grads = reference::backward(&case.dims, &opts, &x.q, &x.k, &x.v, &x.d_out);
    let low = naive::attention(case, dtype, &x.q, &x.k, &x.v, &x.d_out);

    if std::env::var_os("FLASH_DEBUG").is_some() {
        for (name, t) in [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv)] {
            let g = download(client, t, dtype);
            let bad: Vec<usize> = (0..g.len()).filter(|&i| !g[i].is_finite()).collect();
            eprintln!(
                "{name}: {} non-finite, first {:?}",
                bad.len(),
                &bad[..bad.len().min(8)]
            );
        }
    }
    let got_out = download(client, &out, dtype);
    let got_lse = download(client, &lse, FloatDtype::F32);
    let grads = [&grads.dq, &grads.dk, &grads.dv].map(|t| download(client, t, dtype));
    assert_forward_close(dtype, (&got_out, &got_lse), &want, &low, &context);
    assert_grads_close(
        dtype,
        grads.each_ref().map(|g| &g[..]),
        &want_grads,
        &low,
        &context,
    );

    eprintln!(
        "{path:?} {dtype:?} {:?} causal={} window={:?} softcap={:?} {layout:?}: device {:.2?}, total {:.2?}",
        case.dims,
        case.causal,
        case.window,
        case.softcap,
        device_time,
        start.elapsed()
    );
    // Rows that see no key: O = 0 and LSE = −∞ exactly, never NaN.
    for (row, &l) in want.lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(
                got_lse[row],
                f64::NEG_INFINITY,
                "LSE of fully masked row {row} — {context}"
            );
            let o = &got_out[row * case.dims.dim_v..][..case.dims.dim_v];
            assert!(
                o.iter().all(|&x| x == 0.0),
                "O of fully masked row {row}: {o:?} — {context}"
            );
        }
    }
    Ok(())
}

#[test]
fn forward_and_backward_match_the_oracle() {
    let client = common::client();
    let dtypes = common::dtypes(&client);
    for case in common::selected_cases() {
        for &dtype in &dtypes {
            // lavapipe compiles and computes half precision slowly: on the CPU device the
            // half-precision dtypes run the short problems of head dim ≤ 64 (the portable
            // kernels' code differs from f32 in the element type alone); the GPU runs all.
            let half_on_cpu = !case.is_long() && case.dims.dim_qk.max(case.dims.dim_v) <= 64;
            if common::is_cpu_device() && dtype != FloatDtype::F32 && !half_on_cpu {
                continue;
            }
            for path in common::paths(&client, dtype) {
                check_case(&client, &case, dtype, Layout::Contiguous, path);
            }
        }
    }
}

/// More (batch, head) pairs than one grid dimension holds (65 535: the training kernels
/// spread them over two) and more query rows than the backward's `D` kernel fits in one
/// (over 2^20: its cubes spread over the grid as CubeCL lays elements out); a WebGPU device
/// refused both launches before. f32 on a CPU driver, every dtype and path on a GPU.
#[test]
fn launches_past_one_grid_dimension_match_the_oracle() {
    let client = common::client();
    // 2 · 32 769 = 65 538 pairs of 17 queries: 1 114 146 rows.
    let case = Case {
        causal: true,
        ..common::case(common::dims(2, 32769, 32769, 17, 3, 16, 16))
    };
    for dtype in common::dtypes(&client) {
        if common::is_cpu_device() && dtype != FloatDtype::F32 {
            continue;
        }
        for path in common::paths(&client, dtype) {
            check_case(&client, &case, dtype, Layout::Contiguous, path);
        }
    }
}

/// The register-level path's deterministic backward (dQ in its own pass instead of by
/// atomics, which the default takes) against the oracle, every catalogue problem it runs.
#[test]
fn deterministic_backward_matches_the_oracle() {
    let client = common::client();
    let Some(dtype) = register_path_dtype(&client) else {
        return;
    };
    for case in common::selected_cases() {
        let case = Case {
            deterministic: true,
            ..case
        };
        check_case(
            &client,
            &case,
            dtype,
            Layout::Contiguous,
            KernelPath::RegisterMma,
        );
    }
}

/// Sets an environment variable for its lifetime, a failing check included (the tests run
/// on one thread: `RUST_TEST_THREADS=1`, .cargo/config.toml).
struct EnvVar(&'static str);

impl EnvVar {
    fn set(name: &'static str, value: &str) -> Self {
        // SAFETY: no other thread reads the environment meanwhile (above).
        unsafe { std::env::set_var(name, value) };
        Self(name)
    }
}

impl Drop for EnvVar {
    fn drop(&mut self) {
        // SAFETY: as in `set`.
        unsafe { std::env::remove_var(self.0) };
    }
}

/// On sm_90 the forward and backward of the catalogue problems with `d_qk = d_v ∈ {64, 128}`
/// run on warpgroup products (the default, checked here); with `FLASH_WGMMA=0` they run on
/// the `mma.sync` kernels sm_80 runs, checked against the oracle here. Skipped (said on
/// stderr) on devices without warpgroup products, where the catalogue runs those kernels.
#[test]
fn kernels_without_warpgroup_products_match_the_oracle() {
    let client = common::client();
    let Some(dtype) = register_path_dtype(&client) else {
        return;
    };
    let limits = DeviceLimits::from_properties(client.properties());
    if !limits.warpgroup_mma {
        eprintln!("no warpgroup products (sm_90) on this device");
        return;
    }
    let mut ran = 0;
    for case in common::selected_cases() {
        let (qs, ks, vs, _) = shapes(&case);
        let problem = AttentionProblem::new(&qs, &ks, &vs, dtype, case.options()).unwrap();
        let backward = choose_register_backward_tiles(&problem, &limits);
        if !backward.is_ok_and(|config| config.warpgroup.is_some()) {
            continue;
        }
        let forward = choose_register_mma_tiles(&problem, &limits).unwrap();
        assert!(forward.warpgroup.is_some(), "{case:?}: {forward:?}");
        let _off = EnvVar::set("FLASH_WGMMA", "0");
        check_case(
            &client,
            &case,
            dtype,
            Layout::Contiguous,
            KernelPath::RegisterMma,
        );
        ran += 1;
    }
    assert!(ran > 0, "no catalogue problem takes the warpgroup products");
}

/// The dtype the register-level path's tests run in, or `None` (said on stderr) where the
/// device has no such path.
fn register_path_dtype(client: &Client) -> Option<FloatDtype> {
    let dtype = auto_test_dtype(client);
    let has = common::paths(client, dtype).contains(&KernelPath::RegisterMma);
    if !has {
        eprintln!(
            "no register-level path on this device: its backward is the only one with atomics"
        );
    }
    has.then_some(dtype)
}

/// The register-level backward's dQ by f32 atomics, which it takes for query sequences of
/// at least `ATOMIC_DQ_MIN_SEQ_Q`: short key sequences (cheap for the oracle), causal with
/// s_q > s_kv (most rows see no key: their dQ must stay zero) with GQA, and a sliding window
/// with softcap and d_v ≠ d_qk.
#[test]
fn atomic_dq_backward_matches_the_oracle() {
    let client = common::client();
    let Some(dtype) = register_path_dtype(&client) else {
        return;
    };
    let s = ATOMIC_DQ_MIN_SEQ_Q;
    let cases = [
        Case {
            causal: true,
            ..common::case(common::dims(1, 4, 2, s, 300, 64, 64))
        },
        Case {
            window: (Some(40), Some(8)),
            softcap: Some(5.0),
            ..common::case(common::dims(1, 2, 1, s + 5, 200, 128, 96))
        },
    ];
    // On sm_90 the first problem would take the warpgroup products (dQ in its own pass).
    let _off = EnvVar::set("FLASH_WGMMA", "0");
    let limits = DeviceLimits {
        warpgroup_mma: false,
        ..DeviceLimits::from_properties(client.properties())
    };
    for case in cases {
        let (qs, ks, vs, _) = shapes(&case);
        let problem = AttentionProblem::new(&qs, &ks, &vs, dtype, case.options()).unwrap();
        let config = choose_register_backward_tiles(&problem, &limits).unwrap();
        assert!(
            config.atomic_dq,
            "{case:?} should take the atomic dQ: {config:?}"
        );
        check_case(
            &client,
            &case,
            dtype,
            Layout::Contiguous,
            KernelPath::RegisterMma,
        );
    }
}

/// The atomic dQ adds up into a sum from `DeviceTensor::zeros_f32`: zeros, also in memory
/// that a NaN-poisoned tensor of the same size has just released to the pool (read back
/// first, so that its upload is done and its memory reused; a plain allocation fails here).
#[test]
fn zeroed_sums_start_at_zero() {
    let client = common::client();
    let shape = [2, 3, 97, 40];
    let nan = poisoned(&client, &shape, FloatDtype::F32);
    client.read_one(nan.handle.clone()).expect("poisoned");
    drop(nan);
    let sum = DeviceTensor::zeros_f32(&client, &shape);
    let got = download(&client, &sum, FloatDtype::F32);
    assert_eq!(got.len(), shape.iter().product::<usize>());
    assert!(
        got.iter().all(|&x| x == 0.0),
        "non-zero entries in a zeroed sum"
    );
}

#[test]
fn strided_bshd_inputs_are_read_in_place() {
    let client = common::client();
    for case in common::catalogue().iter().filter(|c| !c.is_long()) {
        check_case(
            &client,
            case,
            FloatDtype::F32,
            Layout::Bshd,
            KernelPath::Portable,
        );
        // The tensor-core paths read strided half-precision inputs the same way.
        for path in common::paths(&client, FloatDtype::BF16) {
            if path != KernelPath::Portable {
                check_case(&client, case, FloatDtype::BF16, Layout::Bshd, path);
            }
        }
    }
}

/// The dtype of the `Auto` tests: half precision where the device has it (the
/// register-level path's dtypes); f32 on the CPU test device, where half precision is slow.
fn auto_test_dtype(client: &Client) -> FloatDtype {
    match common::is_cpu_device() {
        true => FloatDtype::F32,
        false => *common::dtypes(client).last().unwrap(),
    }
}

/// Inputs whose rows are not 16-byte aligned, the incoming gradient included: `Auto` runs
/// them (on CUDA the register-level forward and backward step down to the `cmma` kernels)
/// and the results match the oracle.
#[test]
fn misaligned_rows_step_down_and_stay_correct() {
    let client = common::client();
    let dtype = auto_test_dtype(&client);
    for case in common::catalogue()
        .iter()
        .filter(|c| !c.is_long())
        .filter(|c| c.dims.dim_qk % 8 == 0 && c.dims.dim_v % 8 == 0)
        .take(3)
    {
        check_case(&client, case, dtype, Layout::PaddedRows, KernelPath::Auto);
    }
}

/// Softmax scales under `Auto`: a positive one (on CUDA the register-level forward folds it
/// into the exponent), and zero and negative ones, which that path refuses (it takes row
/// maxima of unscaled scores), so the forward steps down; all match the oracle, masked rows
/// with s_q ≠ s_kv included.
#[test]
fn every_scale_sign_runs_under_auto() {
    let client = common::client();
    let dtype = auto_test_dtype(&client);
    let base = common::catalogue()
        .into_iter()
        .find(|c| c.causal && c.dims.seq_q > c.dims.seq_kv && c.dims.dim_qk == 64)
        .expect("a causal d = 64 case with s_q > s_kv");
    for scale in [0.4, 0.0, -0.4] {
        let case = Case {
            scale: Some(scale),
            ..base
        };
        check_case(&client, &case, dtype, Layout::Contiguous, KernelPath::Auto);
    }
}

#[test]
fn backward_is_bitwise_deterministic() {
    let client = common::client();
    for dtype in common::dtypes(&client) {
        if common::is_cpu_device() && dtype != FloatDtype::F32 {
            continue; // half precision is slow on lavapipe; covered on GPUs
        }
        for path in common::paths(&client, dtype) {
            check_deterministic(&client, dtype, path);
        }
    }
}

fn check_deterministic(client: &Client, dtype: FloatDtype, path: KernelPath) {
    let case = Case {
        deterministic: true,
        ..common::catalogue()[8] // GQA 8/2, causal window, d_v ≠ d_qk
    };
    let (seed, mut rng) = common::rng();
    let x = inputs(&case, dtype, &mut rng);
    let (qs, ks, vs, os) = shapes(&case);
    let (q, k, v) = (
        upload(client, &x.q, &qs, dtype),
        upload(client, &x.k, &ks, dtype),
        upload(client, &x.v, &vs, dtype),
    );
    let d_out = upload(client, &x.d_out, &os, dtype);
    let fwd = forward(client, &q, &k, &v, dtype, case.options(), path).unwrap();
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &fwd.out,
        lse: &fwd.lse,
    };
    let run = || {
        let g = backward(client, saved, &d_out, dtype, case.options(), path).unwrap();
        [g.dq, g.dk, g.dv].map(|t: DeviceTensor| client.read_one(t.handle).unwrap().to_vec())
    };
    assert!(
        run() == run(),
        "two backward runs differ bitwise ({path:?}, {dtype:?}, seed {seed})"
    );
}

#[test]
fn unsupported_dtypes_are_refused_clearly() {
    let client = common::client();
    let supported = common::dtypes(&client);
    let case = common::catalogue()[2];
    let (qs, ks, vs, _) = shapes(&case);
    for dtype in [FloatDtype::F16, FloatDtype::BF16] {
        if supported.contains(&dtype) {
            continue;
        }
        // Buffers of the right size; the launcher must refuse before touching them.
        let t = |s: &[usize]| DeviceTensor::empty(&client, s, 2);
        let err = forward(
            &client,
            &t(&qs),
            &t(&ks),
            &t(&vs),
            dtype,
            case.options(),
            KernelPath::Auto,
        )
        .unwrap_err();
        assert!(matches!(err, FlashError::Dtype { .. }), "{dtype:?}: {err}");
    }
    // f32 is supported everywhere.
    assert!(supported.contains(&FloatDtype::F32));
}

#[test]
fn bad_shapes_are_errors_not_launches() {
    let client = common::client();
    let t = |s: &[usize]| DeviceTensor::empty(&client, s, 4);
    let err = forward(
        &client,
        &t(&[1, 3, 8, 16]),
        &t(&[1, 2, 8, 16]),
        &t(&[1, 2, 8, 16]),
        FloatDtype::F32,
        Default::default(),
        KernelPath::Auto,
    )
    .unwrap_err();
    assert!(err.to_string().contains("`key`"), "{err}");
    let err = forward(
        &client,
        &t(&[1, 2, 8]),
        &t(&[1, 2, 8, 16]),
        &t(&[1, 2, 8, 16]),
        FloatDtype::F32,
        Default::default(),
        KernelPath::Auto,
    )
    .unwrap_err();
    assert!(
        matches!(err, FlashError::Rank { arg: "query", .. }),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_core_path_is_an_error() {
    let client = common::client();
    let case = common::catalogue()[2];
    let (qs, ks, vs, _) = shapes(&case);
    let limits = DeviceLimits::from_properties(client.properties());
    for dtype in common::dtypes(&client) {
        if limits.has_tensor_cores(dtype) {
            continue;
        }
        let t = |s: &[usize]| DeviceTensor::empty(&client, s, dtype.size());
        let err = forward(
            &client,
            &t(&qs),
            &t(&ks),
            &t(&vs),
            dtype,
            case.options(),
            KernelPath::TensorCore,
        )
        .unwrap_err();
        assert!(
            matches!(err, FlashError::Unavailable(_)),
            "{dtype:?}: {err}"
        );
        assert!(err.to_string().contains("cmma"), "{err}");
    }
}

/// The register-level path refuses, with a clear error, what its 16-byte copies cannot read
/// (and devices without its instructions); `Auto` then runs another path.
#[test]
fn the_register_path_refuses_what_it_cannot_read() {
    let client = common::client();
    for dtype in common::dtypes(&client) {
        if dtype == FloatDtype::F32 {
            continue;
        }
        let run = |dims: [usize; 4], q_strides: Option<Vec<usize>>, path| {
            let [b, h, s, d] = dims;
            let mut q = DeviceTensor::empty(&client, &[b, h, s, d + 1], dtype.size());
            q.shape = vec![b, h, s, d];
            q.strides = q_strides.unwrap_or(q.strides);
            let kv = DeviceTensor::empty(&client, &[b, h, s, d], dtype.size());
            forward(&client, &q, &kv, &kv, dtype, Default::default(), path).map(|_| ())
        };
        // A head dim that is not a multiple of 8.
        let err = run([1, 2, 33, 39], None, KernelPath::RegisterMma).unwrap_err();
        assert!(
            matches!(err, FlashError::Unavailable(_)),
            "{dtype:?}: {err}"
        );
        if !common::paths(&client, dtype).contains(&KernelPath::RegisterMma) {
            assert!(err.to_string().contains("mma"), "{err}");
            continue;
        }
        assert!(err.to_string().contains("multiples of 8"), "{err}");
        // Rows of 65 elements: not 16-byte aligned.
        let misaligned = Some(vec![2 * 33 * 65, 33 * 65, 65, 1]);
        let err = run([1, 2, 33, 64], misaligned.clone(), KernelPath::RegisterMma).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("16-byte") && msg.contains("query"), "{msg}");
        // `Auto` steps down to a path that reads them.
        run([1, 2, 33, 64], misaligned, KernelPath::Auto).unwrap();
        run([1, 2, 33, 39], None, KernelPath::Auto).unwrap();
    }
}

/// Extra device memory of the calls, on every path of the device: the forward holds O and
/// the LSE and nothing else; the backward holds dQ, dK and dV, its transient D
/// (`[b, h_q, s_q]` f32) freed; no `s × s` buffer anywhere. Measured on a second pair of
/// calls: the first may grow the runtime's own buffers (launch metadata) once.
#[test]
fn calls_allocate_only_their_outputs() {
    let client = common::client();
    let case = common::catalogue()[8]; // GQA 8/2, causal window, d_v ≠ d_qk
    let (_, mut rng) = common::rng();
    let dtype = *common::dtypes(&client).last().unwrap();
    let d = &case.dims;
    let x = inputs(&case, dtype, &mut rng);
    let (qs, ks, vs, os) = shapes(&case);
    let (q, k, v) = (
        upload(&client, &x.q, &qs, dtype),
        upload(&client, &x.k, &ks, dtype),
        upload(&client, &x.v, &vs, dtype),
    );
    let d_out = upload(&client, &x.d_out, &os, dtype);
    let size = |shape: &[usize], elem: usize| (shape.iter().product::<usize>() * elem) as u64;
    // Allocations may be rounded up to the device's alignment.
    let slack = |n: u64| n * 512;
    for path in common::paths(&client, dtype) {
        let warm = forward(&client, &q, &k, &v, dtype, case.options(), path).unwrap();
        let saved = Saved {
            q: &q,
            k: &k,
            v: &v,
            out: &warm.out,
            lse: &warm.lse,
        };
        drop(backward(&client, saved, &d_out, dtype, case.options(), path).unwrap());
        drop(warm);
        let before = common::bytes_in_use(&client);
        let fwd = forward(&client, &q, &k, &v, dtype, case.options(), path).unwrap();
        let after_forward = common::bytes_in_use(&client);
        let want = size(&os, dtype.size()) + size(&os[..3], 4);
        let got = after_forward - before;
        assert!(
            (want..=want + slack(2)).contains(&got),
            "{path:?} {dtype:?}: forward holds {got} bytes, O + LSE are {want}"
        );
        let saved = Saved {
            q: &q,
            k: &k,
            v: &v,
            out: &fwd.out,
            lse: &fwd.lse,
        };
        let grads = backward(&client, saved, &d_out, dtype, case.options(), path).unwrap();
        let got = common::bytes_in_use(&client) - after_forward;
        let want = size(&qs, dtype.size()) + size(&ks, dtype.size()) + size(&vs, dtype.size());
        assert!(
            (want..=want + slack(3)).contains(&got),
            "{path:?} {dtype:?}: backward holds {got} bytes, dQ + dK + dV are {want} (D would be {})",
            size(&os[..3], 4)
        );
        eprintln!(
            "{path:?} {dtype:?} {d:?}: forward +{} B (O + LSE), backward +{got} B (dQ, dK, dV)",
            after_forward - before
        );
        drop(grads);
        drop(fwd);
    }
}

mod probe {
    use cubecl::prelude::*;

    /// Counts the iterations one loop of `n` runs.
    #[cube(launch_unchecked)]
    pub fn count_loop_iterations(out: &mut Tensor<u32>, n: u32) {
        let mut count = 0u32;
        for _ in 0..n {
            count += 1;
        }
        out[0] = count;
    }
}

/// llvmpipe (lavapipe's driver, the CPU test device) stops every loop of a kernel once the
/// kernel's loops have run 65 535 iterations together, without an error: a loop of 100 000
/// runs 65 535 times there and whole elsewhere. `DeviceLimits::loop_iterations` must know
/// it, since the portable launchers keep within it (`loop_budget`).
#[test]
fn the_device_loop_budget_is_known() {
    use cubecl::prelude::{CubeCount, CubeDim, TensorArg};
    let client = common::client();
    let limits = DeviceLimits::from_properties(client.properties());
    let n = 100_000u32;
    let out = DeviceTensor::from_bytes(&client, &[1], &0u32.to_le_bytes());
    unsafe {
        probe::count_loop_iterations::launch_unchecked(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            TensorArg::from_raw_parts(out.handle.clone(), vec![1].into(), vec![1].into()),
            n,
        );
    }
    let bytes = client.read_one(out.handle).expect("read back");
    let ran = u32::from_le_bytes(bytes[..4].try_into().unwrap());
    match limits.loop_iterations {
        Some(budget) => assert_eq!(u64::from(ran), budget, "loop of {n} on {limits:?}"),
        None => assert_eq!(ran, n, "a loop of {n} was cut short on {limits:?}"),
    }
}

/// Where the driver has a loop budget, a problem whose portable kernels would pass it is an
/// error naming the driver, from the forward and from the backward (long keys, long queries),
/// and the device keeps working (devices without a budget: the kernels crate's
/// `long_sequences_are_refused_on_llvmpipe_only` and the op's composed-path test).
#[test]
fn problems_past_the_loop_budget_are_refused() {
    let client = common::client();
    let limits = DeviceLimits::from_properties(client.properties());
    let long_keys = common::case(common::dims(1, 1, 1, 1, 40_000, 64, 64));
    let long_queries = common::case(common::dims(1, 4, 1, 40_000, 1, 64, 64));
    for case in [long_keys, long_queries] {
        if limits.loop_iterations.is_none() {
            continue;
        }
        let (qs, ks, vs, os) = shapes(&case);
        // Buffers of the right size; the launchers must refuse before touching them.
        let t = |s: &[usize]| DeviceTensor::empty(&client, s, 4);
        let (q, k, v) = (t(&qs), t(&ks), t(&vs));
        let (out, lse) = (t(&os), t(&os[..3]));
        let saved = Saved {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
        };
        let bwd = backward(
            &client,
            saved,
            &t(&os),
            FloatDtype::F32,
            case.options(),
            KernelPath::Auto,
        );
        let refused =
            |e: &FlashError| matches!(e, FlashError::Unavailable(m) if m.contains("llvmpipe"));
        // Long keys: the forward's and the dQ kernel's loops over key blocks; long queries:
        // the dK/dV kernel's loop over query blocks (their forward fits, and is not run).
        assert!(
            bwd.as_ref().is_err_and(refused),
            "backward: {:?}",
            bwd.err()
        );
        if case.dims.seq_kv > case.dims.seq_q {
            let fwd = forward(
                &client,
                &q,
                &k,
                &v,
                FloatDtype::F32,
                case.options(),
                KernelPath::Auto,
            );
            assert!(fwd.as_ref().is_err_and(refused), "forward: {:?}", fwd.err());
        }
    }
    // The device still runs a problem that fits.
    check_case(
        &client,
        &common::catalogue()[1],
        FloatDtype::F32,
        Layout::Contiguous,
        KernelPath::Portable,
    );
}

/// Problems whose dQ kernel (one query against 1920 keys) and dK/dV kernel (1488 queries
/// against 20 keys) come within 10% of the CPU driver's loop budget at d = 128 (the kernels
/// crate's `near_budget_problems_are_near_it`) run whole: were the launchers' counts short,
/// llvmpipe would cut their loops and the results would be wrong (a count that left out
/// each loop's closing test let 2048 keys through, and dQ came out infinite).
#[test]
fn problems_just_within_the_loop_budget_are_right() {
    let client = common::client();
    for dims in [
        common::dims(1, 1, 1, 1, 1920, 128, 128),
        common::dims(1, 1, 1, 1488, 20, 128, 128),
    ] {
        check_case(
            &client,
            &common::case(dims),
            FloatDtype::F32,
            Layout::Contiguous,
            KernelPath::Portable,
        );
    }
}

/// A tensor whose elements lie past 2^32 − 1 of its start (here a view whose second
/// sequence sits 2^32 elements on) is refused naming it: the kernels compute 32-bit
/// offsets, which would wrap.
#[test]
fn tensors_past_32_bit_offsets_are_refused_by_name() {
    let client = common::client();
    let t = |s: &[usize]| DeviceTensor::empty(&client, s, 4);
    let (q, k) = (t(&[2, 2, 8, 16]), t(&[2, 2, 8, 16]));
    let far = DeviceTensor {
        shape: vec![2, 2, 8, 16],
        strides: vec![1 << 32, 128, 16, 1],
        handle: k.handle.clone(),
    };
    for (arg, [q, k, v]) in [("query", [&far, &k, &k]), ("value", [&q, &k, &far])] {
        let err = forward(
            &client,
            q,
            k,
            v,
            FloatDtype::F32,
            Default::default(),
            KernelPath::Auto,
        )
        .unwrap_err();
        assert!(
            matches!(err, FlashError::Shape { arg: a, .. } if a == arg)
                && err.to_string().contains("32-bit offsets"),
            "{arg}: {err}"
        );
    }
}
