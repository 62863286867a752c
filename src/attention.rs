//! The public tensor API: validation, then the fused op on Cube devices or the composed
//! fallback everywhere else.

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Tensor};
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
/// # Panics
/// On mismatched shapes, head counts, dtypes or devices, with a message naming the argument.
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
    let (o, lse) = <Dispatch as FlashAttentionOps>::flash_attention_fwd(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        options,
    );
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
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
