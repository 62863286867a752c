//! Cold start of a server process: the wall time of `warm_up` for the calls of a LLaMA-8B-like
//! model (GQA 32:8, d = 128, bf16): a causal training step (forward and backward), the prefill
//! of a packed batch of prompts and decode steps against a paged cache with rotary
//! embedding. Its first run in a process compiles every kernel variant those calls launch;
//! run it again with `--cache-dir` (the `kernel-cache` feature) to measure a later process
//! that loads them from disk. One JSON line per run.
//!
//!     cargo run --release --features cuda,kernel-cache --example cold_start -- --cache-dir /tmp/kernels

#[allow(dead_code)] // of the shared pieces, this example takes the device only
mod shared;

use std::time::Instant;

use burn_flash_attention::{FlashAttentionOptions, WarmUp, warm_up};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Cold start: the time to compile (or load) a model's attention kernels")]
struct Args {
    /// Device: cuda, rocm, wgpu, wgpu-cpu, flex.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Keep compiled kernels in this directory across processes (`kernel-cache` feature).
    #[arg(long)]
    cache_dir: Option<std::path::PathBuf>,
    /// Sizes small enough for a CPU device.
    #[arg(long)]
    tiny: bool,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

fn main() {
    let args = Args::parse();
    if let Some(dir) = &args.cache_dir {
        #[cfg(feature = "kernel-cache")]
        burn_flash_attention::enable_kernel_cache(dir).expect("the kernel cache");
        #[cfg(not(feature = "kernel-cache"))]
        panic!(
            "--cache-dir {}: build with the `kernel-cache` feature",
            dir.display()
        );
    }
    let device = shared::device(&args.device);
    let dtype = shared::dtype(&args.dtype);
    let (heads, dims, seq, capacity) = match args.tiny {
        true => ([4, 2], [32, 32], 64, 64),
        false => ([32, 8], [128, 128], 4096, 8192),
    };
    let causal = FlashAttentionOptions::default().with_causal(true);
    let calls = [
        WarmUp::Attention {
            q: [1, heads[0], seq, dims[0]],
            k: [1, heads[1], seq, dims[0]],
            v: [1, heads[1], seq, dims[1]],
            options: causal,
            backward: true,
        },
        WarmUp::Varlen {
            lengths_q: vec![seq / 2, seq / 4, seq / 4],
            lengths_k: vec![seq / 2, seq / 4, seq / 4],
            heads,
            dims,
            options: causal,
            backward: false,
        },
        WarmUp::Decode {
            batch: 8,
            new_tokens: 1,
            capacity,
            page_size: Some(16),
            heads,
            dims,
            append: true,
            rotary: Some((dims[0], false)),
            options: causal,
        },
    ];
    let start = Instant::now();
    warm_up(&device, dtype, &calls);
    let first = start.elapsed().as_secs_f64();
    // The same calls again in this process: what is left once every kernel is compiled.
    let start = Instant::now();
    warm_up(&device, dtype, &calls);
    let again = start.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "device": args.device,
            "card": std::env::var("BENCH_CARD").unwrap_or_default(),
            "date": std::env::var("BENCH_DATE").unwrap_or_default(),
            "dtype": args.dtype,
            "kernel_cache": args.cache_dir.is_some(),
            "warm_up_s": first,
            "again_s": again,
        })
    );
}
