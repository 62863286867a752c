//! Score terms (additive bias with its gradient, −∞ as a mask, ALiBi) against the f64
//! oracle: the kernels on every path of the selected device, and the Burn op under
//! autodiff, fused and composed.

use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_flash_attention::kernels::{
    BlockMask, BlockShape, FlashError, FloatDtype, KernelPath, ScoreBias, TermsGrad,
    backward::{Saved, backward_biased},
    forward::forward_biased,
    reference::{self, Broadcast4},
};
use burn_flash_attention::{
    AttentionBias, BlockMask as OpBlockMask, FlashAttentionOptions, FlashMultiHeadAttentionConfig,
    flash_attention_biased, flash_attention_biased_with_lse, supports_flash_attention,
};
use cubecl::client::Client;
use rand::Rng;

use crate::common::{
    self, Case, assert_forward_close, assert_grads_close, case, dims, download, naive, poisoned,
    tensor, upload, values,
};

/// ALiBi slopes: one per query head, or one per (batch, query head).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Alibi {
    None,
    PerHead,
    PerBatchHead,
}

/// A problem with terms: the bias's (broadcast) shape, which of its entries are −∞, ALiBi,
/// and whether the backward returns the bias's gradient.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TermsCase {
    pub case: Case,
    pub bias: Option<[usize; 4]>,
    /// Entry `(b, h, i, j)` of the bias (its own coordinates) is −∞.
    pub hidden: fn(usize, usize, usize, usize) -> bool,
    pub alibi: Alibi,
    pub grad: bool,
    /// A block mask over the problem ([`BlockMask`]), intersected with the other masks.
    pub blocks: Option<fn(&Case) -> BlockMask>,
}

pub(crate) fn nothing_hidden(_: usize, _: usize, _: usize, _: usize) -> bool {
    false
}

/// Small problems (lavapipe runs them in CI): every broadcast form of the bias, rows the
/// bias hides completely, s_q ≠ s_kv both ways, GQA, window and softcap.
fn cases() -> Vec<TermsCase> {
    vec![
        // Full-shape bias (its gradient stored, not summed), causal, ALiBi per head.
        TermsCase {
            case: Case {
                causal: true,
                ..case(dims(2, 4, 2, 37, 53, 40, 40))
            },
            bias: Some([2, 4, 37, 53]),
            hidden: nothing_hidden,
            alibi: Alibi::PerHead,
            grad: true,
            blocks: None,
        },
        // Broadcast over the batch (gradient summed), window and softcap; the window's
        // keys start past the first key block and end in a partial one. Rows of 150 keys
        // start off 16-byte boundaries: on sm_90 the kernels read this bias at the lanes'
        // scores, ahead of the products, rather than staging it.
        TermsCase {
            case: Case {
                window: (Some(8), Some(4)),
                softcap: Some(5.0),
                ..case(dims(2, 2, 1, 33, 150, 64, 64))
            },
            bias: Some([1, 2, 33, 150]),
            hidden: |_, _, i, j| (i + j) % 7 == 0,
            alibi: Alibi::None,
            grad: true,
            blocks: None,
        },
        // A mask as −∞: batch 2 sees no key, some rows of batch 1 none either; ALiBi per
        // (batch, head); broadcast over heads.
        TermsCase {
            case: case(dims(3, 2, 2, 20, 29, 32, 32)),
            bias: Some([3, 1, 20, 29]),
            hidden: |b, _, i, j| b == 2 || (b == 1 && i % 5 == 0) || (b == 0 && j > 24),
            alibi: Alibi::PerBatchHead,
            grad: true,
            blocks: None,
        },
        // Key padding `[b, 1, 1, s_kv]`, causal with s_q > s_kv (rows without keys), MQA.
        TermsCase {
            case: Case {
                causal: true,
                ..case(dims(2, 3, 1, 45, 17, 72, 72))
            },
            bias: Some([2, 1, 1, 17]),
            hidden: |b, _, _, j| b == 1 && j >= 9,
            alibi: Alibi::None,
            grad: true,
            blocks: None,
        },
        // A deterministic backward: the broadcast bias's gradient added up in a pass of its
        // own (over the batch and the queries here). On sm_90 the kernels stage this bias in
        // shared memory (one row for every query), its last 16 bytes past the keys' end.
        TermsCase {
            case: Case {
                deterministic: true,
                causal: true,
                ..case(dims(2, 2, 2, 24, 150, 64, 64))
            },
            bias: Some([1, 2, 1, 150]),
            hidden: |_, _, _, j| j == 3,
            alibi: Alibi::None,
            grad: true,
            blocks: None,
        },
        // A full-shape bias over several key and query blocks at d = 128 (the warpgroup
        // kernels' head dim on sm_90, which stage a block's bias with K and V), the last
        // blocks partial, causal with s_q < s_kv.
        TermsCase {
            case: Case {
                causal: true,
                ..case(dims(1, 2, 1, 130, 200, 128, 128))
            },
            bias: Some([1, 2, 130, 200]),
            hidden: |_, h, i, j| h == 1 && (i * 7 + j) % 11 == 0,
            alibi: Alibi::None,
            grad: true,
            blocks: None,
        },
        // ALiBi alone, no gradient asked.
        TermsCase {
            case: Case {
                causal: true,
                ..case(dims(1, 4, 4, 65, 65, 64, 64))
            },
            bias: None,
            hidden: nothing_hidden,
            alibi: Alibi::PerHead,
            grad: false,
            blocks: None,
        },
        // Block masks: packed documents, causal, of lengths that straddle the blocks (a
        // different split per batch), GQA.
        TermsCase {
            case: case(dims(2, 4, 2, 300, 300, 64, 64)),
            bias: None,
            hidden: nothing_hidden,
            alibi: Alibi::None,
            grad: false,
            blocks: Some(|c| {
                let ends: [&[usize]; 2] = [&[70, 220, 300], &[128, 131, 300]];
                let ids: Vec<Vec<u32>> = ends
                    .iter()
                    .map(|ends| {
                        (0..c.dims.seq_q)
                            .map(|t| ends.iter().position(|&e| t < e).unwrap() as u32)
                            .collect()
                    })
                    .collect();
                BlockMask::documents(&ids, &ids, true, B128).unwrap()
            }),
        },
        // Prefix-LM with s_q < s_kv, blocks of 128 × 256, MQA, ALiBi.
        TermsCase {
            case: case(dims(2, 3, 1, 200, 330, 40, 24)),
            bias: None,
            hidden: nothing_hidden,
            alibi: Alibi::PerHead,
            grad: false,
            blocks: Some(|c| {
                let blocks = BlockShape {
                    block_q: 128,
                    block_kv: 256,
                };
                BlockMask::prefix_lm(&[150, 3], c.dims.seq_q, c.dims.seq_kv, blocks).unwrap()
            }),
        },
        // A mask per (batch, head) from a predicate: empty, full and partial blocks, rows it
        // hides completely, s_q > s_kv, GQA, a window on top and a bias with its gradient.
        TermsCase {
            case: Case {
                window: (Some(150), None),
                ..case(dims(2, 2, 1, 260, 140, 32, 32))
            },
            bias: Some([1, 2, 1, 140]),
            hidden: nothing_hidden,
            alibi: Alibi::None,
            grad: true,
            blocks: Some(|c| {
                let d = c.dims;
                BlockMask::from_fn(
                    [d.batch, d.heads_q, d.seq_q, d.seq_kv],
                    B128,
                    |b, h, i, j| {
                        let empty = b == 1 && i < 128 && j >= 128;
                        let full = b == 0 && i >= 128 && j < 128;
                        let hidden_row = i % 50 == 7;
                        full || (!empty && !hidden_row && (i * 7 + j * 13 + h) % 5 != 0)
                    },
                )
                .unwrap()
            }),
        },
    ]
}

const B128: BlockShape = BlockShape {
    block_q: 128,
    block_kv: 128,
};

/// The bias's values (`−∞` where `hidden`) and the ALiBi slopes (flattened `[h]` or
/// `[b, h]`).
fn terms_data(t: &TermsCase, rng: &mut rand::rngs::StdRng) -> (Option<Vec<f64>>, Vec<f64>) {
    let bias = t.bias.map(|[bb, hh, sq, skv]| {
        let mut data = Vec::with_capacity(bb * hh * sq * skv);
        for b in 0..bb {
            for h in 0..hh {
                for i in 0..sq {
                    for j in 0..skv {
                        data.push(match (t.hidden)(b, h, i, j) {
                            true => f64::NEG_INFINITY,
                            false => rng.random_range(-2.0..2.0),
                        });
                    }
                }
            }
        }
        data
    });
    let heads = t.case.dims.heads_q;
    let slopes = match t.alibi {
        Alibi::None => vec![],
        Alibi::PerHead => (0..heads).map(|h| 0.5f64.powi(h as i32 + 1)).collect(),
        Alibi::PerBatchHead => (0..t.case.dims.batch * heads)
            .map(|n| 0.25 + 0.1 * n as f64)
            .collect(),
    };
    (bias, slopes)
}

fn slopes_shape(t: &TermsCase) -> [usize; 2] {
    match t.alibi {
        Alibi::PerBatchHead => [t.case.dims.batch, t.case.dims.heads_q],
        _ => [1, t.case.dims.heads_q],
    }
}

/// The oracle's options for `t` and the terms as the naive reference adds them.
fn reference_options(
    t: &TermsCase,
    bias: &Option<Vec<f64>>,
    slopes: &[f64],
    blocks: Option<&BlockMask>,
) -> reference::ReferenceOptions {
    let d = t.case.dims;
    let shape = [d.batch, d.heads_q, d.seq_q, d.seq_kv];
    reference::ReferenceOptions {
        bool_mask: blocks.map(|m| Broadcast4 {
            data: (0..shape.iter().product())
                .map(|n| {
                    let (j, i) = (n % d.seq_kv, n / d.seq_kv % d.seq_q);
                    let (h, b) = (
                        n / (d.seq_kv * d.seq_q) % d.heads_q,
                        n / (d.seq_kv * d.seq_q * d.heads_q),
                    );
                    !m.is_visible(b, h, i, j)
                })
                .collect(),
            shape,
        }),
        bias: bias.clone().map(|data| Broadcast4 {
            data,
            shape: t.bias.unwrap(),
        }),
        alibi_slopes: (!slopes.is_empty()).then(|| slopes.to_vec()),
        ..t.case.reference_options()
    }
}

/// `d(bias)` of the naive reference: its logits' gradient summed into the bias's shape.
fn summed(dlogits: &[f64], t: &TermsCase) -> Vec<f64> {
    let d = &t.case.dims;
    let bias = Broadcast4 {
        data: vec![0.0; t.bias.unwrap().iter().product()],
        shape: t.bias.unwrap(),
    };
    let mut out = bias.data.clone();
    let [bb, hh, sq, skv] = bias.shape;
    let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            for i in 0..d.seq_q {
                for j in 0..d.seq_kv {
                    let at =
                        ((pick(bb, b) * hh + pick(hh, h)) * sq + pick(sq, i)) * skv + pick(skv, j);
                    out[at] += dlogits[((b * d.heads_q + h) * d.seq_q + i) * d.seq_kv + j];
                }
            }
        }
    }
    out
}

/// Forward and backward with terms on `path` (outputs poisoned first) against the oracle,
/// on inputs of a fresh seed ([`common::rng`]).
fn check(client: &Client, t: &TermsCase, dtype: FloatDtype, path: KernelPath) {
    if let Err(e) = check_seeded(client, t, dtype, path, common::rng()) {
        panic!("{path:?} refused {t:?} in {dtype:?}: {e}");
    }
}

/// [`check`] on the inputs `seed` draws from `rng`; `Err` where the path refuses the
/// problem on this device (`FlashError::Unavailable`), before anything runs.
pub(crate) fn check_seeded(
    client: &Client,
    t: &TermsCase,
    dtype: FloatDtype,
    path: KernelPath,
    (seed, mut rng): (u64, rand::rngs::StdRng),
) -> Result<(), FlashError> {
    let d = t.case.dims;
    if path == KernelPath::RegisterMma && !(d.dim_qk % 8 == 0 && d.dim_v % 8 == 0) {
        return Ok(());
    }
    let context = format!("seed {seed} (FLASH_SEED={seed} reproduces), {path:?}, {dtype:?}, {t:?}");
    let x: Vec<Vec<f64>> = [d.q_len(), d.k_len(), d.v_len(), d.o_len()]
        .into_iter()
        .map(|n| common::randn(&mut rng, n, dtype))
        .collect();
    let (bias_data, slopes) = terms_data(t, &mut rng);
    // The bias is held in the dtype of Q: the oracle sees it rounded the same way.
    let bias_data: Option<Vec<f64>> =
        bias_data.map(|b| b.iter().map(|&x| common::round(x, dtype)).collect());
    let qs = [d.batch, d.heads_q, d.seq_q, d.dim_qk];
    let ks = [d.batch, d.heads_kv, d.seq_kv, d.dim_qk];
    let vs = [d.batch, d.heads_kv, d.seq_kv, d.dim_v];
    let os = [d.batch, d.heads_q, d.seq_q, d.dim_v];
    let q = upload(client, &x[0], &qs, dtype);
    let k = upload(client, &x[1], &ks, dtype);
    let v = upload(client, &x[2], &vs, dtype);
    let d_out = upload(client, &x[3], &os, dtype);
    let bias = bias_data
        .as_ref()
        .map(|b| upload(client, b, &t.bias.unwrap(), dtype));
    let alibi =
        (!slopes.is_empty()).then(|| upload(client, &slopes, &slopes_shape(t), FloatDtype::F32));
    let host_blocks = t.blocks.map(|build| build(&t.case));
    let blocks = host_blocks.as_ref().map(|m| m.upload(client));
    let terms = ScoreBias {
        bias: bias.as_ref(),
        alibi_slopes: alibi.as_ref(),
        block_mask: blocks.as_ref(),
        ..ScoreBias::none()
    };

    // Outputs are fresh allocations: poison the pool they come from.
    for shape in [&os[..], &os[..3]] {
        drop(poisoned(client, shape, dtype));
    }
    let fwd = match forward_biased(client, &q, &k, &v, terms, dtype, t.case.options(), path) {
        Err(e @ FlashError::Unavailable(_)) => return Err(e),
        other => other.unwrap_or_else(|e| panic!("forward: {e} — {context}")),
    };
    for shape in [&qs[..], &ks[..], &vs[..]] {
        drop(poisoned(client, shape, dtype));
    }
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &fwd.out,
        lse: &fwd.lse,
    };
    let bias_grad = TermsGrad {
        bias: t.grad,
        ..TermsGrad::default()
    };
    let (grads, of_terms) = backward_biased(
        client,
        saved,
        &d_out,
        terms,
        bias_grad,
        dtype,
        t.case.options(),
        path,
    )
    .unwrap_or_else(|e| panic!("backward: {e} — {context}"));

    let opts = reference_options(t, &bias_data, &slopes, host_blocks.as_ref());
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let want_grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    let bias_at = |b: usize, h: usize, i: usize, j: usize| {
        if host_blocks
            .as_ref()
            .is_some_and(|m| !m.is_visible(b, h, i, j))
        {
            return f64::NEG_INFINITY;
        }
        let mut s = match (&bias_data, t.bias) {
            (Some(data), Some([bb, hh, sq, skv])) => {
                let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
                data[((pick(bb, b) * hh + pick(hh, h)) * sq + pick(sq, i)) * skv + pick(skv, j)]
            }
            _ => 0.0,
        };
        if !slopes.is_empty() {
            let slope = if slopes.len() == d.heads_q {
                slopes[h]
            } else {
                slopes[b * d.heads_q + h]
            };
            s -= slope * (i as f64 + d.seq_kv as f64 - d.seq_q as f64 - j as f64).abs();
        }
        s
    };
    let low = naive::attention_with_terms(&t.case, dtype, [&x[0], &x[1], &x[2], &x[3]], &bias_at);

    let got_out = download(client, &fwd.out, dtype);
    let got_lse = download(client, &fwd.lse, FloatDtype::F32);
    let [got_dq, got_dk, got_dv] =
        [&grads.dq, &grads.dk, &grads.dv].map(|t| download(client, t, dtype));
    assert_forward_close(dtype, (&got_out, &got_lse), &want, &low, &context);
    assert_grads_close(
        dtype,
        [&got_dq, &got_dk, &got_dv],
        &want_grads,
        &low,
        &context,
    );
    match (t.grad, of_terms.bias) {
        (true, Some(dbias)) => {
            let got = download(client, &dbias, FloatDtype::F32);
            let want = want_grads.d_bias.expect("the oracle's bias gradient");
            // FlashAttention's rule; an entry that sums several scores' gradients (a bias
            // broadcast over some dimension) also allowed the rounding bound of its sum.
            let naive_db = summed(&low.dlogits, t);
            let abs_sums = summed(&low.dlogits.iter().map(|g| g.abs()).collect::<Vec<_>>(), t);
            common::assert_close_sums(
                "dBias", &got, &want, &naive_db, &abs_sums, dtype, 1e-4, &context,
            );
        }
        (false, None) => {}
        (asked, got) => panic!(
            "asked for d(bias): {asked}, got one: {} — {context}",
            got.is_some()
        ),
    }
    // Rows the terms hide completely: O = 0, LSE = −∞ and dQ = 0 exactly, never NaN.
    common::assert_hidden_rows(
        &want.lse,
        [&got_lse, &got_out, &got_dq],
        [d.dim_v, d.dim_qk],
        &context,
    );
    eprintln!("{path:?} {dtype:?} {t:?}: ok");
    Ok(())
}

#[test]
fn score_terms_match_the_oracle_on_every_path() {
    let client = common::client();
    let dtypes = common::dtypes(&client);
    for t in common::selected(cases()) {
        for &dtype in &dtypes {
            // lavapipe computes half precision slowly: f32 there (the GPU runs them all).
            if common::is_cpu_device() && dtype != FloatDtype::F32 {
                continue;
            }
            for path in common::paths(&client, dtype) {
                check(&client, &t, dtype, path);
            }
        }
    }
}

/// With `deterministic`, a broadcast bias's gradient is bitwise the same from run to run.
#[test]
fn a_deterministic_bias_gradient_is_bitwise_reproducible() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let d = dims(2, 4, 2, 40, 40, 32, 32);
    let (_, mut rng) = common::rng();
    let up = |rng: &mut rand::rngs::StdRng, shape: [usize; 4]| {
        let n = shape.iter().product();
        upload(&client, &common::randn(rng, n, dtype), &shape, dtype)
    };
    let q = up(&mut rng, [2, 4, 40, 32]);
    let k = up(&mut rng, [2, 2, 40, 32]);
    let v = up(&mut rng, [2, 2, 40, 32]);
    let d_out = up(&mut rng, [2, 4, 40, 32]);
    let bias = up(&mut rng, [1, 1, 40, 40]);
    let terms = ScoreBias {
        bias: Some(&bias),
        ..ScoreBias::none()
    };
    let options = Case {
        deterministic: true,
        ..case(d)
    }
    .options();
    let fwd = forward_biased(&client, &q, &k, &v, terms, dtype, options, KernelPath::Auto).unwrap();
    let saved = Saved {
        q: &q,
        k: &k,
        v: &v,
        out: &fwd.out,
        lse: &fwd.lse,
    };
    let run = || {
        let bias_grad = TermsGrad {
            bias: true,
            ..TermsGrad::default()
        };
        let (_, of_terms) = backward_biased(
            &client,
            saved,
            &d_out,
            terms,
            bias_grad,
            dtype,
            options,
            KernelPath::Auto,
        )
        .unwrap();
        client.read_one(of_terms.bias.unwrap().handle).unwrap()
    };
    let first = run();
    for _ in 0..3 {
        assert!(run() == first, "d(bias) differs between runs");
    }
}

#[test]
fn terms_of_the_wrong_shape_are_named() {
    let client = common::client();
    let dtype = FloatDtype::F32;
    let d = dims(2, 4, 2, 8, 9, 16, 16);
    let q = upload(&client, &vec![0.0; d.q_len()], &[2, 4, 8, 16], dtype);
    let k = upload(&client, &vec![0.0; d.k_len()], &[2, 2, 9, 16], dtype);
    let wrong_bias = upload(&client, &vec![0.0; 2 * 4 * 8 * 3], &[2, 4, 8, 3], dtype);
    let wrong_slopes = upload(&client, &[0.0; 6], &[2, 3], FloatDtype::F32);
    for (terms, arg) in [
        (
            ScoreBias {
                bias: Some(&wrong_bias),
                ..ScoreBias::none()
            },
            "`bias`",
        ),
        (
            ScoreBias {
                alibi_slopes: Some(&wrong_slopes),
                ..ScoreBias::none()
            },
            "`alibi_slopes`",
        ),
    ] {
        let options = case(d).options();
        let err = forward_biased(&client, &q, &k, &k, terms, dtype, options, KernelPath::Auto)
            .err()
            .unwrap_or_else(|| panic!("{arg} of the wrong shape was taken"));
        assert!(err.to_string().contains(arg), "{err}");
    }
}

/// The Burn op under autodiff on `device`: a trained bias `[1, h, s_q, s_kv]`, a key padding
/// mask (one sequence fully padded) and ALiBi. Returns `[O, dQ, dK, dV, d(bias)]`.
fn run_op(device: &Device, x: &[Vec<f64>; 5], slopes: &[f64], padded: &[bool]) -> [Vec<f64>; 5] {
    let device = device.clone().autodiff();
    let (b, h, sq, skv, dh) = (2, 2, 13, 21, 16);
    let q = tensor(&x[0], [b, h, sq, dh], &device).require_grad();
    let k = tensor(&x[1], [b, h, skv, dh], &device).require_grad();
    let v = tensor(&x[2], [b, h, skv, dh], &device).require_grad();
    let g = tensor(&x[3], [b, h, sq, dh], &device);
    let bias = tensor(&x[4], [1, h, sq, skv], &device).require_grad();
    let padding = Tensor::<2, Bool>::from_data(TensorData::new(padded.to_vec(), [b, skv]), &device);
    let terms = AttentionBias::new()
        .with_bias(bias.clone())
        .with_key_padding(padding)
        .with_alibi(tensor(slopes, [1, h], &device));
    let options = FlashAttentionOptions::default().with_causal(true);
    let (out, lse) =
        flash_attention_biased_with_lse(q.clone(), k.clone(), v.clone(), terms, options);
    assert_eq!(lse.dims(), [b, h, sq]);
    let grads = (out.clone() * g).sum().backward();
    [
        values(out),
        values(q.grad(&grads).unwrap()),
        values(k.grad(&grads).unwrap()),
        values(v.grad(&grads).unwrap()),
        values(bias.grad(&grads).unwrap()),
    ]
}

#[test]
fn the_op_trains_a_bias_fused_and_composed() {
    let fused = common::burn_device();
    assert!(supports_flash_attention(&fused));
    let (seed, mut rng) = common::rng();
    let d = dims(2, 2, 2, 13, 21, 16, 16);
    let x: [Vec<f64>; 5] = [d.q_len(), d.k_len(), d.v_len(), d.o_len(), 2 * 13 * 21]
        .map(|n| common::randn(&mut rng, n, FloatDtype::F32));
    let slopes = [0.5, 0.125];
    // Sequence 1 is all padding: its rows see no key.
    let padded: Vec<bool> = (0..2 * 21).map(|n| n >= 21 || n % 21 >= 18).collect();
    // The oracle sees the padding as −∞ in a `[b, h, s_q, s_kv]` bias.
    let mut full = Vec::new();
    for b in 0..2 {
        for h in 0..2 {
            for i in 0..13 {
                for j in 0..21 {
                    full.push(match padded[b * 21 + j] {
                        true => f64::NEG_INFINITY,
                        false => x[4][(h * 13 + i) * 21 + j],
                    });
                }
            }
        }
    }
    let opts = reference::ReferenceOptions {
        mask: burn_flash_attention::kernels::MaskSpec::causal(),
        bias: Some(Broadcast4 {
            data: full,
            shape: [2, 2, 13, 21],
        }),
        alibi_slopes: Some(slopes.to_vec()),
        ..Default::default()
    };
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    // d(bias) of the `[1, h, s_q, s_kv]` parameter: the full gradient summed over the batch.
    let full_db = grads.d_bias.unwrap();
    let want_db: Vec<f64> = (0..2 * 13 * 21)
        .map(|n| full_db[n] + full_db[2 * 13 * 21 + n])
        .collect();
    let flex = Device::flex();
    for device in [fused, flex] {
        let context = format!("seed {seed}, {device:?}");
        let got = run_op(&device, &x, &slopes, &padded);
        for (what, got, want) in [
            ("O", &got[0], &want.out),
            ("dQ", &got[1], &grads.dq),
            ("dK", &got[2], &grads.dk),
            ("dV", &got[3], &grads.dv),
            ("dBias", &got[4], &want_db),
        ] {
            let err = common::max_abs_diff(got, want);
            assert!(err < 2e-4, "{what}: error {err:.3e} — {context}");
        }
    }
}

#[test]
fn padded_keys_are_hidden_by_the_module() {
    let device = common::burn_device();
    let (_, mut rng) = common::rng();
    let mha = FlashMultiHeadAttentionConfig::new(32, 4)
        .with_n_kv_heads(Some(2))
        .init(&device);
    let (b, sq, skv, kept) = (2, 5, 11, 7);
    let x = |n: usize, rng: &mut rand::rngs::StdRng| common::randn(rng, n, FloatDtype::F32);
    let query = tensor(&x(b * sq * 32, &mut rng), [b, sq, 32], &device);
    let keys = tensor(&x(b * skv * 32, &mut rng), [b, skv, 32], &device);
    let padding: Vec<bool> = (0..b * skv).map(|n| n % skv >= kept).collect();
    let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [b, skv]), &device);
    let masked = mha.forward_qkv(query.clone(), keys.clone(), keys.clone(), Some(padding));
    // The same as attending to the kept keys alone.
    let kept_keys = keys.slice([0..b, 0..kept, 0..32]);
    let truncated = mha.forward_qkv(query, kept_keys.clone(), kept_keys, None);
    let err = common::max_abs_diff(&values(masked), &values(truncated));
    assert!(err < 1e-5, "padded keys change the output by {err:.3e}");
}

#[test]
fn misplaced_terms_name_the_argument() {
    let device = common::burn_device();
    let z = |shape: [usize; 4]| Tensor::<4>::zeros(shape, &device);
    let (q, k) = (z([1, 2, 4, 8]), z([1, 2, 6, 8]));
    let bad_bias = AttentionBias::new().with_bias(z([1, 2, 4, 5]));
    let result = std::panic::catch_unwind(|| {
        flash_attention_biased(
            q.clone(),
            k.clone(),
            k.clone(),
            bad_bias,
            Default::default(),
        )
    });
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains("`bias`"), "{message}");
    let bad_slopes = AttentionBias::new().with_alibi(Tensor::zeros([1, 3], &device));
    let result = std::panic::catch_unwind(|| {
        flash_attention_biased(
            q.clone(),
            k.clone(),
            k.clone(),
            bad_slopes,
            Default::default(),
        )
    });
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains("`alibi_slopes`"), "{message}");
    // A block mask built for 5 keys, not 6.
    let mask = BlockMask::from_fn([1, 1, 4, 5], B128, |_, _, i, j| j <= i).unwrap();
    let bad_blocks = AttentionBias::new().with_block_mask(OpBlockMask::new(mask, &device));
    let result = std::panic::catch_unwind(|| {
        flash_attention_biased(
            q.clone(),
            k.clone(),
            k.clone(),
            bad_blocks,
            Default::default(),
        )
    });
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains("block_mask"), "{message}");
}

/// The op through a block mask (packed documents, causal, split differently per batch)
/// and a trainable key bias under autodiff, fused and composed, against the oracle.
#[test]
fn the_op_trains_through_a_block_mask_fused_and_composed() {
    let (seed, mut rng) = common::rng();
    let d = dims(2, 2, 1, 150, 150, 16, 16);
    let x: [Vec<f64>; 5] = [d.q_len(), d.k_len(), d.v_len(), d.o_len(), 2 * 150]
        .map(|n| common::randn(&mut rng, n, FloatDtype::F32));
    let ends: [[usize; 2]; 2] = [[60, 150], [131, 150]];
    let ids: Vec<Vec<u32>> = ends
        .iter()
        .map(|e| (0..150).map(|t| u32::from(t >= e[0])).collect())
        .collect();
    let mask = BlockMask::documents(&ids, &ids, true, B128).unwrap();
    let hidden: Vec<bool> = (0..2 * 2 * 150 * 150)
        .map(|n| {
            let (j, i, b) = (n % 150, n / 150 % 150, n / (2 * 150 * 150));
            !mask.is_visible(b, 0, i, j)
        })
        .collect();
    let opts = reference::ReferenceOptions {
        bias: Some(Broadcast4 {
            data: (0..2 * 2 * 150 * 150)
                .map(|n| x[4][(n / (150 * 150) % 2) * 150 + n % 150])
                .collect(),
            shape: [2, 2, 150, 150],
        }),
        bool_mask: Some(Broadcast4 {
            data: hidden,
            shape: [2, 2, 150, 150],
        }),
        ..Default::default()
    };
    let want = reference::forward(&d, &opts, &x[0], &x[1], &x[2]);
    let grads = reference::backward(&d, &opts, &x[0], &x[1], &x[2], &x[3]);
    // d(bias) of the `[1, h, 1, s_kv]` parameter: summed over the batch and the queries.
    let full_db = grads.d_bias.unwrap();
    let mut want_db = vec![0.0; 2 * 150];
    for (n, g) in full_db.iter().enumerate() {
        want_db[(n / (150 * 150) % 2) * 150 + n % 150] += g;
    }
    for device in [common::burn_device(), Device::flex()] {
        let context = format!("seed {seed}, {device:?}");
        let ad = device.clone().autodiff();
        let q = tensor(&x[0], [2, 2, 150, 16], &ad).require_grad();
        let k = tensor(&x[1], [2, 1, 150, 16], &ad).require_grad();
        let v = tensor(&x[2], [2, 1, 150, 16], &ad).require_grad();
        let g = tensor(&x[3], [2, 2, 150, 16], &ad);
        let bias = tensor(&x[4], [1, 2, 1, 150], &ad).require_grad();
        let terms = AttentionBias::new()
            .with_bias(bias.clone())
            .with_block_mask(OpBlockMask::new(mask.clone(), &ad));
        let out =
            flash_attention_biased(q.clone(), k.clone(), v.clone(), terms, Default::default());
        let got_grads = (out.clone() * g).sum().backward();
        for (what, got, want) in [
            ("O", values(out), &want.out),
            ("dQ", values(q.grad(&got_grads).unwrap()), &grads.dq),
            ("dK", values(k.grad(&got_grads).unwrap()), &grads.dk),
            ("dV", values(v.grad(&got_grads).unwrap()), &grads.dv),
            ("dBias", values(bias.grad(&got_grads).unwrap()), &want_db),
        ] {
            let err = common::max_abs_diff(&got, want);
            assert!(err < 2e-4, "{what}: error {err:.3e} — {context}");
        }
    }
}
