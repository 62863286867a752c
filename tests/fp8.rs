//! FP8 attention through the Burn ops: the values quantization keeps, attention on them
//! against the oracle, and the gradients passed straight through to float inputs.

use burn::tensor::{DType, Device};
use burn_flash_attention::kernels::{FloatDtype, reference};
use burn_flash_attention::{
    FlashAttentionOptions, Fp8Scaling, flash_attention, flash_attention_fp8,
    flash_attention_fp8_trained, quantize_fp8,
};
use float8::F8E4M3;

use crate::common::{
    self, Case, assert_close, assert_grads_close, case, dims, naive, tensor, values,
};

/// Largest E4M3 magnitude: quantization maps a block's largest magnitude to it.
const E4M3_MAX: f64 = 448.0;

/// Causal, GQA 4:2, s_q < s_kv, head dim 40 (per-row scales of 40 values).
fn problem() -> Case {
    Case {
        causal: true,
        ..case(dims(2, 4, 2, 37, 53, 40, 40))
    }
}

fn options(case: &Case) -> FlashAttentionOptions {
    FlashAttentionOptions::default().with_causal(case.causal)
}

/// Standard normal values with one in a thousand (and the first) ten times larger: the
/// outliers FP8's scales must absorb.
fn with_outliers(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f64> {
    use rand::Rng;
    let mut x = common::randn(rng, n, FloatDtype::F32);
    for (i, value) in x.iter_mut().enumerate() {
        if i == 0 || rng.random::<f64>() < 1e-3 {
            *value *= 10.0;
        }
    }
    x
}

/// Checks that `fp8` (dequantized) holds each of `x`'s values as an E4M3 value times its
/// block's scale (the block's largest magnitude over 448), rounded to the nearest; returns
/// the root-mean-square error.
fn check_fp8_values(x: &[f64], fp8: &[f64], block: usize, context: &str) -> f64 {
    let mut squares = 0.0;
    for (xs, qs) in x.chunks(block).zip(fp8.chunks(block)) {
        let scale = xs.iter().fold(0.0f64, |m, v| m.max(v.abs())) / E4M3_MAX;
        for (&x, &q) in xs.iter().zip(qs) {
            let code = q / scale;
            let nearest = F8E4M3::from_f64(x / scale).to_f64();
            // The scale is computed in f32 on the device: allow its rounding.
            assert!(
                (code - nearest).abs() <= 1e-5 * nearest.abs().max(1.0),
                "{x} quantized to {q} ({code} × scale {scale}), expected {nearest} × scale \
                 — {context}"
            );
            squares += (q - x).powi(2);
        }
    }
    (squares / x.len() as f64).sqrt()
}

#[test]
fn quantization_keeps_the_nearest_e4m3_values() {
    let device = common::burn_device();
    let (seed, mut rng) = common::rng();
    let shape = [2, 3, 9, 40];
    let n = shape.iter().product();
    let x = with_outliers(&mut rng, n);
    let mut errors = Vec::new();
    for (scaling, block) in [(Fp8Scaling::PerTensor, n), (Fp8Scaling::PerRow, 40)] {
        let context = format!("seed {seed}, {scaling:?}");
        let q = quantize_fp8(tensor(&x, shape, &device), scaling);
        assert!(
            matches!(q.dtype(), DType::QFloat(_)),
            "{:?} — {context}",
            q.dtype()
        );
        let fp8 = values(q.dequantize());
        errors.push(check_fp8_values(&x, &fp8, block, &context));
    }
    // The outlier coarsens every value under one scale, only its own row under row scales.
    assert!(
        errors[1] < errors[0],
        "row scales gave RMSE {} against the tensor scale's {} (seed {seed})",
        errors[1],
        errors[0]
    );
}

/// Q, K, V and the upstream gradient of `case`, with outliers.
fn inputs(case: &Case, rng: &mut rand::rngs::StdRng) -> [Vec<f64>; 4] {
    let d = &case.dims;
    [d.q_len(), d.k_len(), d.v_len(), d.o_len()].map(|n| with_outliers(rng, n))
}

fn shapes(case: &Case) -> [[usize; 4]; 4] {
    let d = &case.dims;
    [
        [d.batch, d.heads_q, d.seq_q, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_qk],
        [d.batch, d.heads_kv, d.seq_kv, d.dim_v],
        [d.batch, d.heads_q, d.seq_q, d.dim_v],
    ]
}

/// The FP8 values of `x` (quantized on `device` with `scaling`, dequantized).
fn fp8_values(x: &[f64], shape: [usize; 4], scaling: Fp8Scaling, device: &Device) -> Vec<f64> {
    values(quantize_fp8(tensor(x, shape, device), scaling).dequantize())
}

#[test]
fn fp8_attention_is_attention_on_the_fp8_values() {
    let device = common::burn_device();
    let case = problem();
    let (seed, mut rng) = common::rng();
    let x = inputs(&case, &mut rng);
    let shape = shapes(&case);
    for scaling in [Fp8Scaling::PerTensor, Fp8Scaling::PerRow] {
        let context = format!("seed {seed}, {scaling:?}, {case:?}");
        let [q, k, v] = [0, 1, 2].map(|i| quantize_fp8(tensor(&x[i], shape[i], &device), scaling));
        let fp8 = [&q, &k, &v].map(|t| values(t.clone().dequantize()));
        let out = flash_attention_fp8(q, k, v, options(&case), DType::F32);
        assert_eq!(out.dtype(), DType::F32, "{context}");
        let got = values(out);
        let want = reference::forward(
            &case.dims,
            &case.reference_options(),
            &fp8[0],
            &fp8[1],
            &fp8[2],
        );
        let low = naive::attention(&case, FloatDtype::F32, &fp8[0], &fp8[1], &fp8[2], &x[3]);
        assert_close(
            FloatDtype::F32,
            "O",
            &got,
            &want.out,
            &low.out,
            2e-5,
            &context,
        );
        // Against the exact inputs, the error is FP8's: bounded by its rounding (2^-4 of a
        // value) spread through the softmax, far above f32's.
        let exact = reference::forward(&case.dims, &case.reference_options(), &x[0], &x[1], &x[2]);
        let err = common::max_abs_diff(&got, &exact.out);
        let magnitude = exact.out.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(
            err < 0.25 * magnitude && err > 1e-4 * magnitude,
            "FP8 error {err} against the exact inputs (largest output {magnitude}) — {context}"
        );
    }
}

#[test]
fn fp8_training_passes_the_gradients_straight_through() {
    let device = common::burn_device().autodiff();
    let case = problem();
    let (seed, mut rng) = common::rng();
    let x = inputs(&case, &mut rng);
    let shape = shapes(&case);
    let scaling = Fp8Scaling::PerRow;
    let context = format!("seed {seed}, {case:?}");
    let [q, k, v] = [0, 1, 2].map(|i| tensor(&x[i], shape[i], &device).require_grad());
    let g = tensor(&x[3], shape[3], &device);
    let out = flash_attention_fp8_trained(q.clone(), k.clone(), v.clone(), scaling, options(&case));
    let grads = (out.clone() * g).sum().backward();
    let got = [
        values(out),
        values(q.grad(&grads).unwrap()),
        values(k.grad(&grads).unwrap()),
        values(v.grad(&grads).unwrap()),
    ];
    // Attention and its gradients at the FP8 values.
    let fp8 = [0, 1, 2].map(|i| fp8_values(&x[i], shape[i], scaling, &device));
    let opts = case.reference_options();
    let want = reference::forward(&case.dims, &opts, &fp8[0], &fp8[1], &fp8[2]);
    let grad = reference::backward(&case.dims, &opts, &fp8[0], &fp8[1], &fp8[2], &x[3]);
    let low = naive::attention(&case, FloatDtype::F32, &fp8[0], &fp8[1], &fp8[2], &x[3]);
    assert_close(
        FloatDtype::F32,
        "O",
        &got[0],
        &want.out,
        &low.out,
        2e-5,
        &context,
    );
    assert_grads_close(
        FloatDtype::F32,
        [&got[1], &got[2], &got[3]],
        &grad,
        &low,
        &context,
    );
    // The same call as the op on those values, where the op runs fused.
    let [fq, fk, fv] = [0, 1, 2].map(|i| tensor(&fp8[i], shape[i], &device));
    let direct = values(flash_attention(fq, fk, fv, options(&case)));
    assert_eq!(direct, got[0], "{context}");
}
