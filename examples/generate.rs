//! A small LLaMA-style byte-level decoder (RMSNorm, rotary position embedding, GQA, SwiGLU)
//! trained on the text the repository ships, or loaded from the checkpoint this example
//! writes, then generating for prompts of different lengths with a paged KV cache per layer:
//! sequences join the batch as others leave, each prompt is prefilled on its own, and every
//! step decodes the active sequences together through `flash_attention_with_kvcache` (the
//! rotary embedding applied inside the op). The greedy tokens are checked against
//! recomputing each whole sequence without a cache. Progress bars while it trains and
//! generates; tokens per second at the end.
//!
//!     cargo run --release --features wgpu --example generate -- --device wgpu-cpu --tiny
//!     cargo run --release --features cuda --example generate -- --device cuda

use std::path::PathBuf;
use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_flash_attention::{FlashAttentionOptions, PagedKvCache, RotaryEmbedding, flash_attention};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

#[path = "shared/mod.rs"]
mod shared;

use shared::{TEXT, VOCAB, batches, device};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// cuda, rocm, wgpu, wgpu-cpu (lavapipe) or flex.
    #[arg(long, default_value = "wgpu-cpu")]
    device: String,
    /// A tiny model and run (the CPU test device's configuration).
    #[arg(long)]
    tiny: bool,
    #[arg(long, default_value_t = 300)]
    steps: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (GQA).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Prompts to generate for, of different lengths.
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Sequences decoded together at most; the others wait for a place.
    #[arg(long, default_value_t = 4)]
    active: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 48)]
    new_tokens: usize,
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Weights to load if the file exists, else to write after training.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
}

impl Args {
    /// The `--tiny` configuration.
    fn resolved(self) -> Self {
        if !self.tiny {
            return self;
        }
        Self {
            steps: 20,
            batch: 4,
            seq: 32,
            d_model: 32,
            heads: 4,
            kv_heads: 2,
            layers: 2,
            prompts: 4,
            active: 2,
            new_tokens: 6,
            page_size: 4,
            ..self
        }
    }

    fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Longest sequence: the longest prompt and its new tokens.
    fn max_len(&self) -> usize {
        prompt_len(self, self.prompts - 1) + self.new_tokens
    }
}

#[derive(Module, Debug)]
struct Attention {
    query: Linear,
    key: Linear,
    value: Linear,
    output: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    /// Q `[b, heads, s, d]`, K and V `[b, kv_heads, s, d]` of `x` `[b, s, d_model]`.
    fn project(&self, x: Tensor<3>) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [b, s, _] = x.dims();
        let split = |proj: &Linear, heads: usize| {
            proj.forward(x.clone())
                .reshape([b, s, heads, self.head_dim])
                .swap_dims(1, 2)
        };
        (
            split(&self.query, self.heads),
            split(&self.key, self.kv_heads),
            split(&self.value, self.kv_heads),
        )
    }

    fn merge(&self, context: Tensor<4>) -> Tensor<3> {
        let [b, h, s, d] = context.dims();
        self.output
            .forward(context.swap_dims(1, 2).reshape([b, s, h * d]))
    }

    /// Whole sequences from position 0, without a cache.
    fn forward(&self, x: Tensor<3>, rope: &RotaryEmbedding) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let positions: Vec<usize> = (0..b).flat_map(|_| 0..s).collect();
        let (q, k, v) = self.project(x);
        let (q, k) = (rope.apply(q, &positions), rope.apply(k, &positions));
        let options = FlashAttentionOptions::default().with_causal(true);
        self.merge(flash_attention(q, k, v, options))
    }

    /// The next tokens of the sequences `ids` of `cache`: their keys and values join the
    /// cache and the queries attend to everything before them.
    fn decode(
        &self,
        x: Tensor<3>,
        rope: &RotaryEmbedding,
        cache: &mut PagedKvCache,
        ids: &[usize],
    ) -> Tensor<3> {
        let (q, k, v) = self.project(x);
        let options = FlashAttentionOptions::default().with_causal(true);
        self.merge(cache.step(ids, q, k, v, Some(rope), options))
    }
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
struct FeedForward {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl FeedForward {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.down
            .forward(silu(self.gate.forward(x.clone())) * self.up.forward(x))
    }
}

#[derive(Module, Debug)]
struct Block {
    attention_norm: RmsNorm,
    attention: Attention,
    feed_norm: RmsNorm,
    feed: FeedForward,
}

#[derive(Module, Debug)]
struct Llama {
    tokens: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
}

impl Llama {
    fn new(args: &Args, device: &Device) -> Self {
        let d = args.d_model;
        let hd = args.head_dim();
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        Llama {
            tokens: EmbeddingConfig::new(VOCAB, d).init(device),
            blocks: (0..args.layers)
                .map(|_| Block {
                    attention_norm: RmsNormConfig::new(d).init(device),
                    attention: Attention {
                        query: linear(d, args.heads * hd),
                        key: linear(d, args.kv_heads * hd),
                        value: linear(d, args.kv_heads * hd),
                        output: linear(args.heads * hd, d),
                        heads: args.heads,
                        kv_heads: args.kv_heads,
                        head_dim: hd,
                    },
                    feed_norm: RmsNormConfig::new(d).init(device),
                    feed: FeedForward {
                        gate: linear(d, 3 * d),
                        up: linear(d, 3 * d),
                        down: linear(3 * d, d),
                    },
                })
                .collect(),
            norm: RmsNormConfig::new(d).init(device),
            head: linear(d, VOCAB),
        }
    }

    /// Logits `[b, s, vocab]` of whole sequences `tokens` `[b, s]`, without a cache.
    fn forward(&self, tokens: Tensor<2, Int>, rope: &RotaryEmbedding) -> Tensor<3> {
        let mut x = self.tokens.forward(tokens);
        for block in &self.blocks {
            let a = block
                .attention
                .forward(block.attention_norm.forward(x.clone()), rope);
            x = x + a;
            x = x.clone() + block.feed.forward(block.feed_norm.forward(x));
        }
        self.head.forward(self.norm.forward(x))
    }

    /// Logits `[n, s, vocab]` of the next `s` tokens `[n, s]` of the sequences `ids`, each
    /// layer's keys and values going into its cache.
    fn decode(
        &self,
        tokens: Tensor<2, Int>,
        rope: &RotaryEmbedding,
        caches: &mut [PagedKvCache],
        ids: &[usize],
    ) -> Tensor<3> {
        let mut x = self.tokens.forward(tokens);
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            let a =
                block
                    .attention
                    .decode(block.attention_norm.forward(x.clone()), rope, cache, ids);
            x = x + a;
            x = x.clone() + block.feed.forward(block.feed_norm.forward(x));
        }
        self.head.forward(self.norm.forward(x))
    }
}

/// Trains `model` on windows of the text; prints the first and last loss.
fn train(model: Llama, args: &Args, device: &Device, rope: &RotaryEmbedding) -> Llama {
    let mut model = model;
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut losses = Vec::new();
    let started = Instant::now();
    let bar = progress(
        args.steps,
        "training {bar:30} {pos}/{len} steps, {msg} [{elapsed}]",
    );
    for (step, (x, y)) in batches(args.steps, args.batch, args.seq)
        .into_iter()
        .enumerate()
    {
        let x = Tensor::<2, Int>::from_data(TensorData::new(x, [args.batch, args.seq]), device);
        let y = Tensor::<1, Int>::from_data(TensorData::new(y, [args.batch * args.seq]), device);
        let logits = model
            .forward(x, rope)
            .reshape([args.batch * args.seq, VOCAB]);
        let loss = loss_fn.forward(logits, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(args.lr, model, grads);
        losses.push(loss.into_scalar::<f32>());
        bar.set_message(format!("loss {:.3}", losses[step]));
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "trained {} steps in {:.1} s: loss {:.3} → {:.3}",
        args.steps,
        started.elapsed().as_secs_f64(),
        losses[0],
        losses[losses.len() - 1]
    );
    model
}

/// A progress bar on standard error over `len` units, drawn by `template`.
fn progress(len: usize, template: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(ProgressStyle::with_template(template).expect("a valid template"));
    bar
}

/// Length of prompt `n`: the prompts grow by 3 bytes each.
fn prompt_len(args: &Args, n: usize) -> usize {
    (args.seq / 4).max(2) + 3 * n
}

/// Prompt `n`: a window of the text.
fn prompt(args: &Args, n: usize) -> Vec<i64> {
    let start = (n * 997) % (TEXT.len() - prompt_len(args, n));
    TEXT.as_bytes()[start..start + prompt_len(args, n)]
        .iter()
        .map(|&c| c as i64)
        .collect()
}

fn tokens(rows: &[Vec<i64>], device: &Device) -> Tensor<2, Int> {
    let (n, s) = (rows.len(), rows[0].len());
    Tensor::from_data(TensorData::new(rows.concat(), [n, s]), device)
}

/// The greedy next token of each row of `logits` `[n, s, vocab]` at its last position.
fn next_tokens(logits: Tensor<3>) -> Vec<i64> {
    let [n, s, v] = logits.dims();
    let last = logits.slice([0..n, s - 1..s, 0..v]).reshape([n, v]);
    last.argmax(1)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("token ids")
}

/// A sequence being generated: its cache id, prompt and tokens so far.
struct Running {
    id: usize,
    prompt: usize,
    tokens: Vec<i64>,
}

/// Generates `new_tokens` greedy tokens for every prompt, at most `active` sequences at a
/// time; returns each prompt's tokens (prompt, then generated) and the generated count and
/// seconds of the whole run.
fn generate(
    model: &Llama,
    args: &Args,
    device: &Device,
    rope: &RotaryEmbedding,
) -> (Vec<Vec<i64>>, usize, f64) {
    let hd = args.head_dim();
    let max_pages = args.max_len().div_ceil(args.page_size);
    let pages = args.active * max_pages;
    let mut caches: Vec<PagedKvCache> = (0..args.layers)
        .map(|_| {
            PagedKvCache::new(
                pages,
                args.page_size,
                args.kv_heads,
                [hd, hd],
                max_pages,
                device,
            )
        })
        .collect();
    let mut waiting: Vec<usize> = (0..args.prompts).rev().collect();
    let mut running: Vec<Running> = Vec::new();
    let mut finished: Vec<Vec<i64>> = vec![Vec::new(); args.prompts];
    let (mut generated, started) = (0, Instant::now());
    let bar = progress(
        args.prompts * args.new_tokens,
        "generating {bar:30} {pos}/{len} tokens, {per_sec}, {msg} [{elapsed}]",
    );
    while !(waiting.is_empty() && running.is_empty()) {
        // Sequences join while there is room: each prompt prefilled on its own.
        while running.len() < args.active
            && let Some(n) = waiting.pop()
        {
            let ids: Vec<usize> = caches.iter_mut().map(|c| c.add_sequence()).collect();
            assert!(
                ids.iter().all(|&id| id == ids[0]),
                "the layers' caches agree"
            );
            let text = prompt(args, n);
            let logits = model.decode(
                tokens(&[text.clone()], device),
                rope,
                &mut caches,
                &ids[..1],
            );
            let mut tokens = text;
            tokens.extend(next_tokens(logits));
            generated += 1;
            running.push(Running {
                id: ids[0],
                prompt: n,
                tokens,
            });
        }
        // One step of every running sequence together.
        let ids: Vec<usize> = running.iter().map(|r| r.id).collect();
        let last: Vec<Vec<i64>> = running
            .iter()
            .map(|r| vec![*r.tokens.last().unwrap()])
            .collect();
        let next = next_tokens(model.decode(tokens(&last, device), rope, &mut caches, &ids));
        for (r, t) in running.iter_mut().zip(next) {
            r.tokens.push(t);
            generated += 1;
        }
        // Sequences with all their tokens leave, giving their pages back.
        running.retain(|r| {
            let done = r.tokens.len() >= prompt_len(args, r.prompt) + args.new_tokens;
            if done {
                for cache in caches.iter_mut() {
                    cache.remove_sequence(r.id);
                }
                finished[r.prompt] = r.tokens.clone();
            }
            !done
        });
        bar.set_position(generated as u64);
        bar.set_message(format!(
            "{}/{} prompts done, {} running",
            finished.iter().filter(|t| !t.is_empty()).count(),
            args.prompts,
            running.len(),
        ));
    }
    bar.finish_and_clear();
    (finished, generated, started.elapsed().as_secs_f64())
}

/// Checks each sequence's generated tokens against the greedy choice of the whole sequence
/// recomputed without a cache. Returns the positions whose top two logits lie within
/// `tie` of each other and disagree (a rounding difference, not an error); panics on any
/// other difference.
fn check(
    model: &Llama,
    args: &Args,
    device: &Device,
    rope: &RotaryEmbedding,
    sequences: &[Vec<i64>],
    tie: f32,
) -> usize {
    let mut ties = 0;
    for (n, sequence) in sequences.iter().enumerate() {
        let p = prompt_len(args, n);
        let inputs = sequence[..sequence.len() - 1].to_vec();
        let logits = model.forward(tokens(&[inputs], device), rope);
        let [_, s, v] = logits.dims();
        let rows: Vec<f32> = logits
            .reshape([s, v])
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("logits");
        for (i, &token) in sequence.iter().enumerate().skip(p) {
            let row = &rows[(i - 1) * v..i * v];
            let best = (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            if best as i64 == token {
                continue;
            }
            let gap = row[best] - row[token as usize];
            assert!(
                gap <= tie,
                "prompt {n}, position {i}: the cache chose byte {token}, recomputing chooses {best} \
                 (logits {} against {})",
                row[token as usize],
                row[best]
            );
            ties += 1;
        }
    }
    ties
}

fn main() {
    let args = Args::parse().resolved();
    assert!(
        args.heads % args.kv_heads == 0 && args.d_model % args.heads == 0,
        "--heads must divide --d-model and be a multiple of --kv-heads"
    );
    let device = device(&args.device);
    let training = device.clone().autodiff();
    let rope_on = |device: &Device| {
        RotaryEmbedding::new(
            args.max_len().max(args.seq),
            args.head_dim(),
            10_000.0,
            false,
            burn::tensor::DType::F32,
            device,
        )
    };
    let rope = rope_on(&device);
    let fresh = Llama::new(&args, &training);
    println!(
        "LLaMA-style decoder: {} layers, d_model {}, {}/{} heads, {} parameters, device {device:?}",
        args.layers,
        args.d_model,
        args.heads,
        args.kv_heads,
        fresh.num_params()
    );
    let model = match &args.checkpoint {
        Some(path) if path.exists() => {
            println!("loading {}", path.display());
            fresh.load_file(path).valid()
        }
        _ => {
            let model = train(fresh, &args, &training, &rope_on(&training));
            if let Some(path) = &args.checkpoint {
                model
                    .clone()
                    .save_file(path)
                    .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
                println!("wrote {}", path.display());
            }
            model.valid()
        }
    };

    let (sequences, generated, seconds) = generate(&model, &args, &device, &rope);
    for (n, sequence) in sequences.iter().enumerate().take(3) {
        let p = prompt_len(&args, n);
        let text = |t: &[i64]| {
            String::from_utf8_lossy(&t.iter().map(|&c| c as u8).collect::<Vec<_>>()).into_owned()
        };
        println!("{:?} → {:?}", text(&sequence[..p]), text(&sequence[p..]));
    }
    println!(
        "{generated} tokens for {} prompts ({} at a time, pages of {}) in {seconds:.2} s: {:.1} tokens/s",
        args.prompts,
        args.active,
        args.page_size,
        generated as f64 / seconds
    );
    let ties = check(&model, &args, &device, &rope, &sequences, 1e-3);
    println!(
        "greedy tokens equal to recomputing each sequence without a cache ({ties} near-ties differ)"
    );
}
