//! Plane-level matrix products on tensor cores (`cmma`), the building block of the
//! tensor-core kernels: one plane multiplies a 16-row slab of a shared-memory operand by a
//! shared-memory operand, 16×16×16 fragments at a time, with f32 accumulation.
//!
//! Operands are staged row-major. `A` is always read as stored; `B` is read as stored or
//! transposed (`Xᵀ` of an `X` staged row-major is the same memory read column-major), which
//! is how `Q·Kᵀ`, `dO·Vᵀ` and `Kᵀ`-free products are formed without moving data. Fragment
//! loads need 32-byte aligned addresses: offsets of whole fragments in tiles whose row
//! strides are multiples of 16 bytes (see [`crate::config::MmaConfig::half_stride`]).

use cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

use crate::config::{FRAGMENT, MmaConfig};

/// Alignment of shared tiles read or written as fragments (32-byte addresses).
pub const SHARED_ALIGN: usize = 32;

/// How the `B` operand of a product is read: its row stride as staged, and whether it is
/// read transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    pub stride: usize,
    pub transposed: bool,
}

impl Operand {
    pub const fn as_stored(stride: usize) -> Self {
        Self {
            stride,
            transposed: false,
        }
    }
    pub const fn transposed(stride: usize) -> Self {
        Self {
            stride,
            transposed: true,
        }
    }
    /// Element steps between fragments (`row` + 1, `col`) and (`row`, `col` + 1) of the
    /// operand as the product sees it.
    fn fragment_steps(&self) -> (usize, usize) {
        if self.transposed {
            (FRAGMENT, FRAGMENT * self.stride)
        } else {
            (FRAGMENT * self.stride, FRAGMENT)
        }
    }
    fn layout(&self) -> MatrixLayout {
        if self.transposed {
            MatrixLayout::ColMajor
        } else {
            MatrixLayout::RowMajor
        }
    }
}

/// A zeroed 16×16 f32 accumulator.
#[cube]
pub fn zero_accumulator() -> Matrix<f32> {
    Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        FRAGMENT,
        FRAGMENT,
        FRAGMENT,
        MatrixLayout::Undefined,
        0.0,
    )
}

/// `n_frags` zeroed accumulators, kept in registers across a loop.
#[cube]
pub fn zero_accumulators(#[comptime] n_frags: usize) -> Sequence<Matrix<f32>> {
    let mut acc = Sequence::new();
    #[unroll]
    for _ in 0..n_frags {
        acc.push(zero_accumulator());
    }
    acc
}

/// `acc += A[16 × 16·k_frags] · B[:, 16·n .. 16·n + 16]` for one output fragment `n`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_fragment<F: Float>(
    a: &Shared<[F]>,
    a_offset: usize,
    #[comptime] a_stride: usize,
    b: &Shared<[F]>,
    b_offset: usize,
    #[comptime] b_operand: Operand,
    n: usize,
    acc: &Matrix<f32>,
    #[comptime] k_frags: usize,
) {
    let (row_step, col_step) = comptime!(b_operand.fragment_steps());
    #[unroll]
    for kk in 0..k_frags {
        let fa = Matrix::<F>::from_slice(
            MatrixIdent::A,
            FRAGMENT,
            FRAGMENT,
            FRAGMENT,
            MatrixLayout::RowMajor,
            &a.slice(a_offset + kk * FRAGMENT, a.len()),
            a_stride as u32,
        );
        let fb = Matrix::<F>::from_slice(
            MatrixIdent::B,
            FRAGMENT,
            FRAGMENT,
            FRAGMENT,
            comptime!(b_operand.layout()),
            &b.slice(b_offset + kk * row_step + n * col_step, b.len()),
            comptime!(b_operand.stride as u32),
        );
        cmma::execute(&fa, &fb, acc, acc);
    }
}

/// `out = A · B` for one plane, stored row-major as f32: `A` is 16 × `16·k_frags` at
/// `a_offset`, the product 16 × `16·n_frags` lands at `out_offset`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn product_to_shared<F: Float>(
    a: &Shared<[F]>,
    a_offset: usize,
    #[comptime] a_stride: usize,
    b: &Shared<[F]>,
    b_offset: usize,
    #[comptime] b_operand: Operand,
    out: &mut Shared<[f32]>,
    out_offset: usize,
    #[comptime] out_stride: usize,
    #[comptime] k_frags: usize,
    #[comptime] n_frags: usize,
) {
    #[unroll]
    for n in 0..n_frags {
        let acc = zero_accumulator();
        accumulate_fragment(
            a, a_offset, a_stride, b, b_offset, b_operand, n, &acc, k_frags,
        );
        cmma::store(
            &mut out.slice_mut(out_offset + n * FRAGMENT, out.len()),
            &acc,
            out_stride as u32,
            MatrixLayout::RowMajor,
        );
    }
}

/// `acc += A · B` into `n_frags` register accumulators (see [`zero_accumulators`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate<F: Float>(
    a: &Shared<[F]>,
    a_offset: usize,
    #[comptime] a_stride: usize,
    b: &Shared<[F]>,
    b_offset: usize,
    #[comptime] b_operand: Operand,
    acc: &Sequence<Matrix<f32>>,
    #[comptime] k_frags: usize,
    #[comptime] n_frags: usize,
) {
    #[unroll]
    for n in 0..n_frags {
        accumulate_fragment(
            a,
            a_offset,
            a_stride,
            b,
            b_offset,
            b_operand,
            n,
            acc.index(n),
            k_frags,
        );
    }
}

/// Stores register accumulators row-major as f32 at `out_offset`.
#[cube]
pub fn store_accumulators(
    acc: &Sequence<Matrix<f32>>,
    out: &mut Shared<[f32]>,
    out_offset: usize,
    #[comptime] out_stride: usize,
    #[comptime] n_frags: usize,
) {
    #[unroll]
    for n in 0..n_frags {
        cmma::store(
            &mut out.slice_mut(out_offset + n * FRAGMENT, out.len()),
            acc.index(n),
            out_stride as u32,
            MatrixLayout::RowMajor,
        );
    }
}

/// Where a unit works in a tensor-core kernel: each plane owns 16 rows of the cube's tile,
/// and each of those rows is shared by `units_per_row` neighbouring units of the plane.
#[derive(CubeType, Clone, Copy)]
pub struct PlaneRow {
    /// First row of the unit's plane in the cube's tile.
    pub plane_first: usize,
    /// The unit's row in the cube's tile.
    pub row: usize,
    /// Which of the row's `units_per_row` parts the unit owns.
    pub part: usize,
}

#[cube]
impl PlaneRow {
    pub fn new(#[comptime] config: MmaConfig) -> PlaneRow {
        let per_row = comptime!(config.units_per_row());
        let plane_first = UNIT_POS as usize / config.plane_size * FRAGMENT;
        let lane = UNIT_POS as usize % config.plane_size;
        PlaneRow {
            plane_first,
            row: plane_first + lane / per_row,
            part: lane % per_row,
        }
    }
}
