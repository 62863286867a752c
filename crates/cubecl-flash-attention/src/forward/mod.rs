//! The forward pass: `O = softmax(Q·Kᵀ·scale) · V` and the LSE of every query row.

mod cmma;
mod portable;
mod register_mma;

use cubecl::prelude::*;

use crate::bias::{ScoreBias, ScoreTerms, StagedBias, TermsGrad};
use crate::config::{
    DeviceLimits, KernelPath, MmaConfig, RegisterMmaConfig, TileConfig, apply_tile_override,
    choose_mma_tiles, choose_path, choose_portable_tiles, choose_register_mma_tiles,
};
use crate::error::FlashError;
use crate::launch::{
    DeviceTensor, blocks_by_pairs, check_dtype, check_spans, expect_shape, grid,
    readable_by_16_byte_copies, softcap_arg, window_args,
};
use crate::loop_budget;
use crate::problem::{AttentionOptions, AttentionProblem, FloatDtype};
use crate::sequence::{PackedSequences, batch_view, cu_seqlens};

pub use cmma::{flash_forward_cmma, shared_bytes as cmma_shared_bytes};
pub use portable::flash_forward;
pub use register_mma::flash_forward_mma;

/// Output of the forward pass: `O` `[b, h_q, s_q, d_v]` in the input dtype, and the
/// natural-log LSE `[b, h_q, s_q]` in f32 (−∞ for rows that see no key).
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    pub out: DeviceTensor,
    pub lse: DeviceTensor,
    pub problem: AttentionProblem,
}

/// Runs the forward pass on `client`'s device. Q, K, V may have any strides
/// (`[b, s, h, d]` memory viewed as `[b, h, s, d]` is read in place).
pub fn forward(
    client: &Client,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<ForwardOutput, FlashError> {
    forward_biased(client, q, k, v, ScoreBias::none(), dtype, options, path)
}

/// [`forward`] with terms added to the scores after masking ([`crate::bias`]): a bias
/// tensor `[b | 1, h_q | 1, s_q | 1, s_kv | 1]` in the dtype of Q (−∞ hides a key) and/or
/// ALiBi slopes `[b | 1, h_q]` (f32), a block mask, a score function
/// ([`crate::score_mod`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_biased(
    client: &Client,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    bias: ScoreBias<'_>,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<ForwardOutput, FlashError> {
    let problem = AttentionProblem::new(&q.shape, &k.shape, &v.shape, dtype, options)?;
    let terms = bias.terms(&problem, TermsGrad::default())?;
    let out = DeviceTensor::empty(client, &problem.out_shape(), dtype.size());
    let lse = DeviceTensor::empty(client, &problem.lse_shape(), 4);
    launch(
        client,
        [q, k, v],
        &out,
        &lse,
        &problem,
        None,
        (bias, terms),
        path,
    )?;
    Ok(ForwardOutput { out, lse, problem })
}

/// [`forward`] into caller-provided outputs: `out` `[b, h_q, s_q, d_v]` (dtype `dtype`) and
/// `lse` `[b, h_q, s_q]` (f32), of any strides.
#[allow(clippy::too_many_arguments)]
pub fn forward_into(
    client: &Client,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &DeviceTensor,
    lse: &DeviceTensor,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(), FlashError> {
    let problem = AttentionProblem::new(&q.shape, &k.shape, &v.shape, dtype, options)?;
    expect_shape("out", out, &problem.out_shape())?;
    expect_shape("lse", lse, &problem.lse_shape())?;
    let no_terms = (ScoreBias::none(), ScoreTerms::default());
    launch(client, [q, k, v], out, lse, &problem, None, no_terms, path)
}

/// The forward pass of a packed batch of variable-length sequences (no padding): `q`
/// `[total_q, h_q, d_qk]`, `k` `[total_kv, h_kv, d_qk]`, `v` `[total_kv, h_kv, d_v]`, of any
/// strides, sequence `i` at tokens `cu_seqlens[i]..cu_seqlens[i + 1]` of `sequences_q`
/// (`sequences_kv`). Returns `out` `[total_q, h_q, d_v]` and the LSE `[h_q, total_q]` (as
/// FlashAttention's varlen forward). Masks are bottom-right aligned within each sequence.
#[allow(clippy::too_many_arguments)]
pub fn forward_packed(
    client: &Client,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    sequences_q: &PackedSequences,
    sequences_kv: &PackedSequences,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<ForwardOutput, FlashError> {
    let sequences = [sequences_q, sequences_kv];
    let none = ScoreBias::none();
    forward_packed_biased(client, [q, k, v], sequences, none, dtype, options, path)
}

/// [`forward_packed`] with score terms ([`forward_biased`]'s), each indexed as in the dense
/// batch of the sequences padded to the longest: by sequence, head and positions within the
/// sequence. A bias is `[b | 1, h_q | 1, longest s_q | 1, longest s_kv | 1]` (a sequence
/// reads its top-left `s_q × s_kv` corner), ALiBi slopes `[b | 1, h_q]`, a block mask's
/// blocks those of the padded batch, and a score function sees the sequence as its batch
/// index.
#[allow(clippy::too_many_arguments)]
pub fn forward_packed_biased(
    client: &Client,
    [q, k, v]: [&DeviceTensor; 3],
    [sequences_q, sequences_kv]: [&PackedSequences; 2],
    bias: ScoreBias<'_>,
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<ForwardOutput, FlashError> {
    let problem = packed_problem([q, k, v], sequences_q, sequences_kv, dtype, options)?;
    let terms = bias.terms(&problem, TermsGrad::default())?;
    let total_q = sequences_q.total();
    let out = DeviceTensor::empty(
        client,
        &[total_q, problem.heads_q, problem.dim_v],
        dtype.size(),
    );
    let lse = DeviceTensor::empty(client, &[problem.heads_q, total_q], 4);
    let sequences = (sequences_q, sequences_kv);
    let terms = (bias, terms);
    launch_packed(
        client,
        [q, k, v],
        &out,
        &lse,
        &problem,
        sequences,
        terms,
        path,
    )?;
    Ok(ForwardOutput { out, lse, problem })
}

/// [`forward_packed`] into caller-provided outputs: `out` `[total_q, h_q, d_v]` and `lse`
/// `[h_q, total_q]` (f32), of any strides.
#[allow(clippy::too_many_arguments)]
pub fn forward_packed_into(
    client: &Client,
    [q, k, v]: [&DeviceTensor; 3],
    out: &DeviceTensor,
    lse: &DeviceTensor,
    [sequences_q, sequences_kv]: [&PackedSequences; 2],
    dtype: FloatDtype,
    options: AttentionOptions,
    path: KernelPath,
) -> Result<(), FlashError> {
    let problem = packed_problem([q, k, v], sequences_q, sequences_kv, dtype, options)?;
    let total_q = sequences_q.total();
    expect_shape("out", out, &[total_q, problem.heads_q, problem.dim_v])?;
    expect_shape("lse", lse, &[problem.heads_q, total_q])?;
    let sequences = (sequences_q, sequences_kv);
    let no_terms = (ScoreBias::none(), ScoreTerms::default());
    launch_packed(
        client,
        [q, k, v],
        out,
        lse,
        &problem,
        sequences,
        no_terms,
        path,
    )
}

/// [`launch`] on the kernels' `[1, heads, total, dim]` views of a packed batch's tensors.
#[allow(clippy::too_many_arguments)]
fn launch_packed(
    client: &Client,
    [q, k, v]: [&DeviceTensor; 3],
    out: &DeviceTensor,
    lse: &DeviceTensor,
    problem: &AttentionProblem,
    sequences: (&PackedSequences, &PackedSequences),
    terms: (ScoreBias<'_>, ScoreTerms),
    path: KernelPath,
) -> Result<(), FlashError> {
    launch(
        client,
        [&batch_view(q), &batch_view(k), &batch_view(v)],
        &batch_view(out),
        &batch_view(lse),
        problem,
        Some(sequences),
        terms,
        path,
    )
}

/// The problem of a packed batch, its tensors checked: batch = the sequences, sequence
/// lengths = the longest ones.
pub(crate) fn packed_problem(
    [q, k, v]: [&DeviceTensor; 3],
    sequences_q: &PackedSequences,
    sequences_kv: &PackedSequences,
    dtype: FloatDtype,
    options: AttentionOptions,
) -> Result<AttentionProblem, FlashError> {
    for (arg, t) in [("query", q), ("key", k), ("value", v)] {
        if t.shape.len() != 3 {
            return Err(FlashError::Shape {
                arg,
                shape: t.shape.clone(),
                expected: "rank 3, [total tokens, heads, head dim], in a packed batch".into(),
            });
        }
    }
    sequences_q.check_total("query", &q.shape, "cu_seqlens_q")?;
    sequences_kv.check_total("key", &k.shape, "cu_seqlens_k")?;
    sequences_kv.check_total("value", &v.shape, "cu_seqlens_k")?;
    if sequences_q.count() != sequences_kv.count() {
        return Err(FlashError::Option {
            arg: "cu_seqlens_k",
            expected: format!(
                "as many sequences as `cu_seqlens_q` ({}), got {}",
                sequences_q.count(),
                sequences_kv.count()
            ),
        });
    }
    let batch = sequences_q.count();
    let as_batch = |t: &DeviceTensor, seq: usize| [batch, t.shape[1], seq, t.shape[2]];
    AttentionProblem::new(
        &as_batch(q, sequences_q.longest()),
        &as_batch(k, sequences_kv.longest()),
        &as_batch(v, sequences_kv.longest()),
        dtype,
        options,
    )
}

/// Launches the forward kernel `plan` picks for `problem`, into `out` and `lse`, adding the
/// score terms `bias` (checked, as `terms`); a packed batch's tensors are the kernels' `[1,
/// heads, total, dim]` views.
#[allow(clippy::too_many_arguments)]
fn launch(
    client: &Client,
    [q, k, v]: [&DeviceTensor; 3],
    out: &DeviceTensor,
    lse: &DeviceTensor,
    problem: &AttentionProblem,
    packed: Option<(&PackedSequences, &PackedSequences)>,
    (bias, terms): (ScoreBias<'_>, ScoreTerms),
    path: KernelPath,
) -> Result<(), FlashError> {
    let (problem, dtype) = (*problem, problem.dtype);
    check_dtype(client, dtype)?;
    if problem.is_empty() {
        return Ok(());
    }
    check_spans(
        [
            ("query", q),
            ("key", k),
            ("value", v),
            ("out", out),
            ("lse", lse),
        ]
        .into_iter()
        .chain(bias.indexed_tensors()),
    )?;
    let (cu_q, cu_kv) = cu_seqlens(packed, lse);
    let is_packed = packed.is_some();
    let limits = DeviceLimits::from_properties(client.properties());
    let (left, right) = window_args(&problem);
    let (block_words, block_view) = bias.block_args(lse, false);
    let bias_tensor = bias.bias;
    let [bias, slopes, params] = bias.args(q, lse);
    let terms = terms.with_dropout_of(&problem);
    match plan(path, &problem, &limits, [q, k, v])? {
        Plan::RegisterMma(config) => {
            let config = RegisterMmaConfig {
                batch_inner: batch_inner(bias_tensor, &problem, is_packed),
                ..with_staged_bias(config, bias_tensor, dtype.size(), &limits)
            };
            if let Some(blocks) = terms.block_mask {
                blocks.check_tiles(config.block_rows(), config.block_kv)?;
            }
            let count = blocks_by_pairs(
                problem.seq_q.div_ceil(config.block_rows()),
                problem.batch * problem.heads_q,
            );
            let (q_rows, k_rows, v_rows) = (
                q.row_layout("query")?,
                k.row_layout("key")?,
                v.row_layout("value")?,
            );
            unsafe {
                flash_forward_mma::launch_unchecked(
                    client,
                    count,
                    CubeDim::new_1d(config.units() as u32),
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    out.arg(),
                    lse.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    q_rows,
                    k_rows,
                    v_rows,
                    problem.scale(),
                    softcap_arg(&problem),
                    left,
                    right,
                    f32::NEG_INFINITY,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    block_view.arg(),
                    params.arg(),
                    config,
                    is_packed,
                    terms,
                    dtype.elem_type(),
                );
            }
        }
        Plan::TensorCore => {
            let config = mma_config(&problem, &limits)?;
            let count = blocks_by_pairs(
                problem.seq_q.div_ceil(config.block_rows()),
                problem.batch * problem.heads_q,
            );
            unsafe {
                flash_forward_cmma::launch_unchecked(
                    client,
                    count,
                    CubeDim::new_1d(config.units() as u32),
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    out.arg(),
                    lse.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    problem.scale(),
                    softcap_arg(&problem),
                    left,
                    right,
                    f32::NEG_INFINITY,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    block_view.arg(),
                    params.arg(),
                    config,
                    is_packed,
                    terms,
                    dtype.elem_type(),
                );
            }
        }
        Plan::Portable => {
            let config = portable_config(&problem, &limits)?;
            let (count, dim) = grid(&config, problem.seq_q, problem.batch, problem.heads_q);
            unsafe {
                flash_forward::launch_unchecked(
                    client,
                    count,
                    dim,
                    q.arg(),
                    k.arg(),
                    v.arg(),
                    out.arg(),
                    lse.arg(),
                    cu_q.arg(),
                    cu_kv.arg(),
                    problem.scale(),
                    softcap_arg(&problem),
                    left,
                    right,
                    f32::NEG_INFINITY,
                    bias.arg(),
                    slopes.arg(),
                    problem.dropout_args(),
                    block_words.arg(),
                    block_view.arg(),
                    params.arg(),
                    config,
                    is_packed,
                    terms,
                    dtype.elem_type(),
                );
            }
        }
    }
    Ok(())
}

/// The kernel that runs, with the register-level path's tiles.
enum Plan {
    RegisterMma(RegisterMmaConfig),
    TensorCore,
    Portable,
}

/// [`choose_path`]'s path, except that `Auto` steps down from the register-level path to the
/// `cmma` one for problems that path does not take (head dims not a multiple of 8, inputs not
/// readable by 16-byte copies).
fn plan(
    requested: KernelPath,
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    inputs: [&DeviceTensor; 3],
) -> Result<Plan, FlashError> {
    let from_path = |path| match path {
        KernelPath::TensorCore => Plan::TensorCore,
        _ => Plan::Portable,
    };
    let chosen = choose_path(requested, problem.dtype, limits)?;
    if chosen != KernelPath::RegisterMma {
        return Ok(from_path(chosen));
    }
    let fits = register_mma_config(problem, limits).and_then(|config| {
        for (name, t) in ["query", "key", "value"].into_iter().zip(inputs) {
            if !readable_by_16_byte_copies(t, problem.dtype.size()) {
                return Err(FlashError::Unavailable(format!(
                    "the register-level path reads {name} with 16-byte copies: it needs a unit \
                     stride in the head dim, other strides that are multiples of 16 bytes and \
                     a 16-byte aligned buffer; got strides {:?}",
                    t.strides
                )));
            }
        }
        Ok(config)
    });
    match fits {
        Ok(config) => Ok(Plan::RegisterMma(config)),
        Err(_) if requested == KernelPath::Auto => {
            choose_path(KernelPath::TensorCore, problem.dtype, limits).map(from_path)
        }
        Err(e) => Err(e),
    }
}

/// Tiles of the register-level forward kernel, with tuning overrides: `FLASH_WGMMA=0` takes
/// the tiles chosen without warpgroup products (sm_90), for comparison;
/// `FLASH_WGMMA_FWD_TILES=planes,block_kv[,together]` (e.g. `8,64` or `8,128,0`) sets the
/// warpgroup kernel's tiles (and whether K and V are awaited together),
/// `FLASH_MMA_TILES=m_tiles,block_kv,q_in_registers` (e.g. `2,64,0`) the `mma.sync` kernel's;
/// `FLASH_WGMMA_WIDE=1` takes 128-column warpgroup products in the forward
/// ([`RegisterMmaConfig::wide_products`]);
/// `FLASH_BIAS_AHEAD=0` reads the bias after the products
/// ([`RegisterMmaConfig::bias_ahead`]; `=fwd` keeps the forward's alone, see
/// `backward::tuned`).
pub(crate) fn register_mma_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<RegisterMmaConfig, FlashError> {
    let limits = match std::env::var("FLASH_WGMMA").as_deref() {
        Ok("0") => DeviceLimits {
            warpgroup_mma: false,
            ..*limits
        },
        _ => *limits,
    };
    let mut config = choose_register_mma_tiles(problem, &limits)?;
    if std::env::var("FLASH_BIAS_AHEAD").as_deref() == Ok("0") {
        config.bias_ahead = false;
    }
    if config.warpgroup.is_some() && std::env::var("FLASH_WGMMA_WIDE").as_deref() == Ok("1") {
        config.wide_products = true;
    }
    let shared_bytes =
        |config: &RegisterMmaConfig| config.forward_shared_bytes(problem.dtype.size());
    if config.warpgroup.is_some() {
        return apply_tile_override(
            "FLASH_WGMMA_FWD_TILES",
            "planes (4 or 8),block_kv (64 or 128)[,K and V awaited together (0 or 1)]",
            config,
            |config, parts| match *parts {
                [planes @ (4 | 8), block_kv @ (64 | 128)] => {
                    config.planes = planes;
                    config.block_kv = block_kv;
                    true
                }
                [planes @ (4 | 8), block_kv @ (64 | 128), together @ (0 | 1)] => {
                    config.planes = planes;
                    config.block_kv = block_kv;
                    config.kv_together = together == 1;
                    true
                }
                _ => false,
            },
            shared_bytes,
            &limits,
        );
    }
    apply_tile_override(
        "FLASH_MMA_TILES",
        "m_tiles (1 or 2),block_kv (a multiple of 16),q_in_registers (0 or 1)",
        config,
        |config, parts| match *parts {
            [m_tiles, block_kv, q_in_registers]
                if (1..=2).contains(&m_tiles) && block_kv % 16 == 0 && block_kv > 0 =>
            {
                config.m_tiles = m_tiles;
                config.block_kv = block_kv;
                config.q_in_registers = q_in_registers != 0;
                true
            }
            _ => false,
        },
        shared_bytes,
        &limits,
    )
}

/// `config` staging the bias in shared memory where it can and should
/// ([`RegisterMmaConfig::bias_staged`], [`StagedBias`]).
fn with_staged_bias(
    config: RegisterMmaConfig,
    bias: Option<&DeviceTensor>,
    elem: usize,
    limits: &DeviceLimits,
) -> RegisterMmaConfig {
    match config.staging_bias(elem, limits) {
        Some(staged) if StagedBias::Forward.wanted(bias, elem) => staged,
        _ => config,
    }
}

/// Whether the register-level forward launches one head's sequences side by side
/// ([`RegisterMmaConfig::batch_inner`]) for a bias broadcast over a batch of several
/// sequences (dense batches): with `FLASH_BIAS_BATCH_INNER=1`. Measured on the H100 (bf16,
/// s = 4096, docs/benchmarks.md) 1.01–1.02× faster forward, it stays off by default until
/// the score-terms tests have run with it on a GPU.
fn batch_inner(bias: Option<&DeviceTensor>, problem: &AttentionProblem, packed: bool) -> bool {
    std::env::var("FLASH_BIAS_BATCH_INNER").as_deref() == Ok("1")
        && !packed
        && problem.batch > 1
        && bias.is_some_and(|b| b.shape[0] == 1)
}

/// Tiles of the portable forward kernel: K and V rows are staged in f32.
pub(crate) fn portable_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<TileConfig, FlashError> {
    let config = choose_portable_tiles(problem, limits, 4 * (problem.dim_qk + problem.dim_v))?;
    let iterations = loop_budget::forward_iterations(problem, &config);
    loop_budget::check("forward", iterations, problem, limits)?;
    Ok(config)
}

/// Tiles of the tensor-core forward kernel.
pub(crate) fn mma_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<MmaConfig, FlashError> {
    choose_mma_tiles(problem, limits, cmma::shared_bytes)
}
