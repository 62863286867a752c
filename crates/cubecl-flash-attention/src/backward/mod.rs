//! The backward pass: `dQ`, `dK`, `dV` from `dO`, recomputing the scores from Q, K and the
//! forward's LSE instead of storing them. Three launches:
//! 1. [`flash_backward_delta`]: `D = rowsum(dO ⊙ O)`;
//! 2. [`flash_backward_dkdv`]: `dK`, `dV` per key block (GQA groups summed in the cube);
//! 3. [`flash_backward_dq`]: `dQ` per query block.
//!
//! Steps 2 and 3 have a portable form, a tensor-core form ([`flash_backward_dkdv_cmma`],
//! [`flash_backward_dq_cmma`]) and a register-level form ([`flash_backward_dkdv_mma`],
//! [`flash_backward_dq_mma`]), chosen as in the forward. The register-level path steps down
//! to the `cmma` kernels where its kernels cannot take the problem: inputs not readable by
//! 16-byte copies, or head dims too large for its registers and shared memory (beyond 256).
//!
//! For query sequences of at least [`crate::config::ATOMIC_DQ_MIN_SEQ_Q`], unless
//! [`AttentionOptions::deterministic`] is set, the register-level path folds step 3 into
//! step 2 where the tiles allow: the dK/dV kernel adds `dS·K` to an f32 dQ sum with
//! atomics ([`dq_atomic`]), five matrix products per block pair instead of seven.
//!
//! Extra device memory: `D`, `[b, h_q, s_q]` f32, and for the atomic dQ its f32 sum (the
//! shape of Q). No `s × s` buffer. Without atomics the result is bitwise identical from run
//! to run.

mod dkdv;
mod dkdv_cmma;
mod dkdv_register_mma;
mod dq;
mod dq_atomic;
mod dq_cmma;
mod dq_register_mma;
mod preprocess;

use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use crate::bias::{ScoreBias, ScoreTerms, StagedBias, TermsGrad, sum_bias_grad};
use crate::config::{
    DeviceLimits, KernelPath, MmaConfig, RegisterBackwardConfig, TileConfig, apply_tile_override,
    choose_mma_tiles, choose_path, choose_portable_tiles, choose_register_backward_tiles,
};
use crate::error::FlashError;
use crate::forward::packed_problem;
use crate::launch::{
    DeviceTensor, MAX_SPAN, blocks_by_pairs, check_dtype, check_spans, expect_shape, grid,
    readable_by_16_byte_copies, softcap_arg, window_args,
};
use crate::loop_budget;
use crate::problem::{AttentionOptions, AttentionProblem, FloatDtype};
use crate::score_mod::{cell_type, float_atomics};
use crate::sequence::{PackedSequences, batch_view, cu_seqlens};

pub use dkdv::flash_backward_dkdv;
pub use dkdv_cmma::{flash_backward_dkdv_cmma, shared_bytes as dkdv_cmma_shared_bytes};
pub use dkdv_register_mma::flash_backward_dkdv_mma;
pub use dq::flash_backward_dq;
pub use dq_atomic::flash_backward_dq_from_sum;
pub use dq_cmma::{flash_backward_dq_cmma, shared_bytes as dq_cmma_shared_bytes};
pub use dq_register_mma::flash_backward_dq_mma;
pub use preprocess::{DELTA_LANES, flash_backward_delta};

/// Gradients of Q, K and V, contiguous, in the input dtype.
#[derive(Clone, Debug)]
pub struct Gradients {
    pub dq: DeviceTensor,
    pub dk: DeviceTensor,
    pub dv: DeviceTensor,
}

/// The forward's tensors the backward reads: `out` and `lse` as [`crate::forward::forward`]
/// returned them.
#[derive(Clone, Copy)]
pub struct Saved<'a> {
    pub q: &'a DeviceTensor,
    pub k: &'a DeviceTensor,
    pub v: &'a DeviceTensor,
    pub out: &'a DeviceTensor,
    pub lse: &'a DeviceTensor,
}

/// Runs the backward pass for the upstream gradient `d_out` (shape of `out`).
pub fn backward(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<Gradients, FlashError> {
    let none = ScoreBias::none();
    let no_grad = TermsGrad::default();
    backward_biased(client, saved, d_out, none, no_grad, dtype, options, path).map(|(g, _)| g)
}

/// The gradients of the score terms [`backward_biased`] computes, in f32.
#[derive(Clone, Debug, Default)]
pub struct TermsGradients {
    /// `d(bias)` in the bias's shape (contiguous), summed over the dimensions where the bias
    /// broadcasts.
    pub bias: Option<DeviceTensor>,
    /// The gradient of the score function's parameters, in their shape and strides.
    pub score_params: Option<DeviceTensor>,
}

/// [`backward`] of [`crate::forward::forward_biased`]: the same score terms `bias`, and
/// the gradients of the terms `grad` asks for.
#[allow(clippy::too_many_arguments)]
pub fn backward_biased(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    bias: ScoreBias<'_>,
    grad: TermsGrad,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(Gradients, TermsGradients), FlashError> {
    let Saved { q, k, v, .. } = saved;
    let problem = AttentionProblem::new(&q.shape, &k.shape, &v.shape, dtype, options)?;
    backward_with_terms(client, saved, d_out, &problem, None, (bias, grad), path)
}

/// The backward of `problem` with score terms `bias` and the terms' gradients `grad` asks
/// for: of a dense batch, or of the packed batch `packed` (whose tensors are packed, `out`
/// `[total_q, h_q, d_v]`, `lse` `[h_q, total_q]`).
fn backward_with_terms(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    problem: &AttentionProblem,
    packed: Option<(&PackedSequences, &PackedSequences)>,
    (bias, grad): (ScoreBias<'_>, TermsGrad),
    path: KernelPath,
) -> Result<(Gradients, TermsGradients), FlashError> {
    let Saved { q, k, v, .. } = saved;
    let (problem, dtype, options) = (*problem, problem.dtype, problem.options);
    let mut terms = bias.terms(&problem, grad)?;
    let zeros_like = |t: &DeviceTensor| DeviceTensor::zeros_f32(client, &t.shape);
    let dbias = bias.bias.filter(|_| grad.bias).map(zeros_like);
    let dparams = bias
        .score_params
        .filter(|_| terms.score_params_grad)
        .map(|p| DeviceTensor::zeros_f32_like(client, p));
    if problem.is_empty() || problem.seq_kv == 0 {
        // No query, or no key: every gradient is zero.
        let shapes = [&q.shape[..], &k.shape[..], &v.shape[..]];
        let terms_grads = TermsGradients {
            bias: dbias,
            score_params: dparams,
        };
        return Ok((zero_gradients(client, shapes, dtype)?, terms_grads));
    }
    // A deterministic backward adds a broadcast bias's gradient up in a pass of its own, in
    // a fixed order, from the whole `[b, h_q, s_q, s_kv]` gradient (that much memory more).
    let full = [
        problem.batch,
        problem.heads_q,
        problem.seq_q,
        problem.seq_kv,
    ];
    let mut full_dbias = None;
    if let (true, Some(out)) = (options.deterministic && terms.bias_grad_sums, &dbias) {
        // Each unit of the sum loops over the positions folded into its element.
        let folded: usize = (0..4)
            .filter(|&d| out.shape[d] == 1)
            .map(|d| full[d])
            .product();
        let limits = DeviceLimits::from_properties(client.properties());
        loop_budget::check("bias-gradient sum", folded as u64, &problem, &limits)?;
        terms.bias_grad_sums = false;
        if full.iter().product::<usize>() > MAX_SPAN {
            return Err(FlashError::Option {
                arg: "deterministic",
                expected: format!(
                    "false for this bias: its deterministic gradient sums a whole {full:?} \
                     gradient, past the 2^32 − 1 elements the kernels address"
                ),
            });
        }
        full_dbias = Some(DeviceTensor::zeros_f32(client, &full));
    }
    let grads = Gradients {
        dq: DeviceTensor::empty(client, &q.shape, dtype.size()),
        dk: DeviceTensor::empty(client, &k.shape, dtype.size()),
        dv: DeviceTensor::empty(client, &v.shape, dtype.size()),
    };
    let (out_shape, lse_shape) = match packed {
        Some(_) => (
            vec![q.shape[0], problem.heads_q, problem.dim_v],
            vec![problem.heads_q, q.shape[0]],
        ),
        None => (problem.out_shape().to_vec(), problem.lse_shape().to_vec()),
    };
    check_shapes(saved, d_out, &grads, &out_shape, &lse_shape)?;
    let outputs = TermsOutputs {
        dbias: full_dbias.as_ref().or(dbias.as_ref()),
        dparams: dparams.as_ref(),
    };
    let terms = (bias, terms, outputs);
    match packed {
        Some(sequences) => launch_packed(
            client, saved, d_out, &grads, &problem, sequences, terms, path,
        )?,
        None => launch(client, saved, d_out, &grads, &problem, None, terms, path)?,
    }
    if let (Some(full), Some(out)) = (&full_dbias, &dbias) {
        let elements: usize = out.shape.iter().product();
        let cube = 256u32;
        unsafe {
            sum_bias_grad::launch_unchecked(
                client,
                calculate_cube_count_elemwise(client, elements, CubeDim::new_1d(cube)),
                CubeDim::new_1d(cube),
                full.arg(),
                out.arg(),
            );
        }
    }
    let terms_grads = TermsGradients {
        bias: dbias,
        score_params: dparams,
    };
    Ok((grads, terms_grads))
}

/// Where the dQ kernels write the terms' gradients (f32, zeroed): `d(bias)` and the score
/// function's parameters' gradient, where the terms ask for them.
#[derive(Clone, Copy, Default)]
struct TermsOutputs<'a> {
    dbias: Option<&'a DeviceTensor>,
    dparams: Option<&'a DeviceTensor>,
}

/// [`backward`] into caller-provided gradients (shapes of Q, K, V; any strides). Needs
/// non-empty query and key sequences ([`backward`] handles the empty cases).
pub fn backward_into(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    grads: &Gradients,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(), FlashError> {
    let Saved { q, k, v, .. } = saved;
    let problem = AttentionProblem::new(&q.shape, &k.shape, &v.shape, dtype, options)?;
    let lse_shape = problem.lse_shape();
    check_shapes(saved, d_out, grads, &problem.out_shape(), &lse_shape)?;
    if problem.is_empty() || problem.seq_kv == 0 {
        return Err(FlashError::Shape {
            arg: "key",
            shape: k.shape.clone(),
            expected: "backward_into needs non-empty query and key sequences".into(),
        });
    }
    let no_terms = (
        ScoreBias::none(),
        ScoreTerms::default(),
        TermsOutputs::default(),
    );
    launch(client, saved, d_out, grads, &problem, None, no_terms, path)
}

/// An error naming the argument unless `out` and `d_out` have `out_shape`, `lse` has
/// `lse_shape` and the gradients the shapes of Q, K, V.
fn check_shapes(
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    grads: &Gradients,
    out_shape: &[usize],
    lse_shape: &[usize],
) -> Result<(), FlashError> {
    expect_shape("out", saved.out, out_shape)?;
    expect_shape("d_out", d_out, out_shape)?;
    expect_shape("lse", saved.lse, lse_shape)?;
    expect_shape("dq", &grads.dq, &saved.q.shape)?;
    expect_shape("dk", &grads.dk, &saved.k.shape)?;
    expect_shape("dv", &grads.dv, &saved.v.shape)
}

/// The backward pass of a packed batch ([`crate::forward::forward_packed`]): `saved` holds
/// the packed `q`, `k`, `v`, the forward's `out` `[total_q, h_q, d_v]` and `lse`
/// `[h_q, total_q]`; `d_out` has the shape of `out`. Returns the gradients, contiguous,
/// in the shapes of `q`, `k`, `v`.
#[allow(clippy::too_many_arguments)]
pub fn backward_packed(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    sequences_q: &PackedSequences,
    sequences_kv: &PackedSequences,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<Gradients, FlashError> {
    let (none, no_grad) = (ScoreBias::none(), TermsGrad::default());
    let sequences = [sequences_q, sequences_kv];
    backward_packed_biased(
        client, saved, d_out, sequences, none, no_grad, dtype, options, path,
    )
    .map(|(g, _)| g)
}

/// [`backward_packed`] of [`crate::forward::forward_packed_biased`]: the same score terms
/// `bias` (each indexed by sequence, head and positions within the sequence), and the
/// gradients of the terms `grad` asks for.
#[allow(clippy::too_many_arguments)]
pub fn backward_packed_biased(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    [sequences_q, sequences_kv]: [&PackedSequences; 2],
    bias: ScoreBias<'_>,
    grad: TermsGrad,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(Gradients, TermsGradients), FlashError> {
    let problem = packed_problem(
        [saved.q, saved.k, saved.v],
        sequences_q,
        sequences_kv,
        dtype,
        options,
    )?;
    let sequences = Some((sequences_q, sequences_kv));
    backward_with_terms(
        client,
        saved,
        d_out,
        &problem,
        sequences,
        (bias, grad),
        path,
    )
}

/// [`backward_packed`] into caller-provided gradients (shapes of Q, K, V; any strides).
#[allow(clippy::too_many_arguments)]
pub fn backward_packed_into(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    grads: &Gradients,
    [sequences_q, sequences_kv]: [&PackedSequences; 2],
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(), FlashError> {
    let Saved { q, k, v, .. } = saved;
    let problem = packed_problem([q, k, v], sequences_q, sequences_kv, dtype, options)?;
    let out_shape = [q.shape[0], problem.heads_q, problem.dim_v];
    let lse_shape = [problem.heads_q, q.shape[0]];
    check_shapes(saved, d_out, grads, &out_shape, &lse_shape)?;
    if problem.is_empty() || problem.seq_kv == 0 {
        return Err(FlashError::Shape {
            arg: "key",
            shape: k.shape.clone(),
            expected: "backward_packed_into needs a query and a key in some sequence".into(),
        });
    }
    let sequences = (sequences_q, sequences_kv);
    let no_terms = (
        ScoreBias::none(),
        ScoreTerms::default(),
        TermsOutputs::default(),
    );
    launch_packed(
        client, saved, d_out, grads, &problem, sequences, no_terms, path,
    )
}

/// [`launch`] on the kernels' `[1, heads, total, dim]` views of a packed batch's tensors.
#[allow(clippy::too_many_arguments)]
fn launch_packed(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    grads: &Gradients,
    problem: &AttentionProblem,
    sequences: (&PackedSequences, &PackedSequences),
    terms: (ScoreBias<'_>, ScoreTerms, TermsOutputs<'_>),
    path: KernelPath,
) -> Result<(), FlashError> {
    let Saved { q, k, v, out, lse } = saved;
    let view = |t: &DeviceTensor| batch_view(t);
    let views = Gradients {
        dq: view(&grads.dq),
        dk: view(&grads.dk),
        dv: view(&grads.dv),
    };
    let saved = Saved {
        q: &view(q),
        k: &view(k),
        v: &view(v),
        out: &view(out),
        lse: &view(lse),
    };
    launch(
        client,
        saved,
        &view(d_out),
        &views,
        problem,
        Some(sequences),
        terms,
        path,
    )
}

/// Launches the backward kernels for `problem`, into `grads`, with the score terms `bias`
/// (checked, as `terms`) and, where `terms` asks for them, their gradients into `outputs`;
/// a packed batch's tensors are the kernels' `[1, heads, total, dim]` views.
#[allow(clippy::too_many_arguments)]
fn launch(
    client: &Client,
    saved: Saved<'_>,
    d_out: &DeviceTensor,
    grads: &Gradients,
    problem: &AttentionProblem,
    packed: Option<(&PackedSequences, &PackedSequences)>,
    (bias, terms, outputs): (ScoreBias<'_>, ScoreTerms, TermsOutputs<'_>),
    path: KernelPath,
) -> Result<(), FlashError> {
    let Saved { q, k, v, out, lse } = saved;
    let (mut problem, dtype) = (*problem, problem.dtype);
    check_dtype(client, dtype)?;
    check_spans(
        [
            ("query", q),
            ("key", k),
            ("value", v),
            ("out", out),
            ("lse", lse),
            ("d_out", d_out),
            ("dq", &grads.dq),
            ("dk", &grads.dk),
            ("dv", &grads.dv),
        ]
        .into_iter()
        .chain(bias.indexed_tensors()),
    )?;
    let (cu_q, cu_kv) = cu_seqlens(packed, lse);
    let is_packed = packed.is_some();
    let limits = DeviceLimits::from_properties(client.properties());
    // The terms' gradients are written by the dQ kernels: no dQ folded into dK/dV by
    // atomics.
    problem.options.deterministic |= terms.bias_grad || terms.score_params_grad;
    let mut plan = plan(path, &problem, &limits, [q, k, v, d_out])?;
    // The register-level dK/dV kernel walks one list of query blocks for every query head of
    // a group: a block mask that differs between a group's heads takes the `cmma` kernels.
    let per_head_mask = bias.block_mask.is_some_and(|m| m.layout.shape[1] > 1);
    if matches!(plan, Plan::RegisterMma(_)) && per_head_mask && problem.group_size() > 1 {
        plan = Plan::TensorCore;
    }
    // Where the device adds floats atomically the sums run no loop of their own.
    let sum_loops = terms.bias_grad_sums && !float_atomics(client.properties());
    if let (Plan::Portable { dq, .. }, true) = (&plan, sum_loops) {
        let iterations = loop_budget::dq_iterations(&problem, dq)
            + loop_budget::bias_grad_sum_iterations(&problem, dq);
        loop_budget::check(
            "dQ (with the bias's gradient)",
            iterations,
            &problem,
            &limits,
        )?;
    }
    // Absent terms pass tokens the kernels never read.
    let (block_words, by_query) = bias.block_args(lse, false);
    let (_, by_key) = bias.block_args(lse, true);
    let dim = problem.dim_qk.max(problem.dim_v);
    let elem_size = dtype.size();
    let staged_dq = StagedBias::Dq.wanted(bias.bias, elem_size);
    let staged_dkdv = StagedBias::Dkdv { dim }.wanted(bias.bias, elem_size);
    let [bias, slopes, params] = bias.args(q, lse);
    let terms = terms.with_dropout_of(&problem);
    let dbias = outputs.dbias.unwrap_or(lse).clone();
    let dparams = outputs.dparams.unwrap_or(lse).clone();
    // With terms, the kernels read the LSE the delta kernel rewrites: rows the terms hide
    // completely (`LSE = −∞`) must give `P = 0`.
    let guarded_lse = (terms.any() || terms.block_mask.is_some())
        .then(|| DeviceTensor::empty(client, &lse.shape, 4));
    let lse_in = lse;
    let lse = guarded_lse.as_ref().unwrap_or(lse_in);
    let (left, right) = window_args(&problem);
    let (scale, softcap) = (problem.scale(), softcap_arg(&problem));
    let elem = dtype.elem_type();
    let cells = cell_type(client.properties());

    let delta = DeviceTensor::empty(client, &lse.shape, 4);
    let rows: usize = lse.shape.iter().product();
    let cube = 256u32.min(limits.max_units_per_cube as u32);
    let delta_rows = cube as usize / DELTA_LANES;
    let delta_dim = CubeDim::new_1d((delta_rows * DELTA_LANES) as u32);
    unsafe {
        flash_backward_delta::launch_unchecked(
            client,
            calculate_cube_count_elemwise(client, rows * DELTA_LANES, delta_dim),
            delta_dim,
            out.arg(),
            d_out.arg(),
            delta.arg(),
            lse_in.arg(),
            guarded_lse.as_ref().unwrap_or(lse_in).arg(),
            problem.dim_v,
            delta_rows,
            guarded_lse.is_some(),
            elem,
        );
    }

    match plan {
        Plan::RegisterMma(config) => {
            // Each kernel stages the bias or not ([`StagedBias`]), where the stages fit.
            let staged = |wanted: bool| match config.staging_bias(elem_size, &limits) {
                Some(staged) if wanted => staged,
                _ => config,
            };
            let (dkdv_config, dq_config) = (staged(staged_dkdv), staged(staged_dq));
            // dK/dV: cubes of keys streaming queries; dQ: cubes of queries streaming keys.
            if let Some(blocks) = terms.block_mask {
                blocks.check_tiles(config.block_stream, config.block_rows())?;
                blocks.check_tiles(config.block_rows(), config.block_stream)?;
            }
            // The zeroed f32 dQ sum of the atomic form (a token tensor without).
            let dq_sum = if config.atomic_dq {
                DeviceTensor::zeros_f32(client, &q.shape)
            } else {
                DeviceTensor::empty(client, &[1, 1, 1, 1], 4)
            };
            let count = blocks_by_pairs(
                problem.seq_kv.div_ceil(config.block_rows()),
                problem.batch * problem.heads_kv,
            );
            for &gradients in config.key_gradients() {
                unsafe {
                    flash_backward_dkdv_mma::launch_unchecked(
                        client,
                        count.clone(),
                        CubeDim::new_1d(config.units() as u32),
                        q.arg(),
                        k.arg(),
                        v.arg(),
                        d_out.arg(),
                        lse.arg(),
                        delta.arg(),
                        grads.dk.arg(),
                        grads.dv.arg(),
                        dq_sum.arg(),
                        cu_q.arg(),
                        cu_kv.arg(),
                        q.row_layout("query")?,
                        k.row_layout("key")?,
                        v.row_layout("value")?,
                        d_out.row_layout("d_out")?,
                        lse.row_layout("lse")?,
                        delta.row_layout("delta")?,
                        dq_sum.row_layout("dq")?,
                        scale,
                        softcap,
                        left,
                        right,
                        bias.arg(),
                        slopes.arg(),
                        problem.dropout_args(),
                        block_words.arg(),
                        by_key.arg(),
                        params.arg(),
                        warpgroup_only_for(dkdv_config, "dkdv"),
                        gradients,
                        is_packed,
                        terms,
                        elem,
                    );
                }
            }
            if config.atomic_dq {
                unsafe {
                    let elements = q.shape.iter().product::<usize>();
                    flash_backward_dq_from_sum::launch_unchecked(
                        client,
                        calculate_cube_count_elemwise(client, elements, CubeDim::new_1d(cube)),
                        CubeDim::new_1d(cube),
                        dq_sum.arg(),
                        grads.dq.arg(),
                        scale,
                        elem,
                    );
                }
                return Ok(());
            }
            let count = blocks_by_pairs(
                problem.seq_q.div_ceil(config.block_rows()),
                problem.batch * problem.heads_q,
            );
            unsafe {
                flash_backward_dq_mma::launch_unchecked(
                    client,
                    count,
                    CubeDim::new_1d(config.units() as u32),
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    d_out.arg(),
                    lse.arg(),
                    delta.arg(),
                    grads.dq.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    q.row_layout("query")?,
                    k.row_layout("key")?,
                    v.row_layout("value")?,
                    d_out.row_layout("d_out")?,
                    scale,
                    softcap,
                    left,
                    right,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    by_query.arg(),
                    dbias.arg(),
                    params.arg(),
                    dparams.arg(),
                    warpgroup_only_for(dq_config, "dq"),
                    is_packed,
                    terms,
                    elem,
                    cells,
                );
            }
        }
        Plan::TensorCore => {
            let config = dkdv_mma_config(&problem, &limits)?;
            let count = blocks_by_pairs(
                problem.seq_kv.div_ceil(config.block_rows()),
                problem.batch * problem.heads_kv,
            );
            unsafe {
                flash_backward_dkdv_cmma::launch_unchecked(
                    client,
                    count,
                    CubeDim::new_1d(config.units() as u32),
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    d_out.arg(),
                    lse.arg(),
                    delta.arg(),
                    grads.dk.arg(),
                    grads.dv.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    scale,
                    softcap,
                    left,
                    right,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    by_key.arg(),
                    params.arg(),
                    config,
                    is_packed,
                    terms,
                    elem,
                );
            }
            let config = dq_mma_config(&problem, &limits)?;
            let count = blocks_by_pairs(
                problem.seq_q.div_ceil(config.block_rows()),
                problem.batch * problem.heads_q,
            );
            unsafe {
                flash_backward_dq_cmma::launch_unchecked(
                    client,
                    count,
                    CubeDim::new_1d(config.units() as u32),
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    d_out.arg(),
                    lse.arg(),
                    delta.arg(),
                    grads.dq.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    scale,
                    softcap,
                    left,
                    right,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    by_query.arg(),
                    dbias.arg(),
                    params.arg(),
                    dparams.arg(),
                    config,
                    is_packed,
                    terms,
                    elem,
                    cells,
                );
            }
        }
        Plan::Portable { dkdv, dq } => {
            let (count, dim) = grid(&dkdv, problem.seq_kv, problem.batch, problem.heads_kv);
            unsafe {
                flash_backward_dkdv::launch_unchecked(
                    client,
                    count,
                    dim,
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    d_out.arg(),
                    lse.arg(),
                    delta.arg(),
                    grads.dk.arg(),
                    grads.dv.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    scale,
                    softcap,
                    left,
                    right,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    by_key.arg(),
                    params.arg(),
                    dkdv,
                    is_packed,
                    terms,
                    elem,
                );
            }

            let (count, dim) = grid(&dq, problem.seq_q, problem.batch, problem.heads_q);
            unsafe {
                flash_backward_dq::launch_unchecked(
                    client,
                    count,
                    dim,
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    d_out.arg(),
                    lse.arg(),
                    delta.arg(),
                    grads.dq.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    scale,
                    softcap,
                    left,
                    right,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    by_query.arg(),
                    dbias.arg(),
                    params.arg(),
                    dparams.arg(),
                    dq,
                    is_packed,
                    terms,
                    elem,
                    cells,
                );
            }
        }
    }
    Ok(())
}

/// The backward kernels that run.
enum Plan {
    RegisterMma(RegisterBackwardConfig),
    TensorCore,
    /// The dK/dV and dQ kernels' tiles, both checked before anything launches.
    Portable {
        dkdv: TileConfig,
        dq: TileConfig,
    },
}

/// [`choose_path`]'s path, except that the register-level path steps down to the `cmma`
/// kernels for problems its backward kernels do not take (see the module docs). Requesting
/// it on a device without it is an error, as in the forward.
fn plan(
    requested: KernelPath,
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    inputs: [&DeviceTensor; 4],
) -> Result<Plan, FlashError> {
    match choose_path(requested, problem.dtype, limits)? {
        KernelPath::RegisterMma => {
            let readable = inputs
                .iter()
                .all(|t| readable_by_16_byte_copies(t, problem.dtype.size()));
            match choose_register_backward_tiles(problem, limits) {
                Ok(config) if readable => Ok(Plan::RegisterMma(tuned(config, problem, limits)?)),
                _ => choose_path(KernelPath::TensorCore, problem.dtype, limits)
                    .map(|_| Plan::TensorCore),
            }
        }
        KernelPath::TensorCore => Ok(Plan::TensorCore),
        KernelPath::Auto | KernelPath::Portable => Ok(Plan::Portable {
            dkdv: dkdv_portable_config(problem, limits)?,
            dq: dq_portable_config(problem, limits)?,
        }),
    }
}

/// Tiles of the register-level backward kernels, as the launcher picks them (for
/// [`crate::sources`], compiled with the CUDA or ROCm runtime).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn register_backward_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<RegisterBackwardConfig, FlashError> {
    tuned(
        choose_register_backward_tiles(problem, limits)?,
        problem,
        limits,
    )
}

/// `config` with the tuning overrides applied: `FLASH_WGMMA=0` takes the tiles chosen
/// without warpgroup products (sm_90), for comparison; `FLASH_MMA_BWD_TILES=planes,block_stream`
/// (e.g. `8,32`) sets the tiles of the `mma.sync` kernels (no warpgroup products),
/// `FLASH_WGMMA_BWD_TILES=planes` (4 or 8: one or two warpgroups per cube) those of the
/// warpgroup kernels; `FLASH_BIAS_AHEAD=0` (or `fwd`) reads the bias after the products
/// ([`RegisterBackwardConfig::bias_ahead`]).
fn tuned(
    config: RegisterBackwardConfig,
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<RegisterBackwardConfig, FlashError> {
    let mut config = config;
    if matches!(
        std::env::var("FLASH_BIAS_AHEAD").as_deref(),
        Ok("0" | "fwd")
    ) {
        config.bias_ahead = false;
    }
    let config = match std::env::var("FLASH_WGMMA").as_deref() {
        Ok("0") if config.warpgroup.is_some() => choose_register_backward_tiles(
            problem,
            &DeviceLimits {
                warpgroup_mma: false,
                ..*limits
            },
        )?,
        _ => config,
    };
    let tiles = apply_tile_override(
        "FLASH_MMA_BWD_TILES",
        "planes (1 to 16),block_stream (a multiple of 16)",
        RegisterBackwardConfig {
            warpgroup: None,
            ..config
        },
        |config, parts| match *parts {
            [planes, block_stream]
                if (1..=16).contains(&planes) && block_stream % 16 == 0 && block_stream > 0 =>
            {
                config.planes = planes;
                config.block_stream = block_stream;
                true
            }
            _ => false,
        },
        |config| config.shared_bytes(problem.dtype.size()),
        limits,
    )?;
    if std::env::var_os("FLASH_MMA_BWD_TILES").is_some() {
        return Ok(tiles);
    }
    if config.warpgroup.is_none() {
        return Ok(config);
    }
    apply_tile_override(
        "FLASH_WGMMA_BWD_TILES",
        "planes (4 or 8)",
        config,
        |config, parts| match *parts {
            [planes @ (4 | 8)] => {
                config.planes = planes;
                true
            }
            _ => false,
        },
        |config| config.shared_bytes(problem.dtype.size()),
        limits,
    )
}

/// `config` for the register-level backward kernel `kernel` ("dkdv" or "dq"):
/// `FLASH_WGMMA=dkdv` (`dq`) keeps the warpgroup products in that kernel alone, for
/// comparison.
fn warpgroup_only_for(config: RegisterBackwardConfig, kernel: &str) -> RegisterBackwardConfig {
    match std::env::var("FLASH_WGMMA").as_deref() {
        Ok(only @ ("dkdv" | "dq")) if only != kernel => RegisterBackwardConfig {
            warpgroup: None,
            ..config
        },
        _ => config,
    }
}

/// Tiles of the portable dK/dV kernel: key rows in registers; Q, dO, LSE and D rows staged
/// in f32.
pub(crate) fn dkdv_portable_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<TileConfig, FlashError> {
    let config = choose_portable_tiles(problem, limits, 4 * (problem.dim_qk + problem.dim_v + 2))?;
    let iterations = loop_budget::dkdv_iterations(problem, &config);
    loop_budget::check("dK/dV", iterations, problem, limits)?;
    Ok(config)
}

/// Tiles of the portable dQ kernel: query rows in registers; K and V rows staged in f32.
pub(crate) fn dq_portable_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<TileConfig, FlashError> {
    let config = choose_portable_tiles(problem, limits, 4 * (problem.dim_qk + problem.dim_v))?;
    let iterations = loop_budget::dq_iterations(problem, &config);
    loop_budget::check("dQ", iterations, problem, limits)?;
    Ok(config)
}

/// Tiles of the tensor-core dK/dV kernel.
pub(crate) fn dkdv_mma_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<MmaConfig, FlashError> {
    choose_mma_tiles(problem, limits, dkdv_cmma::shared_bytes)
}

/// Tiles of the tensor-core dQ kernel.
pub(crate) fn dq_mma_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<MmaConfig, FlashError> {
    choose_mma_tiles(problem, limits, dq_cmma::shared_bytes)
}

/// Gradients of a problem with no query or no key: all zero, in the shapes of Q, K, V.
fn zero_gradients(
    client: &Client,
    [q, k, v]: [&[usize]; 3],
    dtype: FloatDtype,
) -> Result<Gradients, FlashError> {
    let zeros = |shape: &[usize]| {
        let bytes = vec![0u8; shape.iter().product::<usize>() * dtype.size()];
        DeviceTensor::from_bytes(client, shape, &bytes)
    };
    Ok(Gradients {
        dq: zeros(q),
        dk: zeros(k),
        dv: zeros(v),
    })
}
