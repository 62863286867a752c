//! Packed batches of variable-length sequences: attention over sequences concatenated along
//! one token axis, without padding (FlashAttention's `varlen` functions). This is what
//! training with sequence packing and the prefill of a batch of prompts use.

use burn::backend::Dispatch;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cubecl_flash_attention::{AttentionProblem, PackedSequences as KernelSequences};

use crate::attention::{check_like_q, fused_kernels_take, kernel_dtype};
use crate::bias::{AttentionBias, check_terms, fused_biased, fused_kernels_take_terms};
use crate::fallback;
use crate::ops::FlashAttentionOps;
use crate::options::{FlashAttentionOptions, PackedLengths, VarlenOptions};
use crate::serving::host_ints;

const OP: &str = "flash_attention_varlen";

/// Where each sequence of a packed batch starts: `cu_seqlens` (Int `[b + 1]`: 0, then the
/// running sum of the lengths) on the device, and the lengths, checked, on the host (so
/// that a call needs no read back).
///
/// ```
/// # let device = burn::tensor::Device::flex();
/// use burn_flash_attention::PackedSequences;
/// let sequences = PackedSequences::from_lengths(&[3, 0, 5], &device);
/// assert_eq!((sequences.total(), sequences.longest()), (8, 5));
/// ```
#[derive(Clone, Debug)]
pub struct PackedSequences {
    cu_seqlens: Tensor<1, Int>,
    lengths: Vec<usize>,
}

impl PackedSequences {
    /// Sequences of the given lengths, packed in that order, on `device`.
    ///
    /// # Panics
    /// Where the lengths add up to 2^31 tokens or more.
    pub fn from_lengths(lengths: &[usize], device: &Device) -> Self {
        let offsets =
            KernelSequences::offsets(lengths).unwrap_or_else(|e| panic!("PackedSequences: {e}"));
        let count = offsets.len();
        Self {
            cu_seqlens: Tensor::from_data(TensorData::new(offsets, [count]), device),
            lengths: lengths.to_vec(),
        }
    }

    /// The sequences `cu_seqlens` (Int `[b + 1]`) delimits, as FlashAttention takes them. It
    /// is read back once, here, and checked.
    ///
    /// # Panics
    /// Unless it starts at 0 and never decreases, naming `cu_seqlens`.
    pub fn from_cu_seqlens(cu_seqlens: Tensor<1, Int>) -> Self {
        let offsets = host_ints(cu_seqlens.clone());
        let lengths = KernelSequences::lengths_of("cu_seqlens", &offsets)
            .unwrap_or_else(|e| panic!("PackedSequences: {e}"));
        assert!(
            offsets.last().is_none_or(|&total| total <= i32::MAX as i64),
            "PackedSequences: `cu_seqlens` ends at {:?}, at most 2^31 − 1 tokens are taken",
            offsets.last()
        );
        Self {
            cu_seqlens,
            lengths,
        }
    }

    /// `cu_seqlens`, Int `[b + 1]`.
    pub fn cu_seqlens(&self) -> Tensor<1, Int> {
        self.cu_seqlens.clone()
    }

    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Number of sequences.
    pub fn count(&self) -> usize {
        self.lengths.len()
    }

    /// Tokens of all sequences.
    pub fn total(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Length of the longest sequence (0 for none).
    pub fn longest(&self) -> usize {
        self.lengths.iter().copied().max().unwrap_or(0)
    }
}

/// Attention within each sequence of a packed batch, fused, forward and backward:
///
/// - `q` `[total_q, heads_q, dim_qk]`, `k` `[total_kv, heads_kv, dim_qk]`, `v` `[total_kv,
///   heads_kv, dim_v]` → `[total_q, heads_q, dim_v]`;
/// - sequence `i`'s queries are rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` of `q` and they
///   attend to its keys, rows `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` of `k` and `v` only;
/// - causal and window masks are bottom-right aligned within each sequence; a sequence
///   with queries but no keys gets zeros;
/// - GQA, softcap and the other options as [`flash_attention`](crate::flash_attention).
///
/// Under autodiff the backward is fused too (gradients of `q`, `k`, `v`). On backends
/// without the fused kernels it is composed from Burn ops sequence by sequence.
///
/// # Panics
/// On shapes that disagree with the sequences, mismatched heads, dtypes or devices, with a
/// message naming the argument.
pub fn flash_attention_varlen(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    sequences_q: &PackedSequences,
    sequences_k: &PackedSequences,
    options: FlashAttentionOptions,
) -> Tensor<3> {
    flash_attention_varlen_with_lse(q, k, v, sequences_q, sequences_k, options).0
}

/// [`flash_attention_varlen`], also returning the natural-log LSE of every query row,
/// `[heads_q, total_q]` in f32 (−∞ where a row sees no key), not tracked by autodiff.
pub fn flash_attention_varlen_with_lse(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    sequences_q: &PackedSequences,
    sequences_k: &PackedSequences,
    options: FlashAttentionOptions,
) -> (Tensor<3>, Tensor<2>) {
    let problem = validate(&q, &k, &v, sequences_q, sequences_k, &options);
    let (lengths_q, lengths_k) = (sequences_q.lengths(), sequences_k.lengths());
    if !fused_kernels_take(&q.device(), &problem) {
        let lengths = (lengths_q, lengths_k);
        return fallback::attention_packed_biased(q, k, v, lengths, None, None, &options);
    }
    let (o, lse) = <Dispatch as FlashAttentionOps>::flash_attention_varlen_fwd(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        sequences_q.cu_seqlens().into_dispatch(),
        sequences_k.cu_seqlens().into_dispatch(),
        VarlenOptions {
            attention: options,
            lengths_q: lengths_q.to_vec(),
            lengths_k: lengths_k.to_vec(),
        },
    );
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
}

/// [`flash_attention_varlen`] with score terms ([`AttentionBias`], as
/// [`flash_attention_biased`](crate::flash_attention_biased) takes them), each indexed as in
/// the dense batch of the sequences padded to the longest: a bias or mask `[b | 1, h_q | 1,
/// longest s_q | 1, longest s_kv | 1]` (sequence `i` reads `[i, .., ..s_q(i), ..s_kv(i)]`),
/// ALiBi slopes `[b | 1, h_q]`, a block mask over the padded batch's blocks, a score
/// function whose batch index is the sequence and whose positions are within it. Under
/// autodiff the bias and the score function's parameters get their gradients. On
/// backends without the fused kernels it is composed sequence by sequence (a score
/// function, which only the kernels run, panics there).
///
/// # Panics
/// As [`flash_attention_varlen`], and on terms of the wrong shape, dtype or device, with a
/// message naming the argument.
pub fn flash_attention_varlen_biased(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    sequences_q: &PackedSequences,
    sequences_k: &PackedSequences,
    terms: AttentionBias,
    options: FlashAttentionOptions,
) -> Tensor<3> {
    flash_attention_varlen_biased_with_lse(q, k, v, sequences_q, sequences_k, terms, options).0
}

/// [`flash_attention_varlen_biased`], also returning the LSE `[heads_q, total_q]` (f32, not
/// tracked by autodiff).
pub fn flash_attention_varlen_biased_with_lse(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    sequences_q: &PackedSequences,
    sequences_k: &PackedSequences,
    terms: AttentionBias,
    options: FlashAttentionOptions,
) -> (Tensor<3>, Tensor<2>) {
    const OP: &str = "flash_attention_varlen_biased";
    let problem = validate(&q, &k, &v, sequences_q, sequences_k, &options);
    check_terms(OP, &problem, &terms, &q.device());
    let (lengths_q, lengths_k) = (sequences_q.lengths(), sequences_k.lengths());
    if !fused_kernels_take_terms(OP, &problem, &terms, &q.device()) {
        let (bias, slopes) = terms.composed(q.dtype());
        let lengths = (lengths_q, lengths_k);
        return fallback::attention_packed_biased(q, k, v, lengths, bias, slopes, &options);
    }
    let (device, dtype) = (q.device(), q.dtype());
    let absent = q.clone().detach().unsqueeze::<4>();
    let qkv = [q, k, v].map(Tensor::into_dispatch);
    let packed = (
        [sequences_q.cu_seqlens(), sequences_k.cu_seqlens()],
        PackedLengths {
            lengths_q: lengths_q.to_vec(),
            lengths_k: lengths_k.to_vec(),
        },
    );
    let (o, lse) = fused_biased(qkv, (&device, dtype, absent), terms, options, Some(packed));
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
}

/// The packed problem (batch = the sequences, lengths = the longest), checked; panics with a
/// message naming the argument on any mismatch.
fn validate(
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    sequences_q: &PackedSequences,
    sequences_k: &PackedSequences,
    options: &FlashAttentionOptions,
) -> AttentionProblem {
    let dtype = q.dtype();
    let Some(kernel_dtype) = kernel_dtype(dtype) else {
        panic!("{OP}: `q` has dtype {dtype:?}, expected F32, F16 or BF16");
    };
    check_like_q(
        OP,
        (dtype, &q.device()),
        [("k", k), ("v", v)].map(|(arg, t)| (arg, t.dtype(), t.device())),
    );
    for (arg, sequences) in [("cu_seqlens_q", sequences_q), ("cu_seqlens_k", sequences_k)] {
        assert!(
            sequences.cu_seqlens.device() == q.device(),
            "{OP}: `{arg}` is on device {:?}, expected {:?} (the device of `q`)",
            sequences.cu_seqlens.device(),
            q.device()
        );
    }
    assert_eq!(
        sequences_k.count(),
        sequences_q.count(),
        "{OP}: `cu_seqlens_k` has {} sequences, expected {} (those of `cu_seqlens_q`)",
        sequences_k.count(),
        sequences_q.count()
    );
    for (arg, dims, sequences, cu) in [
        ("q", q.dims(), sequences_q, "cu_seqlens_q"),
        ("k", k.dims(), sequences_k, "cu_seqlens_k"),
        ("v", v.dims(), sequences_k, "cu_seqlens_k"),
    ] {
        assert_eq!(
            dims[0],
            sequences.total(),
            "{OP}: `{arg}` has shape {dims:?}, expected {} tokens first (the total of `{cu}`)",
            sequences.total()
        );
    }
    let batch = sequences_q.count();
    let as_batch = |[_, heads, dim]: [usize; 3], seq: usize| [batch, heads, seq, dim];
    AttentionProblem::new(
        &as_batch(q.dims(), sequences_q.longest()),
        &as_batch(k.dims(), sequences_k.longest()),
        &as_batch(v.dims(), sequences_k.longest()),
        kernel_dtype,
        options.kernel_options(),
    )
    .unwrap_or_else(|e| panic!("{OP}: {e}"))
}
