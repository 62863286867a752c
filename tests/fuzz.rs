//! Property-based fuzzing of the training kernels against the f64 oracle (`proptest`):
//! batch, heads and GQA ratio, `s_q` and `s_kv` drawn independently, head dims (odd ones
//! and `d_v ≠ d_qk` included), causal, windows, softcap, scale, dropout and the
//! deterministic backward alone and combined, every dtype, input layout and kernel path of
//! the device; O, LSE, dQ, dK and dV by FlashAttention's tolerance rule, rows that see no
//! key exactly O = 0 and LSE = −∞ ([`check_case_seeded`]). The same problems again with
//! score terms: a bias broadcast over any of its dimensions (`−∞` entries hiding scores,
//! rows or columns; its gradient asked for or not) and ALiBi per head or per (batch, head),
//! alone and together ([`bias::check_seeded`]). And decode steps of the serving kernels
//! ([`decode::check_seeded`]): batch, GQA ratio, 1 to 7 new queries appended or not, cache
//! capacities, sequence lengths from empty to full, contiguous or paged caches of any page
//! size, split counts, causal, windows, softcap, ALiBi, a bias or key padding mask over the
//! cache and a score function. A failure shrinks to the smallest case that still fails and
//! is printed with the seed of its inputs.
//!
//! - `FLASH_FUZZ_CASES=n`: cases to run; by default a few on a CPU driver (each new head
//!   dim or option set compiles kernels, slowly there) and more on a GPU. Long runs set
//!   thousands.
//! - `FLASH_FUZZ_SEED=n`: the run's seed (printed first); the same seed on the same device
//!   draws the same cases.
//! - `FLASH_PATH` keeps one kernel path, as for the other kernel tests.
//! - `FLASH_FUZZ_SHAPES=n`: up to `n` shapes per drawn case (default 1). The shapes after
//!   the first keep the case's kernel variant (head dims, dtype, path, layout and options)
//!   and draw the batch, heads and lengths anew (decode: batch, K/V heads, capacity and
//!   lengths), so that on a GPU, where each new variant compiles its kernels, a long run
//!   checks many shapes per compilation. Each shape is a case of its own against the
//!   oracle; a failing one shrinks with the rest.

use burn_flash_attention::kernels::loop_budget;
use burn_flash_attention::kernels::{
    AttentionProblem, DeviceLimits, Dropout, FloatDtype, KernelPath,
};
use cubecl::client::Client;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng};

use burn_flash_attention::kernels::decode::Splits;

use crate::bias::{self, Alibi, TermsCase, nothing_hidden};
use crate::common::{self, Case, case, dims};
use crate::decode::{self, BiasKind, Serving};
use crate::kernels::{Layout, check_case_seeded};

/// One drawn case: the problem and options, which of the device's dtypes and kernel paths
/// runs it (indices, taken modulo the device's lists), the inputs' layout and seed.
#[derive(Clone, Debug)]
struct Drawn {
    case: Case,
    dtype: usize,
    path: usize,
    layout: Layout,
    seed: u64,
    /// More shapes run with the case's kernels (`FLASH_FUZZ_SHAPES`).
    more: Vec<Shape>,
}

/// A shape drawn for a case's kernels: sequences, K/V heads, lengths and the inputs' seed
/// (the GQA ratio and head dims stay the case's).
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_kv: usize,
    seed: u64,
}

impl Drawn {
    /// The case, then the case with each of its other shapes.
    fn shapes(&self) -> impl Iterator<Item = Drawn> + '_ {
        let d = self.case.dims;
        let group = d.heads_q / d.heads_kv;
        std::iter::once(self.clone()).chain(self.more.iter().map(move |s| Drawn {
            case: Case {
                dims: dims(
                    s.batch,
                    s.heads_kv * group,
                    s.heads_kv,
                    s.seq_q,
                    s.seq_kv,
                    d.dim_qk,
                    d.dim_v,
                ),
                ..self.case
            },
            seed: s.seed,
            more: Vec::new(),
            ..self.clone()
        }))
    }
}

/// Shapes drawn per case beyond the first (`FLASH_FUZZ_SHAPES − 1`).
fn more_shapes() -> usize {
    std::env::var("FLASH_FUZZ_SHAPES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(0, |n| n.saturating_sub(1))
}

/// `(batch, heads_kv)` lowered, the larger first, until the oracle can afford the shape.
fn within_work(
    bounds: Bounds,
    (mut batch, mut heads_kv): (usize, usize),
    per_head_pair: usize,
) -> (usize, usize) {
    while batch * heads_kv * per_head_pair > bounds.work && batch * heads_kv > 1 {
        if batch >= heads_kv {
            batch -= 1;
        } else {
            heads_kv -= 1;
        }
    }
    (batch, heads_kv)
}

fn other_shape(bounds: Bounds) -> impl Strategy<Value = (usize, usize, usize, usize, u64)> {
    (
        1..=bounds.batch,
        1..=bounds.heads_kv,
        seq_len(bounds.seq),
        seq_len(bounds.seq),
        any::<u64>(),
    )
}

/// How large the drawn problems grow: the oracle runs them in f64 on the host.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    batch: usize,
    heads_kv: usize,
    group: usize,
    seq: usize,
    /// Head dims drawn, besides any in `8..=256` on GPUs.
    dims: &'static [usize],
    any_dim: bool,
    /// Most `b · h_q · s_q · s_kv · (d_qk + d_v)` a case may cost the oracle.
    work: usize,
}

/// On a CPU driver: a few head dims (each compiles its kernels) and short sequences.
const CPU: Bounds = Bounds {
    batch: 2,
    heads_kv: 2,
    group: 3,
    seq: 96,
    dims: &[8, 40, 64, 72],
    any_dim: false,
    work: 4_000_000,
};

/// On a GPU: up to 2048 positions, 32 query heads, any head dim up to 256.
const GPU: Bounds = Bounds {
    batch: 4,
    heads_kv: 4,
    group: 8,
    seq: 2048,
    dims: &[32, 40, 64, 72, 80, 96, 111, 128, 136, 192, 200, 256],
    any_dim: true,
    work: 400_000_000,
};

/// Lengths from 1, most of them short: odd sizes around tile edges are where bugs hide.
fn seq_len(most: usize) -> BoxedStrategy<usize> {
    prop_oneof![
        3 => 1..=17usize,
        4 => 1..=most.min(300),
        2 => 1..=most,
    ]
    .boxed()
}

fn head_dim(bounds: Bounds) -> BoxedStrategy<usize> {
    let listed = proptest::sample::select(bounds.dims);
    match bounds.any_dim {
        // Mostly listed dims: each new one compiles its kernels.
        true => prop_oneof![7 => listed, 1 => 8..=256usize].boxed(),
        false => listed.boxed(),
    }
}

/// Causal, a window (either side may be unbounded) or neither.
fn mask() -> impl Strategy<Value = (bool, (Option<usize>, Option<usize>))> {
    prop_oneof![
        2 => Just((false, (None, None))),
        2 => Just((true, (None, None))),
        // A causal mask with a left window: sliding-window attention.
        1 => (0..=64usize).prop_map(|left| (true, (Some(left), Some(0)))),
        1 => (proptest::option::of(0..=64usize), proptest::option::of(0..=64usize))
            .prop_map(|window| (false, window)),
    ]
}

fn drawn(bounds: Bounds) -> impl Strategy<Value = Drawn> {
    let shape = (
        1..=bounds.batch,
        1..=bounds.heads_kv,
        1..=bounds.group,
        seq_len(bounds.seq),
        seq_len(bounds.seq),
        head_dim(bounds),
        prop_oneof![3 => Just(None), 1 => head_dim(bounds).prop_map(Some)],
    );
    let options = (
        mask(),
        proptest::option::weighted(0.3, 1.0f64..50.0),
        proptest::option::weighted(0.2, prop_oneof![-0.5f64..-0.01, 0.01f64..0.5]),
        proptest::option::weighted(0.2, (0.0f32..0.5, any::<u64>(), any::<u32>())),
        proptest::bool::weighted(0.2),
    );
    let layout = prop_oneof![
        3 => Just(Layout::Contiguous),
        1 => Just(Layout::Bshd),
        1 => Just(Layout::PaddedRows),
    ];
    let more = proptest::collection::vec(other_shape(bounds), 0..=more_shapes());
    (
        shape,
        options,
        0..3usize,
        0..3usize,
        layout,
        any::<u64>(),
        more,
    )
        .prop_map(
            move |(
                (batch, heads_kv, group, seq_q, seq_kv, dim_qk, dim_v),
                ((causal, window), softcap, scale, dropout, deterministic),
                dtype,
                path,
                layout,
                seed,
                more,
            )| {
                let dim_v = dim_v.unwrap_or(dim_qk);
                // Fewer sequences and heads where the oracle's work would pass the bound.
                let work = |seq_q: usize, seq_kv: usize| group * seq_q * seq_kv * (dim_qk + dim_v);
                let (batch, heads_kv) = within_work(bounds, (batch, heads_kv), work(seq_q, seq_kv));
                let dims = dims(
                    batch,
                    heads_kv * group,
                    heads_kv,
                    seq_q,
                    seq_kv,
                    dim_qk,
                    dim_v,
                );
                let more = more
                    .into_iter()
                    .map(|(batch, heads_kv, seq_q, seq_kv, seed)| {
                        let (batch, heads_kv) =
                            within_work(bounds, (batch, heads_kv), work(seq_q, seq_kv));
                        Shape {
                            batch,
                            heads_kv,
                            seq_q,
                            seq_kv,
                            seed,
                        }
                    })
                    .collect();
                Drawn {
                    case: Case {
                        causal,
                        window,
                        softcap,
                        scale,
                        deterministic,
                        dropout: dropout.map(|(p, seed, offset)| Dropout { p, seed, offset }),
                        ..case(dims)
                    },
                    dtype,
                    path,
                    layout,
                    seed,
                    more,
                }
            },
        )
}

/// The problem drawn, unless the oracle could not afford it (a single long sequence pair
/// at a wide head dim).
fn affordable(d: &Drawn, bounds: Bounds) -> bool {
    let x = &d.case.dims;
    x.batch * x.heads_q * x.seq_q * x.seq_kv * (x.dim_qk + x.dim_v) <= bounds.work
}

/// Runs `check` on the cases `strategy` draws: `FLASH_FUZZ_CASES` of them (`default` on a
/// CPU driver, four times as many on a GPU), from the run's seed `FLASH_FUZZ_SEED`; a
/// failure shrinks and panics with the smallest case.
fn fuzz<S: Strategy>(
    strategy: S,
    default: u32,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let default = if common::is_cpu_device() {
        default
    } else {
        4 * default
    };
    let cases = env("FLASH_FUZZ_CASES").map_or(default, |n| n as u32);
    let seed = env("FLASH_FUZZ_SEED").unwrap_or_else(rand::random);
    eprintln!("fuzzing {cases} cases, FLASH_FUZZ_SEED={seed}");
    let mut runner = TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        // Each shrinking step reruns the kernels and the oracle.
        max_shrink_iters: 64,
        max_global_rejects: cases * 4,
        ..Config::default()
    });
    match runner.run(&strategy, check) {
        Ok(()) => eprintln!("{cases} cases passed (FLASH_FUZZ_SEED={seed})"),
        Err(TestError::Fail(reason, minimal)) => panic!(
            "the smallest failing case: {minimal:#?}\n{reason}\n(FLASH_FUZZ_SEED={seed} draws \
             this run again)"
        ),
        Err(TestError::Abort(reason)) => {
            panic!("fuzzing stopped: {reason} (FLASH_FUZZ_SEED={seed})")
        }
    }
}

/// The bounds of the device's cases.
fn bounds() -> Bounds {
    match common::is_cpu_device() {
        true => CPU,
        false => GPU,
    }
}

/// The dtype and path `d` names among the device's, unless there is no such path or the
/// portable kernels would refuse the problem on the driver's loop budget (then `None`: the
/// case is drawn again).
fn dtype_and_path(
    client: &Client,
    limits: &DeviceLimits,
    d: &Drawn,
) -> Option<(FloatDtype, KernelPath)> {
    let dtypes = common::dtypes(client);
    let dtype = dtypes[d.dtype % dtypes.len()];
    // `FLASH_PATH` may keep no path of this dtype (the tensor-core paths take no f32).
    let paths = common::paths(client, dtype);
    let path = *paths.get(d.path % paths.len().max(1))?;
    let fits = path != KernelPath::Portable
        || loop_budget::check_problem(&problem(&d.case, dtype), limits).is_ok();
    fits.then_some((dtype, path))
}

#[test]
fn random_problems_match_the_oracle() {
    let client = common::client();
    let limits = DeviceLimits::from_properties(client.properties());
    let bounds = bounds();
    fuzz(drawn(bounds), 16, |d| {
        // The first shape decides whether the case runs; a later one the oracle or the
        // driver's loop budget cannot afford, or that its path refuses, is left out.
        for (n, d) in d.shapes().enumerate() {
            let ran = affordable(&d, bounds)
                .then(|| dtype_and_path(&client, &limits, &d))
                .flatten()
                .map(|(dtype, path)| {
                    let rng = StdRng::seed_from_u64(d.seed);
                    // A path that refuses the problem on this device (a scale or size it
                    // does not take) draws another case; `Auto` takes such problems
                    // elsewhere.
                    check_case_seeded(&client, &d.case, dtype, d.layout, path, (d.seed, rng))
                        .is_ok()
                });
            prop_assume!(
                n > 0 || ran == Some(true),
                "no path, past a budget or refused"
            );
        }
        Ok(())
    });
}

/// `−∞` entries of a drawn bias, in its own coordinates `(b, h, i, j)` (0 along the
/// dimensions it broadcasts over): none, scattered scores, whole rows of batch 0 (rows that
/// see no key at all), keys hidden per head.
const HIDDEN: [fn(usize, usize, usize, usize) -> bool; 4] = [
    nothing_hidden,
    |_, _, i, j| (i + 2 * j) % 7 == 3,
    |b, _, i, _| b == 0 && i % 3 == 1,
    |_, h, _, j| j % 4 == h % 4,
];

/// A drawn problem with score terms: which of the bias's dimensions are full (the others
/// broadcast), which `−∞` pattern it carries ([`HIDDEN`]), whether its gradient is asked
/// for, and ALiBi.
#[derive(Clone, Debug)]
struct DrawnTerms {
    drawn: Drawn,
    bias: Option<[bool; 4]>,
    hidden: usize,
    grad: bool,
    alibi: Alibi,
}

impl DrawnTerms {
    fn terms_case(&self) -> TermsCase {
        let d = self.drawn.case.dims;
        let full = [d.batch, d.heads_q, d.seq_q, d.seq_kv];
        let bias = self
            .bias
            .map(|keep| std::array::from_fn(|n| if keep[n] { full[n] } else { 1 }));
        TermsCase {
            case: self.drawn.case,
            bias,
            hidden: HIDDEN[self.hidden],
            alibi: self.alibi,
            grad: self.grad && bias.is_some(),
            blocks: None,
        }
    }
}

fn drawn_terms(bounds: Bounds) -> impl Strategy<Value = DrawnTerms> {
    let alibi = prop_oneof![
        Just(Alibi::None),
        Just(Alibi::PerHead),
        Just(Alibi::PerBatchHead)
    ];
    (
        drawn(bounds),
        proptest::option::weighted(0.8, any::<[bool; 4]>()),
        0..HIDDEN.len(),
        any::<bool>(),
        alibi,
    )
        .prop_map(|(drawn, bias, hidden, grad, alibi)| DrawnTerms {
            drawn,
            bias,
            hidden,
            grad,
            // Some term on every case.
            alibi: match (bias, alibi) {
                (None, Alibi::None) => Alibi::PerHead,
                (_, alibi) => alibi,
            },
        })
}

#[test]
fn random_problems_with_score_terms_match_the_oracle() {
    let client = common::client();
    let limits = DeviceLimits::from_properties(client.properties());
    let bounds = bounds();
    fuzz(drawn_terms(bounds), 8, |t| {
        // As the dense fuzzer's shapes: the first decides, later ones may be left out.
        for (n, drawn) in t.drawn.shapes().enumerate() {
            let t = DrawnTerms { drawn, ..t.clone() };
            let ran = affordable(&t.drawn, bounds)
                .then(|| dtype_and_path(&client, &limits, &t.drawn))
                .flatten()
                .map(|(dtype, path)| {
                    let seed = t.drawn.seed;
                    let rng = StdRng::seed_from_u64(seed);
                    bias::check_seeded(&client, &t.terms_case(), dtype, path, (seed, rng)).is_ok()
                });
            prop_assume!(
                n > 0 || ran == Some(true),
                "no path, past a budget or refused"
            );
        }
        Ok(())
    });
}

/// The kernels' view of `case` in `dtype`.
fn problem(case: &Case, dtype: FloatDtype) -> AttentionProblem {
    let d = &case.dims;
    AttentionProblem::new(
        &[d.batch, d.heads_q, d.seq_q, d.dim_qk],
        &[d.batch, d.heads_kv, d.seq_kv, d.dim_qk],
        &[d.batch, d.heads_kv, d.seq_kv, d.dim_v],
        dtype,
        case.options(),
    )
    .expect("a drawn problem is well formed")
}

/// A drawn decode step: the problem, which of the device's dtypes runs it, the split count
/// (`None`: the device's choice) and the seed of its inputs and lengths.
#[derive(Clone, Debug)]
struct DrawnDecode {
    serving: Serving,
    dtype: usize,
    splits: Option<usize>,
    seed: u64,
    /// More steps run with the same kernels (`FLASH_FUZZ_SHAPES`): batch, K/V heads,
    /// capacity and the seed of the inputs and lengths.
    more: Vec<(usize, usize, usize, u64)>,
}

impl DrawnDecode {
    /// The step, then the step with each of its other shapes.
    fn steps(&self) -> impl Iterator<Item = DrawnDecode> + '_ {
        let group = self.serving.heads_q / self.serving.heads_kv;
        std::iter::once(self.clone()).chain(self.more.iter().map(
            move |&(batch, heads_kv, capacity, seed)| DrawnDecode {
                serving: Serving {
                    batch,
                    heads_kv,
                    heads_q: heads_kv * group,
                    capacity,
                    ..self.serving
                },
                seed,
                more: Vec::new(),
                ..self.clone()
            },
        ))
    }
}

/// How large drawn decode steps grow (the oracle runs them in f64 on the host).
#[derive(Clone, Copy, Debug)]
struct DecodeBounds {
    batch: usize,
    heads_kv: usize,
    group: usize,
    capacity: usize,
    dims: &'static [usize],
    /// Most `b · h_q · s_q · capacity · (d_qk + d_v)` a step may cost the oracle.
    work: usize,
}

const DECODE_CPU: DecodeBounds = DecodeBounds {
    batch: 3,
    heads_kv: 2,
    group: 4,
    capacity: 80,
    dims: &[8, 24, 40, 64],
    work: 2_000_000,
};

const DECODE_GPU: DecodeBounds = DecodeBounds {
    batch: 8,
    heads_kv: 4,
    group: 8,
    capacity: 4096,
    dims: &[32, 40, 64, 72, 96, 128, 256],
    work: 200_000_000,
};

fn drawn_decode(bounds: DecodeBounds) -> impl Strategy<Value = DrawnDecode> {
    let dims = proptest::sample::select(bounds.dims);
    let shape = (
        1..=bounds.batch,
        1..=bounds.heads_kv,
        1..=bounds.group,
        1..=7usize,
        1..=bounds.capacity,
        dims.clone(),
        prop_oneof![3 => Just(None), 1 => dims.prop_map(Some)],
    );
    let cache = (
        prop_oneof![
            2 => Just(None),
            1 => proptest::sample::select(&[1usize, 3, 8, 16, 64, 256][..]).prop_map(Some),
        ],
        proptest::bool::weighted(0.8),
    );
    let options = (
        mask(),
        proptest::option::weighted(0.3, 1.0f64..30.0),
        any::<bool>(),
        proptest::option::weighted(
            0.4,
            prop_oneof![Just(BiasKind::Scores), Just(BiasKind::Padding)],
        ),
        proptest::bool::weighted(0.3),
    );
    let splits = proptest::option::weighted(0.5, 1..=7usize);
    let more = proptest::collection::vec(
        (
            1..=bounds.batch,
            1..=bounds.heads_kv,
            1..=bounds.capacity,
            any::<u64>(),
        ),
        0..=more_shapes(),
    );
    (shape, cache, options, 0..3usize, splits, any::<u64>(), more).prop_map(
        move |(
            (batch, heads_kv, group, s_q, capacity, dim_qk, dim_v),
            (page_size, append),
            ((causal, window), softcap, alibi, bias, score_fn),
            dtype,
            splits,
            seed,
            more,
        )| {
            let dim_v = dim_v.unwrap_or(dim_qk);
            // Room for the appended keys, and fewer sequences where the oracle's work would
            // pass the bound.
            let fit = |batch: usize, heads_kv: usize, capacity: usize| {
                let capacity = capacity.max(if append { s_q } else { 1 });
                let work = |b: usize| b * heads_kv * group * s_q * capacity * (dim_qk + dim_v);
                let mut batch = batch;
                while batch > 1 && work(batch) > bounds.work {
                    batch -= 1;
                }
                (batch, capacity)
            };
            let (batch, capacity) = fit(batch, heads_kv, capacity);
            let more = more
                .into_iter()
                .map(|(batch, heads_kv, capacity, seed)| {
                    let (batch, capacity) = fit(batch, heads_kv, capacity);
                    (batch, heads_kv, capacity, seed)
                })
                .collect();
            DrawnDecode {
                serving: Serving {
                    batch,
                    heads_q: heads_kv * group,
                    heads_kv,
                    s_q,
                    capacity,
                    dim_qk,
                    dim_v,
                    page_size,
                    append,
                    causal,
                    window,
                    softcap,
                    alibi,
                    bias,
                    score_fn,
                },
                dtype,
                splits,
                seed,
                more,
            }
        },
    )
}

#[test]
fn random_decode_steps_match_the_oracle() {
    let client = common::client();
    let bounds = match common::is_cpu_device() {
        true => DECODE_CPU,
        false => DECODE_GPU,
    };
    fuzz(drawn_decode(bounds), 8, |t| {
        // The first step decides whether the case runs; a later one the oracle cannot
        // afford, or that the kernels refuse, is left out.
        for (n, t) in t.steps().enumerate() {
            let s = t.serving;
            let affordable =
                s.batch * s.heads_q * s.s_q * s.capacity * (s.dim_qk + s.dim_v) <= bounds.work;
            let ran = affordable.then(|| {
                let dtypes = common::dtypes(&client);
                let dtype = dtypes[t.dtype % dtypes.len()];
                let splits = t.splits.map_or(Splits::Auto, Splits::Exactly);
                // Each sequence empty, holding one position, full, or in between.
                let mut rng = StdRng::seed_from_u64(t.seed);
                let most = s.capacity - s.s_new();
                let lengths = (0..s.batch)
                    .map(|_| match rng.random_range(0..4) {
                        0 => 0,
                        1 => most.min(1),
                        2 => most,
                        _ => rng.random_range(0..=most),
                    })
                    .collect();
                decode::check_seeded(&client, &s, dtype, lengths, splits, (t.seed, rng)).is_ok()
            });
            prop_assume!(
                n > 0 || ran == Some(true),
                "past the oracle's budget or refused"
            );
        }
        Ok(())
    });
}
