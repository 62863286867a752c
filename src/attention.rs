//! The public tensor API: validation, then the fused op on Cube devices or the composed
//! fallback everywhere else.

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor};
use cubecl_flash_attention::launch::MAX_SPAN;
use cubecl_flash_attention::{AttentionProblem, DeviceLimits, FloatDtype, loop_budget};

use crate::fallback;
use crate::ops::FlashAttentionOps;
use crate::options::FlashAttentionOptions;

/// Attention `softmax(q·kᵀ·scale) · v`, fused: no `[s_q, s_kv]` matrix is ever stored,
/// forward or backward.
///
/// - `q` `[batch, heads_q, seq_q, dim_qk]`, `k` `[batch, heads_kv, seq_kv, dim_qk]`,
///   `v` `[batch, heads_kv, seq_kv, dim_v]` → `[batch, heads_q, seq_q, dim_v]`;
/// - GQA/MQA: `heads_kv` divides `heads_q`, query head `h` reads key/value head
///   `h / (heads_q / heads_kv)`; K and V are not repeated in memory;
/// - `[batch, seq, heads, dim]` tensors passed through `swap_dims(1, 2)` are read in place;
/// - f32, f16 and bf16 (where the device has them); accumulation is f32.
///
/// On CUDA, ROCm and wgpu devices this runs the fused kernels, with a fused backward under
/// autodiff. On other backends (Flex, NdArray, …) it computes the same function from Burn
/// tensor ops, so code never branches on the backend; so does a CPU Vulkan driver
/// (lavapipe) for problems whose kernels would pass its loop budget (see the kernels'
/// `loop_budget`), with the `[s_q, s_kv]` scores in memory.
///
/// The kernels address at most 2^32 − 1 elements of a tensor: a batch past that runs as
/// several calls of fewer sequences each, their outputs (and, under autodiff, gradients)
/// concatenated.
///
/// # Panics
/// On mismatched shapes, head counts, dtypes or devices, with a message naming the argument;
/// where one sequence alone passes the kernels' 2^32 − 1 elements, naming the tensor; on
/// dropout in a batch that runs as several calls (each would number its sequences from 0
/// and draw the others' masks).
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
) -> Tensor<4> {
    flash_attention_with_lse(q, k, v, options).0
}

/// [`flash_attention`], also returning the natural-log log-sum-exp of every query row,
/// `[batch, heads_q, seq_q]` in f32 (−∞ where a row sees no key). The LSE is not tracked by
/// autodiff.
pub fn flash_attention_with_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    let problem = validate(&q, &k, &v, &options);
    if !fused_kernels_take(&q.device(), &problem) {
        return fallback::attention(q, k, v, &options);
    }
    if let Some(chunk) = batch_chunk(&problem) {
        return in_parts(q, k, v, options, chunk);
    }
    let (o, lse) = <Dispatch as FlashAttentionOps>::flash_attention_fwd(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        options,
    );
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
}

/// [`flash_attention_with_lse`] as calls of `chunk` sequences each, outputs (and, under
/// autodiff, gradients) concatenated: for a batch past what one launch takes.
fn in_parts(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: FlashAttentionOptions,
    chunk: usize,
) -> (Tensor<4>, Tensor<3>) {
    let batch = q.dims()[0];
    assert!(
        options.dropout.is_none_or(|d| !d.is_active()),
        "flash_attention: `dropout` in a batch of {batch} sequences, which runs as calls of \
         {chunk} (past 2^32 − 1 elements a tensor): each call would draw the masks of the \
         first sequences again; split the batch and give each part its own offset"
    );
    let (outs, lses): (Vec<_>, Vec<_>) = (0..batch)
        .step_by(chunk)
        .map(|first| {
            let part = first..(first + chunk).min(batch);
            let [q, k, v] = [&q, &k, &v].map(|t| t.clone().slice([part.clone()]));
            flash_attention_with_lse(q, k, v, options)
        })
        .unzip();
    (Tensor::cat(outs, 0), Tensor::cat(lses, 0))
}

/// Sequences per call where `problem`'s tensors (counted as contiguous, the gradients'
/// f32 sums included) would pass the 2^32 − 1 elements the kernels address, else `None`.
/// At least 1: a sequence that alone passes it is refused by the kernels, naming the tensor.
pub(crate) fn batch_chunk(problem: &AttentionProblem) -> Option<usize> {
    let per_sequence = [
        problem.heads_q * problem.seq_q * problem.dim_qk.max(problem.dim_v),
        problem.heads_kv * problem.seq_kv * problem.dim_qk.max(problem.dim_v),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let fits = MAX_SPAN.checked_div(per_sequence).unwrap_or(usize::MAX);
    (problem.batch > fits).then_some(fits.max(1))
}

/// Whether tensors on `device` run the fused kernels (CUDA, ROCm and wgpu devices), rather
/// than the composed fallback.
pub fn supports_flash_attention(device: &Device) -> bool {
    use burn::backend::DispatchDevice;
    #[allow(unreachable_patterns)]
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
        DispatchDevice::Cube(_) => true,
        _ => false,
    }
}

/// Whether the fused kernels run `problem` on `device`: a Cube device, and where its driver
/// cuts loops short past a budget (lavapipe), a problem whose kernels stay within it.
pub(crate) fn fused_kernels_take(device: &Device, problem: &AttentionProblem) -> bool {
    use burn::backend::DispatchDevice;
    #[allow(unreachable_patterns)]
    match device.clone().without_autodiff().as_dispatch() {
        #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
        DispatchDevice::Cube(cube) => {
            let limits = DeviceLimits::from_properties(cube.client().properties());
            loop_budget::check_problem(problem, &limits).is_ok()
        }
        _ => false,
    }
}

/// Panics, naming the argument, unless each of `others` (argument, dtype, device) has the
/// dtype and the device of `q`.
pub(crate) fn check_like_q(
    op: &str,
    q: (DType, &Device),
    others: impl IntoIterator<Item = (&'static str, DType, Device)>,
) {
    let (dtype, device) = q;
    for (arg, t_dtype, t_device) in others {
        assert_eq!(
            t_dtype, dtype,
            "{op}: `{arg}` has dtype {t_dtype:?}, expected {dtype:?} (the dtype of `q`)"
        );
        assert!(
            &t_device == device,
            "{op}: `{arg}` is on device {t_device:?}, expected {device:?} (the device of `q`)"
        );
    }
}

/// The kernels' dtype for a Burn dtype, if they take it.
pub(crate) fn kernel_dtype(dtype: DType) -> Option<FloatDtype> {
    match dtype {
        DType::F32 => Some(FloatDtype::F32),
        DType::F16 => Some(FloatDtype::F16),
        DType::BF16 => Some(FloatDtype::BF16),
        _ => None,
    }
}

/// The problem, checked; panics with a message naming the argument on any mismatch.
pub(crate) fn validate(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    options: &FlashAttentionOptions,
) -> AttentionProblem {
    let dtype = q.dtype();
    let Some(kernel_dtype) = kernel_dtype(dtype) else {
        panic!("flash_attention: `q` has dtype {dtype:?}, expected F32, F16 or BF16");
    };
    check_like_q(
        "flash_attention",
        (dtype, &q.device()),
        [("k", k), ("v", v)].map(|(arg, t)| (arg, t.dtype(), t.device())),
    );
    AttentionProblem::new(
        &q.dims(),
        &k.dims(),
        &v.dims(),
        kernel_dtype,
        options.kernel_options(),
    )
    .unwrap_or_else(|e| panic!("flash_attention: {e}"))
}

#[cfg(test)]
mod tests {
    use cubecl_flash_attention::{AttentionOptions, FloatDtype};

    use super::*;

    fn problem(batch: usize, heads_q: usize, seq: usize, dim: usize) -> AttentionProblem {
        let q = [batch, heads_q, seq, dim];
        let kv = [batch, 1, seq, dim];
        let options = AttentionOptions::default();
        AttentionProblem::new(&q, &kv, &kv, FloatDtype::BF16, options).unwrap()
    }

    #[test]
    fn batches_past_32_bit_offsets_run_in_parts_that_fit() {
        // 2^20 elements a sequence: 4095 sequences stay within 2^32 − 1 elements.
        assert_eq!(batch_chunk(&problem(4095, 8, 1024, 128)), None);
        assert_eq!(batch_chunk(&problem(4096, 8, 1024, 128)), Some(4095));
        assert_eq!(batch_chunk(&problem(8000, 8, 1024, 128)), Some(4095));
        // One sequence past the limit: parts of one, which the kernels then refuse.
        assert_eq!(batch_chunk(&problem(2, 64, 1 << 20, 128)), Some(1));
        // Nothing to address.
        assert_eq!(batch_chunk(&problem(0, 8, 1024, 128)), None);
    }
}
