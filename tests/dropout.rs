//! Dropout on the probabilities against the f64 oracle with the host's keep-mask: the
//! kernels on every path of the selected device, the keep-mask read off the kernels
//! directly, and the Burn op and module under autodiff, fused and composed.

use burn::module::Module;
use burn::nn::DropoutConfig;
use burn::tensor::Device;
use burn_flash_attention::kernels::{
    AttentionOptions, FloatDtype, KernelPath,
    dropout::{Dropout, philox},
    forward::forward,
    reference::{self, Broadcast4},
};
use burn_flash_attention::{
    AttentionBias, FlashAttentionOptions, FlashMultiHeadAttention, FlashMultiHeadAttentionConfig,
    flash_attention_biased, seed_dropout,
};

use crate::common::{self, Case, case, dims, download, tensor, upload, values};
use crate::kernels::{Layout, check_case};

fn dropout(p: f32, seed: u64, offset: u32) -> Option<Dropout> {
    Some(Dropout { p, seed, offset })
}

/// Small problems (lavapipe runs them in CI): s_q ≠ s_kv both ways, GQA, causal rows that
/// see no key, window and softcap, odd head dims.
fn cases() -> Vec<Case> {
    vec![
        Case {
            causal: true,
            dropout: dropout(0.3, 0x5eed, 3),
            ..case(dims(2, 4, 2, 37, 53, 40, 40))
        },
        Case {
            window: (Some(9), Some(3)),
            softcap: Some(4.0),
            dropout: dropout(0.17, u64::MAX - 5, 0),
            ..case(dims(1, 2, 1, 70, 45, 64, 64))
        },
        // s_q < s_kv, causal, several key blocks, GQA: on the register-level path too.
        Case {
            causal: true,
            dropout: dropout(0.2, 77, 2),
            ..case(dims(1, 4, 2, 67, 150, 64, 64))
        },
        // s_q > s_kv, causal: the first rows see no key.
        Case {
            causal: true,
            dropout: dropout(0.5, 1, u32::MAX),
            ..case(dims(2, 2, 2, 40, 24, 32, 32))
        },
    ]
}

#[test]
fn dropout_matches_the_oracle_on_every_path() {
    let client = common::client();
    for case in cases() {
        for &dtype in &common::dtypes(&client) {
            // lavapipe computes half precision slowly: f32 there (the GPU runs them all).
            if common::is_cpu_device() && dtype != FloatDtype::F32 {
                continue;
            }
            for path in common::paths(&client, dtype) {
                check_case(&client, &case, dtype, Layout::Contiguous, path);
            }
        }
    }
}

/// The kernels' keep-mask is the host's, bit for bit, on every path: with Q = 0 every
/// probability of a row is `1/s_kv`, and with V the identity `O[i, j]` is `P[i, j] · Z[i, j]`.
#[test]
fn the_kernels_draw_the_hosts_keep_mask() {
    let client = common::client();
    let (b, h, sq, skv) = (2, 3, 45, 32);
    let d = Dropout {
        p: 0.5,
        seed: 0x0123_4567_89ab_cdef,
        offset: 11,
    };
    let options = AttentionOptions {
        dropout: Some(d),
        ..Default::default()
    };
    for &dtype in &common::dtypes(&client) {
        let q = upload(
            &client,
            &vec![0.0; b * h * sq * skv],
            &[b, h, sq, skv],
            dtype,
        );
        let identity: Vec<f64> = (0..b * h * skv * skv)
            .map(|n| f64::from(u8::from(n % skv == n / skv % skv)))
            .collect();
        let v = upload(&client, &identity, &[b, h, skv, skv], dtype);
        for path in common::paths(&client, dtype) {
            let fwd = forward(&client, &q, &v, &v, dtype, options, path)
                .unwrap_or_else(|e| panic!("{path:?} {dtype:?}: {e}"));
            let out = download(&client, &fwd.out, dtype);
            let mut wrong = Vec::new();
            for (n, &o) in out.iter().enumerate() {
                let (j, i) = (n % skv, n / skv % sq);
                let (head, batch) = (n / (skv * sq) % h, n / (skv * sq * h));
                let kept = d.keeps(batch, h, head, i, j);
                let want = if kept { 2.0 / skv as f64 } else { 0.0 };
                if (o - want).abs() > 1e-3 / skv as f64 {
                    wrong.push((batch, head, i, j, o * skv as f64));
                }
            }
            assert!(
                wrong.is_empty(),
                "{path:?} {dtype:?}: {} of {} probabilities disagree with the host's keep-mask, \
                 first (b, h, i, j, O·s_kv) {:?}",
                wrong.len(),
                out.len(),
                &wrong[..wrong.len().min(4)]
            );
        }
    }
}

#[test]
fn the_keep_mask_drops_p_and_depends_on_seed_and_offset() {
    // Philox-4×32-10's known-answer test (Random123's kat_vectors).
    assert_eq!(
        philox([0; 4], [0; 2]),
        [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
    );
    assert_eq!(
        philox([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
    );
    assert_eq!(
        philox(
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0]
        ),
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
    );
    let mask = |d: Dropout| -> Vec<bool> {
        (0..2 * 4 * 64 * 64)
            .map(|n| d.keeps(n / (4 * 4096), 4, n / 4096 % 4, n / 64 % 64, n % 64))
            .collect()
    };
    let d = Dropout {
        p: 0.3,
        seed: 42,
        offset: 0,
    };
    let kept = mask(d);
    let fraction = kept.iter().filter(|&&k| k).count() as f64 / kept.len() as f64;
    // 32768 draws: the standard deviation of the fraction is 0.0025.
    assert!(
        (fraction - 0.7).abs() < 0.015,
        "kept {fraction}, expected 0.7"
    );
    for other in [Dropout { offset: 1, ..d }, Dropout { seed: 43, ..d }] {
        let same = mask(other)
            .iter()
            .zip(&kept)
            .filter(|(a, b)| a == b)
            .count();
        // Independent masks agree on 0.7² + 0.3² = 58% of the positions.
        let agreement = same as f64 / kept.len() as f64;
        assert!(
            (agreement - 0.58).abs() < 0.02,
            "{other:?} agrees with {d:?} on {agreement}"
        );
    }
    let none = Dropout { p: 0.0, ..d };
    assert!(mask(none).iter().all(|&k| k));
}

#[test]
fn a_dropout_probability_outside_0_1_is_named() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let q = upload(&client, &[0.0; 2 * 8], &[1, 1, 2, 8], dtype);
    for p in [1.0, -0.1, f32::NAN] {
        let options = AttentionOptions {
            dropout: dropout(p, 0, 0),
            ..Default::default()
        };
        let err = forward(&client, &q, &q, &q, dtype, options, KernelPath::Auto)
            .err()
            .unwrap_or_else(|| panic!("dropout {p} was taken"));
        assert!(err.to_string().contains("`dropout`"), "{err}");
    }
}

/// The Burn op under autodiff with dropout and a trained bias, fused and composed, against
/// the oracle: `[O, dQ, dK, dV, d(bias)]`.
#[test]
fn the_op_drops_the_same_probabilities_fused_and_composed() {
    let (seed, mut rng) = common::rng();
    let d = dims(2, 4, 2, 19, 26, 16, 16);
    let drop = Dropout {
        p: 0.25,
        seed,
        offset: 5,
    };
    let bias_len = 4 * 19 * 26;
    let x: [Vec<f64>; 5] = [d.q_len(), d.k_len(), d.v_len(), d.o_len(), bias_len]
        .map(|n| common::randn(&mut rng, n, FloatDtype::F32));
    let case = Case {
        causal: true,
        dropout: Some(drop),
        ..case(d)
    };
    // The bias `[1, h, s_q, s_kv]` as the oracle's full `[b, h, s_q, s_kv]` one.
    let opts = reference::ReferenceOptions {
        bias: Some(Broadcast4 {
            data: [x[4].clone(), x[4].clone()].concat(),
            shape: [2, 4, 19, 26],
        }),
        ..case.reference_options()
    };
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    let full_db = grads.d_bias.unwrap();
    let want_db: Vec<f64> = (0..bias_len)
        .map(|n| full_db[n] + full_db[bias_len + n])
        .collect();
    for device in [common::burn_device(), Device::flex()] {
        let context = format!("seed {seed}, {device:?}");
        let device = device.autodiff();
        let q = tensor(&x[0], [2, 4, 19, 16], &device).require_grad();
        let k = tensor(&x[1], [2, 2, 26, 16], &device).require_grad();
        let v = tensor(&x[2], [2, 2, 26, 16], &device).require_grad();
        let bias = tensor(&x[4], [1, 4, 19, 26], &device).require_grad();
        let options = FlashAttentionOptions::default()
            .with_causal(true)
            .with_dropout(Some(drop));
        let terms = AttentionBias::new().with_bias(bias.clone());
        let out = flash_attention_biased(q.clone(), k.clone(), v.clone(), terms, options);
        let loss = (out.clone() * tensor(&x[3], [2, 4, 19, 16], &device)).sum();
        let g = loss.backward();
        for (what, got, want) in [
            ("O", values(out), &want.out),
            ("dQ", values(q.grad(&g).unwrap()), &grads.dq),
            ("dK", values(k.grad(&g).unwrap()), &grads.dk),
            ("dV", values(v.grad(&g).unwrap()), &grads.dv),
            ("dBias", values(bias.grad(&g).unwrap()), &want_db),
        ] {
            let err = common::max_abs_diff(&got, want);
            assert!(err < 2e-4, "{what}: error {err:.3e} — {context}");
        }
    }
}

/// The module drops while training on an autodiff device, on a new stream each call
/// (repeatable after [`seed_dropout`]), and not on a device without autodiff.
#[test]
fn the_module_drops_while_training_only() {
    let device = common::burn_device();
    let (_, mut rng) = common::rng();
    let x = common::randn(&mut rng, 2 * 9 * 32, FloatDtype::F32);
    let mha = FlashMultiHeadAttentionConfig::new(32, 4)
        .with_dropout(0.4)
        .init(&device);
    // The same weights without dropout.
    let mut undropped = mha.clone();
    undropped.dropout = DropoutConfig::new(0.0).init();
    let run = |m: &FlashMultiHeadAttention, device: &Device| {
        values(m.forward(tensor(&x, [2, 9, 32], device)))
    };
    assert_eq!(
        run(&mha, &device),
        run(&undropped, &device),
        "dropped without autodiff"
    );

    let training = device.autodiff();
    let (mha, undropped) = (mha.to_device(&training), undropped.to_device(&training));
    seed_dropout(9);
    let first = run(&mha, &training);
    let second = run(&mha, &training);
    seed_dropout(9);
    assert_eq!(
        first,
        run(&mha, &training),
        "the same seed draws other masks"
    );
    let plain = run(&undropped, &training);
    for (what, dropped) in [("first", &first), ("second", &second)] {
        let err = common::max_abs_diff(dropped, &plain);
        assert!(err > 1e-3, "the {what} call dropped nothing");
    }
    assert!(
        common::max_abs_diff(&first, &second) > 1e-3,
        "two calls drew the same mask"
    );
}
