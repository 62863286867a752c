//! `FlashMultiHeadAttention`: multi-head attention with q/k/v/o projections on top of the
//! fused op, with grouped key/value heads (GQA/MQA).

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Tensor};

use crate::attention::flash_attention;
use crate::bias::{AttentionBias, flash_attention_biased};
use crate::dropout::next_dropout;
use crate::options::FlashAttentionOptions;

/// Configuration of [`FlashMultiHeadAttention`].
#[derive(Config, Debug)]
pub struct FlashMultiHeadAttentionConfig {
    /// Model width.
    pub d_model: usize,
    /// Query heads; the head dim is `d_model / n_heads`.
    pub n_heads: usize,
    /// Key/value heads (GQA); `None` is `n_heads`. Must divide `n_heads`.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Each position attends only to itself and earlier positions (bottom-right aligned).
    #[config(default = false)]
    pub causal: bool,
    /// Bias in the four projections.
    #[config(default = true)]
    pub bias: bool,
    /// Initializer of the projections.
    #[config(default = "Initializer::XavierUniform { gain: 1.0 }")]
    pub initializer: Initializer,
    /// Dropout on the attention probabilities while training, fused into the kernels
    /// ([`FlashAttentionOptions::dropout`]), each call on a new stream ([`next_dropout`]).
    #[config(default = 0.0)]
    pub dropout: f64,
}

/// Multi-head attention on the fused flash-attention op: a drop-in for
/// `burn::nn::attention::MultiHeadAttention` wherever the attention weights are not needed
/// (the fused op never forms them, which is the point). Its dropout on the attention weights
/// runs inside the kernels, as `burn::nn::Dropout` decides: while training, on an autodiff
/// device.
#[derive(Module, Debug)]
pub struct FlashMultiHeadAttention {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    pub output: Linear,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_k: usize,
    pub causal: bool,
    /// Its probability and training flag; the fused kernels drop the weights.
    pub dropout: Dropout,
}

impl FlashMultiHeadAttentionConfig {
    /// # Panics
    /// If `n_heads` does not divide `d_model` or `n_kv_heads` does not divide `n_heads`.
    pub fn init(&self, device: &Device) -> FlashMultiHeadAttention {
        let n_kv_heads = self.n_kv_heads.unwrap_or(self.n_heads);
        assert!(
            self.n_heads > 0 && self.d_model.is_multiple_of(self.n_heads),
            "FlashMultiHeadAttentionConfig: `n_heads` ({}) must divide `d_model` ({})",
            self.n_heads,
            self.d_model
        );
        assert!(
            n_kv_heads > 0 && self.n_heads.is_multiple_of(n_kv_heads),
            "FlashMultiHeadAttentionConfig: `n_kv_heads` ({n_kv_heads}) must divide `n_heads` ({})",
            self.n_heads
        );
        let d_k = self.d_model / self.n_heads;
        let linear = |d_out| {
            LinearConfig::new(self.d_model, d_out)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        FlashMultiHeadAttention {
            query: linear(self.d_model),
            key: linear(n_kv_heads * d_k),
            value: linear(n_kv_heads * d_k),
            output: linear(self.d_model),
            n_heads: self.n_heads,
            n_kv_heads,
            d_k,
            causal: self.causal,
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

impl FlashMultiHeadAttention {
    /// Self-attention over `x` `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_qkv(x.clone(), x.clone(), x, None)
    }

    /// Attention of `query` `[batch, seq_q, d_model]` over `key`/`value`
    /// `[batch, seq_kv, d_model]`. `mask_pad` `[batch, seq_kv]` marks padded keys with `true`
    /// (fused, as a bias of −∞ on those keys: [`flash_attention_biased`]).
    pub fn forward_qkv(
        &self,
        query: Tensor<3>,
        key: Tensor<3>,
        value: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
    ) -> Tensor<3> {
        let [batch, seq_q, d_model] = query.dims();
        let split = |x: Tensor<3>, proj: &Linear, heads: usize| {
            let [b, s, _] = x.dims();
            // [b, s, h·d] → [b, s, h, d] viewed as [b, h, s, d]: no copy.
            proj.forward(x)
                .reshape([b, s, heads, self.d_k])
                .swap_dims(1, 2)
        };
        let q = split(query, &self.query, self.n_heads);
        let k = split(key, &self.key, self.n_kv_heads);
        let v = split(value, &self.value, self.n_kv_heads);
        let dropping = self.dropout.training.is_enabled()
            && q.device().is_autodiff()
            && self.dropout.prob > 0.0;
        let options = FlashAttentionOptions::default()
            .with_causal(self.causal)
            .with_dropout(dropping.then(|| next_dropout(self.dropout.prob as f32)));
        let context = match mask_pad {
            None => flash_attention(q, k, v, options),
            Some(mask) => {
                let terms = AttentionBias::new().with_key_padding(mask);
                flash_attention_biased(q, k, v, terms, options)
            }
        };
        let context = context.swap_dims(1, 2).reshape([batch, seq_q, d_model]);
        self.output.forward(context)
    }
}
