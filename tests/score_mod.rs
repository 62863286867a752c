//! Score functions written as `#[cube]` code ([`ScoreMod`]) against the f64 oracle: the
//! kernels on every path of the selected device, forward and backward with the parameters'
//! gradient; the built-in terms and masks written as score functions; the Burn op training
//! a relative-position bias under autodiff.

use std::sync::Arc;

use burn::tensor::DType;
use burn_flash_attention::kernels::reference::{self, At, HostScoreFn};
use burn_flash_attention::kernels::score_mod::{ScoreFn, ScoreMod, ScorePosition, add_grad};
use burn_flash_attention::kernels::{
    BlockMask, BlockShape, DeviceTensor, FloatDtype, KernelPath, ScoreBias, TermsGrad,
    backward::{Saved, backward_biased},
    forward::forward_biased,
};
use burn_flash_attention::{
    AttentionBias, BlockMask as OpBlockMask, FlashAttentionOptions, flash_attention_biased,
};
use cubecl::client::Client;
use cubecl::prelude::*;
use rand::Rng;

use crate::common::{
    self, Case, assert_close, assert_forward_close, assert_grads_close, case, dims, download,
    naive, poisoned, tensor, upload, values,
};

/// Distances `key − query` (queries aligned to the end of the keys) are clipped to
/// `±MAX_DISTANCE`.
const MAX_DISTANCE: i32 = 6;
const BUCKETS: usize = 2 * MAX_DISTANCE as usize + 1;

/// A learned bias per query head and clipped relative distance: `params` `[heads, BUCKETS]`.
struct RelativeBias;

#[cube]
impl ScoreMod for RelativeBias {
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        score + params[relative_cell(at, params)]
    }
    fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        1.0
    }
    fn params_grad(
        grad: f32,
        _score: f32,
        _modded: f32,
        at: &ScorePosition,
        params: &Tensor<f32>,
        grads: &mut [Atomic<f32>],
    ) {
        add_grad(grads, relative_cell(at, params), grad);
    }
    fn visible(_at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        true
    }
}

/// `key − (query + seq_kv − seq_q)`, the distance the causal mask measures.
#[cube]
fn aligned_distance(at: &ScorePosition) -> i32 {
    i32::cast_from(at.key) + i32::cast_from(at.seq_q)
        - i32::cast_from(at.query)
        - i32::cast_from(at.seq_kv)
}

#[cube]
fn relative_cell(at: &ScorePosition, params: &Tensor<f32>) -> usize {
    let bucket = clamp(aligned_distance(at), -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE;
    at.head * params.stride(0) + usize::cast_from(bucket)
}

fn host_distance([_, _, i, j]: At, seq_q: usize, seq_kv: usize) -> i64 {
    j as i64 + seq_q as i64 - i as i64 - seq_kv as i64
}

fn host_relative(params: Vec<f64>, seq_q: usize, seq_kv: usize) -> HostScoreFn {
    let cell = move |at: At| {
        let bucket = host_distance(at, seq_q, seq_kv).clamp(-6, 6) + 6;
        at[1] * BUCKETS + bucket as usize
    };
    let len = params.len();
    HostScoreFn {
        score: Arc::new(move |x, at| x + params[cell(at)]),
        grad: Arc::new(|_, _| 1.0),
        visible: Arc::new(|_| true),
        params_grad: Arc::new(move |g, _, at, out| out[cell(at)] += g),
        params_len: len,
    }
}

/// A tanh cap with a learned width `c = params[0]`: `c · tanh(x / c)`.
struct TanhCap;

#[cube]
impl ScoreMod for TanhCap {
    fn score(score: f32, _at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        let cap = params[0];
        cap * (score / cap).tanh()
    }
    fn score_grad(_score: f32, modded: f32, _at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        let t = modded / params[0];
        1.0 - t * t
    }
    fn params_grad(
        grad: f32,
        score: f32,
        modded: f32,
        _at: &ScorePosition,
        params: &Tensor<f32>,
        grads: &mut [Atomic<f32>],
    ) {
        let cap = params[0];
        let t = modded / cap;
        // d(c · tanh(x / c)) / dc = tanh(x / c) − (x / c) · (1 − tanh²(x / c)).
        add_grad(grads, 0, grad * (t - score / cap * (1.0 - t * t)));
    }
    fn visible(_at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        true
    }
}

fn host_tanh_cap(cap: f64) -> HostScoreFn {
    HostScoreFn {
        score: Arc::new(move |x, _| cap * (x / cap).tanh()),
        grad: Arc::new(move |x, _| 1.0 - (x / cap).tanh().powi(2)),
        visible: Arc::new(|_| true),
        params_grad: Arc::new(move |g, x, _, out| {
            let t = (x / cap).tanh();
            out[0] += g * (t - x / cap * (1.0 - t * t));
        }),
        params_len: 1,
    }
}

/// Packed documents as a mask: `params` `[2, n]` holds each query's document (row 0) and
/// each key's (row 1); a query sees the keys of its document.
struct Documents;

#[cube]
impl ScoreMod for Documents {
    fn score(score: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        score
    }
    fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        1.0
    }
    fn params_grad(
        _grad: f32,
        _score: f32,
        _modded: f32,
        _at: &ScorePosition,
        _params: &Tensor<f32>,
        _grads: &mut [Atomic<f32>],
    ) {
    }
    fn visible(at: &ScorePosition, params: &Tensor<f32>) -> bool {
        params[at.query] == params[params.stride(0) + at.key]
    }
}

fn host_documents(docs_q: Vec<u32>, docs_kv: Vec<u32>) -> HostScoreFn {
    HostScoreFn {
        score: Arc::new(|x, _| x),
        grad: Arc::new(|_, _| 1.0),
        visible: Arc::new(move |[_, _, i, j]| docs_q[i] == docs_kv[j]),
        params_grad: Arc::new(|_, _, _, _| {}),
        params_len: 0,
    }
}

/// ALiBi with learned slopes `params` `[1, heads]`.
struct LearnedAlibi;

#[cube]
impl ScoreMod for LearnedAlibi {
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        score - params[at.head] * f32::cast_from(Abs::abs(aligned_distance(at)))
    }
    fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        1.0
    }
    fn params_grad(
        grad: f32,
        _score: f32,
        _modded: f32,
        at: &ScorePosition,
        _params: &Tensor<f32>,
        grads: &mut [Atomic<f32>],
    ) {
        let distance = f32::cast_from(Abs::abs(aligned_distance(at)));
        add_grad(grads, at.head, -grad * distance);
    }
    fn visible(_at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        true
    }
}

/// Which function a case runs, its parameters and its host version.
#[derive(Clone, Copy, Debug)]
enum Function {
    Relative,
    TanhCap,
    /// Documents of every 11 keys; queries `0..4` belong to a document no key has.
    Documents,
    LearnedAlibi,
}

impl Function {
    fn score_fn(self) -> ScoreFn {
        match self {
            Function::Relative => ScoreFn::of::<RelativeBias>(),
            Function::TanhCap => ScoreFn::of::<TanhCap>(),
            Function::Documents => ScoreFn::of::<Documents>(),
            Function::LearnedAlibi => ScoreFn::of::<LearnedAlibi>(),
        }
    }

    /// The parameters `[rows, cols]` and the host function.
    fn params(
        self,
        d: &reference::Dims,
        rng: &mut rand::rngs::StdRng,
    ) -> (Vec<f64>, [usize; 2], HostScoreFn) {
        let f32_of = |x: f64| x as f32 as f64;
        match self {
            Function::Relative => {
                let p: Vec<f64> = (0..d.heads_q * BUCKETS)
                    .map(|_| f32_of(rng.random_range(-2.0..2.0)))
                    .collect();
                let host = host_relative(p.clone(), d.seq_q, d.seq_kv);
                (p, [d.heads_q, BUCKETS], host)
            }
            Function::TanhCap => (vec![3.0], [1, 1], host_tanh_cap(3.0)),
            Function::Documents => {
                let n = d.seq_q.max(d.seq_kv);
                let docs_q: Vec<u32> = (0..d.seq_q)
                    .map(|i| {
                        if i < 4 {
                            99
                        } else {
                            (i * 11 / d.seq_q) as u32 % 3
                        }
                    })
                    .collect();
                let docs_kv: Vec<u32> = (0..d.seq_kv).map(|j| (j / 11) as u32 % 3).collect();
                let mut p = vec![-1.0; 2 * n];
                for (i, &doc) in docs_q.iter().enumerate() {
                    p[i] = f64::from(doc);
                }
                for (j, &doc) in docs_kv.iter().enumerate() {
                    p[n + j] = f64::from(doc);
                }
                (p, [2, n], host_documents(docs_q, docs_kv))
            }
            Function::LearnedAlibi => {
                let slopes: Vec<f64> = (0..d.heads_q).map(|h| 0.5f64.powi(h as i32 + 1)).collect();
                let host = host_alibi(slopes.clone(), d.seq_q, d.seq_kv);
                (slopes, [1, d.heads_q], host)
            }
        }
    }
}

fn host_alibi(slopes: Vec<f64>, seq_q: usize, seq_kv: usize) -> HostScoreFn {
    let len = slopes.len();
    let distance = move |at: At| host_distance(at, seq_q, seq_kv).abs() as f64;
    HostScoreFn {
        score: Arc::new(move |x, at| x - slopes[at[1]] * distance(at)),
        grad: Arc::new(|_, _| 1.0),
        visible: Arc::new(|_| true),
        params_grad: Arc::new(move |g, _, at, out| out[at[1]] -= g * distance(at)),
        params_len: len,
    }
}

/// A problem with a score function; `bias` adds a trained full-shape bias tensor too.
#[derive(Clone, Copy, Debug)]
struct FnCase {
    case: Case,
    function: Function,
    learn: bool,
    bias: bool,
}

/// Small problems (lavapipe runs them in CI): s_q ≠ s_kv both ways, GQA and MQA, causal and
/// window, the built-in softcap under the function, rows the function hides completely;
/// head dims of the `mma.sync` kernels and of the warpgroup products (64, 128).
fn cases() -> Vec<FnCase> {
    vec![
        FnCase {
            case: Case {
                causal: true,
                ..case(dims(2, 4, 2, 37, 53, 40, 40))
            },
            function: Function::Relative,
            learn: true,
            bias: true,
        },
        FnCase {
            case: Case {
                window: (Some(9), Some(4)),
                softcap: Some(20.0),
                ..case(dims(1, 3, 1, 45, 30, 24, 16))
            },
            function: Function::TanhCap,
            learn: true,
            bias: false,
        },
        FnCase {
            case: Case {
                causal: true,
                ..case(dims(2, 2, 2, 29, 40, 64, 64))
            },
            function: Function::Documents,
            learn: false,
            bias: false,
        },
        FnCase {
            case: case(dims(1, 2, 1, 33, 33, 128, 128)),
            function: Function::LearnedAlibi,
            learn: true,
            bias: false,
        },
    ]
}

/// `[rows, cols]` f32 data in rows of `cols + 3` elements, viewed back through strides.
fn upload_pitched(client: &Client, data: &[f64], [rows, cols]: [usize; 2]) -> DeviceTensor {
    let pitch = cols + 3;
    let mut padded = vec![f64::NAN; rows * pitch];
    for (n, &x) in data.iter().enumerate() {
        padded[(n / cols) * pitch + n % cols] = x;
    }
    let mut t = upload(client, &padded, &[rows, pitch], FloatDtype::F32);
    t.shape = vec![rows, cols];
    t.strides = vec![pitch, 1];
    t
}

/// An f32 `[rows, cols]` tensor of any strides, read back in row-major order.
fn download_strided(client: &Client, t: &DeviceTensor) -> Vec<f64> {
    let bytes = client.read_one(t.handle.clone()).expect("read back");
    let all = common::from_bytes(&bytes, FloatDtype::F32);
    let [rows, cols] = [t.shape[0], t.shape[1]];
    (0..rows * cols)
        .map(|n| all[(n / cols) * t.strides[0] + (n % cols) * t.strides[1]])
        .collect()
}

/// Forward and backward of `t` on `path` (outputs poisoned first) against the oracle.
fn check(client: &Client, t: &FnCase, dtype: FloatDtype, path: KernelPath) {
    let d = t.case.dims;
    if path == KernelPath::RegisterMma && !(d.dim_qk % 8 == 0 && d.dim_v % 8 == 0) {
        return;
    }
    let (seed, mut rng) = common::rng();
    let context = format!("seed {seed} (FLASH_SEED={seed} reproduces), {path:?}, {dtype:?}, {t:?}");
    let x: Vec<Vec<f64>> = [d.q_len(), d.k_len(), d.v_len(), d.o_len()]
        .into_iter()
        .map(|n| common::randn(&mut rng, n, dtype))
        .collect();
    let (params, params_shape, host) = t.function.params(&d, &mut rng);
    let full = [d.batch, d.heads_q, d.seq_q, d.seq_kv];
    let bias_data: Option<Vec<f64>> = t.bias.then(|| {
        (0..full.iter().product())
            .map(|_| common::round(rng.random_range(-1.0..1.0), dtype))
            .collect()
    });
    let qs = [d.batch, d.heads_q, d.seq_q, d.dim_qk];
    let ks = [d.batch, d.heads_kv, d.seq_kv, d.dim_qk];
    let vs = [d.batch, d.heads_kv, d.seq_kv, d.dim_v];
    let os = [d.batch, d.heads_q, d.seq_q, d.dim_v];
    let q = upload(client, &x[0], &qs, dtype);
    let k = upload(client, &x[1], &ks, dtype);
    let v = upload(client, &x[2], &vs, dtype);
    let d_out = upload(client, &x[3], &os, dtype);
    let bias = bias_data.as_ref().map(|b| upload(client, b, &full, dtype));
    // The parameters in rows longer than theirs, as a pitched device allocation lays them
    // out: the function indexes them, and their gradient, through the strides.
    let params_t = upload_pitched(client, &params, params_shape);
    let terms = ScoreBias {
        bias: bias.as_ref(),
        score_mod: Some(t.function.score_fn()),
        score_params: Some(&params_t),
        ..ScoreBias::none()
    };
    for shape in [&os[..], &os[..3]] {
        drop(poisoned(client, shape, dtype));
    }
    let fwd = forward_biased(client, &q, &k, &v, terms, dtype, t.case.options(), path)
        .unwrap_or_else(|e| panic!("forward: {e} — {context}"));
    for shape in [&qs[..], &ks[..], &vs[..]] {
        drop(poisoned(client, shape, dtype));
    }
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &fwd.out,
        lse: &fwd.lse,
    };
    let grad = TermsGrad {
        bias: t.bias,
        score_params: t.learn,
    };
    let (grads, of_terms) = backward_biased(
        client,
        saved,
        &d_out,
        terms,
        grad,
        dtype,
        t.case.options(),
        path,
    )
    .unwrap_or_else(|e| panic!("backward: {e} — {context}"));

    let opts = reference::ReferenceOptions {
        bias: bias_data
            .clone()
            .map(|data| reference::Broadcast4 { data, shape: full }),
        score_fn: Some(host.clone()),
        ..t.case.reference_options()
    };
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let want_grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    let bias_at = |b: usize, h: usize, i: usize, j: usize| match &bias_data {
        Some(data) => data[((b * d.heads_q + h) * d.seq_q + i) * d.seq_kv + j],
        None => 0.0,
    };
    let low = naive::attention_with_score_fn(
        &t.case,
        dtype,
        [&x[0], &x[1], &x[2], &x[3]],
        &bias_at,
        Some(&host),
    );

    let got_out = download(client, &fwd.out, dtype);
    let got_lse = download(client, &fwd.lse, FloatDtype::F32);
    let [got_dq, got_dk, got_dv] =
        [&grads.dq, &grads.dk, &grads.dv].map(|t| download(client, t, dtype));
    assert_forward_close(dtype, (&got_out, &got_lse), &want, &low, &context);
    assert_grads_close(
        dtype,
        [&got_dq, &got_dk, &got_dv],
        &want_grads,
        &low,
        &context,
    );
    if t.bias {
        let got = download(
            client,
            of_terms.bias.as_ref().expect("d(bias)"),
            FloatDtype::F32,
        );
        let want = want_grads.d_bias.as_ref().expect("the oracle's d(bias)");
        // The naive reference's d(bias): its logits' gradient through the function.
        let low_db: Vec<f64> = low
            .dlogits
            .iter()
            .enumerate()
            .map(|(n, &g)| {
                let (j, i) = (n % d.seq_kv, n / d.seq_kv % d.seq_q);
                let h = n / (d.seq_kv * d.seq_q) % d.heads_q;
                let b = n / (d.seq_kv * d.seq_q * d.heads_q);
                g * (host.grad)(0.0, [b, h, i, j])
            })
            .collect();
        assert_close(dtype, "dBias", &got, want, &low_db, 1e-4, &context);
    }
    match (t.learn, &of_terms.score_params) {
        (true, Some(dp)) => {
            assert_eq!(
                dp.strides, params_t.strides,
                "the gradient's layout — {context}"
            );
            let got = download_strided(client, dp);
            let want = want_grads
                .d_score_params
                .as_ref()
                .expect("the oracle's gradient");
            // FlashAttention's rule, each parameter's gradient (one sum over the scores)
            // also allowed the rounding bound of its sum.
            common::assert_close_sums(
                "dParams",
                &got,
                want,
                &low.dparams,
                &low.dparams_abs,
                dtype,
                1e-4,
                &context,
            );
        }
        (false, None) => {}
        (asked, got) => panic!(
            "asked for the parameters' gradient: {asked}, got one: {} — {context}",
            got.is_some()
        ),
    }
    // Rows the function hides completely: O = 0, LSE = −∞, dQ = 0, never NaN.
    common::assert_hidden_rows(
        &want.lse,
        [&got_lse, &got_out, &got_dq],
        [d.dim_v, d.dim_qk],
        &context,
    );
    eprintln!("{path:?} {dtype:?} {t:?}: ok");
}

#[test]
fn score_functions_match_the_oracle_on_every_path() {
    let client = common::client();
    for t in cases() {
        for dtype in common::dtypes(&client) {
            // lavapipe computes half precision slowly: f32 there (the GPU runs them all).
            if common::is_cpu_device() && dtype != FloatDtype::F32 {
                continue;
            }
            for path in common::paths(&client, dtype) {
                check(&client, &t, dtype, path);
            }
        }
    }
}

/// The same scores two ways, forward and backward: a score function and the built-in term
/// it writes out (ALiBi; documents as a block mask).
#[test]
fn score_functions_express_the_built_in_terms() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let (seed, mut rng) = common::rng();
    let d = dims(2, 2, 1, 40, 56, 16, 16);
    let t = Case {
        causal: true,
        ..case(d)
    };
    let x: Vec<Vec<f64>> = [d.q_len(), d.k_len(), d.v_len(), d.o_len()]
        .into_iter()
        .map(|n| common::randn(&mut rng, n, dtype))
        .collect();
    let shapes = [
        [d.batch, d.heads_q, d.seq_q, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_v],
        [d.batch, d.heads_q, d.seq_q, d.dim_v],
    ];
    let [q, k, v, d_out] = [0, 1, 2, 3].map(|n| upload(&client, &x[n], &shapes[n], dtype));
    let run = |terms: ScoreBias<'_>| {
        let fwd = forward_biased(
            &client,
            &q,
            &k,
            &v,
            terms,
            dtype,
            t.options(),
            KernelPath::Auto,
        )
        .unwrap();
        let saved = Saved {
            q: &q,
            k: &k,
            v: &v,
            out: &fwd.out,
            lse: &fwd.lse,
        };
        let (grads, _) = backward_biased(
            &client,
            saved,
            &d_out,
            terms,
            TermsGrad::default(),
            dtype,
            t.options(),
            KernelPath::Auto,
        )
        .unwrap();
        [&fwd.out, &grads.dq, &grads.dk, &grads.dv].map(|g| download(&client, g, dtype))
    };
    let slopes = [0.5, 0.25];
    let slopes_t = upload(&client, &slopes, &[1, 2], FloatDtype::F32);
    let docs_q: Vec<u32> = (0..d.seq_q).map(|i| (i / 15) as u32).collect();
    let docs_kv: Vec<u32> = (0..d.seq_kv).map(|j| (j / 19) as u32).collect();
    let n = d.seq_kv;
    let mut docs = vec![-1.0; 2 * n];
    for (i, &doc) in docs_q.iter().enumerate() {
        docs[i] = f64::from(doc);
    }
    for (j, &doc) in docs_kv.iter().enumerate() {
        docs[n + j] = f64::from(doc);
    }
    let docs_t = upload(&client, &docs, &[2, n], FloatDtype::F32);
    let blocks = BlockShape {
        block_q: 128,
        block_kv: 128,
    };
    let host_mask = BlockMask::documents(&[docs_q.clone()], &[docs_kv.clone()], false, blocks)
        .expect("a block mask");
    let device_mask = host_mask.upload(&client);
    let pairs = [
        (
            "ALiBi",
            ScoreBias {
                alibi_slopes: Some(&slopes_t),
                ..ScoreBias::none()
            },
            ScoreBias {
                score_mod: Some(ScoreFn::of::<LearnedAlibi>()),
                score_params: Some(&slopes_t),
                ..ScoreBias::none()
            },
        ),
        (
            "documents",
            ScoreBias {
                block_mask: Some(&device_mask),
                ..ScoreBias::none()
            },
            ScoreBias {
                score_mod: Some(ScoreFn::of::<Documents>()),
                score_params: Some(&docs_t),
                ..ScoreBias::none()
            },
        ),
    ];
    for (what, built_in, as_code) in pairs {
        let (want, got) = (run(built_in), run(as_code));
        for (name, got, want) in ["O", "dQ", "dK", "dV"]
            .into_iter()
            .zip(&got)
            .zip(&want)
            .map(|((n, g), w)| (n, g, w))
        {
            let err = common::max_abs_diff(got, want);
            assert!(err < 1e-5, "{what}, {name}: error {err:.3e} (seed {seed})");
        }
    }
}

/// Bad arguments are named, and the device keeps working.
#[test]
fn score_function_arguments_are_checked() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let d = dims(1, 2, 2, 8, 8, 16, 16);
    let q = upload(&client, &vec![0.1; d.q_len()], &[1, 2, 8, 16], dtype);
    let params = upload(&client, &[0.0; 2 * BUCKETS], &[2, BUCKETS], FloatDtype::F32);
    let f = Some(ScoreFn::of::<RelativeBias>());
    let saved_out = forward_biased(
        &client,
        &q,
        &q,
        &q,
        ScoreBias::none(),
        dtype,
        case(d).options(),
        KernelPath::Auto,
    )
    .unwrap();
    let saved = Saved {
        q: &q,
        k: &q,
        v: &q,
        out: &saved_out.out,
        lse: &saved_out.lse,
    };
    let deterministic = Case {
        deterministic: true,
        ..case(d)
    };
    let learn = TermsGrad {
        score_params: true,
        ..TermsGrad::default()
    };
    let without_fn = ScoreBias {
        score_params: Some(&params),
        ..ScoreBias::none()
    };
    let without_params = ScoreBias {
        score_mod: f,
        ..ScoreBias::none()
    };
    let with_both = ScoreBias {
        score_mod: f,
        score_params: Some(&params),
        ..ScoreBias::none()
    };
    for (terms, options, arg) in [
        (without_fn, case(d), "score_params"),
        (without_params, case(d), "score_params_grad"),
        (with_both, deterministic, "deterministic"),
    ] {
        let err = backward_biased(
            &client,
            saved,
            &q,
            terms,
            learn,
            dtype,
            options.options(),
            KernelPath::Auto,
        )
        .err()
        .unwrap_or_else(|| panic!("`{arg}` was not refused"));
        assert!(err.to_string().contains(arg), "{err}");
    }
    // The device still runs a call with the function.
    forward_biased(
        &client,
        &q,
        &q,
        &q,
        with_both,
        dtype,
        case(d).options(),
        KernelPath::Auto,
    )
    .expect("a forward with the function");
}

/// The Burn op under autodiff trains a relative-position table `[heads, BUCKETS]` (in bf16
/// on devices with it, f32 on lavapipe), and Q, K, V, with the gradients the oracle gives.
#[test]
fn the_op_trains_a_relative_position_bias() {
    let device = common::burn_device().autodiff();
    let (seed, mut rng) = common::rng();
    let d = dims(2, 2, 1, 19, 27, 16, 16);
    let t = Case {
        causal: true,
        ..case(d)
    };
    let x: [Vec<f64>; 4] = [d.q_len(), d.k_len(), d.v_len(), d.o_len()]
        .map(|n| common::randn(&mut rng, n, FloatDtype::F32));
    let (table, _, host) = Function::Relative.params(&d, &mut rng);
    let q = tensor(&x[0], [2, 2, 19, 16], &device).require_grad();
    let k = tensor(&x[1], [2, 1, 27, 16], &device).require_grad();
    let v = tensor(&x[2], [2, 1, 27, 16], &device).require_grad();
    let d_out = tensor(&x[3], [2, 2, 19, 16], &device);
    let params = tensor(&table, [2, BUCKETS], &device).require_grad();
    let terms = AttentionBias::new()
        .with_score_mod::<RelativeBias>()
        .with_score_params(params.clone());
    let o = flash_attention_biased(
        q.clone(),
        k.clone(),
        v.clone(),
        terms,
        FlashAttentionOptions::default().with_causal(true),
    );
    let grads = (o.clone() * d_out).sum().backward();
    let opts = reference::ReferenceOptions {
        score_fn: Some(host),
        ..t.reference_options()
    };
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let want_grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    let got = [
        values(o),
        values(q.grad(&grads).unwrap()),
        values(k.grad(&grads).unwrap()),
        values(v.grad(&grads).unwrap()),
        values(params.grad(&grads).unwrap()),
    ];
    let wanted = [
        &want.out,
        &want_grads.dq,
        &want_grads.dk,
        &want_grads.dv,
        want_grads.d_score_params.as_ref().unwrap(),
    ];
    for ((what, got), want) in ["O", "dQ", "dK", "dV", "dTable"]
        .iter()
        .zip(&got)
        .zip(wanted)
    {
        let err = common::max_abs_diff(got, want);
        assert!(err < 2e-4, "{what}: error {err:.3e} (seed {seed})");
    }
}

/// A score function needs the fused kernels: the composed path refuses it by name.
#[test]
fn the_composed_path_names_the_score_function() {
    let device = burn::tensor::Device::flex();
    let q = burn::tensor::Tensor::<4>::zeros([1, 1, 4, 8], (&device, DType::F32));
    let terms = AttentionBias::new().with_score_mod::<TanhCap>();
    let err = std::panic::catch_unwind(|| {
        flash_attention_biased(
            q.clone(),
            q.clone(),
            q,
            terms,
            FlashAttentionOptions::default(),
        )
    })
    .expect_err("the composed path took a score function");
    let message = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("TanhCap"), "{message}");
    let _ = OpBlockMask::new;
}
