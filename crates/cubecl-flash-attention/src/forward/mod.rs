//! The forward pass: `O = softmax(Q·Kᵀ·scale) · V` and the LSE of every query row.

mod cmma;
mod portable;

use cubecl::prelude::*;

use crate::config::{
    DeviceLimits, KernelPath, MmaConfig, TileConfig, choose_mma_tiles, choose_path,
    choose_portable_tiles,
};
use crate::error::FlashError;
use crate::launch::{DeviceTensor, check_dtype, expect_shape, grid, softcap_arg, window_args};
use crate::problem::{AttentionOptions, AttentionProblem, FloatDtype};

pub use cmma::{flash_forward_cmma, shared_bytes as cmma_shared_bytes};
pub use portable::flash_forward;

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
    let problem = AttentionProblem::new(&q.shape, &k.shape, &v.shape, dtype, options)?;
    let out = DeviceTensor::empty(client, &problem.out_shape(), dtype.size());
    let lse = DeviceTensor::empty(client, &problem.lse_shape(), 4);
    forward_into(client, q, k, v, &out, &lse, dtype, options, path)?;
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
    check_dtype(client, dtype)?;
    if problem.is_empty() {
        return Ok(());
    }
    let limits = DeviceLimits::from_properties(client.properties());
    let (left, right) = window_args(&problem);
    match choose_path(path, dtype, &limits)? {
        KernelPath::TensorCore => {
            let config = mma_config(&problem, &limits)?;
            let count = CubeCount::Static(
                problem.seq_q.div_ceil(config.block_rows()) as u32,
                (problem.batch * problem.heads_q) as u32,
                1,
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
                    problem.scale(),
                    softcap_arg(&problem),
                    left,
                    right,
                    f32::NEG_INFINITY,
                    config,
                    dtype.elem_type(),
                );
            }
        }
        KernelPath::Auto | KernelPath::Portable => {
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
                    problem.scale(),
                    softcap_arg(&problem),
                    left,
                    right,
                    f32::NEG_INFINITY,
                    config,
                    dtype.elem_type(),
                );
            }
        }
    }
    Ok(())
}

/// Tiles of the portable forward kernel: K and V rows are staged in f32.
pub(crate) fn portable_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<TileConfig, FlashError> {
    choose_portable_tiles(problem, limits, 4 * (problem.dim_qk + problem.dim_v))
}

/// Tiles of the tensor-core forward kernel.
pub(crate) fn mma_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<MmaConfig, FlashError> {
    choose_mma_tiles(problem, limits, cmma::shared_bytes)
}
