//! `CubeBackend` (CUDA, ROCm, wgpu): launches the kernels of `cubecl-flash-attention`.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeBackend,
    kernel::{cast, into_contiguous},
    tensor::CubeTensor,
};
use cubecl_flash_attention::{
    DeviceTensor, FloatDtype, KernelPath, PackedSequences,
    backward::{Saved, backward, backward_packed},
    decode::{DecodeInputs, KvCache, Lengths, Splits, decode},
    forward::{forward, forward_packed},
    rotary::Rotary,
};

use crate::attention::kernel_dtype;
use crate::ops::FlashAttentionOps;
use crate::options::{DecodeOptions, FlashAttentionOptions, VarlenOptions};

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

/// A packed batch's sequences: `cu_seqlens` (cast to i32) with the lengths it holds.
fn packed_sequences(cu_seqlens: CubeTensor, lengths: &[usize]) -> PackedSequences {
    PackedSequences::from_device(
        device_tensor(cast(cu_seqlens, DType::I32)),
        lengths.to_vec(),
    )
    .unwrap_or_else(|e| panic!("flash_attention_varlen: {e}"))
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

    fn flash_attention_varlen_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        options: VarlenOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype;
        let client = q.client.clone();
        let like = q.clone();
        let result = forward_packed(
            &client,
            &device_tensor(q),
            &device_tensor(k),
            &device_tensor(v),
            &packed_sequences(cu_seqlens_q, &options.lengths_q),
            &packed_sequences(cu_seqlens_k, &options.lengths_k),
            float_dtype(dtype),
            options.attention.kernel_options(),
            KernelPath::Auto,
        )
        .unwrap_or_else(|e| panic!("flash_attention_varlen forward: {e}"));
        (
            cube_tensor(&like, result.out, dtype),
            cube_tensor(&like, result.lse, DType::F32),
        )
    }

    fn flash_attention_varlen_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        options: VarlenOptions,
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
        let grads = backward_packed(
            &client,
            saved,
            &d_o,
            &packed_sequences(cu_seqlens_q, &options.lengths_q),
            &packed_sequences(cu_seqlens_k, &options.lengths_k),
            float_dtype(dtype),
            options.attention.kernel_options(),
            KernelPath::Auto,
        )
        .unwrap_or_else(|e| panic!("flash_attention_varlen backward: {e}"));
        (
            cube_tensor(&like, grads.dq, dtype),
            cube_tensor(&like, grads.dk, dtype),
            cube_tensor(&like, grads.dv, dtype),
        )
    }

    fn flash_attention_decode(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        cache_seqlens: IntTensor<Self>,
        block_table: IntTensor<Self>,
        k_new: FloatTensor<Self>,
        v_new: FloatTensor<Self>,
        rotary_cos: FloatTensor<Self>,
        rotary_sin: FloatTensor<Self>,
        options: DecodeOptions,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let dtype = q.dtype;
        let client = q.client.clone();
        let like = q.clone();
        // The caches are written in place: a cache shared with another tensor is copied
        // first, as any in-place Burn op does.
        let owned = |t: CubeTensor| if t.can_mut() { t } else { t.copy() };
        let (k_cache, v_cache) = match options.append {
            true => (owned(k_cache), owned(v_cache)),
            false => (k_cache, v_cache),
        };
        let index = |t: CubeTensor| device_tensor(cast(t, DType::I32));
        let seqlens = index(cache_seqlens);
        // A contiguous cache's table is a placeholder the kernels never read.
        let table = match options.paged {
            true => index(block_table),
            false => seqlens.clone(),
        };
        let (k, v) = (
            device_tensor(k_cache.clone()),
            device_tensor(v_cache.clone()),
        );
        let (k_new, v_new) = (device_tensor(k_new), device_tensor(v_new));
        let (cos, sin) = (device_tensor(rotary_cos), device_tensor(rotary_sin));
        let result = decode(
            &client,
            DecodeInputs {
                q: &device_tensor(q),
                cache: KvCache {
                    k: &k,
                    v: &v,
                    block_table: options.paged.then_some(&table),
                },
                cache_seqlens: &seqlens,
                new: options.append.then_some((&k_new, &v_new)),
                lengths: Lengths::Known(&options.lengths),
                rotary: options.rotary.map(|interleaved| Rotary {
                    cos: &cos,
                    sin: &sin,
                    interleaved,
                }),
            },
            float_dtype(dtype),
            options.attention.kernel_options(),
            Splits::Auto,
        )
        .unwrap_or_else(|e| panic!("flash_attention_with_kvcache: {e}"));
        (
            cube_tensor(&like, result.out, dtype),
            cube_tensor(&like, result.lse, DType::F32),
            k_cache,
            v_cache,
        )
    }
}
