//! dQ by f32 atomics (FlashAttention-2's form), for the register-level dK/dV kernel with
//! [`RegisterBackwardConfig::atomic_dq`]: each cube adds `dS·K` of its keys, for every query
//! block it sees, to a zeroed f32 buffer `[batch, heads_q, seq_q, d_qk]`, converted to dQ
//! afterwards ([`flash_backward_dq_from_sum`], which applies the softmax scale).
//!
//! Five matrix products per (query block, key block) pair instead of the seven of a separate
//! dQ pass, which recomputes `S` and `dP`. The order of the additions varies from run to run:
//! not bitwise deterministic.

use cubecl::prelude::*;

use crate::config::{FRAGMENT, RegisterBackwardConfig, RegisterMmaConfig};
use crate::mma_sync::{LoadAddress, Pair, load_a_transposed, load_b, mma, zeros};
use crate::tile::RowLayout;

/// Columns of one accumulator tile.
const TILE_COLS: usize = 8;

/// Adds the plane's share ([`crate::config::DqSplit`]) of `dS·K` for the query block at row
/// `q0` of head `head` to `dq_sum` (laid out as `dq_rows`; rows from `end`, the end of the
/// cube's sequence, are left alone). `ds_tile` holds the block's `dSᵀ`
/// (the cube's keys × the block's queries, stride `stride(block_stream)`, written by every
/// plane and synchronized), `k_tile` the cube's K rows.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_dq_share<F: Float>(
    ds_tile: &Shared<[F]>,
    k_tile: &Shared<[F]>,
    dq_sum: &mut Tensor<f32>,
    dq_rows: &RowLayout,
    batch: usize,
    head: usize,
    q0: usize,
    end: usize,
    #[comptime] config: RegisterBackwardConfig,
) {
    let split = comptime!(
        config
            .dq_split()
            .expect("a dQ split (checked by the heuristic)")
    );
    let keys = comptime!(config.block_rows());
    let ds_ld = comptime!(RegisterMmaConfig::stride(config.block_stream));
    let qk_ld = comptime!(RegisterMmaConfig::stride(config.dim_qk_padded()));
    let tiles = comptime!(split.width / TILE_COLS);

    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let row0 = (plane % split.groups) * FRAGMENT;
    let col0 = (plane / split.groups) * split.width;

    // dQ[row0.., col0..] = dS[row0.., :] · K[:, col0..], 16 keys per step.
    let mut acc = zeros(comptime!(2 * tiles));
    #[unroll]
    for kk in 0..comptime!(keys / FRAGMENT) {
        let dsf = load_a_transposed(
            ds_tile,
            kk * FRAGMENT * ds_ld + row0,
            ds_ld,
            LoadAddress::Window,
        );
        #[unroll]
        for n in 0..comptime!(tiles / 2) {
            let kf = load_b(
                k_tile,
                kk * FRAGMENT * qk_ld + col0 + n * FRAGMENT,
                qk_ld,
                LoadAddress::Window,
            );
            mma(&dsf, 0, &kf, 0, &mut acc, 2 * n);
            mma(&dsf, 0, &kf, 2, &mut acc, 2 * n + 1);
        }
    }

    // Each lane adds its pairs of rows g and g + 8 (head dims are multiples of 8 on this
    // path: a pair is inside the row or wholly in the padding).
    #[unroll]
    for half in 0..2usize {
        let row = q0 + row0 + lane / 4 + 8 * half;
        if row < end {
            let base = dq_rows.offset(batch, head, row);
            #[unroll]
            for n in 0..tiles {
                let col = col0 + n * TILE_COLS + 2 * (lane % 4);
                if col < config.dim_qk {
                    add_pair(dq_sum, base + col, acc[2 * n + half], config.paired_atomics);
                }
            }
        }
    }
}

/// `t[at] += pair[0]`, `t[at + 1] += pair[1]` atomically, results unused (`red`): one
/// paired instruction where the device has it (sm_90), else two.
#[cube]
fn add_pair(t: &mut Tensor<f32>, at: usize, pair: Pair<f32>, #[comptime] paired: bool) {
    let slot = &mut t[at..at + 2];
    let pointer = unsafe { slot.as_mut_ptr_unchecked() };
    let (a, b) = (pair.extract(0usize), pair.extract(1usize));
    if comptime!(paired) {
        gpu_asm!(
            "red.relaxed.gpu.global.add.v2.f32 [{pointer}], {{{a}, {b}}};",
            pointer = in(_) pointer, a = in(_) a, b = in(_) b,
        );
    } else {
        gpu_asm!(
            "red.relaxed.gpu.global.add.f32 [{pointer}], {a}; red.relaxed.gpu.global.add.f32 [{pointer}+4], {b};",
            pointer = in(_) pointer, a = in(_) a, b = in(_) b,
        );
    }
}

/// `dq = scale · dq_sum` in the input dtype, one unit per element (`dq` may be strided;
/// `dq_sum` is contiguous).
#[cube(launch_unchecked)]
pub fn flash_backward_dq_from_sum<F: Float>(
    dq_sum: &Tensor<f32>,
    dq: &mut Tensor<F>,
    scale: f32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < dq_sum.len() {
        let (dim, seq, heads) = (dq.shape(3), dq.shape(2), dq.shape(1));
        let (c, row) = (i % dim, i / dim);
        let (s, h, b) = (row % seq, (row / seq) % heads, row / (seq * heads));
        let at = b * dq.stride(0) + h * dq.stride(1) + s * dq.stride(2) + c * dq.stride(3);
        dq[at] = F::cast_from(dq_sum[i] * scale);
    }
}
