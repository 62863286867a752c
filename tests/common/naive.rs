//! Naive attention computed in the input dtype: the `[s_q, s_kv]` matrices are materialized
//! and every stage's result is rounded to the dtype, as a framework running the composed
//! attention in that dtype would (matrix products accumulate in f32). Its error against the
//! f64 reference sets the tolerance of the kernels (see `assert_close`).

use burn_flash_attention::kernels::FloatDtype;
use burn_flash_attention::kernels::reference::{Dims, HostScoreFn};

use super::{Case, round};

pub struct Naive {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// `P ⊙ (dP − D)` `[b, h_q, s_q, s_kv]`: the gradient of the logits (of a bias, where
    /// there is no score function).
    pub dlogits: Vec<f64>,
    /// The gradient of the score function's parameters (empty without one).
    pub dparams: Vec<f64>,
    /// `Σ |contribution|` of each parameter's gradient over the scores: a sum of that many
    /// terms, each carrying the dtype's rounding, is off by up to the dtype's unit roundoff
    /// times it (see `assert_close_sums`).
    pub dparams_abs: Vec<f64>,
}

/// Forward and backward of `case` with `d_out` as the upstream gradient.
pub fn attention(
    case: &Case,
    dtype: FloatDtype,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_out: &[f64],
) -> Naive {
    attention_with_terms(case, dtype, [q, k, v, d_out], &|_, _, _, _| 0.0)
}

/// [`attention`] with `terms(b, h, i, j)` added to the logits after masking (−∞ hides).
pub fn attention_with_terms(
    case: &Case,
    dtype: FloatDtype,
    xs: [&[f64]; 4],
    terms: &dyn Fn(usize, usize, usize, usize) -> f64,
) -> Naive {
    attention_with_score_fn(case, dtype, xs, terms, None)
}

/// [`attention_with_terms`], then the score function `f` on each logit.
pub fn attention_with_score_fn(
    case: &Case,
    dtype: FloatDtype,
    [q, k, v, d_out]: [&[f64]; 4],
    terms: &dyn Fn(usize, usize, usize, usize) -> f64,
    f: Option<&HostScoreFn>,
) -> Naive {
    let Dims {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_kv,
        dim_qk,
        dim_v,
    } = case.dims;
    let r = |x: f64| round(round(x, FloatDtype::F32), dtype);
    let scale = case.scale.unwrap_or(1.0 / (dim_qk as f64).sqrt());
    let mask = case.mask();
    let group = heads_q / heads_kv;
    let d = &case.dims;
    let mut n = Naive {
        out: vec![0.0; d.o_len()],
        lse: vec![0.0; d.lse_len()],
        dq: vec![0.0; d.q_len()],
        dk: vec![0.0; d.k_len()],
        dv: vec![0.0; d.v_len()],
        dlogits: vec![0.0; d.lse_len() * seq_kv],
        dparams: vec![0.0; f.map_or(0, |f| f.params_len)],
        dparams_abs: vec![0.0; f.map_or(0, |f| f.params_len)],
    };
    // One score's contribution to the parameters' gradient.
    let mut contribution = vec![0.0; f.map_or(0, |f| f.params_len)];
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for b in 0..batch {
        for h in 0..heads_q {
            let hk = h / group;
            let q_at = |i: usize| &q[((b * heads_q + h) * seq_q + i) * dim_qk..][..dim_qk];
            let k_at = |j: usize| &k[((b * heads_kv + hk) * seq_kv + j) * dim_qk..][..dim_qk];
            let v_at = |j: usize| &v[((b * heads_kv + hk) * seq_kv + j) * dim_v..][..dim_v];
            let do_at = |i: usize| &d_out[((b * heads_q + h) * seq_q + i) * dim_v..][..dim_v];
            // S = round(Q·Kᵀ), then scale and softcap, each rounded.
            let mut s = vec![f64::NEG_INFINITY; seq_q * seq_kv];
            let mut ds_dqk = vec![0.0; seq_q * seq_kv];
            // The score function's input and derivative.
            let mut unmodded = vec![0.0; seq_q * seq_kv];
            let mut df = vec![1.0; seq_q * seq_kv];
            for i in 0..seq_q {
                for j in 0..seq_kv {
                    let mut x = r(r(dot(q_at(i), k_at(j))) * scale);
                    let mut g = scale;
                    if let Some(cap) = case.softcap {
                        let t = r((x / cap).tanh());
                        x = r(cap * t);
                        g *= 1.0 - t * t;
                    }
                    if mask.is_visible(i, j, seq_q, seq_kv) {
                        let mut logit = r(x + terms(b, h, i, j));
                        if let Some(f) = f {
                            let at = [b, h, i, j];
                            unmodded[i * seq_kv + j] = logit;
                            df[i * seq_kv + j] = (f.grad)(logit, at);
                            logit = match (f.visible)(at) {
                                true => r((f.score)(logit, at)),
                                false => f64::NEG_INFINITY,
                            };
                        }
                        s[i * seq_kv + j] = logit;
                    }
                    ds_dqk[i * seq_kv + j] = g;
                }
            }
            // P = round(softmax(S)) (softmax in f32).
            let mut p = vec![0.0; seq_q * seq_kv];
            for i in 0..seq_q {
                let row = &s[i * seq_kv..][..seq_kv];
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse_row = (b * heads_q + h) * seq_q + i;
                if max == f64::NEG_INFINITY {
                    n.lse[lse_row] = f64::NEG_INFINITY;
                    continue;
                }
                let f = |x: f64| round(x, FloatDtype::F32);
                let sum = f(row.iter().map(|&x| f((x - max).exp())).sum());
                n.lse[lse_row] = f(max + sum.ln());
                for j in 0..seq_kv {
                    p[i * seq_kv + j] = r(f((row[j] - max).exp()) / sum);
                }
            }
            // O = round(P·V); backward on the rounded matrices.
            for i in 0..seq_q {
                let row = (b * heads_q + h) * seq_q + i;
                // Dropout: `P ⊙ Z` multiplies V (and dO into dV), `dP ⊙ Z` forms dS.
                let z: Vec<f64> = (0..seq_kv)
                    .map(|j| case.dropout_factor(b, h, i, j))
                    .collect();
                let dp: Vec<f64> = (0..seq_kv)
                    .map(|j| r(r(dot(do_at(i), v_at(j))) * z[j]))
                    .collect();
                let mut o = vec![0.0; dim_v];
                for j in 0..seq_kv {
                    for c in 0..dim_v {
                        o[c] += r(p[i * seq_kv + j] * z[j]) * v_at(j)[c];
                    }
                }
                let o: Vec<f64> = o.into_iter().map(r).collect();
                let delta = r(dot(&o, do_at(i)));
                n.out[row * dim_v..][..dim_v].copy_from_slice(&o);
                for j in 0..seq_kv {
                    let pij = p[i * seq_kv + j];
                    let dlogit = r(pij * (dp[j] - delta));
                    n.dlogits[row * seq_kv + j] = dlogit;
                    let mut ds = dlogit * ds_dqk[i * seq_kv + j];
                    if let (Some(f), true) = (f, dlogit != 0.0) {
                        let at = [b, h, i, j];
                        contribution.fill(0.0);
                        (f.params_grad)(dlogit, unmodded[i * seq_kv + j], at, &mut contribution);
                        for (k, c) in contribution.iter().enumerate() {
                            n.dparams[k] += c;
                            n.dparams_abs[k] += c.abs();
                        }
                        ds *= df[i * seq_kv + j];
                    }
                    let kv_row = (b * heads_kv + hk) * seq_kv + j;
                    let pz = r(pij * z[j]);
                    for c in 0..dim_v {
                        n.dv[kv_row * dim_v + c] += pz * do_at(i)[c];
                    }
                    for c in 0..dim_qk {
                        n.dq[row * dim_qk + c] += ds * k_at(j)[c];
                        n.dk[kv_row * dim_qk + c] += ds * q_at(i)[c];
                    }
                }
            }
        }
    }
    for g in [&mut n.dq, &mut n.dk, &mut n.dv] {
        g.iter_mut().for_each(|x| *x = r(*x));
    }
    n
}
