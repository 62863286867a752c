//! A relative-position bias written as a score function and trained end to end.
//!
//! The model sees random tokens without any position embedding and must output, at every
//! position, the token `LAG` positions back. Attention from content alone cannot tell
//! positions apart: only the learned bias per (head, distance), compiled into the fused
//! kernels as a [`ScoreMod`], can pick the right key. The example trains it with Adam,
//! then checks that the loss fell and that a head's bias peaks at distance `−LAG`;
//! it exits non-zero otherwise.
//!
//!     cargo run --release --example score_mod -- --device cuda --features cuda
//!
//! The score function is `#[cube]` code: it runs inside the forward and backward kernels
//! on CUDA, ROCm and wgpu, and its table's gradient comes from the same backward launch.

#[allow(dead_code)] // of the shared pieces, this example takes the device only
mod shared;

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_flash_attention::{AttentionBias, FlashAttentionOptions, flash_attention_biased};
use clap::Parser;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The score function: written with CubeCL's `#[cube]`, where `Tensor` is CubeCL's.
mod relative {
    use burn_flash_attention::kernels::score_mod::{ScoreMod, ScorePosition, add_grad};
    use cubecl::prelude::*;

    /// Distances are clipped to `−MAX_DISTANCE..=MAX_DISTANCE`.
    pub const MAX_DISTANCE: i32 = 8;
    /// One table column per clipped distance.
    pub const BUCKETS: usize = 2 * MAX_DISTANCE as usize + 1;

    /// `score + table[head, distance]`, `table` `[heads, BUCKETS]`, where the distance is
    /// `key − query` (queries aligned to the end of the keys, as the causal mask).
    pub struct RelativePositionBias;

    #[cube]
    impl ScoreMod for RelativePositionBias {
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
        let distance = i32::cast_from(at.key) + i32::cast_from(at.seq_q)
            - i32::cast_from(at.query)
            - i32::cast_from(at.seq_kv);
        let bucket = clamp(distance, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE;
        at.head * table.stride(0) + usize::cast_from(bucket)
    }
}

use relative::{BUCKETS, MAX_DISTANCE, RelativePositionBias};

/// The answer at position `i` is the token at `i − LAG`.
const LAG: usize = 3;
const VOCAB: usize = 16;

#[derive(Parser)]
struct Args {
    /// cuda, rocm, wgpu, wgpu-cpu (lavapipe).
    #[arg(long, default_value = "wgpu")]
    device: String,
    #[arg(long, default_value_t = 120)]
    steps: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 32)]
    seq: usize,
    #[arg(long, default_value_t = 2e-2)]
    lr: f64,
}

#[derive(Module, Debug)]
struct Model {
    embed: Embedding,
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    /// `[heads, BUCKETS]`.
    relative: Param<Tensor<2>>,
    heads: usize,
    head_dim: usize,
}

impl Model {
    fn new(heads: usize, head_dim: usize, device: &Device) -> Self {
        let width = heads * head_dim;
        Self {
            embed: EmbeddingConfig::new(VOCAB, width).init(device),
            query: LinearConfig::new(width, width).init(device),
            key: LinearConfig::new(width, width).init(device),
            value: LinearConfig::new(width, width).init(device),
            out: LinearConfig::new(width, VOCAB).init(device),
            relative: Param::from_tensor(Tensor::zeros([heads, BUCKETS], device)),
            heads,
            head_dim,
        }
    }

    /// Logits `[batch, seq, VOCAB]` for tokens `[batch, seq]`.
    fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let x = self.embed.forward(tokens);
        let split = |t: Tensor<3>| {
            t.reshape([batch, seq, self.heads, self.head_dim])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            split(self.query.forward(x.clone())),
            split(self.key.forward(x.clone())),
            split(self.value.forward(x)),
        );
        let terms = AttentionBias::new()
            .with_score_mod::<RelativePositionBias>()
            .with_score_params(self.relative.val());
        let causal = FlashAttentionOptions::default().with_causal(true);
        let o = flash_attention_biased(q, k, v, terms, causal);
        let width = self.heads * self.head_dim;
        self.out
            .forward(o.swap_dims(1, 2).reshape([batch, seq, width]))
    }
}

/// Random tokens `[batch, seq]` and their targets (the token `LAG` back; the first `LAG`
/// positions are asked for token 0).
fn batch(
    rng: &mut StdRng,
    batch: usize,
    seq: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<1, Int>) {
    let tokens: Vec<i64> = (0..batch * seq)
        .map(|_| rng.random_range(0..VOCAB as i64))
        .collect();
    let targets: Vec<i64> = (0..batch * seq)
        .map(|n| match n % seq >= LAG {
            true => tokens[n - LAG],
            false => 0,
        })
        .collect();
    (
        Tensor::from_data(TensorData::new(tokens, [batch, seq]), device),
        Tensor::from_data(TensorData::new(targets, [batch * seq]), device),
    )
}

fn main() {
    let args = Args::parse();
    let device = shared::device(&args.device).autodiff();
    let mut rng = StdRng::seed_from_u64(5);
    let mut model = Model::new(2, 16, &device);
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut first = None;
    let mut last = f64::INFINITY;
    for step in 0..args.steps {
        let (tokens, targets) = batch(&mut rng, args.batch, args.seq, &device);
        let logits = model
            .forward(tokens)
            .reshape([args.batch * args.seq, VOCAB]);
        let loss = loss_fn.forward(logits, targets);
        last = loss.clone().into_scalar::<f32>() as f64;
        first.get_or_insert(last);
        if step % 20 == 0 || step + 1 == args.steps {
            println!("step {step:4}: loss {last:.4}");
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(args.lr, model, grads);
    }
    let table = model.relative.val().into_data().convert::<f32>();
    let table = table.try_to_vec::<f32>().unwrap();
    let peaks: Vec<i32> = table
        .chunks(BUCKETS)
        .map(|row| {
            let (bucket, _) = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap();
            bucket as i32 - MAX_DISTANCE
        })
        .collect();
    println!("learned bias per head (distance −{MAX_DISTANCE}..={MAX_DISTANCE}):");
    for row in table.chunks(BUCKETS) {
        let cells: Vec<String> = row.iter().map(|x| format!("{x:5.1}")).collect();
        println!("  {}", cells.join(" "));
    }
    let first = first.unwrap_or(f64::INFINITY);
    let learned = last < 0.5 * first && peaks.iter().any(|&p| p == -(LAG as i32));
    println!("loss {first:.3} -> {last:.3}; the bias peaks at distances {peaks:?}");
    if !learned {
        eprintln!("the relative-position bias did not learn to look {LAG} tokens back");
        std::process::exit(1);
    }
    println!("learned to look {LAG} tokens back through the relative-position bias");
}
