//! The f64 oracle's forward against Burn's composed `attention_fallback` on the Flex backend.
//! (Its gradients are checked against finite differences in the kernel crate's unit tests.)

use burn::tensor::module::attention_fallback;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_flash_attention::kernels::{
    FloatDtype, MaskSpec,
    reference::{self, Broadcast4, Dims, ReferenceOptions},
};
use rand::Rng;

use crate::common::{self, max_abs_diff};

fn tensor(data: &[f64], shape: [usize; 4], device: &Device) -> Tensor<4> {
    let data: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(data, shape), device)
}

#[test]
fn reference_matches_burn_attention_fallback() {
    let device = Device::flex();
    let (seed, mut rng) = common::rng();
    // s_q < s_kv and s_q > s_kv, so both causal alignments are exercised.
    for (seq_q, seq_kv) in [(7, 11), (11, 7)] {
        let dims = Dims {
            batch: 2,
            heads_q: 3,
            heads_kv: 3,
            seq_q,
            seq_kv,
            dim_qk: 8,
            dim_v: 5,
        };
        let f32 = FloatDtype::F32;
        let (q, k, v) = (
            common::randn(&mut rng, dims.q_len(), f32),
            common::randn(&mut rng, dims.k_len(), f32),
            common::randn(&mut rng, dims.v_len(), f32),
        );
        let full = [dims.batch, dims.heads_q, seq_q, seq_kv];
        let n = full.iter().product();
        let mask: Vec<bool> = (0..n).map(|_| rng.random_bool(0.2)).collect();
        let bias = common::randn(&mut rng, n, f32);
        let options = ReferenceOptions {
            scale: Some(0.4),
            mask: MaskSpec::causal(),
            softcap: Some(2.5),
            bool_mask: Some(Broadcast4 {
                data: mask.clone(),
                shape: full,
            }),
            bias: Some(Broadcast4 {
                data: bias.clone(),
                shape: full,
            }),
            ..Default::default()
        };
        let want = reference::forward(&dims, &options, &q, &k, &v);

        let got = attention_fallback(
            tensor(&q, [dims.batch, dims.heads_q, seq_q, dims.dim_qk], &device),
            tensor(
                &k,
                [dims.batch, dims.heads_kv, seq_kv, dims.dim_qk],
                &device,
            ),
            tensor(&v, [dims.batch, dims.heads_kv, seq_kv, dims.dim_v], &device),
            Some(Tensor::<4, Bool>::from_data(
                TensorData::new(mask, full),
                &device,
            )),
            Some(tensor(&bias, full, &device)),
            AttentionModuleOptions {
                scale: Some(0.4),
                softcap: Some(2.5),
                is_causal: true,
            },
        );
        let got: Vec<f64> = got
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        let err = max_abs_diff(&got, &want.out);
        assert!(
            err < 1e-5,
            "max error {err:.3e}, s_q={seq_q} s_kv={seq_kv}, seed {seed}"
        );
    }
}

/// The tolerance rule's dtype floor ([`common::rounding_floor`]) is about two units in the
/// last place of the values' magnitude: it lets a kernel round at other points than naive
/// attention does, and no more (a value 1% off stays caught in f16 and f32).
#[test]
fn the_dtype_floor_is_a_few_units_in_the_last_place() {
    let values = [0.84, -0.3, 1e-3, 0.0, f64::NEG_INFINITY];
    let f16 = common::rounding_floor(&values, FloatDtype::F16);
    let bf16 = common::rounding_floor(&values, FloatDtype::BF16);
    let f32 = common::rounding_floor(&values, FloatDtype::F32);
    // Units in the last place at 0.84 (0.84 + 0.3 crosses 1): 2^-11 in f16, 2^-8 in bf16.
    assert!(
        f16 > 0.0 && f16 <= 4.0 * 2f64.powi(-10),
        "f16 floor {f16:e}"
    );
    assert!(
        bf16 > f16 && bf16 <= 4.0 * 2f64.powi(-7),
        "bf16 floor {bf16:e}"
    );
    assert!(f32 <= 4.0 * 2f64.powi(-23), "f32 floor {f32:e}");
    assert!(0.01 * 0.84 > f16, "a 1% error at 0.84 passes the f16 floor");
}
