//! FP8 attention: queries, keys and values held as Burn quantized tensors with 8-bit float
//! values (E4M3, or E5M2) and f32 scales.
//!
//! - [`quantize_fp8`] quantizes a float tensor to E4M3 with one scale per tensor or one per
//!   row of the head dim ([`Fp8Scaling`]);
//! - [`flash_attention_fp8`] runs attention on quantized Q, K and V, the output in the
//!   float dtype asked for;
//! - [`flash_attention_fp8_trained`] takes float tensors, runs the forward on their FP8
//!   values and passes the gradients straight through to them (the backward in their own
//!   dtype, from the inputs kept in it), so that a model trains with FP8 attention by
//!   changing one call.
//!
//! Every device runs the FP8 values through the kernels of the output's dtype today: the
//! values are dequantized (exactly: an E4M3 value times its f32 scale) and rounded to that
//! dtype, then attended with f32 accumulation. Results are those of FP8 inputs; no kernel
//! multiplies FP8 values on FP8 tensor cores yet, so the speed is that of the output's
//! dtype plus the dequantization.

use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn::tensor::{DType, Tensor};

use crate::attention::flash_attention;
use crate::options::FlashAttentionOptions;

/// How [`quantize_fp8`] scales values into E4M3's range (±448).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale for the whole tensor: FlashAttention-3's per-tensor descale factor.
    #[default]
    PerTensor,
    /// One scale per row of the head dim (per token and head; per half-row above 128
    /// values): an outlier then coarsens only its own row. Burn's block scales span at
    /// most 255 values a dimension, which rules out one scale per (batch, head) beyond
    /// 255 positions; a row's scale is finer than that.
    PerRow,
}

/// The quantization scheme of [`quantize_fp8`] for head dim `dim` (a multiple of 4: the
/// values are packed four to a 32-bit word).
pub fn fp8_scheme(scaling: Fp8Scaling, dim: usize) -> QuantScheme {
    let scheme = QuantScheme::default()
        .with_value(QuantValue::E4M3)
        .with_store(QuantStore::PackedU32(0));
    match scaling {
        Fp8Scaling::PerTensor => scheme.per_tensor(ScaleDtype::F32),
        Fp8Scaling::PerRow => scheme.per_block([row_block(dim) as u8], ScaleDtype::F32),
    }
}

/// Values per scale of [`Fp8Scaling::PerRow`]: the row, or its largest part of at most 128
/// values that divides it into parts of a multiple of 4.
fn row_block(dim: usize) -> usize {
    (4..=dim.min(128))
        .rev()
        .find(|b| b % 4 == 0 && dim % b == 0)
        .unwrap_or(4)
}

/// `t` `[batch, heads, seq, dim]` quantized to E4M3 with `scaling`, scales by min-max
/// calibration (the largest magnitude maps to 448). Quantization is not differentiable:
/// the result is detached (see [`flash_attention_fp8_trained`] for training).
///
/// # Panics
/// If `t` is not a float tensor of F32, F16 or BF16, or `dim` is not a multiple of 4.
pub fn quantize_fp8(t: Tensor<4>, scaling: Fp8Scaling) -> Tensor<4> {
    let [.., dim] = t.dims();
    assert!(
        matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16),
        "quantize_fp8: `t` has dtype {:?}, expected F32, F16 or BF16",
        t.dtype()
    );
    assert!(
        dim % 4 == 0,
        "quantize_fp8: `t` has head dim {dim}, expected a multiple of 4 (the values are packed \
         four to a 32-bit word)"
    );
    t.quantize_dynamic(&fp8_scheme(scaling, dim))
}

/// Attention `softmax(q·kᵀ·scale) · v` on FP8 inputs: `q`, `k`, `v` as
/// [`flash_attention`] takes them, each a Burn quantized tensor with E4M3 or E5M2 values
/// (from [`quantize_fp8`], or any scheme Burn dequantizes); the output in `out_dtype`
/// (F32, F16 or BF16). Not tracked by autodiff (quantized tensors carry no gradient).
///
/// # Panics
/// If an input is not quantized to 8-bit float values, `out_dtype` is not a float dtype the
/// kernels take, or on anything [`flash_attention`] refuses (shapes, devices).
pub fn flash_attention_fp8(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
    out_dtype: DType,
) -> Tensor<4> {
    assert!(
        matches!(out_dtype, DType::F32 | DType::F16 | DType::BF16),
        "flash_attention_fp8: `out_dtype` is {out_dtype:?}, expected F32, F16 or BF16"
    );
    for (arg, t) in [("q", &q), ("k", &k), ("v", &v)] {
        check_fp8(arg, t.dtype());
    }
    // `flash_attention` checks the shapes and devices, naming the argument.
    let [q, k, v] = [q, k, v].map(|t| t.dequantize().cast(out_dtype));
    flash_attention(q, k, v, options)
}

/// [`flash_attention`] on the FP8 values of `q`, `k` and `v` (float tensors, quantized with
/// `scaling` as [`quantize_fp8`] does), with gradients passed straight through the
/// quantization: `dq`, `dk`, `dv` are the gradients of attention at the FP8 values, computed
/// in the inputs' dtype from the values the forward read. This is how FP8 attention trains
/// (the forward's rounding is not differentiated).
///
/// # Panics
/// On anything [`quantize_fp8`] or [`flash_attention`] refuses.
pub fn flash_attention_fp8_trained(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    scaling: Fp8Scaling,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    let [q, k, v] = [q, k, v].map(|t| straight_through(t, scaling));
    flash_attention(q, k, v, options)
}

/// `t`'s FP8 value (quantized, dequantized, in `t`'s dtype) whose gradient is `t`'s: in f32,
/// `t + (fp8 − t)` equals the FP8 value exactly (the difference of two values within a
/// factor 2 of each other is exact), and the difference is a constant to autodiff.
fn straight_through(t: Tensor<4>, scaling: Fp8Scaling) -> Tensor<4> {
    let dtype = t.dtype();
    let exact = t.clone().cast(DType::F32);
    let fp8 = quantize_fp8(t.detach(), scaling)
        .dequantize()
        .cast(DType::F32);
    // `fp8` comes from a detached tensor: the difference is untracked.
    let offset = fp8 - exact.clone().detach();
    (exact + offset).cast(dtype)
}

/// Panics, naming `arg`, unless `dtype` is a quantized dtype of 8-bit float values.
fn check_fp8(arg: &str, dtype: DType) {
    let fp8 = matches!(
        dtype,
        DType::QFloat(scheme) if matches!(scheme.value, QuantValue::E4M3 | QuantValue::E5M2)
    );
    assert!(
        fp8,
        "flash_attention_fp8: `{arg}` has dtype {dtype:?}, expected a quantized tensor with \
         E4M3 or E5M2 values (see `quantize_fp8`)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_split_into_parts_of_at_most_128_values() {
        assert_eq!(row_block(64), 64);
        assert_eq!(row_block(128), 128);
        assert_eq!(row_block(256), 128);
        assert_eq!(row_block(40), 40);
        assert_eq!(row_block(200), 100);
        assert_eq!(row_block(8), 8);
    }
}
