//! Packed batches of variable-length sequences (no padding) against the f64 oracle run on
//! each sequence alone, on every kernel path of the device.

use burn_flash_attention::kernels::{
    BlockMask, BlockShape, FloatDtype, KernelPath, PackedSequences, ScoreBias, TermsGrad,
    backward::{Gradients, Saved, backward_packed_biased, backward_packed_into},
    forward::{forward_packed_biased, forward_packed_into},
    reference::{self, Broadcast4},
};
use cubecl::client::Client;

use crate::common::{self, Case, assert_close, case, dims, download, naive, poisoned, upload};

/// A packed problem: the lengths of each sequence's queries and keys, and the options of
/// `template` (whose sequence lengths are ignored).
struct Packed {
    lengths_q: Vec<usize>,
    lengths_kv: Vec<usize>,
    template: Case,
}

/// `[1, h, len, d]` (one sequence, the oracle's layout) from rows `first..first + len` of a
/// packed `[total, h, d]`.
fn sequence_of(packed: &[f64], heads: usize, dim: usize, first: usize, len: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(heads * len * dim);
    for h in 0..heads {
        for t in first..first + len {
            let at = (t * heads + h) * dim;
            out.extend_from_slice(&packed[at..at + dim]);
        }
    }
    out
}

/// Writes one sequence's `[1, h, len, d]` into rows `first..` of a packed `[total, h, d]`.
fn put_sequence(packed: &mut [f64], seq: &[f64], heads: usize, dim: usize, first: usize) {
    let len = seq.len() / (heads * dim).max(1);
    for h in 0..heads {
        for t in 0..len {
            let at = ((first + t) * heads + h) * dim;
            packed[at..at + dim].copy_from_slice(&seq[(h * len + t) * dim..][..dim]);
        }
    }
}

/// What the oracle (and naive attention in the dtype) gives, sequence by sequence, laid out
/// as the packed outputs: O `[total_q, h_q, d_v]`, LSE `[h_q, total_q]`, dQ, dK, dV.
struct Expected {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// `d(bias)` `[b, 1, longest s_q, longest s_kv]`, with terms.
    dbias: Vec<f64>,
}

/// Score terms of a packed batch, indexed as in the padded dense batch: a bias `[b, 1,
/// longest s_q, longest s_kv]` (rounded to the dtype; a sequence reads its top-left corner),
/// ALiBi slopes `[b, h_q]` and a block mask of `[b, 1, longest s_q, longest s_kv]` scores
/// that differs by sequence and hides a whole row of the third.
struct PackedTerms {
    bias: Vec<f64>,
    slopes: Vec<f64>,
    blocks: BlockMask,
    longest_q: usize,
    longest_kv: usize,
}

impl PackedTerms {
    fn random(p: &Packed, dtype: FloatDtype, rng: &mut impl rand::Rng) -> Self {
        let longest_q = p.lengths_q.iter().copied().max().unwrap_or(0);
        let longest_kv = p.lengths_kv.iter().copied().max().unwrap_or(0);
        let batch = p.lengths_q.len();
        let bias = (0..batch * longest_q * longest_kv)
            .map(|_| common::round(rng.random_range(-2.0..2.0), dtype))
            .collect();
        let heads = p.template.dims.heads_q;
        let slopes = (0..batch * heads).map(|n| 0.05 + 0.07 * n as f64).collect();
        let shape = [batch, 1, longest_q, longest_kv];
        let blocks = BlockShape {
            block_q: 128,
            block_kv: 128,
        };
        let visible = |b: usize, _: usize, i: usize, j: usize| {
            (i * 7 + j * 13 + b) % 4 != 0 && !(b == 2 && i == 3)
        };
        let blocks = BlockMask::from_fn(shape, blocks, visible).unwrap();
        PackedTerms {
            bias,
            slopes,
            blocks,
            longest_q,
            longest_kv,
        }
    }

    /// Whether sequence `index` sees key `j` from query `i`.
    fn visible(&self, index: usize, i: usize, j: usize) -> bool {
        self.blocks.is_visible(index, 0, i, j)
    }

    /// Sequence `index`'s bias, `[lq, lk]`.
    fn bias_of(&self, index: usize, lq: usize, lk: usize) -> Vec<f64> {
        let at = |i: usize, j: usize| (index * self.longest_q + i) * self.longest_kv + j;
        (0..lq)
            .flat_map(|i| (0..lk).map(move |j| (i, j)))
            .map(|(i, j)| self.bias[at(i, j)])
            .collect()
    }
}

#[allow(clippy::too_many_arguments)]
fn expected(
    p: &Packed,
    dtype: FloatDtype,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_out: &[f64],
    terms: Option<&PackedTerms>,
    oracle: bool,
) -> Expected {
    let d = p.template.dims;
    let total_q: usize = p.lengths_q.iter().sum();
    let total_kv: usize = p.lengths_kv.iter().sum();
    let mut e = Expected {
        out: vec![0.0; total_q * d.heads_q * d.dim_v],
        lse: vec![f64::NEG_INFINITY; d.heads_q * total_q],
        dq: vec![0.0; total_q * d.heads_q * d.dim_qk],
        dk: vec![0.0; total_kv * d.heads_kv * d.dim_qk],
        dv: vec![0.0; total_kv * d.heads_kv * d.dim_v],
        dbias: vec![0.0; terms.map_or(0, |t| t.bias.len())],
    };
    let (mut q0, mut k0) = (0, 0);
    for (index, (&lq, &lk)) in p.lengths_q.iter().zip(&p.lengths_kv).enumerate() {
        if lq > 0 && lk > 0 {
            let one = Case {
                dims: dims(1, d.heads_q, d.heads_kv, lq, lk, d.dim_qk, d.dim_v),
                dropout_batch: index,
                ..p.template
            };
            let sq = sequence_of(q, d.heads_q, d.dim_qk, q0, lq);
            let sk = sequence_of(k, d.heads_kv, d.dim_qk, k0, lk);
            let sv = sequence_of(v, d.heads_kv, d.dim_v, k0, lk);
            let so = sequence_of(d_out, d.heads_q, d.dim_v, q0, lq);
            let bias = terms.map(|t| t.bias_of(index, lq, lk));
            let slopes = terms.map(|t| t.slopes[index * d.heads_q..][..d.heads_q].to_vec());
            let hidden = |i: usize, j: usize| terms.is_some_and(|t| !t.visible(index, i, j));
            let (out, lse, dq, dk, dv, dbias) = if oracle {
                let opts = reference::ReferenceOptions {
                    bias: bias.clone().map(|data| Broadcast4 {
                        data,
                        shape: [1, 1, lq, lk],
                    }),
                    alibi_slopes: slopes.clone(),
                    bool_mask: terms.map(|_| Broadcast4 {
                        data: (0..lq * lk).map(|n| hidden(n / lk, n % lk)).collect(),
                        shape: [1, 1, lq, lk],
                    }),
                    ..one.reference_options()
                };
                let f = reference::forward(&one.dims, &opts, &sq, &sk, &sv);
                let b = reference::backward(&one.dims, &opts, &sq, &sk, &sv, &so);
                let dbias = b.d_bias.unwrap_or_default();
                (f.out, f.lse, b.dq, b.dk, b.dv, dbias)
            } else {
                let term = |_: usize, h: usize, i: usize, j: usize| match (&bias, &slopes) {
                    _ if hidden(i, j) => f64::NEG_INFINITY,
                    (Some(bias), Some(slopes)) => {
                        let distance = (i as f64 + lk as f64 - lq as f64 - j as f64).abs();
                        bias[i * lk + j] - slopes[h] * distance
                    }
                    _ => 0.0,
                };
                let n = naive::attention_with_terms(&one, dtype, [&sq, &sk, &sv, &so], &term);
                // d(bias) of a bias broadcast over heads: the logits' gradient summed.
                let dbias = (0..lq * lk)
                    .map(|ij| (0..d.heads_q).map(|h| n.dlogits[h * lq * lk + ij]).sum())
                    .collect();
                (n.out, n.lse, n.dq, n.dk, n.dv, dbias)
            };
            if let Some(t) = terms {
                for i in 0..lq {
                    let row = (index * t.longest_q + i) * t.longest_kv;
                    e.dbias[row..][..lk].copy_from_slice(&dbias[i * lk..][..lk]);
                }
            }
            put_sequence(&mut e.out, &out, d.heads_q, d.dim_v, q0);
            put_sequence(&mut e.dq, &dq, d.heads_q, d.dim_qk, q0);
            put_sequence(&mut e.dk, &dk, d.heads_kv, d.dim_qk, k0);
            put_sequence(&mut e.dv, &dv, d.heads_kv, d.dim_v, k0);
            for h in 0..d.heads_q {
                e.lse[h * total_q + q0..][..lq].copy_from_slice(&lse[h * lq..][..lq]);
            }
        }
        q0 += lq;
        k0 += lk;
    }
    e
}

fn check_packed(client: &Client, p: &Packed, dtype: FloatDtype, path: KernelPath) {
    check_packed_terms(client, p, dtype, path, false)
}

/// [`check_packed`], with `with_terms` a random bias (its gradient too) and ALiBi slopes
/// per sequence and head ([`PackedTerms`]).
fn check_packed_terms(
    client: &Client,
    p: &Packed,
    dtype: FloatDtype,
    path: KernelPath,
    with_terms: bool,
) {
    let d = p.template.dims;
    if path == KernelPath::RegisterMma && !(d.dim_qk % 8 == 0 && d.dim_v % 8 == 0) {
        return;
    }
    let (seed, mut rng) = common::rng();
    let context = format!(
        "seed {seed} (FLASH_SEED={seed} reproduces), {path:?}, {dtype:?}, q lengths {:?}, kv \
         lengths {:?}, {:?}",
        p.lengths_q, p.lengths_kv, p.template
    );
    let total_q: usize = p.lengths_q.iter().sum();
    let total_kv: usize = p.lengths_kv.iter().sum();
    let shape_q = [total_q, d.heads_q, d.dim_qk];
    let shape_k = [total_kv, d.heads_kv, d.dim_qk];
    let shape_v = [total_kv, d.heads_kv, d.dim_v];
    let shape_o = [total_q, d.heads_q, d.dim_v];
    let n = |s: &[usize]| s.iter().product::<usize>();
    let q = common::randn(&mut rng, n(&shape_q), dtype);
    let k = common::randn(&mut rng, n(&shape_k), dtype);
    let v = common::randn(&mut rng, n(&shape_v), dtype);
    let d_out = common::randn(&mut rng, n(&shape_o), dtype);

    let sequences_q = PackedSequences::from_lengths(client, &p.lengths_q).unwrap();
    let sequences_kv = PackedSequences::from_lengths(client, &p.lengths_kv).unwrap();
    let sequences = [&sequences_q, &sequences_kv];
    let (tq, tk, tv) = (
        upload(client, &q, &shape_q, dtype),
        upload(client, &k, &shape_k, dtype),
        upload(client, &v, &shape_v, dtype),
    );
    let t_do = upload(client, &d_out, &shape_o, dtype);
    let options = p.template.options();
    let terms = with_terms.then(|| PackedTerms::random(p, dtype, &mut rng));
    let (out, lse, grads, dbias) = match &terms {
        None => {
            let out = poisoned(client, &shape_o, dtype);
            let lse = poisoned(client, &[d.heads_q, total_q], FloatDtype::F32);
            forward_packed_into(
                client,
                [&tq, &tk, &tv],
                &out,
                &lse,
                sequences,
                dtype,
                options,
                path,
            )
            .unwrap_or_else(|e| panic!("forward: {e} — {context}"));
            let grads = Gradients {
                dq: poisoned(client, &shape_q, dtype),
                dk: poisoned(client, &shape_k, dtype),
                dv: poisoned(client, &shape_v, dtype),
            };
            let saved = Saved {
                q: &tq,
                k: &tk,
                v: &tv,
                out: &out,
                lse: &lse,
            };
            backward_packed_into(
                client, saved, &t_do, &grads, sequences, dtype, options, path,
            )
            .unwrap_or_else(|e| panic!("backward: {e} — {context}"));
            (out, lse, grads, None)
        }
        Some(t) => {
            let batch = p.lengths_q.len();
            let bias_shape = [batch, 1, t.longest_q, t.longest_kv];
            let bias = upload(client, &t.bias, &bias_shape, dtype);
            let slopes = upload(client, &t.slopes, &[batch, d.heads_q], FloatDtype::F32);
            let blocks = t.blocks.upload(client);
            let terms = ScoreBias {
                bias: Some(&bias),
                alibi_slopes: Some(&slopes),
                block_mask: Some(&blocks),
                ..ScoreBias::none()
            };
            // Outputs are fresh allocations: poison the pool they come from.
            for shape in [&shape_o[..], &shape_q[..], &shape_k[..], &shape_v[..]] {
                drop(poisoned(client, shape, dtype));
            }
            let tensors = [&tq, &tk, &tv];
            let fwd =
                forward_packed_biased(client, tensors, sequences, terms, dtype, options, path)
                    .unwrap_or_else(|e| panic!("forward: {e} — {context}"));
            let saved = Saved {
                q: &tq,
                k: &tk,
                v: &tv,
                out: &fwd.out,
                lse: &fwd.lse,
            };
            let grad = TermsGrad {
                bias: true,
                ..TermsGrad::default()
            };
            let (grads, of_terms) = backward_packed_biased(
                client, saved, &t_do, sequences, terms, grad, dtype, options, path,
            )
            .unwrap_or_else(|e| panic!("backward: {e} — {context}"));
            (fwd.out, fwd.lse, grads, of_terms.bias)
        }
    };

    let want = expected(p, dtype, &q, &k, &v, &d_out, terms.as_ref(), true);
    let low = expected(p, dtype, &q, &k, &v, &d_out, terms.as_ref(), false);
    if let Some(dbias) = &dbias {
        let got = download(client, dbias, FloatDtype::F32);
        assert_close(
            dtype,
            "dBias",
            &got,
            &want.dbias,
            &low.dbias,
            1e-4,
            &context,
        );
    }
    let got_lse = download(client, &lse, FloatDtype::F32);
    assert_close(
        dtype,
        "O",
        &download(client, &out, dtype),
        &want.out,
        &low.out,
        2e-5,
        &context,
    );
    assert_close(
        FloatDtype::F32,
        "LSE",
        &got_lse,
        &want.lse,
        &low.lse,
        2e-5,
        &context,
    );
    for (name, got, want, low) in [
        ("dQ", &grads.dq, &want.dq, &low.dq),
        ("dK", &grads.dk, &want.dk, &low.dk),
        ("dV", &grads.dv, &want.dv, &low.dv),
    ] {
        assert_close(
            dtype,
            name,
            &download(client, got, dtype),
            want,
            low,
            1e-4,
            &context,
        );
    }
    // Rows of a sequence without keys: LSE −∞ exactly (O and dQ zero, checked above).
    for (i, &l) in want.lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(got_lse[i], f64::NEG_INFINITY, "LSE entry {i} — {context}");
        }
    }
}

/// Packed batches: empty and one-token sequences, `s_q ≠ s_kv` both ways with a
/// bottom-right causal mask per sequence, GQA, a window with a softcap, a head dim off the
/// 16-byte grid, dropout (numbered by sequence).
fn packed_cases() -> Vec<Packed> {
    vec![
        Packed {
            lengths_q: vec![5, 0, 1, 37, 67],
            lengths_kv: vec![7, 3, 0, 37, 150],
            template: Case {
                causal: true,
                dropout: Some(burn_flash_attention::kernels::Dropout {
                    p: 0.2,
                    seed: 77,
                    offset: 2,
                }),
                ..case(dims(0, 4, 2, 0, 0, 64, 64))
            },
        },
        Packed {
            lengths_q: vec![33, 1, 70],
            lengths_kv: vec![33, 1, 70],
            template: Case {
                window: (Some(9), Some(4)),
                softcap: Some(5.0),
                ..case(dims(0, 2, 1, 0, 0, 40, 40))
            },
        },
        Packed {
            lengths_q: vec![130, 20],
            lengths_kv: vec![100, 20],
            template: Case {
                causal: true,
                ..case(dims(0, 2, 2, 0, 0, 128, 128))
            },
        },
    ]
}

#[test]
fn packed_batches_match_the_oracle_per_sequence() {
    let client = common::client();
    for p in packed_cases() {
        for dtype in common::dtypes(&client) {
            for path in common::paths(&client, dtype) {
                check_packed(&client, &p, dtype, path);
            }
        }
    }
}

/// Score terms in a packed batch: each sequence reads its own corner of a bias `[b, 1,
/// longest s_q, longest s_kv]` and of a block mask (which hides a whole row of the third
/// sequence: O = 0, LSE = −∞) and its own ALiBi slopes, at positions within the sequence
/// (bottom-right causal per sequence, s_q ≠ s_kv both ways, a sequence with queries but no
/// keys, one without queries); `d(bias)` lands in each sequence's corner, zero elsewhere.
#[test]
fn packed_batches_with_terms_match_the_oracle_per_sequence() {
    let client = common::client();
    let p = Packed {
        lengths_q: vec![6, 0, 11, 1, 4],
        lengths_kv: vec![9, 3, 11, 14, 0],
        template: Case {
            causal: true,
            ..case(dims(0, 4, 2, 0, 0, 32, 32))
        },
    };
    for dtype in common::dtypes(&client) {
        for path in common::paths(&client, dtype) {
            check_packed_terms(&client, &p, dtype, path, true);
        }
    }
}

/// The f32 sum of the atomic dQ (register-level path, long query sequences) adds each
/// sequence's share into its own rows only.
#[test]
fn packed_batches_with_atomic_dq_match_the_oracle() {
    let client = common::client();
    let dtype = FloatDtype::BF16;
    if !common::paths(&client, dtype).contains(&KernelPath::RegisterMma) {
        return;
    }
    let p = Packed {
        lengths_q: vec![300, 0, 257, 1],
        lengths_kv: vec![290, 5, 300, 64],
        template: Case {
            causal: true,
            ..case(dims(0, 4, 1, 0, 0, 128, 128))
        },
    };
    check_packed(&client, &p, dtype, KernelPath::RegisterMma);
}

#[test]
fn packed_tensors_that_disagree_with_the_lengths_are_refused() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let sequences = PackedSequences::from_lengths(&client, &[3, 4]).unwrap();
    let other = PackedSequences::from_lengths(&client, &[3, 4, 1]).unwrap();
    let t = |shape: &[usize]| poisoned(&client, shape, dtype);
    let (q, k, v) = (t(&[7, 2, 8]), t(&[7, 2, 8]), t(&[7, 2, 8]));
    let run = |q: &_, k: &_, v: &_, kv: &_| {
        burn_flash_attention::kernels::forward::forward_packed(
            &client,
            q,
            k,
            v,
            &sequences,
            kv,
            dtype,
            Default::default(),
            KernelPath::Auto,
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    let long = t(&[8, 2, 8]);
    let err = run(&long, &k, &v, &sequences);
    assert!(
        err.contains("`query`") && err.contains("cu_seqlens_q"),
        "{err}"
    );
    let short = t(&[6, 2, 8]);
    let err = run(&q, &k, &short, &sequences);
    assert!(
        err.contains("`value`") && err.contains("cu_seqlens_k"),
        "{err}"
    );
    let flat = t(&[7, 16]);
    let err = run(&q, &flat, &v, &sequences);
    assert!(err.contains("`key`") && err.contains("rank 3"), "{err}");
    let err = run(&q, &long, &long, &other);
    assert!(
        err.contains("`cu_seqlens_k`") && err.contains("sequences"),
        "{err}"
    );
}

/// The Burn op, forward and autodiff gradients, against the dense op run on each sequence
/// alone: fused on the selected device, composed on Flex.
mod op {
    use burn::tensor::{Device, Tensor, TensorData};
    use burn_flash_attention::{
        AttentionBias, FlashAttentionOptions, PackedSequences, flash_attention_biased_with_lse,
        flash_attention_varlen_biased_with_lse, flash_attention_varlen_with_lse,
    };

    use crate::common;

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f64> {
        t.into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    }

    fn close(what: &str, got: &[f64], want: &[f64], context: &str) {
        let err = common::max_abs_diff(got, want);
        assert!(err <= 2e-4, "{what}: max difference {err:.3e} — {context}");
    }

    /// With `terms`, a trained bias `[b, 1, longest s_q, longest s_kv]` and ALiBi slopes `[b,
    /// h_q]` on both sides (`flash_attention_varlen_biased` against
    /// `flash_attention_biased` on each sequence's corner and row), `d(bias)` compared too.
    fn check(
        device: &Device,
        lengths_q: &[usize],
        lengths_k: &[usize],
        options: FlashAttentionOptions,
        terms: bool,
    ) {
        let device = device.clone().autodiff();
        let (heads_q, heads_k, dim) = (4, 2, 32);
        let (total_q, total_k) = (
            lengths_q.iter().sum::<usize>(),
            lengths_k.iter().sum::<usize>(),
        );
        let (seed, mut rng) = common::rng();
        let context = format!(
            "seed {seed} (FLASH_SEED={seed} reproduces), {device:?}, {lengths_q:?}/{lengths_k:?}"
        );
        let mut tensor = |shape: [usize; 3]| {
            let data: Vec<f32> = common::randn(
                &mut rng,
                shape.iter().product(),
                burn_flash_attention::kernels::FloatDtype::F32,
            )
            .into_iter()
            .map(|x| x as f32)
            .collect();
            Tensor::<3>::from_data(TensorData::new(data, shape), &device)
        };
        let q = tensor([total_q, heads_q, dim]).require_grad();
        let k = tensor([total_k, heads_k, dim]).require_grad();
        let v = tensor([total_k, heads_k, dim]).require_grad();
        let g = tensor([total_q, heads_q, dim]);

        let batch = lengths_q.len();
        let longest = |l: &[usize]| l.iter().copied().max().unwrap_or(0);
        let (longest_q, longest_k) = (longest(lengths_q), longest(lengths_k));
        let bias_data: Vec<f32> = (0..batch * longest_q * longest_k)
            .map(|n| ((n * 37 % 101) as f32 / 101.0 - 0.5) * 2.0)
            .collect();
        let bias_shape = [batch, 1, longest_q, longest_k];
        let bias =
            || Tensor::<4>::from_data(TensorData::new(bias_data.clone(), bias_shape), &device);
        let slopes: Vec<f32> = (0..batch * heads_q)
            .map(|n| 0.05 + 0.03 * n as f32)
            .collect();
        let slopes = Tensor::<2>::from_data(TensorData::new(slopes, [batch, heads_q]), &device);
        let (bias, bias2) = (bias().require_grad(), bias().require_grad());

        let sequences_q = PackedSequences::from_lengths(lengths_q, &device);
        let sequences_k = PackedSequences::from_lengths(lengths_k, &device);
        let (out, lse) = match terms {
            false => flash_attention_varlen_with_lse(
                q.clone(),
                k.clone(),
                v.clone(),
                &sequences_q,
                &sequences_k,
                options,
            ),
            true => flash_attention_varlen_biased_with_lse(
                q.clone(),
                k.clone(),
                v.clone(),
                &sequences_q,
                &sequences_k,
                AttentionBias::new()
                    .with_bias(bias.clone())
                    .with_alibi(slopes.clone()),
                options,
            ),
        };
        let grads = (out.clone() * g.clone()).sum().backward();
        let got = [values(out), values(lse)];
        let got_grads = [&q, &k, &v].map(|t| values(t.grad(&grads).unwrap()));
        let got_dbias = terms.then(|| values(bias.grad(&grads).unwrap()));

        // Sequence by sequence, through the dense op on `[1, h, len, d]`.
        let (q2, k2, v2) = (
            q.clone().detach().require_grad(),
            k.clone().detach().require_grad(),
            v.clone().detach().require_grad(),
        );
        let as_batch = |t: &Tensor<3>, first: usize, len: usize| {
            t.clone()
                .slice([first..first + len])
                .swap_dims(0, 1)
                .unsqueeze_dim::<4>(0)
        };
        let mut want_out = vec![0.0; total_q * heads_q * dim];
        let mut want_lse = vec![f64::NEG_INFINITY; heads_q * total_q];
        let mut loss = Tensor::<1>::zeros([1], &device);
        let (mut q0, mut k0) = (0, 0);
        for (i, (&lq, &lk)) in lengths_q.iter().zip(lengths_k).enumerate() {
            if lq > 0 && lk > 0 {
                let mut sequence_terms = AttentionBias::new();
                if terms {
                    sequence_terms = sequence_terms
                        .with_bias(bias2.clone().slice([i..i + 1, 0..1, 0..lq, 0..lk]))
                        .with_alibi(slopes.clone().slice([i..i + 1, 0..heads_q]));
                }
                let (o, l) = flash_attention_biased_with_lse(
                    as_batch(&q2, q0, lq),
                    as_batch(&k2, k0, lk),
                    as_batch(&v2, k0, lk),
                    sequence_terms,
                    options,
                );
                let o_rows = o.squeeze_dim::<3>(0).swap_dims(0, 1);
                loss = loss + (o_rows.clone() * g.clone().slice([q0..q0 + lq])).sum();
                let o_rows = values(o_rows);
                want_out[q0 * heads_q * dim..][..o_rows.len()].copy_from_slice(&o_rows);
                let l = values(l);
                for h in 0..heads_q {
                    want_lse[h * total_q + q0..][..lq].copy_from_slice(&l[h * lq..][..lq]);
                }
            }
            q0 += lq;
            k0 += lk;
        }
        let grads = loss.backward();
        close("O", &got[0], &want_out, &context);
        close("LSE", &got[1], &want_lse, &context);
        for (name, (got, t)) in ["dQ", "dK", "dV"]
            .iter()
            .zip(got_grads.iter().zip([&q2, &k2, &v2]))
        {
            let want = t
                .grad(&grads)
                .map(values)
                .unwrap_or_else(|| vec![0.0; got.len()]);
            close(name, got, &want, &context);
        }
        if let Some(got) = got_dbias {
            let want = bias2
                .grad(&grads)
                .map(values)
                .unwrap_or_else(|| vec![0.0; got.len()]);
            close("dBias", &got, &want, &context);
        }
    }

    #[test]
    fn varlen_op_matches_attention_sequence_by_sequence() {
        let causal = FlashAttentionOptions::default().with_causal(true);
        let windowed = FlashAttentionOptions::default()
            .with_window(Some(5), Some(2))
            .with_softcap(Some(4.0));
        for device in [common::burn_device(), Device::flex()] {
            check(&device, &[9, 0, 1, 40], &[12, 4, 0, 33], causal, false);
            check(&device, &[17, 3], &[17, 3], windowed, false);
        }
    }

    /// Score terms in a packed batch (a trained bias and ALiBi), fused on the test device and
    /// composed on Flex, against the biased op on each sequence's corner of the terms.
    #[test]
    fn varlen_op_with_terms_matches_the_biased_op_sequence_by_sequence() {
        let causal = FlashAttentionOptions::default().with_causal(true);
        for device in [common::burn_device(), Device::flex()] {
            check(&device, &[9, 0, 1, 14], &[12, 4, 0, 11], causal, true);
        }
    }

    #[test]
    #[should_panic(
        expected = "flash_attention_varlen_biased: `bias` has shape [1, 1, 5, 5], expected [2 | 1, 2 | 1, 3 | 1, 4 | 1]"
    )]
    fn a_bias_of_the_unpadded_shape_is_refused_by_name() {
        let device = common::burn_device();
        let t = |n: usize| Tensor::<3>::zeros([n, 2, 8], &device);
        let sequences_q = PackedSequences::from_lengths(&[3, 2], &device);
        let sequences_k = PackedSequences::from_lengths(&[4, 1], &device);
        // The longest sequences have 3 queries and 4 keys: a bias over the packed totals
        // (5 × 5) is not the padded batch's.
        let wrong = Tensor::<4>::zeros([1, 1, 5, 5], &device);
        flash_attention_varlen_biased_with_lse(
            t(5),
            t(5),
            t(5),
            &sequences_q,
            &sequences_k,
            AttentionBias::new().with_bias(wrong),
            Default::default(),
        );
    }

    #[test]
    #[should_panic(expected = "`cu_seqlens`")]
    fn decreasing_offsets_name_cu_seqlens() {
        let device = common::burn_device();
        let offsets = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(vec![0i64, 5, 3], [3]),
            &device,
        );
        PackedSequences::from_cu_seqlens(offsets);
    }

    #[test]
    #[should_panic(expected = "the total of `cu_seqlens_q`")]
    fn a_total_that_disagrees_names_the_query() {
        let device = common::burn_device();
        let t = |n: usize| Tensor::<3>::zeros([n, 2, 8], &device);
        let sequences = PackedSequences::from_lengths(&[3, 4], &device);
        flash_attention_varlen_with_lse(
            t(8),
            t(7),
            t(7),
            &sequences,
            &sequences,
            Default::default(),
        );
    }
}
