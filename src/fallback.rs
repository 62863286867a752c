//! The same attention composed from Burn tensor ops, for backends without the fused kernels.
//! It materializes the `[s_q, s_kv]` scores (memory grows with s²); autodiff differentiates it
//! like any other composition.

use burn::tensor::{Bool, FloatDType, Tensor, TensorData};

use crate::dropout::Dropout;
use crate::options::FlashAttentionOptions;

/// `(O, LSE)` with the semantics of the fused op: GQA by broadcasting K/V heads, softcap,
/// bottom-right causal / window masks, zero output and −∞ LSE on fully masked rows, and the
/// kernels' dropout.
pub(crate) fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    attention_biased(q, k, v, None, None, options)
}

/// [`attention`] with the score terms of [`flash_attention_biased`](crate::flash_attention_biased)
/// added after masking: `bias` (broadcast, −∞ hides a key) and ALiBi `alibi_slopes`
/// `[b | 1, h_q]`.
pub(crate) fn attention_biased(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    bias: Option<Tensor<4>>,
    alibi_slopes: Option<Tensor<2>>,
    options: &FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>) {
    attention_from_batch(q, k, v, bias, alibi_slopes, options, 0)
}

/// [`attention_biased`] of batch entries `first_batch..` (as the dropout numbers them: a
/// packed batch's sequences).
fn attention_from_batch(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    bias: Option<Tensor<4>>,
    alibi_slopes: Option<Tensor<2>>,
    options: &FlashAttentionOptions,
    first_batch: usize,
) -> (Tensor<4>, Tensor<3>) {
    let [batch, heads_q, seq_q, dim_qk] = q.dims();
    let [_, heads_kv, seq_kv, _] = k.dims();
    // Nothing to compute (Burn broadcasts no dimension of size 0): an empty output, or rows
    // that see no key (O = 0, LSE = −∞).
    if batch * heads_q * seq_q * seq_kv == 0 {
        let rows = [batch, heads_q, seq_q];
        let out = Tensor::<4>::zeros([batch, heads_q, seq_q, v.dims()[3]], &q.device());
        let lse = Tensor::<3>::full(rows, f32::NEG_INFINITY, &q.device());
        return (out.cast(q.dtype()), lse.cast(FloatDType::F32));
    }
    let group = heads_q / heads_kv;
    let (k, v) = (repeat_heads(k, group), repeat_heads(v, group));
    let scale = options
        .scale
        .unwrap_or_else(|| 1.0 / (dim_qk as f32).sqrt());
    let device = q.device();

    let mut scores = q.matmul(k.transpose()).mul_scalar(scale);
    if let Some(cap) = options.softcap {
        scores = scores.div_scalar(cap).tanh().mul_scalar(cap);
    }
    if options.mask().is_masked() {
        let hidden = hidden_keys(options, [batch, heads_q, seq_q, seq_kv], &device);
        scores = scores.mask_fill(hidden, f32::NEG_INFINITY);
    }
    if let Some(bias) = bias {
        let dtype = scores.dtype();
        scores = scores.add(bias.cast(dtype));
    }
    if let Some(slopes) = alibi_slopes {
        // −slope · |i + s_kv − s_q − j|, slopes `[b | 1, h_q]` broadcast over the positions.
        let distance: Vec<f32> = (0..seq_q * seq_kv)
            .map(|n| {
                (((n / seq_kv + seq_kv) as i64 - seq_q as i64) - (n % seq_kv) as i64).abs() as f32
            })
            .collect();
        let distance = Tensor::<2>::from_data(TensorData::new(distance, [seq_q, seq_kv]), &device)
            .unsqueeze::<4>();
        let [b, h] = slopes.dims();
        let dtype = scores.dtype();
        let slopes = slopes.reshape([b, h, 1, 1]).cast(dtype);
        scores = scores.sub(distance.cast(slopes.dtype()).mul(slopes));
    }
    // Softmax with its LSE. A fully masked row has max −∞, clamped (to a value every float
    // dtype holds) so that it yields p = 0; the shift cancels in the softmax.
    let max = scores.clone().max_dim(3).clamp_min(-6.0e4).detach();
    let exp = scores.sub(max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let lse = max
        .add(sum.clone().log())
        .squeeze_dim::<3>(3)
        .cast(FloatDType::F32);
    // A fully masked row's sum is 0: divided by 1 instead, its gradients stay 0 (an
    // additive −∞ passes them on to the scores, where a mask cuts them).
    let empty = sum.clone().equal_elem(0.0).float().cast(sum.dtype());
    let mut p = exp.div(sum.add(empty));
    if let Some(dropout) = options.dropout.filter(|d| d.is_active()) {
        let shape = [batch, heads_q, seq_q, seq_kv];
        let factors = dropout_factors(&dropout, first_batch, shape, &device);
        let dtype = p.dtype();
        p = p.mul(factors.cast(dtype));
    }
    (p.matmul(v), lse)
}

/// The dropout's factors (0 or `1/(1 − p)`) of the probabilities of batch entries
/// `first_batch..`, drawn on the host as the kernels draw them.
fn dropout_factors(
    dropout: &Dropout,
    first_batch: usize,
    shape: [usize; 4],
    device: &burn::tensor::Device,
) -> Tensor<4> {
    let [batch, heads, seq_q, seq_kv] = shape;
    let kept = dropout.kept_scale();
    let mut factors = Vec::with_capacity(shape.iter().product());
    for b in first_batch..first_batch + batch {
        for h in 0..heads {
            for i in 0..seq_q {
                factors.extend((0..seq_kv).map(|j| {
                    if dropout.keeps(b, heads, h, i, j) {
                        kept
                    } else {
                        0.0
                    }
                }));
            }
        }
    }
    Tensor::from_data(TensorData::new(factors, shape), device)
}

/// The terms of sequence `index` of a batch, `len_q` queries against `len_k` keys: the
/// bias's top-left `[1, h | 1, len_q | 1, len_k | 1]` corner of its row (or of the one row
/// that broadcasts) and the row's ALiBi slopes.
fn sequence_terms(
    bias: Option<&Tensor<4>>,
    alibi_slopes: Option<&Tensor<2>>,
    index: usize,
    len_q: usize,
    len_k: usize,
) -> (Option<Tensor<4>>, Option<Tensor<2>>) {
    // Index `at` along a dimension of `size` that broadcasts where it is 1.
    let pick = |size: usize, at: std::ops::Range<usize>| if size == 1 { 0..1 } else { at };
    let bias = bias.map(|b| {
        let [bb, hh, sq, sk] = b.dims();
        b.clone().slice([
            pick(bb, index..index + 1),
            0..hh,
            pick(sq, 0..len_q),
            pick(sk, 0..len_k),
        ])
    });
    let slopes = alibi_slopes.map(|s| {
        let [bb, hh] = s.dims();
        s.clone().slice([pick(bb, index..index + 1), 0..hh])
    });
    (bias, slopes)
}

/// [`attention_biased`] within each sequence of a packed batch (`q` `[total_q, h_q, d]`,
/// `k`/`v` `[total_kv, h_kv, d]`, the sequences' lengths given): `(O [total_q, h_q, d_v],
/// LSE [h_q, total_q])`, one composed attention per sequence. Sequence `i` reads the
/// terms as the padded dense batch does: `bias[i, .., ..s_q(i), ..s_kv(i)]` (each
/// dimension of size 1 broadcast) and its row of `alibi_slopes` `[b | 1, h_q]`.
pub(crate) fn attention_packed_biased(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    (lengths_q, lengths_k): (&[usize], &[usize]),
    bias: Option<Tensor<4>>,
    alibi_slopes: Option<Tensor<2>>,
    options: &FlashAttentionOptions,
) -> (Tensor<3>, Tensor<2>) {
    let [total_q, heads_q, _] = q.dims();
    let dim_v = v.dims()[2];
    let device = q.device();
    // Rows `first..first + len` of a packed tensor as `[1, heads, len, dim]`.
    let sequence = |t: &Tensor<3>, first: usize, len: usize| {
        t.clone()
            .slice([first..first + len])
            .swap_dims(0, 1)
            .unsqueeze_dim::<4>(0)
    };
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    let (mut q0, mut k0) = (0, 0);
    for (index, (&len_q, &len_k)) in lengths_q.iter().zip(lengths_k).enumerate() {
        if len_q > 0 && len_k == 0 {
            let zeros = Tensor::<3>::zeros([len_q, heads_q, dim_v], &device);
            outs.push(zeros.cast(q.dtype()));
            let hidden = Tensor::<2>::full([heads_q, len_q], f32::NEG_INFINITY, &device);
            lses.push(hidden.cast(FloatDType::F32));
        } else if len_q > 0 {
            let (bias, slopes) =
                sequence_terms(bias.as_ref(), alibi_slopes.as_ref(), index, len_q, len_k);
            let (o, lse) = attention_from_batch(
                sequence(&q, q0, len_q),
                sequence(&k, k0, len_k),
                sequence(&v, k0, len_k),
                bias,
                slopes,
                options,
                index,
            );
            outs.push(o.squeeze_dim::<3>(0).swap_dims(0, 1));
            lses.push(lse.squeeze_dim::<2>(0));
        }
        q0 += len_q;
        k0 += len_k;
    }
    if outs.is_empty() {
        let out = Tensor::<3>::zeros([total_q, heads_q, dim_v], &device).cast(q.dtype());
        let lse = Tensor::<2>::zeros([heads_q, total_q], &device).cast(FloatDType::F32);
        return (out, lse);
    }
    (Tensor::cat(outs, 0), Tensor::cat(lses, 1))
}

/// K or V with each head repeated for the `group` query heads that read it.
fn repeat_heads(t: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return t;
    }
    let [b, h, s, d] = t.dims();
    t.unsqueeze_dim::<5>(2)
        .expand([b, h, group, s, d])
        .reshape([b, h * group, s, d])
}

/// `true` where the causal / window mask of `options` hides a key, broadcast to `shape`
/// `[batch, heads, s_q, s_kv]`.
fn hidden_keys(
    options: &FlashAttentionOptions,
    shape: [usize; 4],
    device: &burn::tensor::Device,
) -> Tensor<4, Bool> {
    let [_, _, seq_q, seq_kv] = shape;
    let mask = options.mask();
    let hidden: Vec<bool> = (0..seq_q * seq_kv)
        .map(|n| !mask.is_visible(n / seq_kv, n % seq_kv, seq_q, seq_kv))
        .collect();
    Tensor::<2, Bool>::from_data(TensorData::new(hidden, [seq_q, seq_kv]), device)
        .unsqueeze::<4>()
        .expand(shape)
}

/// The new queries and keys of a decode step turned by `rotary` to their positions
/// ([`RotaryEmbedding`](crate::serving::RotaryEmbedding)), composed from Burn ops; `lengths`
/// are the checked `cache_seqlens`.
pub(crate) fn rotate_new(
    q: Tensor<4>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    rotary: &crate::serving::RotaryEmbedding,
    lengths: &[usize],
    options: &FlashAttentionOptions,
) -> (Tensor<4>, Option<(Tensor<4>, Tensor<4>)>) {
    let s_q = q.dims()[2];
    let masked = options.kernel_options().mask.is_masked();
    let q_positions: Vec<usize> = lengths
        .iter()
        .flat_map(|&len| (0..s_q).map(move |i| len + if masked { i } else { 0 }))
        .collect();
    let q = rotary.apply(q, &q_positions);
    let new = new.map(|(k, v)| {
        let s_new = k.dims()[2];
        let positions: Vec<usize> = lengths.iter().flat_map(|&len| len..len + s_new).collect();
        (rotary.apply(k, &positions), v)
    });
    (q, new)
}

/// [`crate::flash_attention_with_kvcache_and_lse`] composed from Burn tensor ops: the new keys
/// and values written with `slice_assign`, each sequence's keys gathered (through its pages)
/// and attended with [`attention_biased`] (sequence `b` reads the bias's row `b`, keys
/// `0..len + s_new`, and its ALiBi slopes). `lengths` are the checked `cache_seqlens`,
/// `entries` the checked block table (row-major) of a paged cache.
pub(crate) fn decode(
    q: Tensor<4>,
    cache: crate::serving::KvCache,
    lengths: &[usize],
    entries: Option<&[i64]>,
    new: Option<(Tensor<4>, Tensor<4>)>,
    (bias, alibi_slopes): (Option<Tensor<4>>, Option<Tensor<2>>),
    options: &FlashAttentionOptions,
) -> (Tensor<4>, Tensor<3>, crate::serving::KvCache) {
    use burn::tensor::Int;
    let [_, heads_q, seq_q, _] = q.dims();
    let dim_v = cache.v.dims()[3];
    let device = q.device();
    let s_new = new.as_ref().map_or(0, |(k, _)| k.dims()[2]);
    let crate::serving::KvCache {
        mut k,
        mut v,
        block_table,
    } = cache;
    // A paged cache's page size, the page of each of a sequence's positions, and the table.
    let paged = block_table.map(|t| {
        let [_, max_pages] = t.dims();
        let entries = entries.expect("a paged cache's table is checked").to_vec();
        (k.dims()[1], max_pages, entries, t)
    });
    // Position `pos` of sequence `b`: (block, row) in `[blocks, rows, ..]` order.
    let slot = |b: usize, pos: usize| match &paged {
        Some((page_size, max_pages, table, _)) => (
            table[b * max_pages + pos / page_size] as usize,
            pos % page_size,
        ),
        None => (b, pos),
    };
    let mut outs = Vec::with_capacity(lengths.len());
    let mut lses = Vec::with_capacity(lengths.len());
    for (b, &len) in lengths.iter().enumerate() {
        if let Some((k_new, v_new)) = &new {
            for i in 0..s_new {
                let (block, row) = slot(b, len + i);
                let token = |t: &Tensor<4>| t.clone().slice([b..b + 1, 0..t.dims()[1], i..i + 1]);
                let (kt, vt) = (token(k_new), token(v_new));
                let (dk, dv) = (k.dims()[3], v.dims()[3]);
                if paged.is_some() {
                    // [1, h, 1, d] → [1, 1, h, d] at (page, row).
                    let heads = k.dims()[2];
                    let at = |d: usize| [block..block + 1, row..row + 1, 0..heads, 0..d];
                    k = k.slice_assign(at(dk), kt.swap_dims(1, 2));
                    v = v.slice_assign(at(dv), vt.swap_dims(1, 2));
                } else {
                    let heads = k.dims()[1];
                    let at = |d: usize| [block..block + 1, 0..heads, row..row + 1, 0..d];
                    k = k.slice_assign(at(dk), kt);
                    v = v.slice_assign(at(dv), vt);
                }
            }
        }
        let total = len + s_new;
        let qb = q.clone().slice([b..b + 1]);
        if total == 0 {
            let zeros = Tensor::<4>::zeros([1, heads_q, seq_q, dim_v], &device);
            outs.push(zeros.cast(q.dtype()));
            let hidden = Tensor::<3>::full([1, heads_q, seq_q], f32::NEG_INFINITY, &device);
            lses.push(hidden.cast(FloatDType::F32));
            continue;
        }
        let gather = |t: &Tensor<4>| match &paged {
            Some((page_size, max_pages, table, _)) => {
                let used = total.div_ceil(*page_size);
                let ids = table[b * max_pages..][..used].to_vec();
                let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [used]), &device);
                let [_, rows, heads, dim] = t.dims();
                t.clone()
                    .select(0, ids)
                    .reshape([1, used * rows, heads, dim])
                    .slice([0..1, 0..total])
                    .swap_dims(1, 2)
            }
            None => t.clone().slice([b..b + 1, 0..t.dims()[1], 0..total]),
        };
        let (bias, slopes) = sequence_terms(bias.as_ref(), alibi_slopes.as_ref(), b, seq_q, total);
        let (o, lse) = attention_biased(qb, gather(&k), gather(&v), bias, slopes, options);
        outs.push(o);
        lses.push(lse);
    }
    let cache = crate::serving::KvCache {
        k,
        v,
        block_table: paged.map(|(.., t)| t),
    };
    (Tensor::cat(outs, 0), Tensor::cat(lses, 0), cache)
}
