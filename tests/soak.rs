//! Soak and concurrency through the Burn op on the test device (the Fusion device):
//! - calls from several threads at once give bitwise what the same calls give one after
//!   the other;
//! - many mixed calls (forward, forward and backward, shapes and options varying) leave
//!   the device's memory where a warm-up left it.
//!
//! `FLASH_SOAK_CALLS=n` sets the soak's calls (default: a few dozen on a CPU driver, 2000
//! on a GPU; long runs set 10 000).

use burn::tensor::Device;
use burn_flash_attention::kernels::FloatDtype;
use burn_flash_attention::{FlashAttentionOptions, flash_attention_with_lse};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::{self, tensor, values};

/// One call's shape and options.
#[derive(Clone, Copy, Debug)]
struct Call {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_kv: usize,
    dim: usize,
    causal: bool,
    softcap: Option<f32>,
    backward: bool,
}

/// A call drawn from `rng`: small shapes, a few head dims (each compiles once), every mix
/// of options.
fn draw(rng: &mut StdRng) -> Call {
    let heads_kv = rng.random_range(1..=2);
    Call {
        batch: rng.random_range(1..=2),
        heads_q: heads_kv * rng.random_range(1..=2),
        heads_kv,
        seq_q: rng.random_range(1..=40),
        seq_kv: rng.random_range(1..=40),
        dim: [16, 32, 64][rng.random_range(0..3)],
        causal: rng.random(),
        softcap: rng.random_bool(0.3).then_some(20.0),
        backward: rng.random(),
    }
}

/// The call's outputs (O, LSE, and with `backward` dQ, dK, dV of `Σ O`), as host values.
fn run(device: &Device, call: Call, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let f = FloatDtype::F32;
    let shape = |h: usize, s: usize| [call.batch, h, s, call.dim];
    let device = device.clone().autodiff();
    let input = |rng: &mut StdRng, h: usize, s: usize| {
        let data = common::randn(rng, call.batch * h * s * call.dim, f);
        tensor(&data, shape(h, s), &device).require_grad()
    };
    let q = input(&mut rng, call.heads_q, call.seq_q);
    let k = input(&mut rng, call.heads_kv, call.seq_kv);
    let v = input(&mut rng, call.heads_kv, call.seq_kv);
    let options = FlashAttentionOptions::default()
        .with_causal(call.causal)
        .with_softcap(call.softcap)
        .with_deterministic(true);
    let (out, lse) = flash_attention_with_lse(q.clone(), k.clone(), v.clone(), options);
    let mut results = vec![values(out.clone()), values(lse)];
    if call.backward {
        let grads = out.sum().backward();
        for t in [q, k, v] {
            results.push(values(t.grad(&grads).expect("a gradient")));
        }
    }
    results
}

/// Four threads, each with its own calls (different head dims, so kernels compile
/// concurrently), against the same calls run one after the other: bitwise equal (the
/// backward is asked to be deterministic).
#[test]
fn calls_from_several_threads_match_sequential_calls() {
    let device = common::burn_device();
    let (seed, mut rng) = common::rng();
    let calls: Vec<Vec<(Call, u64)>> = (0..4)
        .map(|_| (0..3).map(|_| (draw(&mut rng), rng.random())).collect())
        .collect();
    let sequential: Vec<Vec<Vec<Vec<f64>>>> = calls
        .iter()
        .map(|thread| thread.iter().map(|&(c, s)| run(&device, c, s)).collect())
        .collect();
    let concurrent: Vec<Vec<Vec<Vec<f64>>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = calls
            .iter()
            .map(|thread| {
                let device = device.clone();
                scope.spawn(move || {
                    thread
                        .iter()
                        .map(|&(c, s)| run(&device, c, s))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a thread's calls ran"))
            .collect()
    });
    for (t, (want, got)) in sequential.iter().zip(&concurrent).enumerate() {
        for (n, (w, g)) in want.iter().zip(got).enumerate() {
            let same = w.len() == g.len()
                && w.iter().zip(g).all(|(a, b)| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                });
            assert!(
                same,
                "thread {t}, call {n} ({:?}): results differ from the sequential run, seed {seed}",
                calls[t][n].0
            );
        }
    }
}

/// Mixed calls, the first half as the warm-up (the pools grow to the mix's sizes): over the
/// second half the memory in use stays where the first left it (nothing held per call).
#[test]
fn many_mixed_calls_keep_memory_stable() {
    let device = common::burn_device();
    let client = common::client();
    let (seed, mut rng) = common::rng();
    let default = if common::is_cpu_device() { 40 } else { 2000 };
    let calls = std::env::var("FLASH_SOAK_CALLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default);
    let started = std::time::Instant::now();
    let mut after_warm_up = 0;
    for n in 0..calls {
        if n == calls / 2 {
            after_warm_up = common::bytes_in_use(&client);
        }
        let call = draw(&mut rng);
        let results = run(&device, call, rng.random());
        assert!(
            results
                .iter()
                .flatten()
                .all(|x| x.is_finite() || *x == f64::NEG_INFINITY),
            "call {n} ({call:?}) gave a NaN, seed {seed}"
        );
    }
    let after = common::bytes_in_use(&client);
    eprintln!(
        "{calls} calls in {:.1?}: {after_warm_up} bytes in use after the first half, {after} after",
        started.elapsed()
    );
    assert!(
        after <= after_warm_up + (256 << 10),
        "memory grew from {after_warm_up} to {after} bytes over the last {} calls, seed {seed}",
        calls - calls / 2
    );
}
