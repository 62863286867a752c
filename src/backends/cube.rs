//! `CubeBackend` (CUDA, ROCm, wgpu): launches the kernels of `cubecl-flash-attention`.

use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeBackend, kernel::into_contiguous, tensor::CubeTensor};
use cubecl_flash_attention::{
    DeviceTensor, FloatDtype, KernelPath,
    backward::{Saved, backward},
    forward::forward,
};

use crate::attention::kernel_dtype;
use crate::ops::FlashAttentionOps;
use crate::options::FlashAttentionOptions;

/// The kernel crate's view of a Burn tensor (strides kept: no copy for strided views).
fn device_tensor(t: CubeTensor) -> DeviceTensor {
    let t = if t.meta.is_tiled() {
        into_contiguous(t)
    } else {
        t
    };
    DeviceTensor {
        handle: t.handle.clone(),
        shape: t.meta.shape().to_vec(),
        strides: t.meta.strides().to_vec(),
    }
}

fn cube_tensor(like: &CubeTensor, t: DeviceTensor, dtype: DType) -> CubeTensor {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(t.shape),
        t.handle,
        dtype,
    )
}

/// The kernels' dtype; the public API has already rejected anything else.
fn float_dtype(dtype: DType) -> FloatDtype {
    kernel_dtype(dtype)
        .unwrap_or_else(|| panic!("flash attention takes f32, f16 or bf16 tensors, got {dtype:?}"))
}

impl FlashAttentionOps for CubeBackend {
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype;
        let client = q.client.clone();
        let like = q.clone();
        let result = forward(
            &client,
            &device_tensor(q),
            &device_tensor(k),
            &device_tensor(v),
            float_dtype(dtype),
            options.kernel_options(),
            KernelPath::Auto,
        )
        .unwrap_or_else(|e| panic!("flash attention forward: {e}"));
        (
            cube_tensor(&like, result.out, dtype),
            cube_tensor(&like, result.lse, DType::F32),
        )
    }

    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype;
        let client = q.client.clone();
        let like = q.clone();
        let (q, k, v) = (device_tensor(q), device_tensor(k), device_tensor(v));
        let (o, lse, d_o) = (device_tensor(o), device_tensor(lse), device_tensor(d_o));
        let saved = Saved {
            q: &q,
            k: &k,
            v: &v,
            out: &o,
            lse: &lse,
        };
        let grads = backward(
            &client,
            saved,
            &d_o,
            float_dtype(dtype),
            options.kernel_options(),
            KernelPath::Auto,
        )
        .unwrap_or_else(|e| panic!("flash attention backward: {e}"));
        (
            cube_tensor(&like, grads.dq, dtype),
            cube_tensor(&like, grads.dk, dtype),
            cube_tensor(&like, grads.dv, dtype),
        )
    }
}
