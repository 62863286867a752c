//! Serving kernels (KV-cache decode: contiguous and paged caches, appends in place, split
//! key ranges, score terms) against the f64 oracle, on the device `FLASH_DEVICE` selects.

use std::sync::Arc;

use burn_flash_attention::kernels::{
    AttentionOptions, DeviceLimits, DeviceTensor, FlashError, FloatDtype, MaskSpec, ScoreBias,
    decode::{DecodeInputs, DecodeOutput, KvCache, Lengths, Splits, decode},
    reference::{self, At, Broadcast4, Dims, HostScoreFn},
    rotary::Rotary,
    score_mod::{ScoreFn, ScoreMod, ScorePosition},
};
use cubecl::client::Client;
use cubecl::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};

use crate::common::{self, Case, assert_close, download, naive, upload};

/// A decode problem: `s_q` new queries per sequence against a cache of `capacity` positions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Serving {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub s_q: usize,
    pub capacity: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    /// `Some(page_size)`: a paged cache.
    pub page_size: Option<usize>,
    /// Append `s_q` new keys and values before attending.
    pub append: bool,
    pub causal: bool,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: Option<f64>,
    /// ALiBi with the slopes [`alibi_slope`] gives, per sequence and query head.
    pub alibi: bool,
    /// A bias over the cache's positions ([`bias_value`]).
    pub bias: Option<BiasKind>,
    /// The score function [`SequenceBias`].
    pub score_fn: bool,
}

/// The bias of a test: `[batch, 1, s_q, capacity]` of values with some −∞, or a key
/// padding mask `[batch, capacity]` (`true` where hidden; a bias of 0 and −∞).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BiasKind {
    Scores,
    Padding,
}

/// The bias of sequence `b`'s query `i` and key position `j`: different in every
/// sequence, query and key, −∞ at some.
fn bias_value(kind: BiasKind, b: usize, i: usize, j: usize, dtype: FloatDtype) -> f64 {
    match kind {
        BiasKind::Scores if (b * 31 + i * 7 + j * 3) % 11 == 0 => f64::NEG_INFINITY,
        BiasKind::Scores => {
            common::round(((b * 13 + i * 5 + j * 17) % 23) as f64 / 11.0 - 1.0, dtype)
        }
        BiasKind::Padding if (b * 5 + j * 3) % 7 == 5 => f64::NEG_INFINITY,
        BiasKind::Padding => 0.0,
    }
}

/// [`bias_value`] of every sequence, query and position, `[batch, 1, s_q | 1, positions]`
/// ([`Serving::positions`]).
fn bias_values(s: &Serving, kind: BiasKind, dtype: FloatDtype) -> Broadcast4<f64> {
    let queries = match kind {
        BiasKind::Scores => s.s_q,
        BiasKind::Padding => 1,
    };
    let mut data = Vec::new();
    for b in 0..s.batch {
        for i in 0..queries {
            data.extend((0..s.positions()).map(|j| bias_value(kind, b, i, j, dtype)));
        }
    }
    Broadcast4 {
        data,
        shape: [s.batch, 1, queries, s.positions()],
    }
}

/// Distances from a query's diagonal are clipped to `±MAX_DISTANCE`.
const MAX_DISTANCE: i32 = 4;
const BUCKETS: usize = 2 * MAX_DISTANCE as usize + 1;

/// A learned bias per sequence, query head and clipped distance from the query's diagonal
/// (`params` `[batch, heads_q · BUCKETS]`) that hides the keys at positions `7n + 3 −
/// batch`: the sequence, head, query, key and both lengths all change what it gives, so a
/// kernel passing a wrong one is caught.
struct SequenceBias;

#[cube]
impl ScoreMod for SequenceBias {
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        let distance = i32::cast_from(at.key + at.seq_q) - i32::cast_from(at.query + at.seq_kv);
        let bucket = clamp(distance, -MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE;
        let cell = at.batch * params.stride(0) + at.head * BUCKETS + usize::cast_from(bucket);
        score + params[cell]
    }
    fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        1.0
    }
    fn params_grad(
        _grad: f32,
        _score: f32,
        _modded: f32,
        _at: &ScorePosition,
        _params: &Tensor<f32>,
        _grads: &mut [Atomic<f32>],
    ) {
    }
    fn visible(at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        (at.key + at.batch) % 7 != 3
    }
}

/// [`SequenceBias`]'s parameters, `[batch, heads_q · BUCKETS]` (exact in f32).
fn sequence_bias_params(s: &Serving) -> Vec<f64> {
    (0..s.batch * s.heads_q * BUCKETS)
        .map(|n| ((n * 37) % 19) as f64 / 8.0 - 1.0)
        .collect()
}

/// [`SequenceBias`] on the host for sequence `seq` of `seq_kv` keys, which the oracle sees
/// as batch 0.
fn host_sequence_bias(s: &Serving, seq: usize, seq_kv: usize) -> HostScoreFn {
    let params = sequence_bias_params(s);
    let (heads_q, seq_q) = (s.heads_q, s.s_q);
    let cell = move |[_, h, i, j]: At| {
        let distance = (j + seq_q) as i64 - (i + seq_kv) as i64;
        let max = MAX_DISTANCE as i64;
        let bucket = distance.clamp(-max, max) + max;
        (seq * heads_q + h) * BUCKETS + bucket as usize
    };
    HostScoreFn {
        score: Arc::new(move |x, at| x + params[cell(at)]),
        grad: Arc::new(|_, _| 1.0),
        visible: Arc::new(move |[_, _, _, j]| (j + seq) % 7 != 3),
        params_grad: Arc::new(|_, _, _, _| {}),
        params_len: 0,
    }
}

/// The ALiBi slope of sequence `b`'s query head `h` in the tests: a different one for each
/// head and sequence, so a kernel reading another row's slope is caught.
fn alibi_slope(b: usize, h: usize) -> f64 {
    0.03 * (h + 1) as f64 + 0.01 * b as f64
}

impl Serving {
    pub(crate) fn s_new(&self) -> usize {
        if self.append { self.s_q } else { 0 }
    }

    fn options(&self) -> AttentionOptions {
        AttentionOptions {
            mask: self.mask(),
            softcap: self.softcap.map(|c| c as f32),
            ..Default::default()
        }
    }

    fn mask(&self) -> MaskSpec {
        MaskSpec {
            causal: self.causal,
            window_left: self.window.0,
            window_right: self.window.1,
        }
    }

    fn max_pages(&self) -> usize {
        self.page_size.map_or(0, |p| self.capacity.div_ceil(p))
    }

    /// The key positions a bias over the cache spans: its capacity, or all the positions
    /// of a sequence's pages (`max_pages · page_size`).
    fn positions(&self) -> usize {
        self.page_size
            .map_or(self.capacity, |p| self.max_pages() * p)
    }
}

/// The cache's logical content, `[batch, heads_kv, capacity, d]`: NaN past each sequence's
/// length, so that a kernel reading past it shows.
#[derive(Clone, Debug, PartialEq)]
struct Contents {
    k: Vec<f64>,
    v: Vec<f64>,
}

/// Everything a decode call reads.
struct Data {
    q: Vec<f64>,
    lengths: Vec<usize>,
    contents: Contents,
    new_k: Vec<f64>,
    new_v: Vec<f64>,
    /// Page of each `page_size` positions of each sequence (`-1` where unused).
    table: Vec<i32>,
    pages: usize,
}

fn data(s: &Serving, dtype: FloatDtype, lengths: Vec<usize>, rng: &mut StdRng) -> Data {
    let (b, hq, hkv, cap) = (s.batch, s.heads_q, s.heads_kv, s.capacity);
    // Drawn in an order that does not depend on the page size (the page shuffle last).
    let q = common::randn(rng, b * hq * s.s_q * s.dim_qk, dtype);
    let new_k = common::randn(rng, b * hkv * s.s_new() * s.dim_qk, dtype);
    let new_v = common::randn(rng, b * hkv * s.s_new() * s.dim_v, dtype);
    let mut contents = Contents {
        k: vec![f64::NAN; b * hkv * cap * s.dim_qk],
        v: vec![f64::NAN; b * hkv * cap * s.dim_v],
    };
    for (cache, dim) in [(&mut contents.k, s.dim_qk), (&mut contents.v, s.dim_v)] {
        for (n, x) in cache.iter_mut().enumerate() {
            if (n / dim) % cap < lengths[n / (dim * cap * hkv)] {
                *x = common::round(rng.sample(rand_distr::StandardNormal), dtype);
            }
        }
    }
    // Pages of all sequences drawn from a shuffled pool with spares; unused entries -1.
    let max_pages = s.max_pages();
    let pages = b * max_pages + 3;
    let mut pool: Vec<i32> = (0..pages as i32).collect();
    pool.shuffle(rng);
    let mut table = vec![-1; b * max_pages];
    if let Some(page_size) = s.page_size {
        for seq in 0..b {
            let used = (lengths[seq] + s.s_new()).div_ceil(page_size);
            for p in 0..used {
                table[seq * max_pages + p] = pool[seq * max_pages + p];
            }
        }
    }
    Data {
        q,
        new_k,
        new_v,
        lengths,
        contents,
        table,
        pages,
    }
}

/// The cache on the device: contiguous `[b, h_kv, capacity, d]` or pages `[pages,
/// page_size, h_kv, d]` (spare pages NaN).
fn upload_cache(
    client: &Client,
    s: &Serving,
    d: &Data,
    dtype: FloatDtype,
) -> (DeviceTensor, DeviceTensor, Option<DeviceTensor>) {
    let (b, hkv, cap) = (s.batch, s.heads_kv, s.capacity);
    let Some(page_size) = s.page_size else {
        return (
            upload(client, &d.contents.k, &[b, hkv, cap, s.dim_qk], dtype),
            upload(client, &d.contents.v, &[b, hkv, cap, s.dim_v], dtype),
            None,
        );
    };
    let max_pages = s.max_pages();
    let paged = |logical: &[f64], dim: usize| {
        let mut pages = vec![f64::NAN; d.pages * page_size * hkv * dim];
        for seq in 0..b {
            for (p, &page) in d.table[seq * max_pages..][..max_pages].iter().enumerate() {
                if page < 0 || page as usize >= d.pages {
                    continue;
                }
                for row in 0..page_size {
                    let pos = p * page_size + row;
                    for h in 0..hkv {
                        if pos >= cap {
                            continue;
                        }
                        let from = ((seq * hkv + h) * cap + pos) * dim;
                        let to = ((page as usize * page_size + row) * hkv + h) * dim;
                        pages[to..to + dim].copy_from_slice(&logical[from..from + dim]);
                    }
                }
            }
        }
        upload(client, &pages, &[d.pages, page_size, hkv, dim], dtype)
    };
    let table = DeviceTensor::from_bytes(
        client,
        &[b, max_pages],
        &d.table
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    (
        paged(&d.contents.k, s.dim_qk),
        paged(&d.contents.v, s.dim_v),
        Some(table),
    )
}

/// The cache's logical content, read back.
fn download_cache(
    client: &Client,
    s: &Serving,
    d: &Data,
    k: &DeviceTensor,
    v: &DeviceTensor,
    dtype: FloatDtype,
) -> Contents {
    let (b, hkv, cap) = (s.batch, s.heads_kv, s.capacity);
    let (k, v) = (download(client, k, dtype), download(client, v, dtype));
    let Some(page_size) = s.page_size else {
        return Contents { k, v };
    };
    let max_pages = s.max_pages();
    let logical = |pages: &[f64], dim: usize| {
        let mut out = vec![f64::NAN; b * hkv * cap * dim];
        for seq in 0..b {
            for h in 0..hkv {
                for pos in 0..cap {
                    let page = d.table[seq * max_pages + pos / page_size];
                    if page < 0 || page as usize >= d.pages {
                        continue;
                    }
                    let from = ((page as usize * page_size + pos % page_size) * hkv + h) * dim;
                    let to = ((seq * hkv + h) * cap + pos) * dim;
                    out[to..to + dim].copy_from_slice(&pages[from..from + dim]);
                }
            }
        }
        out
    };
    Contents {
        k: logical(&k, s.dim_qk),
        v: logical(&v, s.dim_v),
    }
}

fn lengths_upload(client: &Client, lengths: &[usize]) -> DeviceTensor {
    let bytes: Vec<u8> = lengths
        .iter()
        .flat_map(|&l| (l as i32).to_le_bytes())
        .collect();
    DeviceTensor::from_bytes(client, &[lengths.len()], &bytes)
}

/// Runs one decode call; returns its output and the cache read back.
fn run(
    client: &Client,
    s: &Serving,
    d: &Data,
    dtype: FloatDtype,
    splits: Splits,
    lengths: Lengths,
) -> (Result<DecodeOutput, FlashError>, Contents) {
    run_turned(client, s, d, dtype, splits, lengths, None)
}

/// [`run`] with the new queries and keys turned by `rope`.
fn run_turned(
    client: &Client,
    s: &Serving,
    d: &Data,
    dtype: FloatDtype,
    splits: Splits,
    lengths: Lengths,
    rope: Option<&Rope>,
) -> (Result<DecodeOutput, FlashError>, Contents) {
    let q = upload(client, &d.q, &[s.batch, s.heads_q, s.s_q, s.dim_qk], dtype);
    let (k, v, table) = upload_cache(client, s, d, dtype);
    let new_k = upload(
        client,
        &d.new_k,
        &[s.batch, s.heads_kv, s.s_new(), s.dim_qk],
        dtype,
    );
    let new_v = upload(
        client,
        &d.new_v,
        &[s.batch, s.heads_kv, s.s_new(), s.dim_v],
        dtype,
    );
    let seqlens = lengths_upload(client, &d.lengths);
    let tables = rope.map(|rope| {
        let shape = [rope.positions, rope.dim / 2];
        (
            upload(client, &rope.cos, &shape, dtype),
            upload(client, &rope.sin, &shape, dtype),
            rope.interleaved,
        )
    });
    let slopes: Vec<f64> = (0..s.batch * s.heads_q)
        .map(|n| alibi_slope(n / s.heads_q, n % s.heads_q))
        .collect();
    let slopes = upload(client, &slopes, &[s.batch, s.heads_q], FloatDtype::F32);
    let bias = s.bias.map(|kind| {
        let bias = bias_values(s, kind, dtype);
        upload(client, &bias.data, &bias.shape, dtype)
    });
    let params = s.score_fn.then(|| {
        let shape = [s.batch, s.heads_q * BUCKETS];
        upload(client, &sequence_bias_params(s), &shape, FloatDtype::F32)
    });
    let inputs = DecodeInputs {
        q: &q,
        cache: KvCache {
            k: &k,
            v: &v,
            block_table: table.as_ref(),
        },
        cache_seqlens: &seqlens,
        new: s.append.then_some((&new_k, &new_v)),
        lengths,
        rotary: tables.as_ref().map(|(cos, sin, interleaved)| Rotary {
            cos,
            sin,
            interleaved: *interleaved,
        }),
        terms: ScoreBias {
            bias: bias.as_ref(),
            alibi_slopes: s.alibi.then_some(&slopes),
            score_mod: s.score_fn.then(ScoreFn::of::<SequenceBias>),
            score_params: params.as_ref(),
            ..ScoreBias::none()
        },
    };
    let result = decode(client, inputs, dtype, s.options(), splits);
    let contents = download_cache(client, s, d, &k, &v, dtype);
    (result, contents)
}

/// The cache content after the append.
fn appended(s: &Serving, d: &Data) -> Contents {
    let mut c = d.contents.clone();
    let (hkv, cap, n) = (s.heads_kv, s.capacity, s.s_new());
    for (cache, new, dim) in [
        (&mut c.k, &d.new_k, s.dim_qk),
        (&mut c.v, &d.new_v, s.dim_v),
    ] {
        for seq in 0..s.batch {
            for h in 0..hkv {
                for i in 0..n {
                    let to = ((seq * hkv + h) * cap + d.lengths[seq] + i) * dim;
                    let from = ((seq * hkv + h) * n + i) * dim;
                    cache[to..to + dim].copy_from_slice(&new[from..from + dim]);
                }
            }
        }
    }
    c
}

/// Equal, NaN equal to NaN.
fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x == y || (x.is_nan() && y.is_nan()))
}

/// Checks the outputs `out` `[b, h_q, s_q, d_v]` and `lse` `[b, h_q, s_q]` of a call on the
/// sequences of `s` against the oracle: `q` the queries of every sequence, `k_of(seq)` /
/// `v_of(seq)` a sequence's keys and values `[h_kv, seq_kv, d]` as attended. Rows that see
/// no key must give O = 0 and LSE = −∞ exactly.
#[allow(clippy::too_many_arguments)]
fn check_sequences(
    s: &Serving,
    dtype: FloatDtype,
    q: &[f64],
    k_of: impl Fn(usize) -> Vec<f64>,
    v_of: impl Fn(usize) -> Vec<f64>,
    out: &[f64],
    lse: Option<&[f64]>,
    context: &str,
) {
    for seq in 0..s.batch {
        let (k, v) = (k_of(seq), v_of(seq));
        let dims = Dims {
            batch: 1,
            heads_q: s.heads_q,
            heads_kv: s.heads_kv,
            seq_q: s.s_q,
            seq_kv: k.len() / (s.heads_kv * s.dim_qk),
            dim_qk: s.dim_qk,
            dim_v: s.dim_v,
        };
        let q = &q[seq * dims.q_len()..][..dims.q_len()];
        let case = Case {
            causal: s.causal,
            window: s.window,
            softcap: s.softcap,
            ..common::case(dims)
        };
        let slopes: Vec<f64> = (0..s.heads_q).map(|h| alibi_slope(seq, h)).collect();
        // The sequence's bias: its row, over its keys.
        let bias = s.bias.map(|kind| {
            let queries = if kind == BiasKind::Scores { s.s_q } else { 1 };
            let data = (0..queries)
                .flat_map(|i| (0..dims.seq_kv).map(move |j| bias_value(kind, seq, i, j, dtype)))
                .collect();
            Broadcast4 {
                data,
                shape: [1, 1, queries, dims.seq_kv],
            }
        });
        let score_fn = s.score_fn.then(|| host_sequence_bias(s, seq, dims.seq_kv));
        let options = reference::ReferenceOptions {
            alibi_slopes: s.alibi.then(|| slopes.clone()),
            bias: bias.clone(),
            score_fn: score_fn.clone(),
            ..case.reference_options()
        };
        let want = reference::forward(&dims, &options, q, &k, &v);
        let terms = |_: usize, h: usize, i: usize, j: usize| {
            let mut term = 0.0;
            if s.alibi {
                let diagonal = i as f64 + dims.seq_kv as f64 - dims.seq_q as f64;
                term -= slopes[h] * (diagonal - j as f64).abs();
            }
            if let Some(kind) = s.bias {
                term += bias_value(kind, seq, i, j, dtype);
            }
            term
        };
        let zeros = vec![0.0; dims.o_len()];
        let low = naive::attention_with_score_fn(
            &case,
            dtype,
            [q, &k, &v, &zeros],
            &terms,
            score_fn.as_ref(),
        );
        let got_out = &out[seq * dims.o_len()..][..dims.o_len()];
        let context = format!("sequence {seq} — {context}");
        assert_close(dtype, "O", got_out, &want.out, &low.out, 2e-5, &context);
        let Some(lse) = lse else {
            continue;
        };
        let got_lse = &lse[seq * dims.lse_len()..][..dims.lse_len()];
        assert_close(
            FloatDtype::F32,
            "LSE",
            got_lse,
            &want.lse,
            &low.lse,
            2e-5,
            &context,
        );
        for (row, &l) in want.lse.iter().enumerate() {
            if l == f64::NEG_INFINITY {
                assert_eq!(
                    got_lse[row],
                    f64::NEG_INFINITY,
                    "LSE of row {row} — {context}"
                );
                let o = &got_out[row * s.dim_v..][..s.dim_v];
                assert!(
                    o.iter().all(|&x| x == 0.0),
                    "O of row {row}: {o:?} — {context}"
                );
            }
        }
    }
}

/// A sequence's first `len` positions of a logical cache `[b, h_kv, capacity, dim]`.
fn positions(s: &Serving, cache: &[f64], seq: usize, len: usize, dim: usize) -> Vec<f64> {
    let (hkv, cap) = (s.heads_kv, s.capacity);
    (0..hkv)
        .flat_map(|h| cache[(seq * hkv + h) * cap * dim..][..len * dim].to_vec())
        .collect()
}

/// Checks one decode call against the oracle, sequence by sequence, and the cache against
/// the expected append.
fn check(client: &Client, s: &Serving, dtype: FloatDtype, lengths: Vec<usize>, splits: Splits) {
    if let Err(e) = check_seeded(client, s, dtype, lengths, splits, common::rng()) {
        panic!("decode refused {s:?} in {dtype:?}: {e}");
    }
}

/// [`check`] on the inputs `seed` draws from `rng`; `Err` where the device refuses the
/// problem (`FlashError::Unavailable`), before anything is written.
pub(crate) fn check_seeded(
    client: &Client,
    s: &Serving,
    dtype: FloatDtype,
    lengths: Vec<usize>,
    splits: Splits,
    (seed, mut rng): (u64, StdRng),
) -> Result<(), FlashError> {
    let d = data(s, dtype, lengths, &mut rng);
    let context = format!(
        "{s:?} {dtype:?} {splits:?} lengths {:?}, seed {seed}",
        d.lengths
    );
    // The lengths read back, and (split in three) as the host knows them.
    let lengths = match splits {
        Splits::Exactly(3) => Lengths::Known(&d.lengths),
        _ => Lengths::ReadBack,
    };
    let (result, contents) = run(client, s, &d, dtype, splits, lengths);
    let result = match result {
        Err(e @ FlashError::Unavailable(_)) => return Err(e),
        other => other.unwrap_or_else(|e| panic!("decode: {e} — {context}")),
    };
    let after = appended(s, &d);
    assert!(
        same(&contents.k, &after.k) && same(&contents.v, &after.v),
        "the cache after the call is not the cache with the new keys appended — {context}"
    );
    let out = download(client, &result.out, dtype);
    let lse = download(client, &result.lse, FloatDtype::F32);

    let len = |seq: usize| d.lengths[seq] + s.s_new();
    check_sequences(
        s,
        dtype,
        &d.q,
        |seq| positions(s, &after.k, seq, len(seq), s.dim_qk),
        |seq| positions(s, &after.v, seq, len(seq), s.dim_v),
        &out,
        Some(&lse),
        &context,
    );
    eprintln!(
        "decode {s:?} {dtype:?} {splits:?} (ran {} splits): ok",
        result.splits
    );
    Ok(())
}

/// Lengths that include an empty sequence, a single position and a full cache.
fn edge_lengths(s: &Serving, rng: &mut StdRng) -> Vec<usize> {
    let most = s.capacity - s.s_new();
    (0..s.batch)
        .map(|b| match b {
            0 => most,
            1 => 0,
            2 => 1,
            _ => rng.random_range(0..=most),
        })
        .collect()
}

const fn serving(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    s_q: usize,
    capacity: usize,
    dim: usize,
) -> Serving {
    Serving {
        batch,
        heads_q,
        heads_kv,
        s_q,
        capacity,
        dim_qk: dim,
        dim_v: dim,
        page_size: None,
        append: true,
        causal: false,
        window: (None, None),
        softcap: None,
        alibi: false,
        bias: None,
        score_fn: false,
    }
}

#[test]
fn decode_matches_the_oracle() {
    let client = common::client();
    let (_, mut rng) = common::rng();
    let problems = [
        // GQA 4:2, one new token, contiguous.
        serving(4, 4, 2, 1, 70, 64),
        // Several new tokens, causal (bottom-right), softcap, paged by 3, d_v ≠ d_qk.
        Serving {
            dim_v: 24,
            page_size: Some(3),
            causal: true,
            softcap: Some(5.0),
            ..serving(3, 3, 3, 5, 40, 40)
        },
        // MQA 8:1 without an append, sliding window, pages of one position, d = 72.
        Serving {
            page_size: Some(1),
            append: false,
            window: (Some(6), Some(0)),
            ..serving(3, 8, 1, 3, 33, 72)
        },
        // Pages of 16, GQA 6:2, 7 new tokens, causal.
        Serving {
            page_size: Some(16),
            causal: true,
            ..serving(3, 6, 2, 7, 50, 64)
        },
        // Window, softcap and ALiBi at d = 128, pages of 8, MQA 8:1 with 2 new tokens: on
        // GPUs two blocks of packed rows, several steps of the vector-load kernel.
        Serving {
            page_size: Some(8),
            window: (Some(9), Some(0)),
            softcap: Some(8.0),
            alibi: true,
            ..serving(3, 8, 1, 2, 60, 128)
        },
        // One page of 256 positions per sequence.
        Serving {
            page_size: Some(256),
            ..serving(2, 2, 1, 1, 256, 32)
        },
        // MQA 8:1 with 3 new tokens, causal, ALiBi: 24 packed rows, on tensor cores a full
        // tile and a partial one.
        Serving {
            causal: true,
            alibi: true,
            ..serving(3, 8, 1, 3, 70, 128)
        },
        // d = 256, pages of 16, softcap.
        Serving {
            page_size: Some(16),
            softcap: Some(6.0),
            ..serving(3, 4, 2, 1, 45, 256)
        },
    ];
    for (n, s) in problems.iter().enumerate() {
        let dtypes = common::dtypes(&client);
        let dtypes = if n == 0 {
            dtypes
        } else {
            vec![dtypes[dtypes.len() - 1]]
        };
        for dtype in dtypes {
            for splits in [Splits::Auto, Splits::Exactly(1), Splits::Exactly(3)] {
                let lengths = edge_lengths(s, &mut rng);
                check(&client, s, dtype, lengths, splits);
            }
        }
    }
}

/// Score terms in decode: a bias over the cache's positions (values with −∞, or a key
/// padding mask), ALiBi and a score function reading every part of its position, on a
/// tensor-core tile with a partial second one (MQA 8:1, 3 new tokens) and a GQA problem
/// with a window; split and unsplit, lengths from empty to full (the padding mask hides the
/// one key of sequence 1, which then gives O = 0 and LSE = −∞).
#[test]
fn decode_adds_score_terms() {
    let client = common::client();
    let (_, mut rng) = common::rng();
    let problems = [
        Serving {
            page_size: Some(8),
            causal: true,
            alibi: true,
            bias: Some(BiasKind::Scores),
            score_fn: true,
            ..serving(3, 8, 1, 3, 40, 128)
        },
        Serving {
            window: (Some(5), Some(0)),
            bias: Some(BiasKind::Padding),
            score_fn: true,
            ..serving(4, 4, 2, 1, 37, 64)
        },
    ];
    let dtype = *common::dtypes(&client).last().unwrap();
    for s in &problems {
        for splits in [Splits::Auto, Splits::Exactly(3)] {
            let lengths = edge_lengths(s, &mut rng);
            check(&client, s, dtype, lengths, splits);
        }
    }
}

/// Many parts to merge: 100 splits of caches up to 1200 keys, so the merge takes its parts
/// in several rounds and rescales between them, while shorter sequences leave most parts
/// empty (LSE −∞) and an empty sequence all of them.
#[test]
fn many_splits_merge_in_rounds() {
    let client = common::client();
    let (_, mut rng) = common::rng();
    let s = Serving {
        causal: true,
        ..serving(4, 4, 2, 1, 1200, 64)
    };
    for dtype in common::dtypes(&client) {
        let lengths = edge_lengths(&s, &mut rng);
        check(&client, &s, dtype, lengths, Splits::Exactly(100));
    }
}

/// A batch of more (sequence, K/V head) pairs than one grid dimension holds (65 535): the
/// decode, append and merge launches spread them over two. Every sequence, on both sides of
/// the first dimension's end, matches the oracle and has its new key appended (paged, two
/// splits merged).
#[test]
fn batches_past_one_grid_dimension_decode() {
    let client = common::client();
    let (_, mut rng) = common::rng();
    // 65 600 sequences of one K/V head (two query heads packed in one row block).
    let s = Serving {
        page_size: Some(2),
        causal: true,
        ..serving(65_600, 2, 1, 1, 4, 8)
    };
    let dtypes = common::dtypes(&client);
    // On a CPU driver the first dtype alone (the kernel is the same for every dtype there).
    let dtypes = if common::is_cpu_device() {
        &dtypes[..1]
    } else {
        &dtypes[..]
    };
    for &dtype in dtypes {
        let lengths = edge_lengths(&s, &mut rng);
        check(&client, &s, dtype, lengths, Splits::Exactly(2));
    }
}

#[test]
fn paged_and_contiguous_caches_give_the_same_bits() {
    let client = common::client();
    let (seed, mut rng) = common::rng();
    let contiguous = Serving {
        causal: true,
        ..serving(3, 4, 2, 2, 45, 64)
    };
    let lengths = edge_lengths(&contiguous, &mut rng);
    let dtypes = common::dtypes(&client);
    for dtype in [FloatDtype::F32, dtypes[dtypes.len() - 1]] {
        same_bits_paged_and_contiguous(&client, &contiguous, dtype, &lengths, seed);
    }
}

/// [`paged_and_contiguous_caches_give_the_same_bits`] in one dtype.
fn same_bits_paged_and_contiguous(
    client: &Client,
    contiguous: &Serving,
    dtype: FloatDtype,
    lengths: &[usize],
    seed: u64,
) {
    let mut outputs = Vec::new();
    for page_size in [None, Some(1), Some(3), Some(16)] {
        let s = Serving {
            page_size,
            ..*contiguous
        };
        let d = data(
            &s,
            dtype,
            lengths.to_vec(),
            &mut StdRng::seed_from_u64(seed),
        );
        let (result, _) = run(client, &s, &d, dtype, Splits::Exactly(2), Lengths::ReadBack);
        let result = result.unwrap_or_else(|e| panic!("decode: {e} — seed {seed}"));
        outputs.push((
            page_size,
            download(client, &result.out, dtype),
            download(client, &result.lse, FloatDtype::F32),
        ));
    }
    for (page_size, out, lse) in &outputs[1..] {
        assert!(
            same(out, &outputs[0].1) && same(lse, &outputs[0].2),
            "{dtype:?}: pages of {page_size:?} differ from the contiguous cache — seed {seed}"
        );
    }
}

#[test]
fn bad_decode_input_is_refused_and_the_cache_left_unchanged() {
    let client = common::client();
    let (seed, mut rng) = common::rng();
    let s = Serving {
        page_size: Some(4),
        ..serving(2, 4, 2, 2, 16, 32)
    };
    let dtype = FloatDtype::F32;
    let expect_refusal = |d: &Data, arg: &str| {
        let (result, contents) = run(&client, &s, d, dtype, Splits::Auto, Lengths::ReadBack);
        let err = result
            .err()
            .unwrap_or_else(|| panic!("{arg}: accepted — seed {seed}"));
        assert!(
            err.to_string().contains(&format!("`{arg}`")),
            "{arg}: {err}"
        );
        // The cache as uploaded, seen through the same block table.
        let (k, v, _) = upload_cache(&client, &s, d, dtype);
        let before = download_cache(&client, &s, d, &k, &v, dtype);
        assert!(
            same(&contents.k, &before.k) && same(&contents.v, &before.v),
            "{arg}: the cache changed — seed {seed}"
        );
    };
    // An append past the capacity.
    let mut d = data(&s, dtype, vec![14, 3], &mut rng);
    d.lengths[0] = 15;
    expect_refusal(&d, "cache_seqlens");
    // A block-table entry that names no page, in a page the sequence uses.
    let mut d = data(&s, dtype, vec![5, 3], &mut rng);
    d.table[1] = d.pages as i32;
    expect_refusal(&d, "block_table");

    // Shapes: each refused naming its argument.
    let d = data(&s, dtype, vec![5, 3], &mut rng);
    let q = upload(&client, &d.q, &[2, 4, 2, 32], dtype);
    let (k, v, table) = upload_cache(&client, &s, &d, dtype);
    let seqlens = lengths_upload(&client, &[5, 3]);
    let short = lengths_upload(&client, &[5]);
    let v_wrong = upload(&client, &vec![0.0; 2 * 2 * 2 * 32], &[2, 2, 2, 32], dtype);
    let k_wrong = upload(&client, &vec![0.0; 2 * 3 * 2 * 32], &[2, 3, 2, 32], dtype);
    let table = table.unwrap();
    let base = DecodeInputs {
        q: &q,
        cache: KvCache {
            k: &k,
            v: &v,
            block_table: Some(&table),
        },
        cache_seqlens: &seqlens,
        new: None,
        lengths: Lengths::ReadBack,
        rotary: None,
        terms: ScoreBias::none(),
    };
    let bad = [
        (
            "cache_seqlens",
            DecodeInputs {
                cache_seqlens: &short,
                ..base
            },
        ),
        (
            "v_cache",
            DecodeInputs {
                cache: KvCache {
                    v: &v_wrong,
                    ..base.cache
                },
                ..base
            },
        ),
        (
            "k",
            DecodeInputs {
                new: Some((&k_wrong, &v)),
                ..base
            },
        ),
        (
            "block_table",
            DecodeInputs {
                cache: KvCache {
                    block_table: Some(&seqlens),
                    ..base.cache
                },
                ..base
            },
        ),
        (
            // One-dimensional slopes.
            "alibi_slopes",
            DecodeInputs {
                terms: ScoreBias {
                    alibi_slopes: Some(&short),
                    ..ScoreBias::none()
                },
                ..base
            },
        ),
    ];
    for (arg, inputs) in bad {
        let err = decode(&client, inputs, dtype, s.options(), Splits::Auto).unwrap_err();
        assert!(
            err.to_string().contains(&format!("`{arg}`")),
            "{arg}: {err}"
        );
    }
    // Refusals found after the shapes (a strided head dim, a split count of 0) still come
    // before the append: the cache's buffer is untouched.
    let wide = common::randn(&mut rng, 2 * 2 * 16 * 64, dtype);
    let buffer = upload(&client, &wide, &[2, 2, 16, 64], dtype);
    let strided = DeviceTensor {
        shape: vec![2, 2, 16, 32],
        strides: vec![2 * 16 * 64, 16 * 64, 64, 2],
        ..buffer.clone()
    };
    let contiguous = upload(&client, &wide[..2 * 2 * 16 * 32], &[2, 2, 16, 32], dtype);
    let new = upload(&client, &vec![0.0; 2 * 2 * 2 * 32], &[2, 2, 2, 32], dtype);
    for (arg, k, splits) in [
        ("k_cache", &strided, Splits::Auto),
        ("splits", &contiguous, Splits::Exactly(0)),
    ] {
        let before = download(&client, k, dtype);
        let raw = download(&client, &buffer, dtype);
        let inputs = DecodeInputs {
            cache: KvCache {
                k,
                v: &contiguous,
                block_table: None,
            },
            new: Some((&new, &new)),
            ..base
        };
        let err = decode(&client, inputs, dtype, s.options(), splits).unwrap_err();
        assert!(
            err.to_string().contains(&format!("`{arg}`")),
            "{arg}: {err}"
        );
        assert!(
            same(&download(&client, k, dtype), &before)
                && same(&download(&client, &buffer, dtype), &raw),
            "{arg}: the cache changed before the refusal — seed {seed}"
        );
    }
    // The device keeps working.
    decode(&client, base, dtype, s.options(), Splits::Auto).expect("a valid call after refusals");
}

/// The cache is written in place: a call with an append holds only its outputs afterwards
/// (O and the LSE; the split's partial results are freed), never a copy of the cache.
#[test]
fn appends_write_the_cache_in_place() {
    let client = common::client();
    let (_, mut rng) = common::rng();
    let s = serving(2, 4, 2, 1, 512, 64);
    let dtype = FloatDtype::F32;
    let d = data(&s, dtype, vec![100, 300], &mut rng);
    let q = upload(&client, &d.q, &[s.batch, s.heads_q, s.s_q, s.dim_qk], dtype);
    let (k, v, _) = upload_cache(&client, &s, &d, dtype);
    let new_k = upload(
        &client,
        &d.new_k,
        &[s.batch, s.heads_kv, 1, s.dim_qk],
        dtype,
    );
    let new_v = upload(&client, &d.new_v, &[s.batch, s.heads_kv, 1, s.dim_v], dtype);
    let seqlens = lengths_upload(&client, &d.lengths);
    let cache_bytes = (s.batch * s.heads_kv * s.capacity * s.dim_qk * 4) as u64;
    let outputs = (s.batch * s.heads_q * s.dim_v * 4 + s.batch * s.heads_q * 4) as u64;
    for splits in [Splits::Exactly(1), Splits::Exactly(3)] {
        let before = common::bytes_in_use(&client);
        let inputs = DecodeInputs {
            q: &q,
            cache: KvCache {
                k: &k,
                v: &v,
                block_table: None,
            },
            cache_seqlens: &seqlens,
            new: Some((&new_k, &new_v)),
            lengths: Lengths::Known(&d.lengths),
            rotary: None,
            terms: ScoreBias::none(),
        };
        let result = decode(&client, inputs, dtype, s.options(), splits).expect("decode");
        let held = common::bytes_in_use(&client) - before;
        assert!(
            held <= outputs + 2 * 512 && held < cache_bytes,
            "{splits:?}: the call holds {held} bytes; O + LSE are {outputs}, a cache {cache_bytes}"
        );
        eprintln!("{splits:?}: +{held} B held (O + LSE = {outputs} B; one cache {cache_bytes} B)");
        drop(result);
    }
}

/// A decode step captured once as a graph (CubeCL's graph capture: one CUDA graph, or wgpu's
/// recorded dispatches) replays for the steps after it, as a server's decode loop runs
/// without paying the launch path per token: between replays the new queries, keys and
/// values and the grown lengths are written into the captured buffers in place, and each
/// replay appends at the new lengths and attends the longer caches, against the oracle. The
/// key range is split in three (cut in the kernel from the lengths on the device), so the
/// replays also run the merge.
#[test]
fn a_captured_decode_step_replays_for_later_steps() {
    let client = common::client();
    let (seed, mut rng) = common::rng();
    let dtype = *common::dtypes(&client).last().expect("a float dtype");
    let s = Serving {
        causal: true,
        ..serving(2, 8, 2, 1, 300, 64)
    };
    let mut d = data(&s, dtype, vec![7, 200], &mut rng);
    let q = upload(&client, &d.q, &[s.batch, s.heads_q, s.s_q, s.dim_qk], dtype);
    let (k, v, _) = upload_cache(&client, &s, &d, dtype);
    let new_shape = [s.batch, s.heads_kv, s.s_new(), s.dim_qk];
    let new_k = upload(&client, &d.new_k, &new_shape, dtype);
    let new_v = upload(&client, &d.new_v, &new_shape, dtype);
    let seqlens = lengths_upload(&client, &d.lengths);
    // The lengths the host knows at capture: the split count is chosen from them once, and
    // every later step stays within the capacity (the caller's to keep).
    let captured_lengths = d.lengths.clone();
    let step = || {
        let inputs = DecodeInputs {
            q: &q,
            cache: KvCache {
                k: &k,
                v: &v,
                block_table: None,
            },
            cache_seqlens: &seqlens,
            new: Some((&new_k, &new_v)),
            lengths: Lengths::Known(&captured_lengths),
            rotary: None,
            terms: ScoreBias::none(),
        };
        decode(&client, inputs, dtype, s.options(), Splits::Exactly(3))
    };
    client
        .graph_prepare()
        .expect("a stream prepared for capture");
    drop(step().expect("the warm-up step"));
    client.start_capture().expect("capture started");
    let captured = step();
    let graph = client.stop_capture().expect("a captured graph");
    let out = captured.expect("the captured step");
    assert_eq!(out.splits, 3, "the captured step runs split");

    let write = |t: &DeviceTensor, bytes: Vec<u8>| {
        client.write(&t.handle, cubecl::bytes::Bytes::from_bytes_vec(bytes));
    };
    for token in 0..3 {
        if token > 0 {
            // The next token: the lengths count the last append; fresh queries, keys and
            // values in the captured buffers.
            d.lengths.iter_mut().for_each(|l| *l += s.s_new());
            d.q = common::randn(&mut rng, d.q.len(), dtype);
            d.new_k = common::randn(&mut rng, d.new_k.len(), dtype);
            d.new_v = common::randn(&mut rng, d.new_v.len(), dtype);
            write(&q, common::to_bytes(&d.q, dtype));
            write(&new_k, common::to_bytes(&d.new_k, dtype));
            write(&new_v, common::to_bytes(&d.new_v, dtype));
            let lengths = d.lengths.iter().flat_map(|&l| (l as i32).to_le_bytes());
            write(&seqlens, lengths.collect());
        }
        // SAFETY: every buffer the graph was captured with is alive, and only this thread
        // uses them, on the capture's stream.
        unsafe { graph.replay() }.expect("replay");
        let after = appended(&s, &d);
        let got = download(&client, &out.out, dtype);
        let lse = download(&client, &out.lse, FloatDtype::F32);
        let len = |seq: usize| d.lengths[seq] + s.s_new();
        let context = format!(
            "token {token} of a captured step, {dtype:?}, lengths {:?}, seed {seed}",
            d.lengths
        );
        check_sequences(
            &s,
            dtype,
            &d.q,
            |seq| positions(&s, &after.k, seq, len(seq), s.dim_qk),
            |seq| positions(&s, &after.v, seq, len(seq), s.dim_v),
            &got,
            Some(&lse),
            &context,
        );
        d.contents = after;
    }
}

#[test]
fn long_caches_are_split_within_the_loop_budget() {
    // On lavapipe one cube would pass the driver's loop budget over 20 000 keys
    // (crate::loop_budget): unsplit, the call is refused; the automatic split count keeps
    // each split within the budget, and the result is right.
    let client = common::client();
    let s = serving(1, 2, 1, 1, 20_000, 64);
    let lengths = vec![s.capacity - 1];
    let limits = DeviceLimits::from_properties(client.properties());
    if limits.loop_iterations.is_some() {
        let (_, mut rng) = common::rng();
        let d = data(&s, FloatDtype::F32, lengths.clone(), &mut rng);
        let (result, _) = run(
            &client,
            &s,
            &d,
            FloatDtype::F32,
            Splits::Exactly(1),
            Lengths::ReadBack,
        );
        assert!(
            matches!(result, Err(FlashError::Unavailable(_))),
            "an unsplit call past the loop budget ran"
        );
    }
    check(&client, &s, FloatDtype::F32, lengths, Splits::Auto);
}

/// Rotary tables `[positions, dim / 2]` (angles `p · 10000^(−2i / dim)`, rounded to the
/// input dtype) and the host's rotation.
struct Rope {
    cos: Vec<f64>,
    sin: Vec<f64>,
    positions: usize,
    dim: usize,
    interleaved: bool,
}

impl Rope {
    fn new(positions: usize, dim: usize, interleaved: bool, dtype: FloatDtype) -> Self {
        let half = dim / 2;
        let angle = |n: usize| {
            let (p, i) = (n / half, n % half);
            p as f64 * 10_000f64.powf(-2.0 * i as f64 / dim as f64)
        };
        let table = |f: fn(f64) -> f64| {
            (0..positions * half)
                .map(|n| common::round(f(angle(n)), dtype))
                .collect()
        };
        Self {
            cos: table(f64::cos),
            sin: table(f64::sin),
            positions,
            dim,
            interleaved,
        }
    }

    /// Turns `row` (one head's values) to `position`.
    fn turn(&self, row: &mut [f64], position: usize) {
        let half = self.dim / 2;
        let x = row.to_vec();
        for i in 0..half {
            let (a, b) = match self.interleaved {
                true => (2 * i, 2 * i + 1),
                false => (i, i + half),
            };
            let (cos, sin) = (self.cos[position * half + i], self.sin[position * half + i]);
            row[a] = x[a] * cos - x[b] * sin;
            row[b] = x[b] * cos + x[a] * sin;
        }
    }
}

#[test]
fn rotary_embedding_turns_the_new_queries_and_keys() {
    // Keys turn to their positions `len + j` as they are appended; queries to `len + i`
    // under a causal mask, else all to `len` (FlashAttention's `flash_attn_with_kvcache`).
    let client = common::client();
    let (seed, mut rng) = common::rng();
    let cases = [
        (
            Serving {
                causal: true,
                ..serving(3, 4, 2, 3, 24, 32)
            },
            false,
            16,
        ),
        (
            Serving {
                page_size: Some(3),
                ..serving(3, 4, 2, 2, 24, 32)
            },
            true,
            32,
        ),
    ];
    for (s, interleaved, rotary_dim) in cases {
        for dtype in common::dtypes(&client) {
            let context = format!("{s:?} {dtype:?} interleaved {interleaved}, seed {seed}");
            let lengths = edge_lengths(&s, &mut rng);
            let d = data(&s, dtype, lengths, &mut rng);
            let rope = Rope::new(s.capacity + s.s_q, rotary_dim, interleaved, dtype);
            let (result, contents) = run_turned(
                &client,
                &s,
                &d,
                dtype,
                Splits::Auto,
                Lengths::ReadBack,
                Some(&rope),
            );
            let result = result.unwrap_or_else(|e| panic!("decode: {e} — {context}"));

            // The cache holds the turned keys (rounded once, by the kernel or here) and the
            // values as they came.
            let (hkv, n, dk) = (s.heads_kv, s.s_new(), s.dim_qk);
            let mut turned = Data {
                q: d.q.clone(),
                lengths: d.lengths.clone(),
                contents: d.contents.clone(),
                new_k: d.new_k.clone(),
                new_v: d.new_v.clone(),
                table: d.table.clone(),
                pages: d.pages,
            };
            // Turned keys and queries are held in the dtype, as the kernels hold them.
            let round =
                |row: &mut [f64]| row.iter_mut().for_each(|x| *x = common::round(*x, dtype));
            for (row, key) in turned.new_k.chunks_mut(dk).enumerate() {
                let seq = row / (hkv * n);
                rope.turn(key, d.lengths[seq] + row % n);
                round(key);
            }
            let after = appended(&s, &turned);
            assert!(same(&contents.v, &after.v), "values changed — {context}");
            let ulp = match dtype {
                FloatDtype::F32 => 1e-6,
                FloatDtype::F16 => 1e-3,
                FloatDtype::BF16 => 8e-3,
            };
            for (n, (&got, &want)) in contents.k.iter().zip(&after.k).enumerate() {
                assert!(
                    same(&[got], &[want]) || (got - want).abs() <= ulp * (1.0 + want.abs()),
                    "cached key value {n}: {got} against {want} — {context}"
                );
            }

            let mut q = d.q.clone();
            for (row, query) in q.chunks_mut(dk).enumerate() {
                let seq = row / (s.heads_q * s.s_q);
                let i = if s.causal { row % s.s_q } else { 0 };
                rope.turn(query, d.lengths[seq] + i);
                round(query);
            }
            let out = download(&client, &result.out, dtype);
            let lse = download(&client, &result.lse, FloatDtype::F32);
            let len = |seq: usize| d.lengths[seq] + n;
            check_sequences(
                &s,
                dtype,
                &q,
                |seq| positions(&s, &contents.k, seq, len(seq), dk),
                |seq| positions(&s, &contents.v, seq, len(seq), s.dim_v),
                &out,
                Some(&lse),
                &context,
            );
        }
    }

    // Tables shorter than the longest sequence with its new tokens, or odd ones, are
    // refused before anything is written.
    let s = serving(3, 4, 2, 1, 24, 32);
    let d = data(&s, FloatDtype::F32, edge_lengths(&s, &mut rng), &mut rng);
    for (rope, arg) in [
        (Rope::new(4, 16, false, FloatDtype::F32), "rotary_cos"),
        (
            Rope::new(s.capacity, 48, false, FloatDtype::F32),
            "rotary_cos",
        ),
    ] {
        let (result, contents) = run_turned(
            &client,
            &s,
            &d,
            FloatDtype::F32,
            Splits::Auto,
            Lengths::ReadBack,
            Some(&rope),
        );
        let err = result.err().expect("bad rotary tables were taken");
        assert!(err.to_string().contains(&format!("`{arg}`")), "{err}");
        assert!(
            same(&contents.k, &d.contents.k),
            "the cache changed — seed {seed}"
        );
    }
}

mod op {
    //! The Burn op `flash_attention_with_kvcache`: two decode steps on the test device and on
    //! Flex (the composed fallback), contiguous (with the score function, on the test device)
    //! and paged (with ALiBi and a key padding mask), the second with the rotary embedding,
    //! against the oracle; the cache the op returns carries the appended keys into the next
    //! step.

    use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
    use burn_flash_attention::{
        AttentionBias, FlashAttentionOptions, KvCache, PagedKvCache, RotaryEmbedding,
        flash_attention_with_kvcache_and_lse, flash_attention_with_kvcache_biased,
    };

    use super::*;
    use crate::common::{tensor, values};

    fn ints<const D: usize>(data: Vec<i64>, shape: [usize; D], device: &Device) -> Tensor<D, Int> {
        Tensor::from_data(TensorData::new(data, shape), device)
    }

    /// The cache of `d` (NaN past the lengths) as Burn tensors, contiguous or paged.
    fn burn_cache(s: &Serving, d: &Data, device: &Device) -> KvCache {
        let (b, hkv, cap) = (s.batch, s.heads_kv, s.capacity);
        let Some(page_size) = s.page_size else {
            return KvCache {
                k: tensor(&d.contents.k, [b, hkv, cap, s.dim_qk], device),
                v: tensor(&d.contents.v, [b, hkv, cap, s.dim_v], device),
                block_table: None,
            };
        };
        let client = common::client();
        // Reuse the kernel tests' page layout, read back as host data.
        let (k, v, _) = upload_cache(&client, s, d, FloatDtype::F32);
        let (k, v) = (
            download(&client, &k, FloatDtype::F32),
            download(&client, &v, FloatDtype::F32),
        );
        let table: Vec<i64> = d.table.iter().map(|&x| x as i64).collect();
        KvCache {
            k: tensor(&k, [d.pages, page_size, hkv, s.dim_qk], device),
            v: tensor(&v, [d.pages, page_size, hkv, s.dim_v], device),
            block_table: Some(ints(table, [b, s.max_pages()], device)),
        }
    }

    #[test]
    fn flash_attention_with_kvcache_matches_the_oracle_step_after_step() {
        let (seed, mut rng) = common::rng();
        for device in [common::burn_device(), Device::flex()] {
            let fused = device != Device::flex();
            for page_size in [None, Some(3)] {
                // ALiBi and a key padding mask on the paged cache; the score function (which
                // only the kernels run) on the contiguous one.
                let s = Serving {
                    page_size,
                    causal: true,
                    alibi: page_size.is_some(),
                    bias: page_size.map(|_| BiasKind::Padding),
                    score_fn: fused && page_size.is_none(),
                    ..serving(3, 4, 2, 2, 24, 32)
                };
                let lengths = vec![5, 0, 9];
                // Pages for both steps are in the table from the start.
                let d = data(
                    &s,
                    FloatDtype::F32,
                    lengths.iter().map(|l| l + s.s_q).collect(),
                    &mut rng,
                );
                let d = Data {
                    lengths: lengths.clone(),
                    ..d
                };
                let options = FlashAttentionOptions::default().with_causal(true);
                let mut cache = burn_cache(&s, &d, &device);
                let mut expected = d;
                for step in 0..2 {
                    let context =
                        format!("{device:?} pages {page_size:?} step {step}, seed {seed}");
                    let q = tensor(&expected.q, [s.batch, s.heads_q, s.s_q, s.dim_qk], &device);
                    let k_new = tensor(
                        &expected.new_k,
                        [s.batch, s.heads_kv, s.s_q, s.dim_qk],
                        &device,
                    );
                    let v_new = tensor(
                        &expected.new_v,
                        [s.batch, s.heads_kv, s.s_q, s.dim_v],
                        &device,
                    );
                    let lens: Vec<i64> = expected.lengths.iter().map(|&l| l as i64).collect();
                    // The second step turns its queries and keys (interleaved pairs on the
                    // paged cache, halves on the contiguous one, over half the head dim).
                    let rope = (step == 1).then(|| {
                        Rope::new(
                            s.capacity,
                            s.dim_qk / 2,
                            page_size.is_some(),
                            FloatDtype::F32,
                        )
                    });
                    let rotary = rope.as_ref().map(|r| {
                        let table = |t: &[f64]| {
                            tensor(t, [1, 1, r.positions, r.dim / 2], &device)
                                .reshape([r.positions, r.dim / 2])
                        };
                        RotaryEmbedding {
                            cos: table(&r.cos),
                            sin: table(&r.sin),
                            interleaved: r.interleaved,
                        }
                    });
                    let mut terms = AttentionBias::new();
                    if s.alibi {
                        let slopes: Vec<f32> = (0..s.batch * s.heads_q)
                            .map(|n| alibi_slope(n / s.heads_q, n % s.heads_q) as f32)
                            .collect();
                        let shape = [s.batch, s.heads_q];
                        terms = terms
                            .with_alibi(Tensor::from_data(TensorData::new(slopes, shape), &device));
                    }
                    if let Some(kind) = s.bias {
                        let bias = bias_values(&s, kind, FloatDtype::F32);
                        let hidden: Vec<bool> = bias.data.iter().map(|&x| x < 0.0).collect();
                        let shape = [s.batch, s.capacity];
                        terms = terms.with_key_padding(Tensor::<2, Bool>::from_data(
                            TensorData::new(hidden, shape),
                            &device,
                        ));
                    }
                    if s.score_fn {
                        let params = sequence_bias_params(&s);
                        let shape = [s.batch, s.heads_q * BUCKETS];
                        terms = terms
                            .with_score_mod::<SequenceBias>()
                            .with_score_params(tensor(&params, shape, &device));
                    }
                    let (out, lse, next) = flash_attention_with_kvcache_biased(
                        q,
                        cache,
                        ints(lens, [s.batch], &device),
                        Some((k_new, v_new)),
                        rotary,
                        terms,
                        options,
                    );
                    cache = next;
                    if let Some(rope) = &rope {
                        let dk = s.dim_qk;
                        for (row, key) in expected.new_k.chunks_mut(dk).enumerate() {
                            let seq = row / (s.heads_kv * s.s_q);
                            rope.turn(key, expected.lengths[seq] + row % s.s_q);
                        }
                        for (row, query) in expected.q.chunks_mut(dk).enumerate() {
                            let seq = row / (s.heads_q * s.s_q);
                            rope.turn(query, expected.lengths[seq] + row % s.s_q);
                        }
                    }
                    let after = appended(&s, &expected);
                    let (out, lse) = (values(out), values(lse));
                    let len = |seq: usize| expected.lengths[seq] + s.s_q;
                    check_sequences(
                        &s,
                        FloatDtype::F32,
                        &expected.q,
                        |seq| positions(&s, &after.k, seq, len(seq), s.dim_qk),
                        |seq| positions(&s, &after.v, seq, len(seq), s.dim_v),
                        &out,
                        Some(&lse),
                        &context,
                    );
                    // The next step: the appended keys are in the cache; new queries and keys.
                    expected.contents = after;
                    for l in expected.lengths.iter_mut() {
                        *l += s.s_q;
                    }
                    expected.q = common::randn(&mut rng, expected.q.len(), FloatDtype::F32);
                    expected.new_k = common::randn(&mut rng, expected.new_k.len(), FloatDtype::F32);
                    expected.new_v = common::randn(&mut rng, expected.new_v.len(), FloatDtype::F32);
                }
            }
        }
    }

    /// The Burn op appends into the cache it is given: a step that moves the cache in and
    /// takes it back reserves no device memory for a cache (the pool cleaned up first, so
    /// that any new buffer shows), and its appended keys are read back from the returned
    /// cache. A cache still shared with another tensor is copied first, which the same
    /// measure sees, and the other tensor keeps its contents.
    #[test]
    fn the_op_appends_in_place_unless_the_cache_is_shared() {
        let device = common::burn_device();
        let client = common::client();
        let (b, hq, hkv, cap, d) = (2, 4, 2, 4096, 64);
        let cache_bytes = (b * hkv * cap * d * 4) as u64;
        let lengths = vec![100i64, 7];
        let options = FlashAttentionOptions::default().with_causal(true);
        let new_key = |fill: f32| Tensor::<4>::full([b, hkv, 1, d], fill, &device);
        // One step appending `fill`, the reserved memory's growth over it, and the cache.
        let step = |cache: KvCache, fill: f32| {
            let q = Tensor::<4>::ones([b, hq, 1, d], &device);
            let (k, v) = (new_key(fill), new_key(fill));
            let seqlens = ints(lengths.clone(), [b], &device);
            device.sync().expect("the device runs");
            client.memory_cleanup().expect("the pool cleans up");
            let reserved = |c: &cubecl::client::Client| {
                cubecl::future::block_on(c.sync()).expect("device synced");
                c.memory_report(cubecl::MemoryScope::Device)
                    .usage()
                    .bytes_reserved
            };
            let before = reserved(&client);
            let (out, _, cache) = flash_attention_with_kvcache_and_lse(
                q,
                cache,
                seqlens,
                Some((k, v)),
                None,
                options,
            );
            let out = values(out);
            assert!(out.iter().all(|x| x.is_finite()), "the step's output");
            (reserved(&client).saturating_sub(before), cache)
        };
        let appended = |cache: &KvCache, fill: f32| {
            let k = values(cache.k.clone());
            (0..b * hkv).all(|bh| {
                let at = (bh * cap + lengths[bh / hkv] as usize) * d;
                k[at..at + d].iter().all(|&x| x == f64::from(fill))
            })
        };
        let cache = KvCache::contiguous(b, hkv, cap, [d, d], &device);
        // Compiles the kernels and fills the pools' small pages.
        let (_, cache) = step(cache, 1.0);
        let (grown, cache) = step(cache, 2.0);
        assert!(
            appended(&cache, 2.0),
            "the returned cache holds the appended keys"
        );
        assert!(
            grown < cache_bytes,
            "a step on a cache moved in reserved {grown} bytes: a cache is {cache_bytes}"
        );
        // Shared: the op copies, and the other tensor keeps the old contents.
        let kept = cache.clone();
        let (grown, cache) = step(cache, 3.0);
        assert!(
            appended(&cache, 3.0) && appended(&kept, 2.0),
            "the copy and the original"
        );
        assert!(
            grown >= 2 * cache_bytes,
            "a step on a shared cache reserved {grown} bytes, less than its copy ({} bytes)",
            2 * cache_bytes
        );
        eprintln!("moved in: no cache reserved; shared: {grown} bytes (a cache {cache_bytes})");
    }

    /// A decode call with `terms` on a cache of 4 positions (2 used), 2 query heads.
    fn decode_with(terms: impl FnOnce(&Device) -> AttentionBias) {
        let device = common::burn_device();
        let cache = KvCache::contiguous(1, 1, 4, [8, 8], &device);
        let q = Tensor::<4>::zeros([1, 2, 1, 8], &device);
        let _ = flash_attention_with_kvcache_biased(
            q,
            cache,
            ints(vec![2], [1], &device),
            None,
            None,
            terms(&device),
            FlashAttentionOptions::default(),
        );
    }

    #[test]
    #[should_panic(expected = "not a block mask")]
    fn decode_refuses_a_block_mask() {
        use burn_flash_attention::BlockMask;
        use burn_flash_attention::kernels::{BlockShape, block_mask};
        decode_with(|device| {
            let blocks = BlockShape {
                block_q: 128,
                block_kv: 128,
            };
            let mask = block_mask::BlockMask::prefix_lm(&[2], 1, 4, blocks).unwrap();
            AttentionBias::new().with_block_mask(BlockMask::new(mask, device))
        });
    }

    #[test]
    #[should_panic(
        expected = "`bias` has shape [1, 2, 1, 3], expected [1 | 1, 2 | 1, 1 | 1, 4 | 1]"
    )]
    fn a_bias_shorter_than_the_cache_is_refused_by_name() {
        decode_with(|device| AttentionBias::new().with_bias(Tensor::zeros([1, 2, 1, 3], device)));
    }

    #[test]
    #[should_panic(expected = "the score function")]
    fn the_composed_decode_names_the_score_function() {
        let device = Device::flex();
        let cache = KvCache::contiguous(1, 1, 4, [8, 8], &device);
        let _ = flash_attention_with_kvcache_biased(
            Tensor::<4>::zeros([1, 2, 1, 8], &device),
            cache,
            ints(vec![2], [1], &device),
            None,
            None,
            AttentionBias::new().with_score_mod::<SequenceBias>(),
            FlashAttentionOptions::default(),
        );
    }

    #[test]
    #[should_panic(expected = "`cache_seqlens`")]
    fn an_append_past_the_capacity_names_the_lengths() {
        let device = common::burn_device();
        let cache = KvCache::contiguous(1, 1, 4, [8, 8], &device);
        let q = Tensor::<4>::zeros([1, 1, 2, 8], &device);
        let new = Tensor::<4>::zeros([1, 1, 2, 8], &device);
        let _ = flash_attention_with_kvcache_and_lse(
            q,
            cache,
            ints(vec![3], [1], &device),
            Some((new.clone(), new)),
            None,
            FlashAttentionOptions::default(),
        );
    }

    #[test]
    fn paged_cache_serves_sequences_that_join_and_leave() {
        let (seed, mut rng) = common::rng();
        let device = common::burn_device();
        let (hq, hkv, d) = (4, 2, 16);
        let mut cache = PagedKvCache::new(12, 3, hkv, [d, d], 6, &device);
        let options = FlashAttentionOptions::default().with_causal(true);
        // Every sequence's keys and values so far, [h_kv, len, d] on the host.
        let mut history: Vec<(Vec<Vec<f64>>, Vec<Vec<f64>>)> = Vec::new();
        let mut step = |cache: &mut PagedKvCache,
                        history: &mut Vec<(Vec<Vec<f64>>, Vec<Vec<f64>>)>,
                        ids: &[usize],
                        s_new: usize| {
            let n = ids.len();
            let q = common::randn(&mut rng, n * hq * s_new * d, FloatDtype::F32);
            let k = common::randn(&mut rng, n * hkv * s_new * d, FloatDtype::F32);
            let v = common::randn(&mut rng, n * hkv * s_new * d, FloatDtype::F32);
            let out = cache.step(
                ids,
                tensor(&q, [n, hq, s_new, d], &device),
                tensor(&k, [n, hkv, s_new, d], &device),
                tensor(&v, [n, hkv, s_new, d], &device),
                None,
                options,
            );
            let out = values(out);
            for (row, &id) in ids.iter().enumerate() {
                if history.len() <= id {
                    history.resize(id + 1, (vec![Vec::new(); hkv], vec![Vec::new(); hkv]));
                }
                let (hk, hv) = &mut history[id];
                for h in 0..hkv {
                    let at = ((row * hkv + h) * s_new) * d;
                    hk[h].extend_from_slice(&k[at..at + s_new * d]);
                    hv[h].extend_from_slice(&v[at..at + s_new * d]);
                }
                assert_eq!(cache.len(id), hk[0].len() / d, "length of sequence {id}");
            }
            let batch = Serving {
                causal: true,
                ..serving(n, hq, hkv, s_new, 0, d)
            };
            let keys = |row: usize| history[ids[row]].0.concat();
            let values_of = |row: usize| history[ids[row]].1.concat();
            let context = format!("step {ids:?} of {s_new}, seed {seed}");
            check_sequences(
                &batch,
                FloatDtype::F32,
                &q,
                keys,
                values_of,
                &out,
                None,
                &context,
            );
        };
        let a = cache.add_sequence();
        let b = cache.add_sequence();
        step(&mut cache, &mut history, &[a], 5); // prompts of different lengths
        step(&mut cache, &mut history, &[b], 2);
        step(&mut cache, &mut history, &[b, a], 1); // decoding together
        step(&mut cache, &mut history, &[a, b], 1);
        let free = cache.free_pages();
        cache.remove_sequence(a); // a leaves: its 3 pages return
        assert_eq!(cache.free_pages(), free + 3);
        let c = cache.add_sequence(); // c takes a's place
        assert_eq!(c, a);
        history[c] = (vec![Vec::new(); hkv], vec![Vec::new(); hkv]);
        step(&mut cache, &mut history, &[c], 4);
        step(&mut cache, &mut history, &[b, c], 1);

        // A step whose new keys do not fit the pages is refused before it takes a page or
        // the pages leave the pool, and the cache serves the next step.
        let free = cache.free_pages();
        let q = Tensor::<4>::zeros([1, hq, 1, d], &device);
        let wrong = Tensor::<4>::zeros([1, hkv, 1, d + 1], &device);
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cache.step(&[b], q, wrong.clone(), wrong, None, options)
        }));
        let message = refused.expect_err("a step with wrong new keys ran");
        let message = message
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.contains("`k`"), "{message}");
        assert_eq!(cache.free_pages(), free);
        step(&mut cache, &mut history, &[c, b], 1);
    }
}
