//! Options of a flash-attention call.

use cubecl_flash_attention::block_mask::BlockMaskLayout;
use cubecl_flash_attention::score_mod::ScoreFn;
use cubecl_flash_attention::{AttentionOptions, Dropout, MaskSpec};
use serde::{Deserialize, Serialize};

/// Options of [`flash_attention`](crate::flash_attention), built with `with_*` methods:
///
/// ```
/// use burn_flash_attention::FlashAttentionOptions;
/// let options = FlashAttentionOptions::default().with_causal(true).with_softcap(Some(30.0));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FlashAttentionOptions {
    /// Softmax scale; `None` is `1/√d_qk`.
    pub scale: Option<f32>,
    /// Hide keys after each query's diagonal. Bottom-right aligned: with `s_q ≠ s_kv`, the
    /// last query sees the last key (as Burn and FlashAttention ≥ 2.1).
    pub causal: bool,
    /// Sliding window: keys visible before the diagonal (`None`: unbounded).
    pub window_left: Option<usize>,
    /// Sliding window: keys visible after the diagonal (`None`: unbounded; causal makes it 0).
    pub window_right: Option<usize>,
    /// `cap · tanh(s / cap)` applied to the scaled scores before masking.
    pub softcap: Option<f32>,
    /// Request a backward pass whose gradients are bitwise identical from run to run. By
    /// default the register-level (CUDA sm_80+) backward of query sequences of 8192 or more
    /// adds `dQ` up with f32 atomics, whose order varies; with this flag it computes `dQ` in a
    /// pass of its own instead (7 matrix products per block pair instead of 5). Other paths
    /// and shorter sequences never use atomics. The gradient of a bias that broadcasts
    /// ([`flash_attention_biased`](crate::flash_attention_biased)) is summed by atomics too;
    /// with this flag, from its whole `[b, h_q, s_q, s_kv]` form in a fixed order instead.
    pub deterministic: bool,
    /// Dropout on the attention probabilities, as `burn::nn::Dropout` on the weights of
    /// `MultiHeadAttention`: each is zeroed with probability `p` or scaled by `1/(1 − p)`.
    /// The keep-mask is drawn from `seed` and `offset` (the same on every backend and
    /// device) and drawn again in the backward, never stored. Calls that share a seed need
    /// different offsets; [`next_dropout`](crate::next_dropout) hands them out. Training
    /// only: the decode entry points refuse it.
    #[serde(default)]
    pub dropout: Option<Dropout>,
}

impl FlashAttentionOptions {
    pub fn with_scale(mut self, scale: Option<f32>) -> Self {
        self.scale = scale;
        self
    }
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    /// Sliding window `(left, right)` around the diagonal; `None` on a side is unbounded.
    pub fn with_window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_left = left;
        self.window_right = right;
        self
    }
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }
    pub fn with_deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }
    pub fn with_dropout(mut self, dropout: Option<Dropout>) -> Self {
        self.dropout = dropout;
        self
    }

    /// The mask these options describe.
    pub fn mask(&self) -> MaskSpec {
        MaskSpec {
            causal: self.causal,
            window_left: self.window_left,
            window_right: self.window_right,
        }
    }

    /// The kernels' form of these options.
    pub fn kernel_options(&self) -> AttentionOptions {
        AttentionOptions {
            scale: self.scale,
            mask: self.mask(),
            softcap: self.softcap,
            deterministic: self.deterministic,
            dropout: self.dropout,
        }
    }
}

/// Options of a packed-batch call ([`flash_attention_varlen`](crate::flash_attention_varlen)),
/// as the backend extension receives them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VarlenOptions {
    pub attention: FlashAttentionOptions,
    /// The query lengths `cu_seqlens_q` holds, as checked on the host.
    pub lengths_q: Vec<usize>,
    /// The key/value lengths `cu_seqlens_k` holds, as checked on the host.
    pub lengths_k: Vec<usize>,
}

/// Options of a decode call ([`flash_attention_with_kvcache`](crate::flash_attention_with_kvcache)),
/// as the backend extension receives them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodeOptions {
    pub attention: FlashAttentionOptions,
    /// The cache is paged (a block table names the pages).
    pub paged: bool,
    /// New keys and values are written into the cache before attending.
    pub append: bool,
    /// `cache_seqlens` as checked on the host (the kernels need not read it back).
    pub lengths: Vec<usize>,
    /// `Some(interleaved)` where the new queries and keys turn by the rotary embedding
    /// (`rotary_cos`, `rotary_sin`): pairs `(2i, 2i + 1)` if `interleaved`, else `(i, i +
    /// rotary_dim / 2)`.
    #[serde(default)]
    pub rotary: Option<bool>,
    /// `bias` `[batch | 1, heads_q | 1, s_q | 1, capacity | 1]` is added to the scores.
    #[serde(default)]
    pub bias: bool,
    /// `alibi_slopes` `[batch | 1, heads_q]` (f32) are added as ALiBi.
    #[serde(default)]
    pub alibi: bool,
    /// A score function ([`kernels::score_mod`](crate::kernels::score_mod)), compiled in.
    #[serde(skip)]
    pub score_mod: Option<ScoreFn>,
    /// The score function's parameters `score_params`, any shape.
    #[serde(default)]
    pub score_params: bool,
}

/// Options of a call with score terms ([`flash_attention_biased`](crate::flash_attention_biased)),
/// as the backend extension receives them: which of its `bias`, `alibi_slopes`,
/// `block_mask` and `score_params` tensors are present (absent ones are ignored
/// placeholders), and the score function.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BiasedOptions {
    pub attention: FlashAttentionOptions,
    /// A packed batch ([`flash_attention_varlen_biased`](crate::flash_attention_varlen_biased)):
    /// the lengths its `cu_seqlens_q` and `cu_seqlens_k` hold, as checked on the host; `q`,
    /// `k`, `v` and `o` are packed `[total, heads, dim]` and the LSE `[h_q, total_q]`.
    pub packed: Option<PackedLengths>,
    /// An additive bias `[b | 1, h_q | 1, s_q | 1, s_kv | 1]` in the dtype of `q`.
    pub bias: bool,
    /// ALiBi slopes `[b | 1, h_q]`.
    pub alibi: bool,
    /// The backward returns the bias's gradient (otherwise the bias itself, as a placeholder).
    pub bias_grad: bool,
    /// A block mask: where its views lie in the `block_mask` words tensor.
    pub block_mask: Option<BlockMaskLayout>,
    /// A score function ([`kernels::score_mod`](crate::kernels::score_mod)).
    pub score_mod: Option<ScoreFn>,
    /// The score function's parameters `score_params`, any shape.
    pub score_params: bool,
    /// The backward returns the parameters' gradient (otherwise the parameters themselves,
    /// as a placeholder).
    pub score_params_grad: bool,
}

/// The sequence lengths of a packed batch, as checked on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackedLengths {
    pub lengths_q: Vec<usize>,
    pub lengths_k: Vec<usize>,
}
