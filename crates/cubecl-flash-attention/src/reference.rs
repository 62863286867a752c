//! The f64 reference oracle: attention computed the obvious way, on the CPU, in f64.
//!
//! It materializes the `[s_q, s_kv]` score matrix of every head and is written for
//! clarity, not speed. Every kernel is tested against it; it is itself tested against
//! finite differences and against Burn's composed attention.
//!
//! Layout: every tensor is contiguous `[batch, heads, seq, dim]`. Query head `hq` reads
//! key/value head `hq / (heads_q / heads_kv)` (contiguous groups, as GQA/MQA).
//!
//! Order of operations on a score, the same as Burn's `attention_fallback`:
//! `s = q·k · scale`, then softcap `cap · tanh(s / cap)`, then the boolean mask, causal and
//! window masks (masked scores are −∞), then the additive bias and ALiBi, then the score
//! function (which may hide the score). A row whose scores are all masked gives `O = 0` and
//! `LSE = −∞`.

use std::fmt;
use std::sync::Arc;

use crate::mask::MaskSpec;

/// A 4-D `[batch, heads, s_q, s_kv]` tensor that broadcasts over each dimension of size 1.
#[derive(Clone, Debug)]
pub struct Broadcast4<T> {
    pub data: Vec<T>,
    /// `[batch, heads, s_q, s_kv]`, each dimension either 1 or full.
    pub shape: [usize; 4],
}

impl<T: Copy> Broadcast4<T> {
    fn at(&self, b: usize, h: usize, i: usize, j: usize) -> T {
        self.data[self.index(b, h, i, j)]
    }

    fn index(&self, b: usize, h: usize, i: usize, j: usize) -> usize {
        let [bb, hh, sq, skv] = self.shape;
        let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
        ((pick(bb, b) * hh + pick(hh, h)) * sq + pick(sq, i)) * skv + pick(skv, j)
    }
}

/// Dropout given explicitly: `keep[b, h, i, j]` says whether the probability survives;
/// survivors are scaled by `1 / (1 − p)`.
#[derive(Clone, Debug)]
pub struct Dropout {
    pub keep: Broadcast4<bool>,
    pub p: f64,
}

/// Where a score lies, as [`crate::score_mod::ScorePosition`]: `[batch, query head, query,
/// key]`.
pub type At = [usize; 4];

/// A score function on the host, as a [`crate::score_mod::ScoreMod`] computes it on the
/// device: the oracle's version of a test's function.
#[derive(Clone)]
pub struct HostScoreFn {
    /// `f(x)` at a position.
    pub score: Arc<dyn Fn(f64, At) -> f64 + Send + Sync>,
    /// `f′(x)` at a position.
    pub grad: Arc<dyn Fn(f64, At) -> f64 + Send + Sync>,
    /// Whether the query sees the key.
    pub visible: Arc<dyn Fn(At) -> bool + Send + Sync>,
    /// Adds the parameters' gradient for `dL/d f(x)` (first argument) at `x` (second).
    pub params_grad: Arc<dyn Fn(f64, f64, At, &mut [f64]) + Send + Sync>,
    /// How many parameters there are.
    pub params_len: usize,
}

impl fmt::Debug for HostScoreFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostScoreFn({} parameters)", self.params_len)
    }
}

/// Every option the oracle supports.
#[derive(Clone, Debug, Default)]
pub struct ReferenceOptions {
    /// Softmax scale; `None` is `1/√d_qk`.
    pub scale: Option<f64>,
    /// Causal and sliding-window masking (bottom-right aligned).
    pub mask: MaskSpec,
    /// `cap · tanh(s / cap)` before masking.
    pub softcap: Option<f64>,
    /// Boolean mask, `true` = masked out (Burn's convention).
    pub bool_mask: Option<Broadcast4<bool>>,
    /// Additive bias on the scores (after masking).
    pub bias: Option<Broadcast4<f64>>,
    /// ALiBi slope per query head (`[h_q]`, or `[b, h_q]` flattened): adds
    /// `−slope · |i + s_kv − s_q − j|`.
    pub alibi_slopes: Option<Vec<f64>>,
    /// Dropout on the probabilities.
    pub dropout: Option<Dropout>,
    /// A score function, after every other term.
    pub score_fn: Option<HostScoreFn>,
}

/// Problem sizes of a reference computation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
}

impl Dims {
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.dim_qk
    }
    pub fn k_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_kv * self.dim_qk
    }
    pub fn v_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_kv * self.dim_v
    }
    pub fn o_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.dim_v
    }
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }
    fn group(&self) -> usize {
        assert!(
            self.heads_kv > 0 && self.heads_q.is_multiple_of(self.heads_kv),
            "heads_q ({}) must be a multiple of heads_kv ({})",
            self.heads_q,
            self.heads_kv
        );
        self.heads_q / self.heads_kv
    }
    fn scale(&self, options: &ReferenceOptions) -> f64 {
        options
            .scale
            .unwrap_or_else(|| 1.0 / (self.dim_qk as f64).sqrt())
    }
}

/// Forward result: `O` `[b, h_q, s_q, d_v]` and `LSE` `[b, h_q, s_q]` (natural log).
#[derive(Clone, Debug)]
pub struct ReferenceForward {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Backward result. `d_bias` has the bias's (broadcast) shape.
#[derive(Clone, Debug)]
pub struct ReferenceBackward {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub d_bias: Option<Vec<f64>>,
    /// The gradient of the score function's parameters.
    pub d_score_params: Option<Vec<f64>>,
}

/// The scores of one head, after every transformation, and what the backward needs.
struct HeadScores {
    /// Final logits, −∞ where masked.
    logits: Vec<f64>,
    /// The logits before the score function (the bias's and the function's input).
    unmodded: Vec<f64>,
    /// `d logits / d unmodded`: the score function's derivative (1 without one).
    dlogit_dunmodded: Vec<f64>,
    /// `d unmodded / d (q·k)`: scale, times the softcap's `1 − tanh²`.
    dlogit_dqk: Vec<f64>,
}

fn head_scores(
    dims: &Dims,
    options: &ReferenceOptions,
    q: &[f64],
    k: &[f64],
    b: usize,
    h: usize,
) -> HeadScores {
    let Dims {
        seq_q,
        seq_kv,
        dim_qk,
        ..
    } = *dims;
    let hk = h / dims.group();
    let scale = dims.scale(options);
    let mut logits = vec![0.0; seq_q * seq_kv];
    let mut unmodded = vec![0.0; seq_q * seq_kv];
    let mut dlogit_dunmodded = vec![1.0; seq_q * seq_kv];
    let mut dlogit_dqk = vec![0.0; seq_q * seq_kv];
    for i in 0..seq_q {
        let qi = &q[((b * dims.heads_q + h) * seq_q + i) * dim_qk..][..dim_qk];
        for j in 0..seq_kv {
            let kj = &k[((b * dims.heads_kv + hk) * seq_kv + j) * dim_qk..][..dim_qk];
            let dot: f64 = qi.iter().zip(kj).map(|(a, b)| a * b).sum();
            let mut s = dot * scale;
            let mut ds = scale;
            if let Some(cap) = options.softcap {
                let t = (s / cap).tanh();
                s = cap * t;
                ds *= 1.0 - t * t;
            }
            let masked = !options.mask.is_visible(i, j, seq_q, seq_kv)
                || options.bool_mask.as_ref().is_some_and(|m| m.at(b, h, i, j));
            if masked {
                s = f64::NEG_INFINITY;
            } else {
                if let Some(bias) = &options.bias {
                    s += bias.at(b, h, i, j);
                }
                if let Some(slopes) = &options.alibi_slopes {
                    let dist = (i as i64 + seq_kv as i64 - seq_q as i64 - j as i64).abs();
                    let slope = match slopes.len() == dims.heads_q {
                        true => slopes[h],
                        false => slopes[b * dims.heads_q + h],
                    };
                    s -= slope * dist as f64;
                }
            }
            unmodded[i * seq_kv + j] = s;
            if let (Some(f), false) = (&options.score_fn, masked) {
                let at = [b, h, i, j];
                dlogit_dunmodded[i * seq_kv + j] = (f.grad)(s, at);
                s = match (f.visible)(at) {
                    true => (f.score)(s, at),
                    false => f64::NEG_INFINITY,
                };
            }
            logits[i * seq_kv + j] = s;
            dlogit_dqk[i * seq_kv + j] = ds;
        }
    }
    HeadScores {
        logits,
        unmodded,
        dlogit_dunmodded,
        dlogit_dqk,
    }
}

/// Row softmax with its log-sum-exp; a fully masked row gives zeros and −∞.
fn softmax_rows(logits: &[f64], seq_q: usize, seq_kv: usize) -> (Vec<f64>, Vec<f64>) {
    let mut p = vec![0.0; seq_q * seq_kv];
    let mut lse = vec![f64::NEG_INFINITY; seq_q];
    for i in 0..seq_q {
        let row = &logits[i * seq_kv..][..seq_kv];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            continue;
        }
        let sum: f64 = row.iter().map(|s| (s - max).exp()).sum();
        lse[i] = max + sum.ln();
        for j in 0..seq_kv {
            p[i * seq_kv + j] = (row[j] - lse[i]).exp();
        }
    }
    (p, lse)
}

/// Dropout factor of probability `(i, j)`: 0 when dropped, `1/(1−p)` when kept, 1 without dropout.
fn dropout_factor(options: &ReferenceOptions, b: usize, h: usize, i: usize, j: usize) -> f64 {
    match &options.dropout {
        None => 1.0,
        Some(d) if d.keep.at(b, h, i, j) => 1.0 / (1.0 - d.p),
        Some(_) => 0.0,
    }
}

/// Attention forward: `O = softmax(scores) · V` and the natural-log LSE of each row.
pub fn forward(
    dims: &Dims,
    options: &ReferenceOptions,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> ReferenceForward {
    check_lengths(dims, q, k, v);
    let Dims {
        seq_q,
        seq_kv,
        dim_v,
        ..
    } = *dims;
    let mut out = vec![0.0; dims.o_len()];
    let mut lse = vec![0.0; dims.lse_len()];
    for b in 0..dims.batch {
        for h in 0..dims.heads_q {
            let hk = h / dims.group();
            let scores = head_scores(dims, options, q, k, b, h);
            let (p, row_lse) = softmax_rows(&scores.logits, seq_q, seq_kv);
            for i in 0..seq_q {
                let row = (b * dims.heads_q + h) * seq_q + i;
                lse[row] = row_lse[i];
                for j in 0..seq_kv {
                    let pij = p[i * seq_kv + j] * dropout_factor(options, b, h, i, j);
                    if pij == 0.0 {
                        continue;
                    }
                    let vj = &v[((b * dims.heads_kv + hk) * seq_kv + j) * dim_v..][..dim_v];
                    for (o, vv) in out[row * dim_v..][..dim_v].iter_mut().zip(vj) {
                        *o += pij * vv;
                    }
                }
            }
        }
    }
    ReferenceForward { out, lse }
}

/// Attention backward: gradients of `Σ O ⊙ dO` with respect to Q, K, V (and the bias).
pub fn backward(
    dims: &Dims,
    options: &ReferenceOptions,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_out: &[f64],
) -> ReferenceBackward {
    check_lengths(dims, q, k, v);
    assert_eq!(d_out.len(), dims.o_len(), "d_out length");
    let Dims {
        seq_q,
        seq_kv,
        dim_qk,
        dim_v,
        ..
    } = *dims;
    let mut dq = vec![0.0; dims.q_len()];
    let mut dk = vec![0.0; dims.k_len()];
    let mut dv = vec![0.0; dims.v_len()];
    let mut d_bias = options.bias.as_ref().map(|b| vec![0.0; b.data.len()]);
    let mut d_params = options.score_fn.as_ref().map(|f| vec![0.0; f.params_len]);
    for b in 0..dims.batch {
        for h in 0..dims.heads_q {
            let hk = h / dims.group();
            let scores = head_scores(dims, options, q, k, b, h);
            let (p, _) = softmax_rows(&scores.logits, seq_q, seq_kv);
            for i in 0..seq_q {
                let row = (b * dims.heads_q + h) * seq_q + i;
                let doi = &d_out[row * dim_v..][..dim_v];
                // dP through the dropout: dPz = (dO · Vᵀ) ⊙ Z.
                let dpz: Vec<f64> = (0..seq_kv)
                    .map(|j| {
                        let vj = &v[((b * dims.heads_kv + hk) * seq_kv + j) * dim_v..][..dim_v];
                        let dot: f64 = doi.iter().zip(vj).map(|(a, b)| a * b).sum();
                        dot * dropout_factor(options, b, h, i, j)
                    })
                    .collect();
                let pi = &p[i * seq_kv..][..seq_kv];
                let d_row: f64 = pi.iter().zip(&dpz).map(|(a, b)| a * b).sum();
                for j in 0..seq_kv {
                    let pij = pi[j];
                    let kv_row = (b * dims.heads_kv + hk) * seq_kv + j;
                    // dV_j += P̃_ij · dO_i, P̃ the dropped-out probabilities.
                    let pz = pij * dropout_factor(options, b, h, i, j);
                    for (dvv, g) in dv[kv_row * dim_v..][..dim_v].iter_mut().zip(doi) {
                        *dvv += pz * g;
                    }
                    // Softmax backward: dLogit = P ⊙ (dPz − rowsum(P ⊙ dPz)), then through
                    // the score function.
                    let mut dlogit = pij * (dpz[j] - d_row);
                    if let (Some(dp), Some(f)) = (d_params.as_mut(), &options.score_fn) {
                        if dlogit != 0.0 {
                            (f.params_grad)(
                                dlogit,
                                scores.unmodded[i * seq_kv + j],
                                [b, h, i, j],
                                dp,
                            );
                        }
                    }
                    if dlogit != 0.0 {
                        dlogit *= scores.dlogit_dunmodded[i * seq_kv + j];
                    }
                    if let (Some(db), Some(bias)) = (d_bias.as_mut(), options.bias.as_ref()) {
                        db[bias.index(b, h, i, j)] += dlogit;
                    }
                    let dqk = dlogit * scores.dlogit_dqk[i * seq_kv + j];
                    if dqk == 0.0 {
                        continue;
                    }
                    for c in 0..dim_qk {
                        dq[row * dim_qk + c] += dqk * k[kv_row * dim_qk + c];
                        dk[kv_row * dim_qk + c] += dqk * q[row * dim_qk + c];
                    }
                }
            }
        }
    }
    ReferenceBackward {
        dq,
        dk,
        dv,
        d_bias,
        d_score_params: d_params,
    }
}

fn check_lengths(dims: &Dims, q: &[f64], k: &[f64], v: &[f64]) {
    assert_eq!(q.len(), dims.q_len(), "q length for {dims:?}");
    assert_eq!(k.len(), dims.k_len(), "k length for {dims:?}");
    assert_eq!(v.len(), dims.v_len(), "v length for {dims:?}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn randn(rng: &mut StdRng, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    fn dims() -> Dims {
        Dims {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            seq_q: 5,
            seq_kv: 7,
            dim_qk: 6,
            dim_v: 3,
        }
    }

    /// The parameters of [`score_fn`] for `dims`.
    fn score_params(rng: &mut StdRng, dims: &Dims) -> Vec<f64> {
        let mut params = vec![2.5];
        params.extend(randn(rng, dims.heads_q * 5).iter().map(|x| 0.3 * x));
        params
    }

    /// Every option at once, so the finite differences exercise every branch.
    fn all_options(rng: &mut StdRng, dims: &Dims, params: &[f64]) -> ReferenceOptions {
        let n = dims.batch * dims.heads_q * dims.seq_q * dims.seq_kv;
        ReferenceOptions {
            scale: Some(0.7),
            mask: MaskSpec {
                causal: true,
                window_left: Some(4),
                window_right: None,
            },
            softcap: Some(1.5),
            bool_mask: Some(Broadcast4 {
                data: (0..dims.heads_q * dims.seq_q * dims.seq_kv)
                    .map(|_| rng.random_bool(0.15))
                    .collect(),
                shape: [1, dims.heads_q, dims.seq_q, dims.seq_kv],
            }),
            bias: Some(Broadcast4 {
                data: randn(rng, dims.batch * dims.seq_q * dims.seq_kv),
                shape: [dims.batch, 1, dims.seq_q, dims.seq_kv],
            }),
            alibi_slopes: Some((0..dims.heads_q).map(|h| 0.1 * (h + 1) as f64).collect()),
            dropout: Some(Dropout {
                keep: Broadcast4 {
                    data: (0..n).map(|_| rng.random_bool(0.8)).collect(),
                    shape: [dims.batch, dims.heads_q, dims.seq_q, dims.seq_kv],
                },
                p: 0.2,
            }),
            score_fn: Some(score_fn(params.to_vec())),
        }
    }

    /// A score function with parameters `[c, table[h_q][5]]`: `c · tanh((x + table[h][clip(j
    /// − i)]) / c)`, hiding scores where `(i + j) % 7 = 3`.
    fn score_fn(params: Vec<f64>) -> HostScoreFn {
        let cell = |[_, h, i, j]: At| 1 + h * 5 + (j as i64 - i as i64).clamp(-2, 2) as usize + 2;
        let inner = {
            let params = params.clone();
            move |x: f64, at: At| (x + params[cell(at)]) / params[0]
        };
        let (p1, i1, i2, i3) = (params.clone(), inner.clone(), inner.clone(), inner);
        HostScoreFn {
            score: Arc::new(move |x, at| p1[0] * i1(x, at).tanh()),
            grad: Arc::new(move |x, at| 1.0 - i2(x, at).tanh().powi(2)),
            visible: Arc::new(|[_, _, i, j]| (i + j) % 7 != 3),
            params_grad: Arc::new(move |g, x, at, out| {
                let u = i3(x, at);
                let t = u.tanh();
                out[0] += g * (t - u * (1.0 - t * t));
                out[cell(at)] += g * (1.0 - t * t);
            }),
            params_len: params.len(),
        }
    }

    fn loss(dims: &Dims, o: &ReferenceOptions, q: &[f64], k: &[f64], v: &[f64], g: &[f64]) -> f64 {
        forward(dims, o, q, k, v)
            .out
            .iter()
            .zip(g)
            .map(|(a, b)| a * b)
            .sum()
    }

    fn check_grad(name: &str, analytic: &[f64], mut numeric: impl FnMut(usize) -> f64) {
        for (i, &a) in analytic.iter().enumerate() {
            let n = numeric(i);
            assert!(
                (a - n).abs() <= 1e-6 * (1.0 + n.abs()),
                "{name}[{i}]: analytic {a} vs finite difference {n}"
            );
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let seed = 7;
        let mut rng = StdRng::seed_from_u64(seed);
        let dims = dims();
        let params = score_params(&mut rng, &dims);
        let options = all_options(&mut rng, &dims, &params);
        let (q, k, v) = (
            randn(&mut rng, dims.q_len()),
            randn(&mut rng, dims.k_len()),
            randn(&mut rng, dims.v_len()),
        );
        let g = randn(&mut rng, dims.o_len());
        let grads = backward(&dims, &options, &q, &k, &v, &g);
        let eps = 1e-6;
        let central = |f: &dyn Fn(f64) -> f64| (f(eps) - f(-eps)) / (2.0 * eps);
        check_grad("dq", &grads.dq, |i| {
            central(&|e| {
                let mut q = q.clone();
                q[i] += e;
                loss(&dims, &options, &q, &k, &v, &g)
            })
        });
        check_grad("dk", &grads.dk, |i| {
            central(&|e| {
                let mut k = k.clone();
                k[i] += e;
                loss(&dims, &options, &q, &k, &v, &g)
            })
        });
        check_grad("dv", &grads.dv, |i| {
            central(&|e| {
                let mut v = v.clone();
                v[i] += e;
                loss(&dims, &options, &q, &k, &v, &g)
            })
        });
        let d_params = grads.d_score_params.expect("the score function's gradient");
        check_grad("d_score_params", &d_params, |i| {
            central(&|e| {
                let mut p = params.clone();
                p[i] += e;
                let o = ReferenceOptions {
                    score_fn: Some(score_fn(p)),
                    ..options.clone()
                };
                loss(&dims, &o, &q, &k, &v, &g)
            })
        });
        let d_bias = grads.d_bias.expect("bias gradient");
        check_grad("d_bias", &d_bias, |i| {
            central(&|e| {
                let mut o = options.clone();
                o.bias.as_mut().unwrap().data[i] += e;
                loss(&dims, &o, &q, &k, &v, &g)
            })
        });
    }

    #[test]
    fn fully_masked_rows_give_zero_and_negative_infinity() {
        // s_q > s_kv with causal: the first s_q − s_kv rows see no key (bottom-right).
        let dims = Dims {
            seq_q: 6,
            seq_kv: 3,
            ..dims()
        };
        let mut rng = StdRng::seed_from_u64(3);
        let options = ReferenceOptions {
            mask: MaskSpec::causal(),
            ..Default::default()
        };
        let (q, k, v) = (
            randn(&mut rng, dims.q_len()),
            randn(&mut rng, dims.k_len()),
            randn(&mut rng, dims.v_len()),
        );
        let f = forward(&dims, &options, &q, &k, &v);
        for row in 0..dims.lse_len() {
            let i = row % dims.seq_q;
            let o = &f.out[row * dims.dim_v..][..dims.dim_v];
            if i < 3 {
                assert_eq!(f.lse[row], f64::NEG_INFINITY, "row {row}");
                assert!(o.iter().all(|&x| x == 0.0), "row {row}: {o:?}");
            } else {
                assert!(f.lse[row].is_finite(), "row {row}");
            }
        }
        let g = randn(&mut rng, dims.o_len());
        let grads = backward(&dims, &options, &q, &k, &v, &g);
        assert!(
            grads
                .dq
                .iter()
                .chain(&grads.dk)
                .chain(&grads.dv)
                .all(|x| x.is_finite())
        );
    }

    #[test]
    fn uniform_keys_average_the_values() {
        // Identical keys make every probability 1/s_kv: O is the mean of V.
        let dims = Dims {
            batch: 1,
            heads_q: 1,
            heads_kv: 1,
            seq_q: 2,
            seq_kv: 4,
            dim_qk: 2,
            dim_v: 1,
        };
        let q = vec![0.3, -0.2, 1.0, 2.0];
        let k = vec![0.5; 8];
        let v = vec![1.0, 2.0, 3.0, 6.0];
        let f = forward(&dims, &ReferenceOptions::default(), &q, &k, &v);
        for o in &f.out {
            assert!((o - 3.0).abs() < 1e-12, "{o}");
        }
    }
}
