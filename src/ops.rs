//! The flash-attention backend extension: one fused forward returning `(O, LSE)` and one
//! fused backward returning `(dQ, dK, dV)`. Implemented for `CubeBackend` (CUDA, ROCm,
//! wgpu) in `backends/cube.rs` and for `Autodiff` in `backends/autodiff.rs`; the Fusion
//! implementation is generated.

use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};

use crate::options::{BiasedOptions, DecodeOptions, FlashAttentionOptions, VarlenOptions};

#[backend_extension(
    Cube: cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm")),
    Fusion,
    Autodiff,
)]
pub trait FlashAttentionOps: Backend {
    /// `q` `[b, h_q, s_q, d_qk]`, `k` `[b, h_kv, s_kv, d_qk]`, `v` `[b, h_kv, s_kv, d_v]` →
    /// (`o` `[b, h_q, s_q, d_v]` in the dtype of `q`, `lse` `[b, h_q, s_q]` in f32).
    #[fusion(meta = meta::forward)]
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of q, k, v for the upstream gradient `d_o` of `o`.
    #[fusion(meta = meta::backward)]
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`flash_attention_fwd`](Self::flash_attention_fwd) with terms added to the scores
    /// after masking: `bias` `[b | 1, h_q | 1, s_q | 1, s_kv | 1]` in the dtype of `q` (−∞
    /// hides a key), ALiBi `alibi_slopes` `[b | 1, h_q]`, a block mask's words
    /// `block_mask` (32-bit, laid out as `options.block_mask` says) and the parameters of
    /// `options.score_mod`, `score_params` (f32), each where `options` says it is present.
    /// With `options.packed`, a packed batch as
    /// [`flash_attention_varlen_fwd`](Self::flash_attention_varlen_fwd) takes it, delimited
    /// by `cu_seqlens_q` and `cu_seqlens_k` (otherwise ignored placeholders), each term
    /// indexed as in the dense batch of the sequences padded to the longest.
    #[fusion(meta = meta::biased_forward)]
    #[allow(clippy::too_many_arguments)]
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of q, k, v; with `options.bias_grad`, of the bias (summed over its
    /// broadcast dimensions; otherwise the bias itself is returned in its place); with
    /// `options.score_params_grad`, of the score function's parameters (f32; otherwise the
    /// parameters themselves).
    #[fusion(meta = meta::biased_backward)]
    #[allow(clippy::too_many_arguments)]
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
    );

    /// A packed batch: `q` `[total_q, h_q, d_qk]`, `k` `[total_kv, h_kv, d_qk]`, `v`
    /// `[total_kv, h_kv, d_v]`, sequence `i` at rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]`
    /// (`cu_seqlens_k` for K and V; Int `[b + 1]`, holding the offsets of the lengths in
    /// `options`) → (`o` `[total_q, h_q, d_v]` in the dtype of `q`, `lse` `[h_q, total_q]`
    /// in f32).
    #[fusion(meta = meta::varlen_forward)]
    fn flash_attention_varlen_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        options: VarlenOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients of q, k, v of a packed batch for the upstream gradient `d_o` of `o`.
    #[fusion(meta = meta::varlen_backward)]
    #[allow(clippy::too_many_arguments)]
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Attention of `q` `[b, h_q, s_q, d_qk]` against a KV cache (contiguous `[b, h_kv,
    /// capacity, d]`, or with `options.paged` pages `[pages, page_size, h_kv, d]` named by
    /// `block_table` `[b, max_pages]`), over the first `cache_seqlens[b]` (+ `s_new`)
    /// positions of each sequence; with `options.append`, `k_new`/`v_new` `[b, h_kv, s_new,
    /// d]` are first written at those positions; with `options.rotary`, the new queries and
    /// keys turn by `rotary_cos`/`rotary_sin` `[positions, rotary_dim / 2]`; the score terms
    /// `bias` `[b | 1, h_q | 1, s_q | 1, capacity | 1]` (dtype of `q`, indexed by key
    /// position), `alibi_slopes` `[b | 1, h_q]` and `score_params` of `options.score_mod`
    /// are added as [`flash_attention_biased_fwd`](Self::flash_attention_biased_fwd) adds
    /// them. Returns (`o`, `lse`, the caches with the new keys and values). Tensors
    /// `options` says are absent are ignored placeholders.
    #[fusion(meta = meta::decode)]
    #[allow(clippy::too_many_arguments)]
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
    );
}

/// Output shapes and dtypes, for Burn's lazy Fusion backend.
mod meta {
    use burn::backend::fusion::custom::TensorSpec;
    use burn::tensor::{DType, Shape};

    use crate::options::{BiasedOptions, DecodeOptions, FlashAttentionOptions, VarlenOptions};

    #[allow(clippy::too_many_arguments)]
    pub fn biased_forward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _bias: &TensorSpec,
        _alibi_slopes: &TensorSpec,
        _block_mask: &TensorSpec,
        _score_params: &TensorSpec,
        cu_seqlens_q: &TensorSpec,
        cu_seqlens_k: &TensorSpec,
        options: &BiasedOptions,
    ) -> (TensorSpec, TensorSpec) {
        match &options.packed {
            Some(packed) => {
                let options = VarlenOptions {
                    attention: options.attention,
                    lengths_q: packed.lengths_q.clone(),
                    lengths_k: packed.lengths_k.clone(),
                };
                varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, &options)
            }
            None => forward(q, k, v, &options.attention),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn biased_backward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        bias: &TensorSpec,
        _alibi_slopes: &TensorSpec,
        _block_mask: &TensorSpec,
        score_params: &TensorSpec,
        _cu_seqlens_q: &TensorSpec,
        _cu_seqlens_k: &TensorSpec,
        _o: &TensorSpec,
        _lse: &TensorSpec,
        _d_o: &TensorSpec,
        _options: &BiasedOptions,
    ) -> (TensorSpec, TensorSpec, TensorSpec, TensorSpec, TensorSpec) {
        // The parameters are f32, and so is their gradient.
        let d_params = score_params.clone();
        (q.clone(), k.clone(), v.clone(), bias.clone(), d_params)
    }

    pub fn varlen_forward(
        q: &TensorSpec,
        _k: &TensorSpec,
        v: &TensorSpec,
        _cu_seqlens_q: &TensorSpec,
        _cu_seqlens_k: &TensorSpec,
        _options: &VarlenOptions,
    ) -> (TensorSpec, TensorSpec) {
        let (total, h) = (q.shape[0], q.shape[1]);
        (
            TensorSpec::new(Shape::new([total, h, v.shape[2]]), q.dtype),
            TensorSpec::new(Shape::new([h, total]), DType::F32),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn varlen_backward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _o: &TensorSpec,
        _lse: &TensorSpec,
        _d_o: &TensorSpec,
        _cu_seqlens_q: &TensorSpec,
        _cu_seqlens_k: &TensorSpec,
        _options: &VarlenOptions,
    ) -> (TensorSpec, TensorSpec, TensorSpec) {
        (q.clone(), k.clone(), v.clone())
    }

    pub fn forward(
        q: &TensorSpec,
        _k: &TensorSpec,
        v: &TensorSpec,
        _options: &FlashAttentionOptions,
    ) -> (TensorSpec, TensorSpec) {
        let (b, h, s_q) = (q.shape[0], q.shape[1], q.shape[2]);
        (
            TensorSpec::new(Shape::new([b, h, s_q, v.shape[3]]), q.dtype),
            TensorSpec::new(Shape::new([b, h, s_q]), DType::F32),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        q: &TensorSpec,
        k: &TensorSpec,
        v: &TensorSpec,
        _o: &TensorSpec,
        _lse: &TensorSpec,
        _d_o: &TensorSpec,
        _options: &FlashAttentionOptions,
    ) -> (TensorSpec, TensorSpec, TensorSpec) {
        (q.clone(), k.clone(), v.clone())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        q: &TensorSpec,
        k_cache: &TensorSpec,
        v_cache: &TensorSpec,
        _cache_seqlens: &TensorSpec,
        _block_table: &TensorSpec,
        _k_new: &TensorSpec,
        _v_new: &TensorSpec,
        _rotary_cos: &TensorSpec,
        _rotary_sin: &TensorSpec,
        _bias: &TensorSpec,
        _alibi_slopes: &TensorSpec,
        _score_params: &TensorSpec,
        _options: &DecodeOptions,
    ) -> (TensorSpec, TensorSpec, TensorSpec, TensorSpec) {
        let (b, h, s_q) = (q.shape[0], q.shape[1], q.shape[2]);
        (
            TensorSpec::new(Shape::new([b, h, s_q, v_cache.shape[3]]), q.dtype),
            TensorSpec::new(Shape::new([b, h, s_q]), DType::F32),
            k_cache.clone(),
            v_cache.clone(),
        )
    }
}
