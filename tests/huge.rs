//! Sizes past 32-bit offsets, on a GPU with 60 GB or more (ignored elsewhere: run with
//! `--ignored huge`; 45 GB at the peak). A bf16 batch whose queries hold more than 2^32
//! elements runs through the Burn op as several calls (`flash_attention`'s parts); the last
//! sequence's output and gradients, past 2^32 elements from the start, equal those of the
//! same sequence run alone (within bf16 rounding: the kernels may tile a lone sequence
//! differently).

use burn::tensor::{DType, Distribution, Tensor};
use burn_flash_attention::{FlashAttentionOptions, flash_attention};

use crate::common;

#[test]
#[ignore = "needs a GPU with 60 GB or more"]
fn batches_past_32_bit_offsets_match_their_sequences_alone() {
    let device = common::burn_device().autodiff();
    // 520 · 16 · 4096 · 128 = 4.36 · 10^9 query elements (8.7 GB in bf16).
    let (batch, heads_q, heads_kv, seq, dim) = (520, 16, 2, 4096, 128);
    // Burn's own kernels (random) index with 32 bits too: every tensor they see here stays
    // under 2^32 elements, the inputs drawn in parts of 65 sequences. Only the attention op
    // sees the whole batch.
    let part = 65;
    let random = |h: usize| {
        let parts = (0..batch / part)
            .map(|_| {
                Tensor::<4>::random(
                    [part, h, seq, dim],
                    Distribution::Normal(0.0, 1.0),
                    (&device, DType::BF16),
                )
            })
            .collect();
        Tensor::cat(parts, 0)
    };
    let (q, k, v) = (random(heads_q), random(heads_kv), random(heads_kv));
    let options = FlashAttentionOptions::default().with_causal(true);
    let [q, k, v] = [q, k, v].map(|t| t.detach().require_grad());
    let out = flash_attention(q.clone(), k.clone(), v.clone(), options);
    // The output's gradient is ones: backward from the output itself (a sum would keep
    // copies of the output and of its gradient per part; the device has no room for them).
    let grads = out.backward();
    let last = batch - 1;
    let pick = |t: &Tensor<4>| t.clone().slice([last..batch]);
    let got = [
        pick(&out.detach()),
        pick(&q.grad(&grads).unwrap()),
        pick(&k.grad(&grads).unwrap()),
        pick(&v.grad(&grads).unwrap()),
    ];
    // The last sequence alone.
    let [q1, k1, v1] = [&q, &k, &v].map(|t| pick(t).detach().require_grad());
    let out1 = flash_attention(q1.clone(), k1.clone(), v1.clone(), options);
    let grads1 = out1.backward();
    let want = [
        out1.detach(),
        q1.grad(&grads1).unwrap(),
        k1.grad(&grads1).unwrap(),
        v1.grad(&grads1).unwrap(),
    ];
    for (name, (g, w)) in ["O", "dQ", "dK", "dV"]
        .iter()
        .zip(got.into_iter().zip(want))
    {
        let (g, w) = (common::values(g), common::values(w));
        assert!(g.iter().all(|x| x.is_finite()), "{name}: not finite");
        let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let err = g
            .iter()
            .zip(&w)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-2 * scale,
            "{name} of the last sequence is off by {err} (largest {scale}) from the sequence alone"
        );
        eprintln!("{name}: largest difference {err} (largest value {scale})");
    }
}
