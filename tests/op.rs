//! The Burn op: forward and autodiff gradients against the oracle on the selected device,
//! the composed fallback on Flex against the fused op, misuse messages, and the module.

use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_flash_attention::kernels::{FloatDtype, reference};
use burn_flash_attention::{
    AttentionBias, FlashAttentionOptions, FlashMultiHeadAttentionConfig, flash_attention,
    flash_attention_biased, flash_attention_with_lse, supports_flash_attention,
};

use crate::common::{self, Case, assert_forward_close, assert_grads_close, naive};

fn tensor(data: &[f64], shape: [usize; 4], device: &Device) -> Tensor<4> {
    let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(data, shape), device)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

fn options(case: &Case) -> FlashAttentionOptions {
    FlashAttentionOptions::default()
        .with_scale(case.scale.map(|s| s as f32))
        .with_causal(case.causal)
        .with_window(case.window.0, case.window.1)
        .with_softcap(case.softcap.map(|c| c as f32))
}

struct Run {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Forward with LSE, then `Σ O ⊙ G` backward, on `device` (made autodiff here). `bshd`
/// builds Q as a `[b, s, h, d]` tensor viewed through `swap_dims(1, 2)`.
fn run(device: &Device, case: &Case, x: &[Vec<f64>; 4], bshd: bool) -> Run {
    let device = device.clone().autodiff();
    let d = &case.dims;
    let q = if bshd {
        let bshd_data = tensor(&x[0], [d.batch, d.heads_q, d.seq_q, d.dim_qk], &device)
            .swap_dims(1, 2)
            .into_data();
        Tensor::<4>::from_data(bshd_data, &device).swap_dims(1, 2)
    } else {
        tensor(&x[0], [d.batch, d.heads_q, d.seq_q, d.dim_qk], &device)
    }
    .require_grad();
    let k = tensor(&x[1], [d.batch, d.heads_kv, d.seq_kv, d.dim_qk], &device).require_grad();
    let v = tensor(&x[2], [d.batch, d.heads_kv, d.seq_kv, d.dim_v], &device).require_grad();
    let g = tensor(&x[3], [d.batch, d.heads_q, d.seq_q, d.dim_v], &device);
    let (out, lse) = flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options(case));
    let grads = (out.clone() * g).sum().backward();
    Run {
        out: values(out),
        lse: values(lse),
        dq: values(q.grad(&grads).unwrap()),
        dk: values(k.grad(&grads).unwrap()),
        dv: values(v.grad(&grads).unwrap()),
    }
}

fn cases() -> Vec<Case> {
    let catalogue = common::catalogue();
    // GQA causal with s_q > s_kv (fully masked rows), d = 64; window + softcap + scale, d = 111;
    // causal with s_q > s_kv at d = 128 (several key blocks).
    vec![catalogue[4], catalogue[7], catalogue[11]]
}

fn random_inputs(case: &Case, rng: &mut rand::rngs::StdRng) -> [Vec<f64>; 4] {
    let d = &case.dims;
    let f = FloatDtype::F32;
    [d.q_len(), d.k_len(), d.v_len(), d.o_len()].map(|n| common::randn(rng, n, f))
}

#[test]
fn fused_op_and_gradients_match_the_oracle() {
    let device = common::burn_device();
    assert!(
        supports_flash_attention(&device),
        "{device:?} should run the fused kernels"
    );
    for case in cases() {
        for bshd in [false, true] {
            check_against_oracle(&device, &case, bshd);
        }
    }
}

/// The op's output, LSE and gradients on fresh random inputs against the oracle.
fn check_against_oracle(device: &Device, case: &Case, bshd: bool) {
    let (seed, mut rng) = common::rng();
    let context = format!("seed {seed}, bshd={bshd}, {case:?}");
    let x = random_inputs(case, &mut rng);
    let got = run(device, case, &x, bshd);
    let opts = case.reference_options();
    let want = reference::forward(&case.dims, &opts, &x[0], &x[1], &x[2]);
    let grads = reference::backward(&case.dims, &opts, &x[0], &x[1], &x[2], &x[3]);
    let low = naive::attention(case, FloatDtype::F32, &x[0], &x[1], &x[2], &x[3]);
    let f32 = FloatDtype::F32;
    assert_forward_close(f32, (&got.out, &got.lse), &want, &low, &context);
    assert_grads_close(f32, [&got.dq, &got.dk, &got.dv], &grads, &low, &context);
}

/// A batch of more (sequence, query head) pairs than one grid dimension holds (65 535): the
/// kernels spread the pairs over two. Outputs and gradients of sequences on both sides of
/// the first dimension's end equal those of the same sequences run alone, plain and with
/// per-sequence terms (a key padding mask and ALiBi slopes per sequence).
#[test]
fn batches_past_one_grid_dimension_match_their_sequences_alone() {
    let device = common::burn_device().autodiff();
    // 4100 · 16 = 65 600 pairs: the pairs of sequences 4095 and on lie past 65 535.
    let (batch, heads_q, heads_kv, s_q, s_kv, d) = (4100, 16, 4, 2, 3, 8);
    let (seed, mut rng) = common::rng();
    let shapes = [
        [batch, heads_q, s_q, d],
        [batch, heads_kv, s_kv, d],
        [batch, heads_kv, s_kv, d],
    ];
    let [q, k, v] = shapes.map(|shape| {
        let x = common::randn(&mut rng, shape.iter().product(), FloatDtype::F32);
        tensor(&x, shape, &device).require_grad()
    });
    // Odd sequences hide their last key; slopes differ per sequence and head.
    let padding: Vec<bool> = (0..batch * s_kv)
        .map(|n| n / s_kv % 2 == 1 && n % s_kv == s_kv - 1)
        .collect();
    let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [batch, s_kv]), &device);
    let slopes: Vec<f32> = (0..batch * heads_q)
        .map(|n| 0.25 + (n % 7) as f32 / 8.0)
        .collect();
    let slopes = Tensor::<2>::from_data(TensorData::new(slopes, [batch, heads_q]), &device);
    let options = FlashAttentionOptions::default().with_causal(true);
    let tail = 4090..batch;
    for terms in [false, true] {
        // Attention of the sequences `range`, their outputs and gradients.
        let run = |range: std::ops::Range<usize>, [q, k, v]: [Tensor<4>; 3]| {
            let out = match terms {
                false => flash_attention(q.clone(), k.clone(), v.clone(), options),
                true => {
                    let bias = AttentionBias::new()
                        .with_key_padding(padding.clone().slice([range.clone()]))
                        .with_alibi(slopes.clone().slice([range.clone()]));
                    flash_attention_biased(q.clone(), k.clone(), v.clone(), bias, options)
                }
            };
            let grads = out.clone().sum().backward();
            let pick =
                |t: Tensor<4>| values(t.slice([tail.start - range.start..tail.end - range.start]));
            [
                pick(out),
                pick(q.grad(&grads).unwrap()),
                pick(k.grad(&grads).unwrap()),
                pick(v.grad(&grads).unwrap()),
            ]
        };
        let got = run(0..batch, [q.clone(), k.clone(), v.clone()]);
        let alone = [&q, &k, &v].map(|t| t.clone().slice([tail.clone()]).detach().require_grad());
        let want = run(tail.clone(), alone);
        for (name, (g, w)) in ["O", "dQ", "dK", "dV"].iter().zip(got.iter().zip(&want)) {
            let err = common::max_abs_diff(g, w);
            let scale = w.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            assert!(
                err <= 1e-5 * scale,
                "{name} of sequences {tail:?} (terms: {terms}) is off by {err} from them run \
                 alone (seed {seed})"
            );
        }
    }
}

#[test]
fn fallback_backend_gives_the_same_results() {
    let fused = common::burn_device();
    let flex = Device::flex();
    assert!(!supports_flash_attention(&flex));
    for case in cases() {
        let (seed, mut rng) = common::rng();
        let context = format!("seed {seed}, {case:?}");
        let x = random_inputs(&case, &mut rng);
        let a = run(&fused, &case, &x, false);
        let b = run(&flex, &case, &x, false);
        for (what, p, q) in [
            ("O", &a.out, &b.out),
            ("LSE", &a.lse, &b.lse),
            ("dQ", &a.dq, &b.dq),
            ("dK", &a.dk, &b.dk),
            ("dV", &a.dv, &b.dv),
        ] {
            let err = common::max_abs_diff(p, q);
            assert!(
                err < 1e-4,
                "{what}: fused vs fallback differ by {err:.3e} — {context}"
            );
        }
    }
}

fn small(device: &Device, shape: [usize; 4]) -> Tensor<4> {
    Tensor::zeros(shape, device)
}

#[test]
#[should_panic(expected = "`key`")]
fn mismatched_head_dims_name_the_argument() {
    let device = common::burn_device();
    flash_attention(
        small(&device, [1, 2, 4, 8]),
        small(&device, [1, 2, 4, 16]),
        small(&device, [1, 2, 4, 8]),
        Default::default(),
    );
}

#[test]
#[should_panic(expected = "GQA")]
fn head_ratio_is_checked() {
    let device = common::burn_device();
    flash_attention(
        small(&device, [1, 3, 4, 8]),
        small(&device, [1, 2, 4, 8]),
        small(&device, [1, 2, 4, 8]),
        Default::default(),
    );
}

#[test]
#[should_panic(expected = "`v` has dtype")]
fn mixed_dtypes_are_refused() {
    let device = common::burn_device();
    let v = small(&device, [1, 2, 4, 8]).cast(burn::tensor::FloatDType::F16);
    flash_attention(
        small(&device, [1, 2, 4, 8]),
        small(&device, [1, 2, 4, 8]),
        v,
        Default::default(),
    );
}

#[test]
fn module_trains() {
    use burn::optim::{AdamConfig, GradientsParams};
    let device = common::burn_device().autodiff();
    let (seed, mut rng) = common::rng();
    let mut model = FlashMultiHeadAttentionConfig::new(32, 4)
        .with_n_kv_heads(Some(2))
        .with_causal(true)
        .init(&device);
    let mut optim = AdamConfig::new().init();
    let x = tensor(
        &common::randn(&mut rng, 2 * 16 * 32, FloatDtype::F32),
        [1, 2, 16, 32],
        &device,
    )
    .reshape([2, 16, 32]);
    // Learn the identity map through attention.
    let mut losses = Vec::new();
    for _ in 0..30 {
        let loss = (model.forward(x.clone()) - x.clone()).powi_scalar(2).mean();
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    assert!(
        losses.iter().all(|l| l.is_finite()),
        "{losses:?} (seed {seed})"
    );
    assert!(
        losses[29] < 0.5 * losses[0],
        "loss did not fall: {losses:?} (seed {seed})"
    );
}

/// A problem past the CPU driver's loop budget (lavapipe: two queries against 20 000 keys)
/// is refused by the kernels there, and the op takes its composed path instead: forward and
/// gradients still match the oracle. On GPUs the fused kernels run it.
#[test]
fn problems_past_the_loop_budget_take_the_composed_path() {
    use burn_flash_attention::kernels::{AttentionProblem, DeviceLimits, loop_budget};
    let device = common::burn_device();
    let case = common::case(common::dims(1, 2, 1, 2, 20_000, 64, 64));
    let d = &case.dims;
    let problem = AttentionProblem::new(
        &[d.batch, d.heads_q, d.seq_q, d.dim_qk],
        &[d.batch, d.heads_kv, d.seq_kv, d.dim_qk],
        &[d.batch, d.heads_kv, d.seq_kv, d.dim_v],
        FloatDtype::F32,
        case.options(),
    )
    .unwrap();
    let limits = DeviceLimits::from_properties(common::client().properties());
    assert_eq!(
        loop_budget::check_problem(&problem, &limits).is_err(),
        limits.loop_iterations.is_some(),
        "{limits:?}"
    );

    check_against_oracle(&device, &case, false);
}

/// `warm_up` runs each kind of call (training step, packed batch, paged decode with rotary)
/// on the test device.
#[test]
fn warm_up_runs_each_kind_of_call() {
    use burn_flash_attention::{WarmUp, warm_up};
    let device = common::burn_device();
    let causal = FlashAttentionOptions::default().with_causal(true);
    warm_up(
        &device,
        burn::tensor::DType::F32,
        &[
            WarmUp::Attention {
                q: [1, 4, 33, 32],
                k: [1, 2, 40, 32],
                v: [1, 2, 40, 32],
                options: causal,
                backward: true,
            },
            WarmUp::Varlen {
                lengths_q: vec![5, 0, 17],
                lengths_k: vec![9, 3, 17],
                heads: [4, 2],
                dims: [32, 32],
                options: causal,
                backward: true,
            },
            WarmUp::Decode {
                batch: 2,
                new_tokens: 1,
                capacity: 48,
                page_size: Some(16),
                heads: [4, 2],
                dims: [32, 32],
                append: true,
                rotary: Some((16, false)),
                options: causal,
            },
        ],
    );
}

#[test]
#[should_panic(expected = "`key`")]
fn warm_up_refuses_what_the_call_would() {
    use burn_flash_attention::{WarmUp, warm_up};
    warm_up(
        &common::burn_device(),
        burn::tensor::DType::F32,
        &[WarmUp::Attention {
            q: [1, 2, 8, 16],
            k: [1, 2, 8, 8],
            v: [1, 2, 8, 16],
            options: FlashAttentionOptions::default(),
            backward: false,
        }],
    );
}
