//! Decode benchmark: one new query token per sequence against a KV cache, contiguous or
//! paged, GQA, as a server's generation step runs it. Reports the bytes of K and V read per
//! second (`b · h_kv · len · (d_qk + d_v) · dtype size / time`), the measure of a
//! memory-bound kernel, next to PyTorch's in `benches/torch_decode.py`.
//!
//! The cache holds whatever the allocator returns (timing does not depend on the values);
//! the lengths are given as the host knows them (`Lengths::Known`), as a server would, so
//! no call waits for a read back. Timing: median over batches of calls queued back to back
//! of the time per call, after a warm-up. With `--graph` the calls are captured once as a
//! graph of 20 (CubeCL's graph capture: a CUDA graph), as a server's decode loop captures its
//! step, and timed by replays: the device's time per call without the host's launch path
//! (records `"graph": true`; `benches/torch_decode.py --graph` captures PyTorch's likewise).
//!
//! `--terms` adds score terms to every call (records named `ours <terms>`): ALiBi, a bias
//! over the cache's positions `[b, 1, 1, capacity]` (a key padding mask's layout), or a score
//! function (a clipped relative-position bias per head, read from a table).
//!
//!     cargo run --release --features cuda --example bench_decode -- --json decode.json

use std::time::Instant;

use burn_flash_attention::kernels::{
    AttentionOptions, DeviceTensor, FloatDtype, ScoreBias,
    decode::{DecodeInputs, KvCache, Lengths, Splits, decode},
    rotary::Rotary,
    score_mod::{ScoreFn, ScoreMod, ScorePosition},
};
use clap::Parser;
use cubecl::prelude::*;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Decode benchmark: K/V bytes read per second")]
struct Args {
    /// Device: cuda, rocm, wgpu, wgpu-cpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Cache lengths (every sequence of the batch holds this many positions).
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 4096, 16384, 32768, 131072])]
    lens: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    batches: Vec<usize>,
    /// Query heads : K/V heads.
    #[arg(long, value_delimiter = ',', default_values = ["32:8", "8:1"])]
    heads: Vec<String>,
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Page sizes; 0 is the contiguous cache.
    #[arg(long, value_delimiter = ',', default_values_t = [0usize, 1, 16, 64, 256])]
    pages: Vec<usize>,
    /// How a sequence's pages lie in the pool: `scattered` (consecutive pages 7919 pages
    /// apart, modulo the pool, as an allocator serving many sequences leaves them) or
    /// `sequential` (in order: the cost of the block table alone, without the scatter's).
    #[arg(long, default_value = "scattered", value_parser = ["scattered", "sequential"])]
    page_order: String,
    /// Split counts to force (0: the heuristic's).
    #[arg(long, value_delimiter = ',', default_values_t = [0usize])]
    splits: Vec<usize>,
    /// Skip points whose cache exceeds this many GiB.
    #[arg(long, default_value_t = 40.0)]
    max_gib: f64,
    #[arg(long, default_value_t = 0.3)]
    seconds: f64,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Turn the queries by the rotary embedding (half-split, the whole head dim), as a
    /// model with RoPE does at every step (records named `ours rotary`).
    #[arg(long)]
    rotary: bool,
    /// Time replays of the calls captured as a graph (see the module docs).
    #[arg(long)]
    graph: bool,
    /// Score terms added to every call.
    #[arg(long, default_value = "none", value_parser = ["none", "alibi", "bias", "score_fn"])]
    terms: String,
}

/// Distances from the query's diagonal are clipped to `±MAX_DISTANCE`.
const MAX_DISTANCE: i32 = 64;

/// A learned bias per query head and clipped distance from the query's diagonal, `params`
/// `[heads_q, 2 · MAX_DISTANCE + 1]` (T5-style relative positions).
struct RelativeBias;

#[cube]
impl ScoreMod for RelativeBias {
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        let distance = i32::cast_from(at.key + at.seq_q) - i32::cast_from(at.query + at.seq_kv);
        let bucket = clamp(distance, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE;
        score + params[at.head * params.stride(0) + usize::cast_from(bucket)]
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
    fn visible(_at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        true
    }
}

fn zeros(client: &cubecl::client::Client, shape: &[usize], elem_size: usize) -> DeviceTensor {
    let bytes = vec![0u8; shape.iter().product::<usize>() * elem_size];
    DeviceTensor::from_bytes(client, shape, &bytes)
}

/// Calls per timed run: queued back to back, or captured as one graph (`--graph`).
const CALLS: usize = 20;

#[derive(Serialize)]
struct Record {
    #[serde(rename = "impl")]
    implementation: String,
    b: usize,
    h_q: usize,
    h_kv: usize,
    cache_len: usize,
    d: usize,
    page_size: usize,
    /// `scattered` or `sequential` (`--page-order`); absent for a contiguous cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    page_order: Option<String>,
    splits: usize,
    /// Timed by graph replays (`--graph`).
    graph: bool,
    ms: f64,
    /// Host time to queue one call (arguments, allocations, launches): where it reaches
    /// `ms`, the host, not the device, sets the pace.
    host_ms: f64,
    kv_gbps: f64,
}

fn client(device: &str) -> cubecl::client::Client {
    let device = match device {
        #[cfg(feature = "cuda")]
        "cuda" => cubecl::Device::Cuda(cubecl::cuda::CudaDevice { index: 0 }),
        #[cfg(feature = "rocm")]
        "rocm" => cubecl::Device::Hip(cubecl::hip::AmdDevice { index: 0 }),
        #[cfg(feature = "wgpu")]
        "wgpu" => cubecl::Device::Wgpu(Default::default()),
        #[cfg(feature = "wgpu")]
        "wgpu-cpu" => cubecl::Device::Wgpu(cubecl::wgpu::WgpuDevice::new(
            cubecl::wgpu::WgpuDeviceKind::Cpu,
        )),
        other => panic!("device `{other}` is not compiled in"),
    };
    device.client()
}

fn i32_tensor(client: &cubecl::client::Client, shape: &[usize], values: &[i32]) -> DeviceTensor {
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    DeviceTensor::from_bytes(client, shape, &bytes)
}

fn main() {
    let args = Args::parse();
    let client = client(&args.device);
    let dtype = match args.dtype.as_str() {
        "bf16" => FloatDtype::BF16,
        "f16" => FloatDtype::F16,
        "f32" => FloatDtype::F32,
        other => panic!("--dtype takes bf16, f16 or f32, got {other}"),
    };
    let d = args.dim;
    let sync = || cubecl::future::block_on(client.sync()).expect("device synced");
    let mut records = Vec::new();
    for heads in &args.heads {
        let (h_q, h_kv) = heads
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .expect("--heads takes h_q:h_kv");
        for &b in &args.batches {
            for &len in &args.lens {
                let kv_bytes = b * h_kv * len * 2 * d * dtype.size();
                if kv_bytes as f64 / (1u64 << 30) as f64 > args.max_gib {
                    continue;
                }
                for &page in &args.pages {
                    for &forced in &args.splits {
                        let q = DeviceTensor::empty(&client, &[b, h_q, 1, d], dtype.size());
                        let tables = args.rotary.then(|| {
                            let table =
                                || DeviceTensor::empty(&client, &[len + 1, d / 2], dtype.size());
                            (table(), table())
                        });
                        let (k, v, table) = if page == 0 {
                            (
                                DeviceTensor::empty(&client, &[b, h_kv, len, d], dtype.size()),
                                DeviceTensor::empty(&client, &[b, h_kv, len, d], dtype.size()),
                                None,
                            )
                        } else {
                            let per_seq = len.div_ceil(page);
                            let pages = b * per_seq;
                            let stride = match args.page_order.as_str() {
                                "sequential" => 1,
                                _ => 7919,
                            };
                            let entries: Vec<i32> =
                                (0..pages).map(|n| ((n * stride) % pages) as i32).collect();
                            (
                                DeviceTensor::empty(&client, &[pages, page, h_kv, d], dtype.size()),
                                DeviceTensor::empty(&client, &[pages, page, h_kv, d], dtype.size()),
                                Some(i32_tensor(&client, &[b, per_seq], &entries)),
                            )
                        };
                        let lengths = vec![len; b];
                        let seqlens = i32_tensor(&client, &[b], &vec![len as i32; b]);
                        let terms = args.terms.as_str();
                        let slopes = (terms == "alibi").then(|| zeros(&client, &[b, h_q], 4));
                        // The bias spans the cache's capacity (whole pages).
                        let capacity = if page == 0 {
                            len
                        } else {
                            len.div_ceil(page) * page
                        };
                        let bias = (terms == "bias")
                            .then(|| zeros(&client, &[b, 1, 1, capacity], dtype.size()));
                        let params = (terms == "score_fn")
                            .then(|| zeros(&client, &[h_q, 2 * MAX_DISTANCE as usize + 1], 4));
                        let splits = match forced {
                            0 => Splits::Auto,
                            n => Splits::Exactly(n),
                        };
                        let call = || {
                            decode(
                                &client,
                                DecodeInputs {
                                    q: &q,
                                    cache: KvCache {
                                        k: &k,
                                        v: &v,
                                        block_table: table.as_ref(),
                                    },
                                    cache_seqlens: &seqlens,
                                    new: None,
                                    lengths: Lengths::Known(&lengths),
                                    rotary: tables.as_ref().map(|(cos, sin)| Rotary {
                                        cos,
                                        sin,
                                        interleaved: false,
                                    }),
                                    terms: ScoreBias {
                                        bias: bias.as_ref(),
                                        alibi_slopes: slopes.as_ref(),
                                        score_mod: params
                                            .as_ref()
                                            .map(|_| ScoreFn::of::<RelativeBias>()),
                                        score_params: params.as_ref(),
                                        block_mask: None,
                                    },
                                },
                                dtype,
                                AttentionOptions::default(),
                                splits,
                            )
                            .expect("decode")
                        };
                        // A point the kernels refuse (or a runtime limit) is reported and skipped.
                        let ran = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call))
                        {
                            Ok(out) => out.splits,
                            Err(_) => {
                                eprintln!("skipped: b {b}, h {h_q}:{h_kv}, len {len}, page {page}");
                                continue;
                            }
                        };
                        // A batch of calls, each output dropped before the next call, as
                        // the warm-up and the capture run them (the pool then serves the
                        // capture from what the warm-up freed).
                        let calls = |n: usize| {
                            for _ in 0..n {
                                drop(call());
                            }
                        };
                        let graph = args.graph.then(|| {
                            client
                                .graph_prepare()
                                .expect("a stream prepared for capture");
                            calls(CALLS);
                            client.start_capture().expect("capture started");
                            calls(CALLS);
                            client.stop_capture().expect("a captured graph")
                        });
                        let run = || match &graph {
                            // SAFETY: the captured buffers (caches, queries, lengths, tables)
                            // outlive the graph; only this thread uses them.
                            Some(graph) => unsafe { graph.replay() }.expect("replay"),
                            None => calls(CALLS),
                        };
                        for _ in 0..3 {
                            run();
                        }
                        sync();
                        let mut times = Vec::new();
                        let mut host_times = Vec::new();
                        let started = Instant::now();
                        while times.len() < 5
                            || (started.elapsed().as_secs_f64() < args.seconds && times.len() < 50)
                        {
                            // Replays five at a time, so that the sync is spread thin.
                            let runs = if args.graph { 5 } else { 1 };
                            let queued = (runs * CALLS) as f64;
                            let t = Instant::now();
                            for _ in 0..runs {
                                run();
                            }
                            host_times.push(t.elapsed().as_secs_f64() * 1e3 / queued);
                            sync();
                            times.push(t.elapsed().as_secs_f64() * 1e3 / queued);
                        }
                        times.sort_by(f64::total_cmp);
                        host_times.sort_by(f64::total_cmp);
                        let ms = times[times.len() / 2];
                        let host_ms = host_times[host_times.len() / 2];
                        let record = Record {
                            implementation: match (args.rotary, terms) {
                                (true, "none") => "ours rotary".into(),
                                (true, terms) => format!("ours rotary {terms}"),
                                (false, "none") => "ours".into(),
                                (false, terms) => format!("ours {terms}"),
                            },
                            b,
                            h_q,
                            h_kv,
                            cache_len: len,
                            d,
                            page_size: page,
                            page_order: (page > 0).then(|| args.page_order.clone()),
                            splits: ran,
                            graph: args.graph,
                            ms,
                            host_ms,
                            kv_gbps: kv_bytes as f64 / ms / 1e6,
                        };
                        println!("{}", serde_json::to_string(&record).unwrap());
                        records.push(record);
                    }
                }
            }
        }
    }
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&records).unwrap()).unwrap();
    }
}
