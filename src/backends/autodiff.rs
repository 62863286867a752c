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
use crate::options::{DecodeOptions, FlashAttentionOptions, VarlenOptions};

#[derive(Debug)]
struct FlashAttentionBackward;

impl<B: Backend + FlashAttentionOps> Backward<B, 3> for FlashAttentionBackward {
    /// Checkpointed Q, K, V; the forward's O and LSE; the options.
    type State = (
        NodeId,
        NodeId,
        NodeId,
        FloatTensor<B>,
        FloatTensor<B>,
        FlashAttentionOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (q_id, k_id, v_id, o, lse, options) = ops.state;
        let q = checkpointer.retrieve_node_output(q_id);
        let k = checkpointer.retrieve_node_output(k_id);
        let v = checkpointer.retrieve_node_output(v_id);
        let (dq, dk, dv) = B::flash_attention_bwd(q, k, v, o, lse, d_o, options);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct VarlenBackward;

impl<B: Backend + FlashAttentionOps> Backward<B, 3> for VarlenBackward {
    /// Checkpointed Q, K, V; the forward's O and LSE; the sequences' offsets; the options.
    type State = (
        NodeId,
        NodeId,
        NodeId,
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        IntTensor<B>,
        VarlenOptions,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (q_id, k_id, v_id, o, lse, cu_q, cu_k, options) = ops.state;
        let q = checkpointer.retrieve_node_output(q_id);
        let k = checkpointer.retrieve_node_output(k_id);
        let v = checkpointer.retrieve_node_output(v_id);
        let (dq, dk, dv) = B::flash_attention_varlen_bwd(q, k, v, o, lse, d_o, cu_q, cu_k, options);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
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
        match VarlenBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let q_id = prep.checkpoint(&q);
                let k_id = prep.checkpoint(&k);
                let v_id = prep.checkpoint(&v);
                let (o, lse) = B::flash_attention_varlen_fwd(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    cu_seqlens_q.clone(),
                    cu_seqlens_k.clone(),
                    options.clone(),
                );
                let state = (
                    q_id,
                    k_id,
                    v_id,
                    o.clone(),
                    lse.clone(),
                    cu_seqlens_q,
                    cu_seqlens_k,
                    options,
                );
                (prep.finish(state, o), Self::from_inner(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (o, lse) = B::flash_attention_varlen_fwd(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    cu_seqlens_q,
                    cu_seqlens_k,
                    options,
                );
                (prep.finish(o), Self::from_inner(lse))
            }
        }
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

    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: FlashAttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match FlashAttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let q_id = prep.checkpoint(&q);
                let k_id = prep.checkpoint(&k);
                let v_id = prep.checkpoint(&v);
                let (o, lse) = B::flash_attention_fwd(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    options,
                );
                let state = (q_id, k_id, v_id, o.clone(), lse.clone(), options);
                (prep.finish(state, o), Self::from_inner(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (o, lse) = B::flash_attention_fwd(
                    q.into_primitive(),
                    k.into_primitive(),
                    v.into_primitive(),
                    options,
                );
                (prep.finish(o), Self::from_inner(lse))
            }
        }
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
