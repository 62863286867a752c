//! Attention with terms added to the scores: an additive bias (trainable), a boolean mask,
//! ALiBi, a block mask and a score function written as code (with trainable parameters),
//! fused into the kernels forward and backward.

use std::sync::Arc;

use burn::backend::{Dispatch, tensor::FloatTensor};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use cubecl_flash_attention::AttentionProblem;
use cubecl_flash_attention::block_mask::{self, BlockMaskLayout};
use cubecl_flash_attention::score_mod::{ScoreFn, ScoreMod};

use crate::attention::{fused_kernels_take, validate};
use crate::fallback;
use crate::ops::FlashAttentionOps;
use crate::options::{BiasedOptions, FlashAttentionOptions, PackedLengths};

/// What [`flash_attention_biased`] adds to the scores `softcap(q·kᵀ · scale)` after the
/// causal and window masks, each term broadcast as `[batch | 1, heads_q | 1, seq_q | 1,
/// seq_kv | 1]`:
///
/// ```
/// # use burn::tensor::{Bool, DType, Tensor};
/// # use burn_flash_attention::AttentionBias;
/// # fn example(bias: Tensor<4>, key_padding: Tensor<2, Bool>, slopes: Tensor<1>) {
/// let terms = AttentionBias::new()
///     .with_bias(bias) // any float dtype; its gradient flows under autodiff
///     .with_key_padding(key_padding) // `[batch, seq_kv]`, `true` = padding
///     .with_alibi(slopes.unsqueeze()); // `[1, heads_q]` or `[batch, heads_q]`
/// # }
/// ```
///
/// - `bias`: added as is; it may be tracked by autodiff, and its gradient is summed over the
///   dimensions where it broadcasts. −∞ hides a key.
/// - `mask`: `true` hides a key (Burn's convention), as −∞ added to the bias.
/// - ALiBi `slopes` `[batch | 1, heads_q]`: adds `−slope · |i + seq_kv − seq_q − j|`
///   (bottom-right aligned, as FlashAttention-2); not differentiated.
/// - A [`BlockMask`]: the kernels skip its empty blocks, run its full ones without mask
///   arithmetic and hide the scores its partial ones hide.
/// - A score function ([`ScoreMod`], `#[cube]` code; see
///   [`kernels::score_mod`](crate::kernels::score_mod) and `examples/score_mod.rs`) with
///   parameters `[rows, cols]`: compiled into the kernels, applied to each score after the
///   other terms, able to hide keys; its parameters' gradient flows under autodiff. It runs
///   on CUDA, ROCm and wgpu devices.
///
/// A query row whose every key is hidden gives a zero output, LSE −∞ and zero gradients.
#[derive(Clone, Debug, Default)]
pub struct AttentionBias {
    bias: Option<Tensor<4>>,
    mask: Option<Tensor<4, Bool>>,
    alibi_slopes: Option<Tensor<2>>,
    block_mask: Option<BlockMask>,
    score_mod: Option<ScoreFn>,
    score_params: Option<Tensor<2>>,
}

/// A block mask ([`block_mask::BlockMask`], built on the host from documents, a prefix, a
/// window or any predicate) on a device, for [`AttentionBias::with_block_mask`]. Build it
/// once and pass it to every call that shares it (each layer of a model, forward and
/// backward): it is uploaded here, not per call.
///
/// ```
/// # use burn::tensor::Device;
/// # use burn_flash_attention::{AttentionBias, BlockMask};
/// # use burn_flash_attention::kernels::{BlockShape, block_mask};
/// # fn example(device: &Device) {
/// // Two packed documents of 100 and 156 tokens, causal within each.
/// let ids: Vec<u32> = (0..256).map(|t| if t < 100 { 0 } else { 1 }).collect();
/// let blocks = BlockShape { block_q: 128, block_kv: 128 };
/// let mask = block_mask::BlockMask::documents(&[ids.clone()], &[ids], true, blocks).unwrap();
/// let terms = AttentionBias::new().with_block_mask(BlockMask::new(mask, device));
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BlockMask {
    host: Arc<block_mask::BlockMask>,
    words: Tensor<1, Int>,
    layout: BlockMaskLayout,
}

impl BlockMask {
    /// `mask` on `device`.
    pub fn new(mask: block_mask::BlockMask, device: &Device) -> Self {
        let (words, layout) = mask.words();
        // The words' bits, as the backend's 32-bit integers.
        let bits: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
        let len = bits.len();
        let words = Tensor::from_data(TensorData::new(bits, [len]), (device, DType::I32));
        Self {
            host: Arc::new(mask),
            words,
            layout,
        }
    }

    /// The mask on the host.
    pub fn host(&self) -> &block_mask::BlockMask {
        &self.host
    }

    /// The mask as a boolean tensor `[b | 1, h | 1, s_q, s_kv]`, `true` where a key is hidden
    /// (Burn's convention): what the composed path adds as −∞.
    fn hidden(&self) -> Tensor<4, Bool> {
        let shape = self.host.shape();
        let [batch, heads, seq_q, seq_kv] = shape;
        let mut hidden = Vec::with_capacity(shape.iter().product());
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..seq_q {
                    hidden.extend((0..seq_kv).map(|j| !self.host.is_visible(b, h, i, j)));
                }
            }
        }
        Tensor::from_data(TensorData::new(hidden, shape), &self.words.device())
    }
}

impl AttentionBias {
    pub fn new() -> Self {
        Self::default()
    }

    /// An additive bias `[batch | 1, heads_q | 1, seq_q | 1, seq_kv | 1]`; a second call
    /// adds to the first.
    pub fn with_bias(mut self, bias: Tensor<4>) -> Self {
        self.bias = Some(match self.bias {
            Some(previous) => previous.add(bias),
            None => bias,
        });
        self
    }

    /// A boolean mask `[batch | 1, heads_q | 1, seq_q | 1, seq_kv | 1]`, `true` where a key
    /// is hidden; a second call hides the keys of either.
    pub fn with_mask(mut self, mask: Tensor<4, Bool>) -> Self {
        self.mask = Some(match self.mask {
            Some(previous) => previous.bool_or(mask),
            None => mask,
        });
        self
    }

    /// A key padding mask `[batch, seq_kv]`, `true` for padding.
    pub fn with_key_padding(self, padding: Tensor<2, Bool>) -> Self {
        let [batch, seq_kv] = padding.dims();
        self.with_mask(padding.reshape([batch, 1, 1, seq_kv]))
    }

    /// ALiBi slopes `[batch | 1, heads_q]`.
    pub fn with_alibi(mut self, slopes: Tensor<2>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }

    /// A block mask `[batch | 1, heads_q | 1, seq_q, seq_kv]` (replacing an earlier one).
    pub fn with_block_mask(mut self, mask: BlockMask) -> Self {
        self.block_mask = Some(mask);
        self
    }

    /// The score function `M` (replacing an earlier one), applied to each score after the
    /// other terms.
    pub fn with_score_mod<M: ScoreMod>(mut self) -> Self {
        self.score_mod = Some(ScoreFn::of::<M>());
        self
    }

    /// The score function's parameters `[rows, cols]`, any float dtype (the kernels read
    /// them as f32); their gradient flows under autodiff.
    pub fn with_score_params(mut self, params: Tensor<2>) -> Self {
        self.score_params = Some(params);
        self
    }

    /// The terms of a decode call, checked against `problem` (whose keys are the cache's
    /// capacity: a bias is indexed by key position) and the device of `q`; panics naming
    /// a block mask, which decode does not take.
    pub(crate) fn into_decode_terms(
        mut self,
        op: &str,
        problem: &AttentionProblem,
        q: &Tensor<4>,
    ) -> DecodeTerms {
        assert!(
            self.block_mask.is_none(),
            "{op}: decode takes a bias, a mask, ALiBi and a score function, not a block mask \
             (its blocks tile training-shaped problems: pass the mask it summarises instead)"
        );
        check_terms(op, problem, &self, &q.device());
        let score_mod = self.score_mod.take();
        let params = self.score_params.take().map(|p| p.cast(DType::F32));
        let (bias, slopes) = self.folded_bias(q.dtype());
        DecodeTerms {
            bias,
            alibi_slopes: slopes.map(|s| s.cast(DType::F32)),
            score_mod,
            score_params: params,
        }
    }

    /// The terms as the composed fallback adds them: a block mask as the boolean mask it
    /// summarises, folded with the bias ([`AttentionBias::folded_bias`]).
    pub(crate) fn composed(mut self, dtype: DType) -> (Option<Tensor<4>>, Option<Tensor<2>>) {
        if let Some(blocks) = self.block_mask.take() {
            self = self.with_mask(blocks.hidden());
        }
        self.folded_bias(dtype)
    }

    /// The bias with the mask folded in as −∞, in `dtype`.
    fn folded_bias(self, dtype: burn::tensor::DType) -> (Option<Tensor<4>>, Option<Tensor<2>>) {
        let mask = self.mask.map(|mask| {
            Tensor::<4>::zeros(mask.shape(), (&mask.device(), dtype))
                .mask_fill(mask, f32::NEG_INFINITY)
        });
        let bias = match (self.bias.map(|b| b.cast(dtype)), mask) {
            (Some(bias), Some(mask)) => Some(bias.add(mask)),
            (bias, mask) => bias.or(mask),
        };
        (bias, self.alibi_slopes)
    }
}

/// A decode call's terms ([`AttentionBias::into_decode_terms`]): the bias with the mask
/// folded in (dtype of `q`), the ALiBi slopes and the score function's parameters (f32).
pub(crate) struct DecodeTerms {
    pub bias: Option<Tensor<4>>,
    pub alibi_slopes: Option<Tensor<2>>,
    pub score_mod: Option<ScoreFn>,
    pub score_params: Option<Tensor<2>>,
}

/// Checks ALiBi slopes against `[batch, heads_q]`: `[batch | 1, heads_q]`, on `device` (that
/// of `q`); panics naming `alibi_slopes` and `op`.
fn check_alibi(op: &str, slopes: &Tensor<2>, [batch, heads_q]: [usize; 2], device: &Device) {
    let [b, h] = slopes.dims();
    assert!(
        (b == batch || b == 1) && h == heads_q,
        "{op}: `alibi_slopes` has shape [{b}, {h}], expected [{batch} | 1, {heads_q}] (batch, \
         query heads)"
    );
    assert!(
        &slopes.device() == device,
        "{op}: `alibi_slopes` is on device {:?}, expected {device:?} (the device of `q`)",
        slopes.device(),
    );
}

/// [`flash_attention`](crate::flash_attention) with `terms` added to the scores (see
/// [`AttentionBias`]): fused on CUDA, ROCm and wgpu devices, forward and backward, with the
/// bias's gradient when it is tracked. Only the bias itself and its gradient take
/// `[s_q, s_kv]` memory, never the scores.
///
/// # Panics
/// On mismatched shapes, dtypes or devices, with a message naming the argument.
pub fn flash_attention_biased(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    terms: AttentionBias,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    flash_attention_biased_with_lse(q, k, v, terms, options).0
}

/// [`flash_attention_biased`], also returning the natural-log LSE of every query row
/// `[batch, heads_q, seq_q]` in f32 (−∞ where a row sees no key), not tracked by autodiff.
pub fn flash_attention_biased_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    terms: AttentionBias,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    const OP: &str = "flash_attention_biased";
    let problem = validate(&q, &k, &v, &options);
    check_terms(OP, &problem, &terms, &q.device());
    if !fused_kernels_take_terms(OP, &problem, &terms, &q.device()) {
        let (bias, slopes) = terms.composed(q.dtype());
        return fallback::attention_biased(q, k, v, bias, slopes, &options);
    }
    let (device, dtype) = (q.device(), q.dtype());
    let absent = q.clone().detach();
    let qkv = [q, k, v].map(Tensor::into_dispatch);
    let (o, lse) = fused_biased(qkv, (&device, dtype, absent), terms, options, None);
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
}

/// Whether the fused kernels take a call with `terms` (see [`fused_kernels_take`]); panics
/// where they do not and a score function, which only they can run, is among the terms.
pub(crate) fn fused_kernels_take_terms(
    op: &str,
    problem: &AttentionProblem,
    terms: &AttentionBias,
    device: &Device,
) -> bool {
    let fused = fused_kernels_take(device, problem);
    if let (Some(score_mod), false) = (terms.score_mod, fused) {
        panic!(
            "{op}: the score function {} is compiled into the fused kernels, which do not take \
             this call (device {device:?}; they run on CUDA, ROCm and wgpu devices, within the \
             device's loop budget)",
            score_mod.name(),
        );
    }
    fused
}

/// The fused forward with `terms` of `q`, `k`, `v` (dense, or packed by `packed`: the
/// sequences' offsets and lengths) on `device` in `dtype`: `(O, LSE)` as the backend
/// extension returns them. `absent` (untracked, in `dtype`) stands in for an absent bias.
pub(crate) fn fused_biased(
    [q, k, v]: [FloatTensor<Dispatch>; 3],
    (device, dtype, absent): (&Device, DType, Tensor<4>),
    mut terms: AttentionBias,
    options: FlashAttentionOptions,
    packed: Option<([Tensor<1, Int>; 2], PackedLengths)>,
) -> (FloatTensor<Dispatch>, FloatTensor<Dispatch>) {
    let block_mask = terms.block_mask.take();
    let score_mod = terms.score_mod.take();
    let params = terms.score_params.take();
    let (bias, slopes) = terms.folded_bias(dtype);
    let (offsets, packed) = match packed {
        Some((offsets, lengths)) => (Some(offsets), Some(lengths)),
        None => (None, None),
    };
    let options = BiasedOptions {
        attention: options,
        packed,
        bias: bias.is_some(),
        alibi: slopes.is_some(),
        bias_grad: false,
        block_mask: block_mask.as_ref().map(|m| m.layout),
        score_mod,
        score_params: params.is_some(),
        score_params_grad: false,
    };
    // Absent terms pass untracked placeholders the kernels never read.
    let bias = bias.unwrap_or(absent);
    let slopes = slopes.unwrap_or_else(|| Tensor::zeros([1, 1], (device, DType::F32)));
    // One Int placeholder serves the block mask's words and the packed offsets alike.
    let mut int_placeholder = None;
    let mut absent_ints = || {
        int_placeholder
            .get_or_insert_with(|| Tensor::<1, Int>::zeros([1], (device, DType::I32)))
            .clone()
    };
    let words = block_mask.map_or_else(&mut absent_ints, |m| m.words);
    let params = params.map_or_else(
        || Tensor::zeros([1, 1], (device, DType::F32)),
        |p| p.cast(DType::F32),
    );
    let [cu_q, cu_k] = offsets.unwrap_or_else(|| [absent_ints(), absent_ints()]);
    <Dispatch as FlashAttentionOps>::flash_attention_biased_fwd(
        q,
        k,
        v,
        bias.into_dispatch(),
        slopes.detach().into_dispatch(),
        words.into_dispatch(),
        params.into_dispatch(),
        cu_q.into_dispatch(),
        cu_k.into_dispatch(),
        options,
    )
}

/// Panics, naming the argument, unless the bias and the mask broadcast to the scores `[b,
/// h_q, s_q, s_kv]`, the slopes are `[b | 1, h_q]`, and all are on the device of `q`.
pub(crate) fn check_terms(
    op: &str,
    problem: &AttentionProblem,
    terms: &AttentionBias,
    device: &Device,
) {
    let full = [
        problem.batch,
        problem.heads_q,
        problem.seq_q,
        problem.seq_kv,
    ];
    let device = device.clone();
    let tensors = [
        terms.bias.as_ref().map(|t| ("bias", t.dims(), t.device())),
        terms.mask.as_ref().map(|t| ("mask", t.dims(), t.device())),
    ];
    for (arg, dims, t_device) in tensors.into_iter().flatten() {
        assert!(
            dims.iter().zip(full).all(|(&n, f)| n == f || n == 1),
            "{op}: `{arg}` has shape {dims:?}, expected [{} | 1, {} | 1, {} | 1, {} | 1] \
             (batch, query heads, queries, keys)",
            full[0],
            full[1],
            full[2],
            full[3]
        );
        assert!(
            t_device == device,
            "{op}: `{arg}` is on device {t_device:?}, expected {device:?} (the device of `q`)"
        );
    }
    if let Some(blocks) = &terms.block_mask {
        if let Err(e) = blocks.layout.check(full) {
            panic!("{op}: {e}");
        }
        let t_device = blocks.words.device();
        assert!(
            t_device == device,
            "{op}: `block_mask` is on device {t_device:?}, expected {device:?} (the device of \
             `q`)"
        );
    }
    if let Some(params) = &terms.score_params {
        assert!(
            terms.score_mod.is_some(),
            "{op}: `score_params` without a score function to read them \
             (AttentionBias::with_score_mod)"
        );
        assert!(
            params.device() == device,
            "{op}: `score_params` is on device {:?}, expected {device:?} (the device of `q`)",
            params.device()
        );
    }
    if let Some(slopes) = &terms.alibi_slopes {
        check_alibi(op, slopes, [problem.batch, problem.heads_q], &device);
    }
}
