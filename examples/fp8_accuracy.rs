//! FP8 attention's numerical error, as FlashAttention-3 reports it: the root-mean-square
//! error of the output against an f64 reference, on Q, K and V drawn from N(0, 1) with one
//! entry in a thousand carrying an extra N(0, 100) (outliers).
//!
//!     cargo run --release --example fp8_accuracy -- --device cuda
//!
//! Variants emulated on the host (f64 arithmetic, values rounded where a kernel holds them
//! in a narrower type):
//! - `bf16`: Q, K, V rounded to bf16, the baseline;
//! - `fp8 tensor, P fp8`: Q, K, V in E4M3 with one scale per tensor, the probabilities
//!   `exp(s − m)` rounded to E4M3 before `P·V` (FlashAttention-3's baseline FP8 kernel);
//! - `fp8 row, P fp8`: one scale per row of the head dim;
//! - `… hadamard`: Q and K rotated by the orthonormal Hadamard matrix along the head dim
//!   before quantization (`QKᵀ` is unchanged; an outlier spreads over its row):
//!   FlashAttention-3's incoherent processing;
//! - `fp8 …, P f32`: FP8 inputs, probabilities kept in f32.
//!
//! And [`flash_attention_fp8`] on `--device` with each scaling (the output in `--dtype`).

use burn::tensor::{DType, Tensor, TensorData};
use burn_flash_attention::{FlashAttentionOptions, Fp8Scaling, flash_attention_fp8, quantize_fp8};
use clap::Parser;
use float8::F8E4M3;
use half::bf16;
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal, StandardNormal};

#[allow(dead_code)] // of the shared pieces, this example takes the device only
mod shared;

#[derive(Parser, Debug)]
#[command(about = "FP8 attention's error against an f64 reference")]
struct Args {
    /// cuda, rocm, wgpu, wgpu-cpu or flex.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// The op's output dtype: bf16, f16 or f32 (f32 on a CPU driver).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// A power of 2 (the Hadamard rotation's size).
    #[arg(long, default_value_t = 128)]
    dim: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// Largest E4M3 magnitude.
const E4M3_MAX: f64 = 448.0;

/// One `[heads, seq, dim]` tensor's values, row-major.
type Values = Vec<f64>;

fn main() {
    let args = Args::parse();
    let (h, s, d) = (args.heads, args.seq, args.dim);
    assert!(d.is_power_of_two(), "--dim {d}: expected a power of 2");
    let mut rng = StdRng::seed_from_u64(args.seed);
    let outlier = Normal::new(0.0, 10.0).unwrap();
    let mut draw = || -> Values {
        (0..h * s * d)
            .map(|_| {
                let x: f64 = StandardNormal.sample(&mut rng);
                if rng.random::<f64>() < 1e-3 {
                    x + outlier.sample(&mut rng)
                } else {
                    x
                }
            })
            .collect()
    };
    let (q, k, v) = (draw(), draw(), draw());
    let exact = attention(&q, &k, &v, h, s, d, None);

    let bf16_round = |x: &Values| x.iter().map(|&v| bf16::from_f64(v).to_f64()).collect();
    let p_fp8 = Some(e4m3 as fn(f64) -> f64);
    let mut rows: Vec<(String, f64)> = Vec::new();
    let mut report = |name: &str, out: &Values| {
        let err = rmse(out, &exact);
        println!("{name:<32} RMSE {err:.3e}");
        rows.push((name.to_string(), err));
    };
    let bf = [&q, &k, &v].map(bf16_round);
    report("bf16", &attention(&bf[0], &bf[1], &bf[2], h, s, d, None));
    for (scaling, block) in [("tensor", h * s * d), ("row", d)] {
        let [fq, fk, fv] = [&q, &k, &v].map(|x| quantized(x, block));
        let name = format!("fp8 {scaling}, P fp8");
        report(&name, &attention(&fq, &fk, &fv, h, s, d, p_fp8));
        let name = format!("fp8 {scaling}, P f32");
        report(&name, &attention(&fq, &fk, &fv, h, s, d, None));
        let [rq, rk] = [&q, &k].map(|x| quantized(&hadamard(x, d), block));
        let name = format!("fp8 {scaling}, P fp8, hadamard");
        report(&name, &attention(&rq, &rk, &fv, h, s, d, p_fp8));
    }

    let device = shared::device(&args.device);
    let dtype = shared::dtype(&args.dtype);
    for scaling in [Fp8Scaling::PerTensor, Fp8Scaling::PerRow] {
        let [tq, tk, tv] = [&q, &k, &v].map(|x| {
            let data: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let t = Tensor::<4>::from_data(TensorData::new(data, [1, h, s, d]), &device);
            quantize_fp8(t.cast(dtype), scaling)
        });
        let out = flash_attention_fp8(tq, tk, tv, FlashAttentionOptions::default(), dtype);
        let out: Values = out
            .cast(DType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        report(
            &format!("flash_attention_fp8 {scaling:?} ({})", args.dtype),
            &out,
        );
    }
    let naive = rows[1].1;
    println!("\nagainst the naive FP8 kernel (`fp8 tensor, P fp8`), RMSE ratio:");
    for (name, err) in &rows {
        println!("{name:<32} {:.2}×", naive / err);
    }
}

/// E4M3's nearest value to `x` (saturating at ±448).
fn e4m3(x: f64) -> f64 {
    F8E4M3::from_f64(x.clamp(-E4M3_MAX, E4M3_MAX)).to_f64()
}

/// `x` quantized to E4M3 with one scale per `block` consecutive values (the block's
/// largest magnitude mapping to 448), dequantized.
fn quantized(x: &Values, block: usize) -> Values {
    x.chunks(block)
        .flat_map(|b| {
            let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())) / E4M3_MAX;
            b.iter().map(move |&v| {
                if scale > 0.0 {
                    e4m3(v / scale) * scale
                } else {
                    0.0
                }
            })
        })
        .collect()
}

/// Each row of `d` values times the orthonormal Hadamard matrix (Sylvester's, `/ √d`), by
/// the fast Walsh–Hadamard transform.
fn hadamard(x: &Values, d: usize) -> Values {
    let mut out = x.clone();
    for row in out.chunks_mut(d) {
        let mut len = 1;
        while len < d {
            for start in (0..d).step_by(2 * len) {
                for i in start..start + len {
                    let (a, b) = (row[i], row[i + len]);
                    row[i] = a + b;
                    row[i + len] = a - b;
                }
            }
            len *= 2;
        }
        row.iter_mut().for_each(|v| *v /= (d as f64).sqrt());
    }
    out
}

/// `softmax(q·kᵀ/√d) · v` per head in f64, the probabilities `exp(s − m)` passed through
/// `round_p` (if any) before `P·V` and summed unrounded.
fn attention(
    q: &Values,
    k: &Values,
    v: &Values,
    h: usize,
    s: usize,
    d: usize,
    round_p: Option<fn(f64) -> f64>,
) -> Values {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; h * s * d];
    let mut scores = vec![0.0; s];
    for head in 0..h {
        fn row_of(t: &Values, at: usize, d: usize) -> &[f64] {
            &t[at * d..(at + 1) * d]
        }
        let at = |t, row: usize| row_of(t, head * s + row, d);
        for i in 0..s {
            let qi = at(q, i);
            for (j, score) in scores.iter_mut().enumerate() {
                *score = qi.iter().zip(at(k, j)).map(|(a, b)| a * b).sum::<f64>() * scale;
            }
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            let row = &mut out[(head * s + i) * d..(head * s + i + 1) * d];
            for (j, &score) in scores.iter().enumerate() {
                let p = (score - max).exp();
                sum += p;
                let p = round_p.map_or(p, |round| round(p));
                row.iter_mut().zip(at(v, j)).for_each(|(o, x)| *o += p * x);
            }
            row.iter_mut().for_each(|o| *o /= sum);
        }
    }
    out
}

fn rmse(got: &Values, want: &Values) -> f64 {
    let sum: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    (sum / got.len() as f64).sqrt()
}
