//! A small GPT-style byte-level language model trained on a text the repository ships
//! (`examples/data/lighthouse.txt`), once with the fused flash-attention op and once with
//! Burn's composed attention, from the same initial weights and the same batches. Prints both
//! loss curves, their largest difference, and the time and device memory of a training step.
//!
//!     cargo run --release --example gpt -- --device wgpu-cpu --steps 200
//!     cargo run --release --features cuda --example gpt -- --device cuda

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_flash_attention::{FlashAttentionOptions, flash_attention};
use clap::Parser;

#[path = "shared/mod.rs"]
mod shared;

use shared::{TEXT, VOCAB, batches, device};

#[derive(Parser, Debug)]
struct Args {
    /// cuda, rocm, wgpu, wgpu-cpu (lavapipe) or flex.
    #[arg(long, default_value = "wgpu-cpu")]
    device: String,
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    seq: usize,
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads (GQA).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Train with `flash`, `burn` (composed attention) or `both` and compare.
    #[arg(long, default_value = "both")]
    attention: String,
}

#[derive(Module, Debug)]
struct CausalSelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    heads: usize,
    kv_heads: usize,
    d_k: usize,
    flash: bool,
}

impl CausalSelfAttention {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, d_model] = x.dims();
        let split = |proj: &Linear, heads: usize| {
            proj.forward(x.clone())
                .reshape([b, s, heads, self.d_k])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            split(&self.query, self.heads),
            split(&self.key, self.kv_heads),
            split(&self.value, self.kv_heads),
        );
        let context = if self.flash {
            flash_attention(q, k, v, FlashAttentionOptions::default().with_causal(true))
        } else {
            // Burn's attention has no GQA: repeat each key/value head for its query heads.
            let group = self.heads / self.kv_heads;
            let repeat = |t: Tensor<4>| {
                t.unsqueeze_dim::<5>(2)
                    .expand([b, self.kv_heads, group, s, self.d_k])
                    .reshape([b, self.heads, s, self.d_k])
            };
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            attention(q, repeat(k), repeat(v), None, None, options)
        };
        self.output
            .forward(context.swap_dims(1, 2).reshape([b, s, d_model]))
    }
}

#[derive(Module, Debug)]
struct Block {
    norm_1: LayerNorm,
    attention: CausalSelfAttention,
    norm_2: LayerNorm,
    up: Linear,
    down: Linear,
    gelu: Gelu,
}

#[derive(Module, Debug)]
struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(args: &Args, device: &Device) -> Self {
        let d = args.d_model;
        let d_k = d / args.heads;
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        Gpt {
            tokens: EmbeddingConfig::new(VOCAB, d).init(device),
            positions: EmbeddingConfig::new(args.seq, d).init(device),
            blocks: (0..args.layers)
                .map(|_| Block {
                    norm_1: LayerNormConfig::new(d).init(device),
                    attention: CausalSelfAttention {
                        query: linear(d, d),
                        key: linear(d, args.kv_heads * d_k),
                        value: linear(d, args.kv_heads * d_k),
                        output: linear(d, d),
                        heads: args.heads,
                        kv_heads: args.kv_heads,
                        d_k,
                        flash: true,
                    },
                    norm_2: LayerNormConfig::new(d).init(device),
                    up: linear(d, 4 * d),
                    down: linear(4 * d, d),
                    gelu: Gelu::new(),
                })
                .collect(),
            norm: LayerNormConfig::new(d).init(device),
            head: linear(d, VOCAB),
        }
    }

    /// The same weights, attending with the fused op (`flash`) or Burn's composed attention.
    fn with_flash(mut self, flash: bool) -> Self {
        for block in &mut self.blocks {
            block.attention.flash = flash;
        }
        self
    }

    fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..s as i64, &tokens.device())
            .reshape([1, s])
            .expand([b, s]);
        let mut x = self.tokens.forward(tokens) + self.positions.forward(positions);
        for block in &self.blocks {
            x = x.clone() + block.attention.forward(block.norm_1.forward(x.clone()));
            let h = block
                .gelu
                .forward(block.up.forward(block.norm_2.forward(x.clone())));
            x = x + block.down.forward(h);
        }
        self.head.forward(self.norm.forward(x))
    }
}

/// Trains a copy of `model`; returns the losses and the median step time in seconds.
fn train(
    model: Gpt,
    args: &Args,
    device: &Device,
    data: &[(Vec<i64>, Vec<i64>)],
) -> (Vec<f32>, f64) {
    let mut model = model;
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let (mut losses, mut times) = (Vec::new(), Vec::new());
    for (x, y) in data {
        let start = Instant::now();
        let x =
            Tensor::<2, Int>::from_data(TensorData::new(x.clone(), [args.batch, args.seq]), device);
        let y = Tensor::<1, Int>::from_data(
            TensorData::new(y.clone(), [args.batch * args.seq]),
            device,
        );
        let logits = model.forward(x).reshape([args.batch * args.seq, VOCAB]);
        let loss = loss_fn.forward(logits, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(args.lr, model, grads);
        losses.push(loss.into_scalar::<f32>());
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (losses, times[times.len() / 2])
}

fn main() {
    let args = Args::parse();
    assert!(args.seq < TEXT.len(), "--seq must be shorter than the text");
    let device = device(&args.device).autodiff();
    let data = batches(args.steps, args.batch, args.seq);
    let model = Gpt::new(&args, &device);
    println!(
        "GPT: {} layers, d_model {}, {}/{} heads, seq {}, batch {}, {} parameters, device {device:?}",
        args.layers,
        args.d_model,
        args.heads,
        args.kv_heads,
        args.seq,
        args.batch,
        model.num_params()
    );
    if args.attention != "both" {
        let flash = args.attention == "flash";
        let (losses, step) = train(model.with_flash(flash), &args, &device, &data);
        println!(
            "{}: loss {:.4} → {:.4}, median training step {:.2} ms",
            args.attention,
            losses[0],
            losses[args.steps - 1],
            step * 1e3
        );
        return;
    }
    let (flash, flash_step) = train(model.clone().with_flash(true), &args, &device, &data);
    let (composed, composed_step) = train(model.with_flash(false), &args, &device, &data);
    println!("step   flash-attention   burn-attention");
    for step in (0..args.steps)
        .step_by((args.steps / 10).max(1))
        .chain([args.steps - 1])
    {
        println!(
            "{step:>4}   {:>15.4}   {:>14.4}",
            flash[step], composed[step]
        );
    }
    let max_diff = flash
        .iter()
        .zip(&composed)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "largest loss difference over {} steps: {max_diff:.2e}",
        args.steps
    );
    println!(
        "median training step: flash-attention {:.2} ms, burn-attention {:.2} ms",
        flash_step * 1e3,
        composed_step * 1e3
    );
    assert!(
        flash[args.steps - 1] < 0.8 * flash[0],
        "the loss did not fall with flash attention: {flash:?}"
    );
}
