//! Fused-op benchmark: our kernels against Burn's `module::attention` and materialized
//! attention, in one process, forward, backward and forward+backward, over a grid of
//! problems. FLOPs as FlashAttention's benchmark: forward 4·b·h·s²·d (halved when causal),
//! backward 2.5× forward. The backward time is the forward+backward time minus the forward
//! time (Burn's autodiff graph is consumed by `backward`, so the backward cannot be rerun
//! alone). The backward starts from the output itself (`o.backward()`: Burn seeds it with
//! an upstream gradient of ones, one fill of the output's shape), as PyTorch's is given a
//! ready `dO`; no reduction of the output is timed.
//!
//! Timing, after a warm-up: `ms` is the median over batches of calls queued back to back
//! (the device synced once per batch) of the time per call, as `triton.testing.do_bench`
//! (which PyTorch's numbers in `benches/torch_sdpa.py` use) times calls queued without a
//! host sync between them. `synced_ms` is the median of single calls each followed by a
//! device sync: it adds one host-device round trip per call, and on a tiny problem it
//! shows the fixed cost of a call (host work, launch).
//!
//! `ours-varlen` runs each problem as a packed batch (`flash_attention_varlen`: the `b`
//! sequences of length `s` concatenated, `[b·s, h, d]`) on the same tokens, to show what
//! packing costs against the padded equal-length run (`ours`); `ours-bshd` runs the dense op
//! on that same memory (`[b, s, h, d]` viewed through `swap_dims(1, 2)`), which separates
//! the cost of the layout from that of the packing. Each run's backward gets `dO` in its
//! op's own layout (`[b·s, h, d]` for the packed batch). With `--mixed` the `b` sequences take
//! lengths drawn uniformly from `[s/8, s]` (a fixed seed): `ours-varlen` packs just their
//! tokens, `ours` pads each to `s`, and FLOPs count the real lengths for both, so TFLOP/s
//! compare the useful work done per second.
//!
//! `--terms` adds terms to the scores of the runs of ours (the others do not take them):
//! `alibi` (ALiBi slopes `2^(−8(h+1)/H)`), `relpos` (a trained relative-position table
//! `[h, 2s − 1]` read at `i − j + s − 1` by a score function compiled into the kernels, its
//! gradient added up by the backward), `relpos-select` (the same table gathered into a
//! `[1, h, s, s]` bias inside the timed call with Burn ops, its gradient through the
//! gather), `bias` (a fixed `[1, h, s, s]` bias), `window` (a
//! sliding window of `--window` keys to the left, with FLOPs counted over the visible pairs
//! only, as for any mask other than causal).
//!
//! Block masks (`--terms`, a [`BlockMask`] built once, outside the timed calls; FLOPs over
//! the visible pairs): `documents` (8 packed documents per sequence, document `k` of length
//! ∝ `k + 1`, causal within each document when `--causal true`), `prefix` (prefix-LM: the
//! first quarter of the keys seen by every query, causal after it), `sparse` (blocks of
//! 128 × 128 kept or dropped at random with probability `--density`, no partial block:
//! compare with the dense non-causal run at `density ×` its time).
//!
//! `--dropout p` drops the attention weights of the runs of ours (the others run without);
//! `benches/torch_sdpa.py --dropout p` times PyTorch's with the same `dropout_p`.
//!
//! Memory per call, from CubeCL's memory report: `held_extra_mib`, what the outputs hold
//! after the call; `peak_extra_mib`, how far the device memory reserved by the call grew
//! from a cleaned-up pool (an upper bound of the transient peak at the pool's page size).
//!
//!     cargo run --release --features cuda --example bench -- --device cuda --json out.json

use std::time::Instant;

use burn::tensor::module::{attention, attention_fallback};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Distribution, FloatDType, Int, Tensor, TensorData};
use burn_flash_attention::{
    AttentionBias, BlockMask, FlashAttentionOptions, PackedSequences, flash_attention,
    flash_attention_biased, flash_attention_varlen, kernels, kernels::BlockShape, next_dropout,
};
use clap::Parser;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The score function of `--terms relpos`: CubeCL code, where `Tensor` is CubeCL's.
mod relpos {
    use burn_flash_attention::kernels::score_mod::{ScoreMod, ScorePosition, add_grad};
    use cubecl::prelude::*;

    /// `score + table[head, i − j + s_kv − 1]`, `table` `[heads, s_q + s_kv − 1]`.
    pub struct RelativePositionTable;

    #[cube]
    impl ScoreMod for RelativePositionTable {
        fn score(score: f32, at: &ScorePosition, table: &Tensor<f32>) -> f32 {
            score + table[cell(at, table)]
        }
        fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _table: &Tensor<f32>) -> f32 {
            1.0
        }
        fn params_grad(
            grad: f32,
            _score: f32,
            _modded: f32,
            at: &ScorePosition,
            table: &Tensor<f32>,
            grads: &mut [Atomic<f32>],
        ) {
            add_grad(grads, cell(at, table), grad);
        }
        fn visible(_at: &ScorePosition, _table: &Tensor<f32>) -> bool {
            true
        }
    }

    #[cube]
    fn cell(at: &ScorePosition, table: &Tensor<f32>) -> usize {
        at.head * table.stride(0) + at.query + at.seq_kv - 1 - at.key
    }
}
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Flash-attention benchmark: ours vs Burn vs materialized")]
struct Args {
    /// Device: cuda, rocm, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Sequence lengths (batch = tokens / s).
    #[arg(long, value_delimiter = ',', default_values_t = [512usize, 1024, 2048, 4096])]
    seqs: Vec<usize>,
    /// Head dims (heads = 2048 / d: 16 at d=128, 32 at d=64).
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128])]
    dims: Vec<usize>,
    /// Causal settings to run.
    #[arg(long, value_delimiter = ',', default_values_t = [false, true])]
    causal: Vec<bool>,
    /// Dtypes: bf16, f16, f32.
    #[arg(long, value_delimiter = ',', default_values = ["bf16"])]
    dtypes: Vec<String>,
    /// Implementations: ours, ours-deterministic (the backward without atomics),
    /// ours-varlen (the same sequences as a packed batch), ours-bshd (the dense op on the
    /// packed batch's `[b, s, h, d]` memory), burn, materialized.
    #[arg(long, value_delimiter = ',', default_values = ["ours", "burn", "materialized"])]
    impls: Vec<String>,
    /// Passes: fwd, bwd, fwd_bwd.
    #[arg(long, value_delimiter = ',', default_values = ["fwd", "bwd", "fwd_bwd"])]
    passes: Vec<String>,
    /// Tokens per problem (b·s).
    #[arg(long, default_value_t = 16384)]
    tokens: usize,
    /// Query heads per key/value head (GQA); 1 is plain multi-head attention.
    #[arg(long, default_value_t = 1)]
    gqa: usize,
    /// Measure each point for about this long (at least 3 runs, at most 50).
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// Skip materialized attention above this sequence length (its memory grows with s²).
    #[arg(long, default_value_t = 4096)]
    materialized_max_seq: usize,
    /// Write the records as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Sequences of mixed lengths (see the module docs).
    #[arg(long)]
    mixed: bool,
    /// Terms on the scores (see the module docs): none, alibi, relpos, relpos-select, bias,
    /// window, documents, prefix, sparse.
    #[arg(long, default_value = "none")]
    terms: String,
    /// Keys to the left of the diagonal with `--terms window`.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// The share of blocks kept by `--terms sparse`.
    #[arg(long, default_value_t = 0.25)]
    density: f64,
    /// Dropout probability on the attention weights of the runs of ours (0: none).
    #[arg(long, default_value_t = 0.0)]
    dropout: f32,
}

#[derive(Serialize)]
struct Record {
    #[serde(rename = "impl")]
    implementation: String,
    pass: String,
    dtype: String,
    b: usize,
    h: usize,
    h_kv: usize,
    s_q: usize,
    s_kv: usize,
    d: usize,
    causal: bool,
    /// Tokens of the batch's sequences (without padding).
    tokens: usize,
    mixed: bool,
    /// `--terms`, when not `none`.
    #[serde(skip_serializing_if = "Option::is_none")]
    terms: Option<String>,
    /// `--dropout`, when not 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    dropout: Option<f32>,
    ms: f64,
    tflops: f64,
    peak_extra_mib: Option<f64>,
    held_extra_mib: Option<f64>,
    synced_ms: Option<f64>,
}

#[derive(Serialize)]
struct Header {
    header: bool,
    card: String,
    date: String,
    commit: String,
    driver: String,
    device: String,
}

fn device(name: &str) -> (Device, Option<cubecl::client::Client>) {
    match name {
        #[cfg(feature = "cuda")]
        "cuda" => (
            Device::cuda(0),
            Some(cubecl::Device::Cuda(cubecl::cuda::CudaDevice { index: 0 }).client()),
        ),
        #[cfg(feature = "rocm")]
        "rocm" => (
            Device::rocm(0),
            Some(cubecl::Device::Hip(cubecl::hip::AmdDevice { index: 0 }).client()),
        ),
        #[cfg(feature = "wgpu")]
        "wgpu" => (Device::wgpu(burn::tensor::DeviceKind::DefaultDevice), None),
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => (Device::wgpu(burn::tensor::DeviceKind::Cpu), None),
        other => panic!("--device {other}: not compiled in (features: cuda, rocm, wgpu)"),
    }
}

fn dtype(name: &str) -> FloatDType {
    match name {
        "bf16" => FloatDType::BF16,
        "f16" => FloatDType::F16,
        "f32" => FloatDType::F32,
        other => panic!("--dtypes {other}: expected bf16, f16 or f32"),
    }
}

/// (bytes in use, bytes reserved) on the device.
fn memory(client: &Option<cubecl::client::Client>) -> Option<(u64, u64)> {
    client.as_ref().map(|c| {
        let usage = c.memory_report(cubecl::MemoryScope::Device).usage();
        (usage.bytes_in_use, usage.bytes_reserved)
    })
}

/// One measured point: median seconds per call, and the memory of one call (see the
/// module docs).
struct Measure {
    seconds: f64,
    held_extra_mib: Option<f64>,
    peak_extra_mib: Option<f64>,
    /// Median seconds of single calls, each followed by a device sync.
    synced: Option<f64>,
}

fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Measures `f` (warmed up, device synced).
fn measure(
    dev: &Device,
    client: &Option<cubecl::client::Client>,
    seconds: f64,
    mut f: impl FnMut() -> Vec<Tensor<4>>,
) -> Measure {
    drop(f());
    dev.sync().unwrap();
    if let Some(c) = client {
        c.memory_cleanup().unwrap();
    }
    let before = memory(client);
    let out = f();
    dev.sync().unwrap();
    let after = memory(client);
    let (held_extra_mib, peak_extra_mib) = match (before, after) {
        (Some((used0, reserved0)), Some((used1, reserved1))) => (
            Some(mib(used1 as i64 - used0 as i64)),
            Some(mib(
                (reserved1 as i64 - reserved0 as i64).max(used1 as i64 - used0 as i64)
            )),
        ),
        _ => (None, None),
    };
    drop(out);
    let median = |mut times: Vec<f64>| {
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    // Single synced calls: at least 3, for about a third of the time (at most 20).
    let mut synced = Vec::new();
    let start = Instant::now();
    while synced.len() < 3 || (start.elapsed().as_secs_f64() < seconds / 3.0 && synced.len() < 20) {
        let t = Instant::now();
        let out = f();
        dev.sync().unwrap();
        synced.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    // Batches of calls back to back, sized from the synced time to last ~`seconds / 10` each
    // (2 to 50 calls), at least 5 batches.
    let synced = median(synced);
    let calls = ((seconds / 10.0 / synced) as usize).clamp(2, 50);
    let mut batches = Vec::new();
    let start = Instant::now();
    while batches.len() < 5 || (start.elapsed().as_secs_f64() < seconds && batches.len() < 20) {
        let t = Instant::now();
        for _ in 0..calls {
            drop(f());
        }
        dev.sync().unwrap();
        batches.push(t.elapsed().as_secs_f64() / calls as f64);
    }
    Measure {
        seconds: median(batches),
        held_extra_mib,
        peak_extra_mib,
        synced: Some(synced),
    }
}

/// The block mask of `--terms` over sequences of `s` (see the module docs), the same for
/// every batch and head; `None` for terms without one.
fn block_pattern(terms: &str, s: usize, causal: bool, density: f64) -> Option<kernels::BlockMask> {
    let shape = BlockShape {
        block_q: 128,
        block_kv: 128,
    };
    let mask = match terms {
        "documents" => {
            // Document k ends at s · (k + 1)(k + 2) / 72: lengths ∝ k + 1, 8 documents.
            let ends: Vec<usize> = (0..8).map(|k| s * (k + 1) * (k + 2) / 72).collect();
            let ids: Vec<u32> = (0..s)
                .map(|t| ends.iter().position(|&e| t < e).unwrap_or(7) as u32)
                .collect();
            kernels::BlockMask::documents(&[ids.clone()], &[ids], causal, shape)
        }
        "prefix" => kernels::BlockMask::prefix_lm(&[s / 4], s, s, shape),
        "sparse" => {
            // Block (i, j) is kept when a multiplicative hash of it falls below the density.
            let kept = |i: usize, j: usize| {
                let hash = (i as u32).wrapping_mul(2654435761) ^ (j as u32).wrapping_mul(40503);
                f64::from(hash.wrapping_mul(2246822519) >> 8) / f64::from(1u32 << 24) < density
            };
            kernels::BlockMask::from_block_fn(
                [1, 1, s, s],
                shape,
                |_, _, q, k| {
                    Some(match kept(q.start / 128, k.start / 128) {
                        true => kernels::BlockState::Full,
                        false => kernels::BlockState::Empty,
                    })
                },
                |_, _, _, _| unreachable!("every block is classified"),
            )
        }
        _ => return None,
    };
    Some(mask.expect("a valid block mask"))
}

fn main() {
    let args = Args::parse();
    let (dev, client) = device(&args.device);
    let mut records: Vec<serde_json::Value> = Vec::new();
    // CubeCL names the runtime, not the card: the card's name comes from the
    // caller (e.g. `nvidia-smi --query-gpu=name`) when it is known.
    let card = std::env::var("BENCH_CARD")
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(|| client.as_ref().map(|c| c.name().to_string()))
        .unwrap_or_else(|| args.device.clone());
    records.push(
        serde_json::to_value(Header {
            header: true,
            card: card.clone(),
            date: std::env::var("BENCH_DATE").unwrap_or_default(),
            commit: std::env::var("BENCH_COMMIT").unwrap_or_default(),
            driver: std::env::var("BENCH_DRIVER").unwrap_or_default(),
            device: args.device.clone(),
        })
        .unwrap(),
    );
    println!("card: {card}");
    let points: Vec<_> = args
        .dtypes
        .iter()
        .flat_map(|t| args.dims.iter().map(move |&d| (t.clone(), d)))
        .flat_map(|(t, d)| args.seqs.iter().map(move |&s| (t.clone(), d, s)))
        .flat_map(|(t, d, s)| args.causal.iter().map(move |&c| (t.clone(), d, s, c)))
        .collect();
    let total = points.len();
    for (n, (dt, d, s, causal)) in points.into_iter().enumerate() {
        let b = (args.tokens / s).max(1);
        let h = 2048 / d;
        let h_kv = h / args.gqa;
        let dtype_ = dtype(&dt);
        let make = |heads: usize| {
            Tensor::<4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), &dev).cast(dtype_)
        };
        let (q, k, v) = (make(h), make(h_kv), make(h_kv));
        let lengths: Vec<usize> = match args.mixed {
            true => {
                let mut rng = StdRng::seed_from_u64(0);
                (0..b)
                    .map(|_| rng.random_range(s.div_ceil(8)..=s))
                    .collect()
            }
            false => vec![s; b],
        };
        let tokens: usize = lengths.iter().sum();
        // The packed batch's `[total, heads, d]` tensors, seen as `[1, heads, total, d]`: the
        // dense run's sequences concatenated, or fresh ones of the mixed lengths.
        let packed = |t: &Tensor<4>| {
            let [_, heads, _, _] = t.dims();
            match args.mixed {
                false => t.clone().swap_dims(1, 2).reshape([1, tokens, heads, d]),
                true => {
                    Tensor::<4>::random([1, tokens, heads, d], Distribution::Normal(0.0, 1.0), &dev)
                        .cast(dtype_)
                }
            }
            .swap_dims(1, 2)
        };
        // The dense op on the packed memory, `[b, s, h, d]` seen as `[b, h, s, d]`.
        let bshd = |t: &Tensor<4>| {
            let [_, heads, _, _] = t.dims();
            t.clone()
                .swap_dims(1, 2)
                .reshape([b * s, heads, d])
                .reshape([b, s, heads, d])
                .swap_dims(1, 2)
        };
        let sequences = PackedSequences::from_lengths(&lengths, &dev);
        let mut flops = lengths
            .iter()
            .map(|&n| 4.0 * (h * n * n * d) as f64)
            .sum::<f64>()
            / if causal { 2.0 } else { 1.0 };
        let window = (args.terms == "window").then_some(args.window);
        if let Some(w) = window {
            // The (query, key) pairs a left window of `w` (and causal, if set) leaves.
            let pairs = |n: usize| -> usize {
                (0..n)
                    .map(|i| (i + 1).min(w + 1) + if causal { 0 } else { (n - 1 - i).min(n) })
                    .sum()
            };
            flops = lengths
                .iter()
                .map(|&n| 4.0 * (h * d * pairs(n)) as f64)
                .sum();
        }
        // The terms' tensors: ALiBi slopes, a relative-position table (trained) or a bias.
        let slopes = Tensor::<2>::from_data(
            TensorData::new(
                (0..h)
                    .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32))
                    .collect::<Vec<_>>(),
                [1, h],
            ),
            &dev,
        );
        let table =
            Tensor::<2>::random([h, 2 * s - 1], Distribution::Normal(0.0, 1.0), &dev).cast(dtype_);
        let offsets = Tensor::<1, Int>::from_data(
            TensorData::new(
                (0..s * s)
                    .map(|n| (n / s + s - 1 - n % s) as i64)
                    .collect::<Vec<_>>(),
                [s * s],
            ),
            &dev,
        );
        let fixed_bias =
            Tensor::<4>::random([1, h, s, s], Distribution::Normal(0.0, 1.0), &dev).cast(dtype_);
        let blocks = block_pattern(&args.terms, s, causal, args.density);
        if let Some(mask) = &blocks {
            flops = 4.0 * (b * h * d) as f64 * mask.visible_pairs() as f64;
        }
        let blocks = blocks.map(|mask| BlockMask::new(mask, &dev));
        for imp in &args.impls {
            let ours = imp.starts_with("ours");
            if !ours && h_kv != h {
                continue; // Burn's attention has no GQA
            }
            if imp == "materialized" && s > args.materialized_max_seq {
                continue;
            }
            if args.mixed && !matches!(imp.as_str(), "ours" | "ours-varlen") {
                continue; // the other runs have no mixed form
            }
            let opts = FlashAttentionOptions::default()
                .with_causal(causal && blocks.is_none())
                .with_window(window, None)
                .with_deterministic(imp == "ours-deterministic")
                .with_dropout((args.dropout > 0.0).then(|| next_dropout(args.dropout)));
            if args.terms != "none" && imp != "ours" {
                continue; // the terms run on the dense op alone
            }
            let burn_opts = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
            };
            let (q, k, v) = match imp.as_str() {
                "ours-varlen" => (packed(&q), packed(&k), packed(&v)),
                "ours-bshd" => (bshd(&q), bshd(&k), bshd(&v)),
                _ => (q.clone(), k.clone(), v.clone()),
            };
            let unpack = |t: Tensor<4>| {
                let [_, heads, _, dim] = t.dims();
                t.swap_dims(1, 2).reshape([tokens, heads, dim])
            };
            let forward =
                |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, trained_table: Option<Tensor<2>>| {
                    match imp.as_str() {
                        "ours-varlen" => {
                            let o = flash_attention_varlen(
                                unpack(q),
                                unpack(k),
                                unpack(v),
                                &sequences,
                                &sequences,
                                opts,
                            );
                            // `[1, total, h, d]`: the backward's `dO` arrives in the op's own
                            // layout, as from a projection reading `[total, h · d]`.
                            o.reshape([1, tokens, h, d])
                        }
                        _ if ours => match args.terms.as_str() {
                            "alibi" => {
                                let terms = AttentionBias::new().with_alibi(slopes.clone());
                                flash_attention_biased(q, k, v, terms, opts)
                            }
                            "relpos" => {
                                // Under autodiff the table is the tracked one (see below).
                                let table = trained_table.clone().unwrap_or_else(|| table.clone());
                                let terms = AttentionBias::new()
                                    .with_score_mod::<relpos::RelativePositionTable>()
                                    .with_score_params(table);
                                flash_attention_biased(q, k, v, terms, opts)
                            }
                            "relpos-select" => {
                                let table = trained_table.clone().unwrap_or_else(|| table.clone());
                                let bias = table.select(1, offsets.clone()).reshape([1, h, s, s]);
                                let terms = AttentionBias::new().with_bias(bias);
                                flash_attention_biased(q, k, v, terms, opts)
                            }
                            "bias" => {
                                let terms = AttentionBias::new().with_bias(fixed_bias.clone());
                                flash_attention_biased(q, k, v, terms, opts)
                            }
                            "documents" | "prefix" | "sparse" => {
                                let mask = blocks.clone().expect("a block mask");
                                let terms = AttentionBias::new().with_block_mask(mask);
                                flash_attention_biased(q, k, v, terms, opts)
                            }
                            _ => flash_attention(q, k, v, opts),
                        },
                        "burn" => attention(q, k, v, None, None, burn_opts),
                        _ => attention_fallback(q, k, v, None, None, burn_opts),
                    }
                };
            let wants = |p: &str| args.passes.iter().any(|x| x == p);
            let fwd = (wants("fwd") || wants("bwd")).then(|| {
                measure(&dev, &client, args.seconds, || {
                    vec![forward(q.clone(), k.clone(), v.clone(), None)]
                })
            });
            let fwd_bwd = (wants("fwd_bwd") || wants("bwd")).then(|| {
                let (qa, ka, va) = (
                    q.clone().autodiff().require_grad(),
                    k.clone().autodiff().require_grad(),
                    v.clone().autodiff().require_grad(),
                );
                let trained = args
                    .terms
                    .starts_with("relpos")
                    .then(|| table.clone().autodiff().require_grad());
                measure(&dev, &client, args.seconds, || {
                    let o = forward(qa.clone(), ka.clone(), va.clone(), trained.clone());
                    let grads = o.backward();
                    let mut out = vec![
                        qa.grad(&grads).unwrap(),
                        ka.grad(&grads).unwrap(),
                        va.grad(&grads).unwrap(),
                    ];
                    if let Some(t) = &trained {
                        out.push(t.grad(&grads).unwrap().unsqueeze());
                    }
                    out
                })
            });
            let bwd = match (&fwd, &fwd_bwd) {
                (Some(f), Some(fb)) if wants("bwd") => Some(Measure {
                    seconds: (fb.seconds - f.seconds).max(f64::MIN_POSITIVE),
                    held_extra_mib: None,
                    peak_extra_mib: None,
                    synced: None,
                }),
                _ => None,
            };
            for (pass, m, factor) in [
                ("fwd", fwd.filter(|_| wants("fwd")), 1.0),
                ("bwd", bwd, 2.5),
                ("fwd_bwd", fwd_bwd.filter(|_| wants("fwd_bwd")), 3.5),
            ] {
                let Some(m) = m else { continue };
                let rec = Record {
                    implementation: imp.clone(),
                    pass: pass.into(),
                    dtype: dt.clone(),
                    b,
                    h,
                    h_kv,
                    s_q: s,
                    s_kv: s,
                    d,
                    causal,
                    tokens,
                    mixed: args.mixed,
                    terms: (args.terms != "none").then(|| args.terms.clone()),
                    dropout: (args.dropout > 0.0 && ours).then_some(args.dropout),
                    ms: m.seconds * 1e3,
                    tflops: factor * flops / m.seconds / 1e12,
                    peak_extra_mib: m.peak_extra_mib,
                    held_extra_mib: m.held_extra_mib,
                    synced_ms: m.synced.map(|t| t * 1e3),
                };
                eprintln!(
                    "[{}/{total}] {dt} b{b} h{h}/{h_kv} s{s} d{d} causal={causal} {imp:>12} {pass:>7}: {:9.3} ms {:7.1} TFLOP/s  peak {}  synced {}",
                    n + 1,
                    rec.ms,
                    rec.tflops,
                    rec.peak_extra_mib
                        .map_or("-".into(), |m| format!("{m:.0} MiB")),
                    rec.synced_ms.map_or("-".into(), |t| format!("{t:.3} ms"))
                );
                records.push(serde_json::to_value(rec).unwrap());
            }
        }
    }
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&records).unwrap()).unwrap();
        println!("wrote {}", path.display());
    }
}
