//! `CubeBackend` (CUDA, ROCm, wgpu): launches the kernels of `cubecl-flash-attention`.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::client::Client;
use burn_cubecl::cubecl::zspace::metadata::Metadata;
use burn_cubecl::{
    CubeBackend,
    kernel::{cast, into_contiguous},
    tensor::CubeTensor,
};
use cubecl_flash_attention::{
    DeviceTensor, FlashError, FloatDtype, KernelPath, PackedSequences, ScoreBias, TermsGrad,
    backward::{
        Gradients, Saved, TermsGradients, backward, backward_biased, backward_packed,
        backward_packed_biased,
    },
    block_mask::DeviceBlockMask,
    decode::{DecodeInputs, KvCache, Lengths, Splits, decode},
    forward::{ForwardOutput, forward, forward_biased, forward_packed, forward_packed_biased},
    rotary::Rotary,
};

use crate::attention::kernel_dtype;
use crate::ops::FlashAttentionOps;
use crate::options::{BiasedOptions, DecodeOptions, FlashAttentionOptions, VarlenOptions};

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

/// A packed batch's sequences where `options` says the call is one.
fn packed_batch(
    cu_seqlens_q: CubeTensor,
    cu_seqlens_k: CubeTensor,
    options: &BiasedOptions,
) -> Option<[PackedSequences; 2]> {
    options.packed.as_ref().map(|packed| {
        [
            packed_sequences(cu_seqlens_q, &packed.lengths_q),
            packed_sequences(cu_seqlens_k, &packed.lengths_k),
        ]
    })
}

/// Runs a forward launcher on Burn tensors `[q, k, v]`: returns `(O, LSE)` as Burn tensors
/// (panicking with `what` on a launcher error, which the public API's checks rule out).
fn run_forward(
    what: &str,
    inputs: [CubeTensor; 3],
    launch: impl FnOnce(&Client, [&DeviceTensor; 3], FloatDtype) -> Result<ForwardOutput, FlashError>,
) -> (CubeTensor, CubeTensor) {
    let like = inputs[0].clone();
    let dtype = like.dtype;
    let [q, k, v] = inputs.map(device_tensor);
    let result = launch(&like.client, [&q, &k, &v], float_dtype(dtype))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    (
        cube_tensor(&like, result.out, dtype),
        cube_tensor(&like, result.lse, DType::F32),
    )
}

/// Runs a backward launcher on Burn tensors `[q, k, v, o, lse, d_o]`: returns `(dQ, dK, dV)`
/// as Burn tensors (panicking with `what` on a launcher error).
fn run_backward(
    what: &str,
    inputs: [CubeTensor; 6],
    launch: impl FnOnce(&Client, Saved<'_>, &DeviceTensor, FloatDtype) -> Result<Gradients, FlashError>,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let like = inputs[0].clone();
    let dtype = like.dtype;
    let [q, k, v, out, lse, d_o] = inputs.map(device_tensor);
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
    };
    let grads = launch(&like.client, saved, &d_o, float_dtype(dtype))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    (
        cube_tensor(&like, grads.dq, dtype),
        cube_tensor(&like, grads.dk, dtype),
        cube_tensor(&like, grads.dv, dtype),
    )
}

/// The kernels' views of a call's bias (in its own dtype, which the public API has made
/// that of `q`), ALiBi slopes and score-function parameters (cast to f32).
fn score_terms(
    bias: CubeTensor,
    alibi_slopes: CubeTensor,
    score_params: CubeTensor,
) -> [DeviceTensor; 3] {
    [
        device_tensor(bias),
        device_tensor(cast(alibi_slopes, DType::F32)),
        device_tensor(cast(score_params, DType::F32)),
    ]
}

/// What `options` says a call's score terms are, over their kernel views.
fn score_bias<'a>(
    options: &BiasedOptions,
    [bias, slopes, params]: &'a [DeviceTensor; 3],
    block_mask: Option<&'a DeviceBlockMask>,
) -> ScoreBias<'a> {
    ScoreBias {
        bias: options.bias.then_some(bias),
        alibi_slopes: options.alibi.then_some(slopes),
        block_mask,
        score_mod: options.score_mod,
        score_params: options.score_params.then_some(params),
    }
}

/// The kernels' view of a call's block mask: its words (32-bit) and their layout, where
/// `options` has one.
fn device_block_mask(words: CubeTensor, options: &BiasedOptions) -> Option<DeviceBlockMask> {
    options.block_mask.map(|layout| DeviceBlockMask {
        words: device_tensor(cast(words, DType::I32)),
        layout,
    })
}

/// The kernels' dtype; the public API has already rejected anything else.
fn float_dtype(dtype: DType) -> FloatDtype {
    kernel_dtype(dtype)
        .unwrap_or_else(|| panic!("flash attention takes f32, f16 or bf16 tensors, got {dtype:?}"))
}

impl FlashAttentionOps for CubeBackend {
    fn flash_attention_biased_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        alibi_slopes: FloatTensor<Self>,
        block_mask: IntTensor<Self>,
        score_params: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        options: BiasedOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let terms = score_terms(bias, alibi_slopes, score_params);
        let block_mask = device_block_mask(block_mask, &options);
        let sequences = packed_batch(cu_seqlens_q, cu_seqlens_k, &options);
        run_forward(
            "flash_attention_biased forward",
            [q, k, v],
            |client, [q, k, v], dtype| {
                let terms = score_bias(&options, &terms, block_mask.as_ref());
                let attention = options.attention.kernel_options();
                match &sequences {
                    Some([sq, sk]) => forward_packed_biased(
                        client,
                        [q, k, v],
                        [sq, sk],
                        terms,
                        dtype,
                        attention,
                        KernelPath::Auto,
                    ),
                    None => {
                        forward_biased(client, q, k, v, terms, dtype, attention, KernelPath::Auto)
                    }
                }
            },
        )
    }

    fn flash_attention_biased_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        alibi_slopes: FloatTensor<Self>,
        block_mask: IntTensor<Self>,
        score_params: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        options: BiasedOptions,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (bias_tensor, params_tensor) = (bias.clone(), score_params.clone());
        let terms = score_terms(bias, alibi_slopes, score_params);
        let block_mask = device_block_mask(block_mask, &options);
        let sequences = packed_batch(cu_seqlens_q, cu_seqlens_k, &options);
        let mut terms_grads = TermsGradients::default();
        let (dq, dk, dv) = run_backward(
            "flash_attention_biased backward",
            [q, k, v, o, lse, d_o],
            |client, saved, d_o, dtype| {
                let terms = score_bias(&options, &terms, block_mask.as_ref());
                let grad = TermsGrad {
                    bias: options.bias_grad,
                    score_params: options.score_params_grad,
                };
                let attention = options.attention.kernel_options();
                let (grads, of_terms) = match &sequences {
                    Some([sq, sk]) => backward_packed_biased(
                        client,
                        saved,
                        d_o,
                        [sq, sk],
                        terms,
                        grad,
                        dtype,
                        attention,
                        KernelPath::Auto,
                    ),
                    None => backward_biased(
                        client,
                        saved,
                        d_o,
                        terms,
                        grad,
                        dtype,
                        attention,
                        KernelPath::Auto,
                    ),
                }?;
                terms_grads = of_terms;
                Ok(grads)
            },
        );
        let dbias = match terms_grads.bias {
            Some(d) => cast(cube_tensor(&bias_tensor, d, DType::F32), bias_tensor.dtype),
            None => bias_tensor,
        };
        // The parameters' gradient comes in their layout (the function indexes both alike).
        let dparams = match terms_grads.score_params {
            Some(d) => CubeTensor::new(
                params_tensor.client.clone(),
                d.handle,
                Metadata::new(d.shape, d.strides),
                params_tensor.device.clone(),
                DType::F32,
            ),
            None => params_tensor,
        };
        (dq, dk, dv, dbias, dparams)
    }

    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        run_forward(
            "flash attention forward",
            [q, k, v],
            |client, [q, k, v], dtype| {
                forward(
                    client,
                    q,
                    k,
                    v,
                    dtype,
                    options.kernel_options(),
                    KernelPath::Auto,
                )
            },
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
        let inputs = [q, k, v, o, lse, d_o];
        run_backward(
            "flash attention backward",
            inputs,
            |client, saved, d_o, dtype| {
                backward(
                    client,
                    saved,
                    d_o,
                    dtype,
                    options.kernel_options(),
                    KernelPath::Auto,
                )
            },
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
        let sequences_q = packed_sequences(cu_seqlens_q, &options.lengths_q);
        let sequences_k = packed_sequences(cu_seqlens_k, &options.lengths_k);
        run_forward(
            "flash_attention_varlen forward",
            [q, k, v],
            |client, [q, k, v], dtype| {
                forward_packed(
                    client,
                    q,
                    k,
                    v,
                    &sequences_q,
                    &sequences_k,
                    dtype,
                    options.attention.kernel_options(),
                    KernelPath::Auto,
                )
            },
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
        let sequences_q = packed_sequences(cu_seqlens_q, &options.lengths_q);
        let sequences_k = packed_sequences(cu_seqlens_k, &options.lengths_k);
        let inputs = [q, k, v, o, lse, d_o];
        run_backward(
            "flash_attention_varlen backward",
            inputs,
            |client, saved, d_o, dtype| {
                backward_packed(
                    client,
                    saved,
                    d_o,
                    &sequences_q,
                    &sequences_k,
                    dtype,
                    options.attention.kernel_options(),
                    KernelPath::Auto,
                )
            },
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
        bias: FloatTensor<Self>,
        alibi_slopes: FloatTensor<Self>,
        score_params: FloatTensor<Self>,
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
        let terms = score_terms(bias, alibi_slopes, score_params);
        let [bias, slopes, params] = &terms;
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
                terms: ScoreBias {
                    bias: options.bias.then_some(bias),
                    alibi_slopes: options.alibi.then_some(slopes),
                    block_mask: None,
                    score_mod: options.score_mod,
                    score_params: options.score_params.then_some(params),
                },
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
