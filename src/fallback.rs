//! The same attention composed from Burn tensor ops, for backends without the fused kernels.
//! It materializes the `[s_q, s_kv]` scores (memory grows with s²); autodiff differentiates it
//! like any other composition.

use burn::tensor::{Bool, FloatDType, Tensor, TensorData};

use crate::options::FlashAttentionOptions;

/// `(O, LSE)` with the semantics of the fused op: GQA by broadcasting K/V heads, softcap,
/// bottom-right causal / window masks, zero output and −∞ LSE on fully masked rows.
pub(crate) fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    let [batch, heads_q, seq_q, dim_qk] = q.dims();
    let [_, heads_kv, seq_kv, _] = k.dims();
    let group = heads_q / heads_kv;
    let (k, v) = (repeat_heads(k, group), repeat_heads(v, group));
    let scale = options
        .scale
        .unwrap_or_else(|| 1.0 / (dim_qk as f32).sqrt());

    let mut scores = q.matmul(k.transpose()).mul_scalar(scale);
    if let Some(cap) = options.softcap {
        scores = scores.div_scalar(cap).tanh().mul_scalar(cap);
    }
    if options.mask().is_masked() {
        let hidden = hidden_keys(options, [batch, heads_q, seq_q, seq_kv], &scores.device());
        scores = scores.mask_fill(hidden, f32::NEG_INFINITY);
    }
    // Softmax with its LSE. A fully masked row has max −∞, clamped (to a value every float
    // dtype holds) so that it yields p = 0; the shift cancels in the softmax.
    let max = scores.clone().max_dim(3).clamp_min(-6.0e4).detach();
    let exp = scores.sub(max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let lse = max
        .add(sum.clone().log())
        .squeeze_dim::<3>(3)
        .cast(FloatDType::F32);
    let p = exp.div(sum.clamp_min(f32::MIN_POSITIVE));
    (p.matmul(v), lse)
}

/// [`attention`] with padded keys (`mask_pad` `[batch, seq_kv]`, `true` = padding) hidden
/// as well, through Burn's composed attention.
pub(crate) fn attention_with_padding(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask_pad: Tensor<2, Bool>,
    options: &FlashAttentionOptions,
) -> Tensor<4> {
    use burn::tensor::module::attention as burn_attention;
    use burn::tensor::ops::AttentionModuleOptions;
    let [batch, heads_q, seq_q, _] = q.dims();
    let [_, heads_kv, seq_kv, _] = k.dims();
    let group = heads_q / heads_kv;
    let hidden = hidden_keys(options, [batch, heads_q, seq_q, seq_kv], &q.device());
    let padded = mask_pad
        .reshape([batch, 1, 1, seq_kv])
        .expand([batch, heads_q, seq_q, seq_kv]);
    let options = AttentionModuleOptions {
        scale: options.scale.map(f64::from),
        softcap: options.softcap.map(f64::from),
        is_causal: false,
    };
    burn_attention(
        q,
        repeat_heads(k, group),
        repeat_heads(v, group),
        Some(hidden.bool_or(padded)),
        None,
        options,
    )
}

/// K or V with each head repeated for the `group` query heads that read it.
fn repeat_heads(t: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return t;
    }
    let [b, h, s, d] = t.dims();
    t.unsqueeze_dim::<5>(2)
        .expand([b, h, group, s, d])
        .reshape([b, h * group, s, d])
}

/// `true` where the causal / window mask of `options` hides a key, broadcast to `shape`
/// `[batch, heads, s_q, s_kv]`.
fn hidden_keys(
    options: &FlashAttentionOptions,
    shape: [usize; 4],
    device: &burn::tensor::Device,
) -> Tensor<4, Bool> {
    let [_, _, seq_q, seq_kv] = shape;
    let mask = options.mask();
    let hidden: Vec<bool> = (0..seq_q * seq_kv)
        .map(|n| !mask.is_visible(n / seq_kv, n % seq_kv, seq_q, seq_kv))
        .collect();
    Tensor::<2, Bool>::from_data(TensorData::new(hidden, [seq_q, seq_kv]), device)
        .unsqueeze::<4>()
        .expand(shape)
}
