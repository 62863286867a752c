//! `Autodiff`: the forward keeps Q, K, V (checkpointed), O and the LSE; the backward node
//! calls the fused backward kernels. Burn's materialized attention is never involved.

use burn::backend::{
    Autodiff, AutodiffBackend, Backend,
    autodiff::{
        NodeId,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::{FloatTensor, IntTensor},
};

use crate::ops::FlashAttentionOps;
use crate::options::{BiasedOptions, DecodeOptions, FlashAttentionOptions, VarlenOptions};

/// The fused backward of the dense op and of packed batches: one node for both, which
/// differ only in what they pass the backward op besides the saved tensors.
#[derive(Debug)]
struct FusedBackward;

/// What a [`FusedBackward`] node passes its backward op besides Q, K, V, O and the LSE.
#[derive(Clone, Debug)]
enum Layout<B: Backend> {
    Dense(FlashAttentionOptions),
    /// A packed batch: its sequences' offsets and the options.
    Packed {
        cu_seqlens_q: IntTensor<B>,
        cu_seqlens_k: IntTensor<B>,
        options: VarlenOptions,
    },
}

impl<B: Backend + FlashAttentionOps> Backward<B, 3> for FusedBackward {
    /// Checkpointed Q, K, V; the forward's O and LSE; the layout.
    type State = (
        NodeId,
        NodeId,
        NodeId,
        FloatTensor<B>,
        FloatTensor<B>,
        Layout<B>,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (q_id, k_id, v_id, o, lse, layout) = ops.state;
        let q = checkpointer.retrieve_node_output(q_id);
        let k = checkpointer.retrieve_node_output(k_id);
        let v = checkpointer.retrieve_node_output(v_id);
        let (dq, dk, dv) = match layout {
            Layout::Dense(options) => B::flash_attention_bwd(q, k, v, o, lse, d_o, options),
            Layout::Packed {
                cu_seqlens_q,
                cu_seqlens_k,
                options,
            } => B::flash_attention_varlen_bwd(
                q,
                k,
                v,
                o,
                lse,
                d_o,
                cu_seqlens_q,
                cu_seqlens_k,
                options,
            ),
        };
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Runs `forward` on the inner backend's tensors and, where Q, K or V is tracked, records a
/// [`FusedBackward`] node that keeps Q, K, V (checkpointed), O, the LSE and `layout`.
fn record_forward<B, C>(
    [q, k, v]: [FloatTensor<Autodiff<B, C>>; 3],
    layout: Layout<B>,
    forward: impl FnOnce([FloatTensor<B>; 3]) -> (FloatTensor<B>, FloatTensor<B>),
) -> (FloatTensor<Autodiff<B, C>>, FloatTensor<Autodiff<B, C>>)
where
    B: Backend + FlashAttentionOps,
    C: CheckpointStrategy,
{
    match FusedBackward
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let q_id = prep.checkpoint(&q);
            let k_id = prep.checkpoint(&k);
            let v_id = prep.checkpoint(&v);
            let (o, lse) = forward([q.into_primitive(), k.into_primitive(), v.into_primitive()]);
            let state = (q_id, k_id, v_id, o.clone(), lse.clone(), layout);
            (prep.finish(state, o), Autodiff::<B, C>::from_inner(lse))
        }
        OpsKind::UnTracked(prep) => {
            let (o, lse) = forward([q.into_primitive(), k.into_primitive(), v.into_primitive()]);
            (prep.finish(o), Autodiff::<B, C>::from_inner(lse))
        }
    }
}

/// The fused backward of a call with score terms: Q, K, V, the bias and the score function's
/// parameters are its parents; the gradients of the last two come from the same backward
/// launch, only where they are tracked.
#[derive(Debug)]
struct BiasedBackward;

impl<B: Backend + FlashAttentionOps> Backward<B, 5> for BiasedBackward {
    /// Checkpointed Q, K, V, bias and score-function parameters; the ALiBi slopes, the
    /// block mask and a packed batch's offsets; the forward's O and LSE; the options.
    type State = (
        [NodeId; 5],
        (FloatTensor<B>, IntTensor<B>, [IntTensor<B>; 2]),
        FloatTensor<B>,
        FloatTensor<B>,
        BiasedOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 5>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v, node_bias, node_params] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (ids, (slopes, block_mask, [cu_q, cu_k]), o, lse, options) = ops.state;
        let options = BiasedOptions {
            bias_grad: options.bias && node_bias.is_some(),
            score_params_grad: options.score_params && node_params.is_some(),
            ..options
        };
        let [q, k, v, bias, params] = ids.map(|id| checkpointer.retrieve_node_output(id));
        let (dq, dk, dv, dbias, dparams) = B::flash_attention_biased_bwd(
            q, k, v, bias, slopes, block_mask, params, cu_q, cu_k, o, lse, d_o, options,
        );
        let pairs = [
            (node_q, dq),
            (node_k, dk),
            (node_v, dv),
            (node_bias, dbias),
            (node_params, dparams),
        ];
        for (node, grad) in pairs {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps for Autodiff<B, C> {
    fn flash_attention_varlen_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        cu_seqlens_k: IntTensor<Self>,
        options: VarlenOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let layout = Layout::Packed {
            cu_seqlens_q: cu_seqlens_q.clone(),
            cu_seqlens_k: cu_seqlens_k.clone(),
            options: options.clone(),
        };
        record_forward::<B, C>([q, k, v], layout, |[q, k, v]| {
            B::flash_attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
        })
    }

    /// Not differentiable itself (no double backward).
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
        let (dq, dk, dv) = B::flash_attention_varlen_bwd(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            o.into_primitive(),
            lse.into_primitive(),
            d_o.into_primitive(),
            cu_seqlens_q,
            cu_seqlens_k,
            options,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }

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
        let slopes = alibi_slopes.into_primitive();
        let offsets = [cu_seqlens_q, cu_seqlens_k];
        let forward_options = options.clone();
        let forward = |[q, k, v, bias, params]: [FloatTensor<B>; 5],
                       slopes,
                       block_mask,
                       [cu_q, cu_k]: [IntTensor<B>; 2]| {
            B::flash_attention_biased_fwd(
                q,
                k,
                v,
                bias,
                slopes,
                block_mask,
                params,
                cu_q,
                cu_k,
                forward_options,
            )
        };
        let nodes = [&q, &k, &v, &bias, &score_params].map(|t| t.node());
        match BiasedBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let ids = [&q, &k, &v, &bias, &score_params].map(|t| prep.checkpoint(t));
                let inputs = [q, k, v, bias, score_params].map(|t| t.into_primitive());
                let (o, lse) = forward(inputs, slopes.clone(), block_mask.clone(), offsets.clone());
                let state = (
                    ids,
                    (slopes, block_mask, offsets),
                    o.clone(),
                    lse.clone(),
                    options,
                );
                (prep.finish(state, o), Self::from_inner(lse))
            }
            OpsKind::UnTracked(prep) => {
                let inputs = [q, k, v, bias, score_params].map(|t| t.into_primitive());
                let (o, lse) = forward(inputs, slopes, block_mask, offsets);
                (prep.finish(o), Self::from_inner(lse))
            }
        }
    }

    /// Not differentiable itself (no double backward).
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
        let (dq, dk, dv, dbias, dparams) = B::flash_attention_biased_bwd(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            bias.into_primitive(),
            alibi_slopes.into_primitive(),
            block_mask,
            score_params.into_primitive(),
            cu_seqlens_q,
            cu_seqlens_k,
            o.into_primitive(),
            lse.into_primitive(),
            d_o.into_primitive(),
            options,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
            Self::from_inner(dbias),
            Self::from_inner(dparams),
        )
    }

    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        record_forward::<B, C>([q, k, v], Layout::Dense(options), |[q, k, v]| {
            B::flash_attention_fwd(q, k, v, options)
        })
    }

    /// Not differentiable itself (no double backward).
    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::flash_attention_bwd(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            o.into_primitive(),
            lse.into_primitive(),
            d_o.into_primitive(),
            options,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }

    /// Inference: the outputs and the caches are not tracked (a cache is state, not a
    /// parameter; train with [`flash_attention`](crate::flash_attention)).
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
        let (o, lse, k_cache, v_cache) = B::flash_attention_decode(
            q.into_primitive(),
            k_cache.into_primitive(),
            v_cache.into_primitive(),
            cache_seqlens,
            block_table,
            k_new.into_primitive(),
            v_new.into_primitive(),
            rotary_cos.into_primitive(),
            rotary_sin.into_primitive(),
            bias.into_primitive(),
            alibi_slopes.into_primitive(),
            score_params.into_primitive(),
            options,
        );
        (
            Self::from_inner(o),
            Self::from_inner(lse),
            Self::from_inner(k_cache),
            Self::from_inner(v_cache),
        )
    }
}
