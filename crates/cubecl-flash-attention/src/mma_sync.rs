//! Register-level tensor-core products for the fast CUDA path: `mma.sync` m16n8k16 with f32
//! accumulation, operands loaded from shared memory by `ldmatrix`.
//!
//! Fragments live in registers as pairs ([`Pair`]: 32 bits of f16/bf16, or two f32
//! accumulators), in the layouts PTX defines. Lane `l` of the plane is in row group
//! `g = l / 4` at position `t = l % 4`, and holds:
//!
//! | fragment | pairs (row, first column) |
//! | --- | --- |
//! | A, 16×16 | (g, 2t), (g+8, 2t), (g, 2t+8), (g+8, 2t+8) |
//! | B, 16×8 (k × n) | (k = 2t, n = g), (k = 2t+8, n = g) |
//! | C, 16×8 | (g, 2t), (g+8, 2t) |
//!
//! Two accumulator tiles side by side (columns 0–7 and 8–15) hold exactly the pairs of an A
//! fragment: that is how probabilities go from the softmax to `P·V` without leaving registers
//! ([`accumulators_as_a`]).
//!
//! Accumulator tiles are stored in flat arrays, two pairs per 16×8 tile: pair `2·tile` is row
//! `g`, pair `2·tile + 1` row `g + 8`.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use crate::block_mask::{BlockTile, ViewShape};
use crate::config::FRAGMENT;
use crate::mask::Span;

/// Two neighbouring elements of a fragment.
pub type Pair<E> = Vector<E, Const<2>>;

/// Elements of one 16-byte row `ldmatrix` reads.
const ROW: usize = 8;

#[cube]
fn definition<F: Float>() -> MmaDefinition<F, F, f32> {
    MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize)
}

/// The A fragment of the 16×16 tile at `offset` of a row-major tile with row stride `ld`
/// (one `ldmatrix.x4`: lanes 0–15 address rows 0–15 at column 0, lanes 16–31 at column 8).
#[cube]
pub fn load_a<F: Float>(
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] ld: usize,
    #[comptime] address: LoadAddress,
) -> Array<Pair<F>> {
    let lane = UNIT_POS_PLANE as usize;
    let start = offset + (lane % 16) * ld + (lane / 16) * ROW;
    ldmatrix_x4(tile, start, MatrixIdent::A, false, address)
}

/// The B fragments of two neighbouring 8-column tiles of `Xᵀ`, for the 16×16 block of `X`
/// at `offset` (row-major, stride `ld`): rows of `X` are the columns `n` of the product, as
/// the keys of `K` in `Q·Kᵀ`. Pairs 0–1 are the fragment of rows 0–7 of `X`, pairs 2–3 of
/// rows 8–15.
#[cube]
pub fn load_b_transposed<F: Float>(
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] ld: usize,
    #[comptime] address: LoadAddress,
) -> Array<Pair<F>> {
    ldmatrix_x4(
        tile,
        transposed_row(offset, ld),
        MatrixIdent::B,
        false,
        address,
    )
}

/// The lane's row of an `ldmatrix.x4` of a 16×16 block of `X` at `offset` (stride `ld`)
/// whose fragment is indexed by the columns of `X`: matrix `lane / 8` is read from rows 0–7
/// or 8–15 of `X` (bit 1) at column 0 or 8 (bit 0).
#[cube]
fn transposed_row(offset: usize, #[comptime] ld: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    let matrix = lane / ROW;
    offset + (lane % ROW + (matrix / 2) * ROW) * ld + (matrix % 2) * ROW
}

/// The B fragments of two neighbouring 8-column tiles of the 16×16 block of `X` at `offset`
/// (row-major, stride `ld`; rows of `X` are the reduction `k`, as the keys of `V` in `P·V`),
/// read transposed by `ldmatrix.trans`. Pairs 0–1 are columns 0–7, pairs 2–3 columns 8–15.
#[cube]
pub fn load_b<F: Float>(
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] ld: usize,
    #[comptime] address: LoadAddress,
) -> Array<Pair<F>> {
    let lane = UNIT_POS_PLANE as usize;
    let start = offset + (lane % 16) * ld + (lane / 16) * ROW;
    ldmatrix_x4(tile, start, MatrixIdent::B, true, address)
}

/// The A fragment of the 16×16 block of `Xᵀ`, for the block of `X` at `offset` (row-major,
/// stride `ld`): columns of `X` are the rows `m` of the product, as the queries of a stored
/// `dSᵀ` in `dS·K`. Addressed as [`load_b_transposed`], read transposed by `ldmatrix.trans`.
#[cube]
pub fn load_a_transposed<F: Float>(
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] ld: usize,
    #[comptime] address: LoadAddress,
) -> Array<Pair<F>> {
    // Matrix `lane / 8` of the fragment holds A rows 0–7 or 8–15 (bit 0), A columns 0–7 or
    // 8–15 (bit 1): rows of X (bit 1) at column 0 or 8 (bit 0), as `transposed_row` reads.
    ldmatrix_x4(
        tile,
        transposed_row(offset, ld),
        MatrixIdent::A,
        true,
        address,
    )
}

/// Writes the lane's pair of row `half` of accumulator tile `n` (see [`store_row`]'s layout),
/// converted to the input dtype, at row `row0 + g + 8·half`, columns `8n + 2t` of a
/// row-major shared tile with stride `ld`: one 32-bit store, through the tile's shared
/// address (as the `ldmatrix` loads that read it back).
#[cube]
pub fn store_pair<F: Float>(
    tile: &Shared<[F]>,
    acc: &Array<Pair<f32>>,
    n: usize,
    half: usize,
    row0: usize,
    #[comptime] ld: usize,
) {
    let lane = UNIT_POS_PLANE as usize;
    let at = (row0 + lane / 4 + 8 * half) * ld + 8 * n + 2 * (lane % 4);
    let address = shared_address(tile) + u32::cast_from(at * F::size());
    let bits = u32::reinterpret(Pair::<F>::cast_from(acc[2 * n + half]));
    gpu_asm!(
        "st.shared::cta.b32 [{address}], {bits};",
        address = in(_) address, bits = in(_) bits,
    );
}

/// How `ldmatrix` is given the address of the lane's row. Both forms load the same
/// fragments; which runs faster depends on the kernel, through the schedule `ptxas` builds
/// around the loads (measured on the H200: the forward and dK/dV kernels gain with
/// `Window`, the dQ kernel runs 1–4% faster with `Generic`; docs/benchmarks.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadAddress {
    /// The tile's `.shared` window address, computed once, plus a 32-bit byte offset:
    /// `ptxas` folds the constant part of each offset into the instruction.
    Window,
    /// A generic pointer to the row, converted to a shared address per load (CubeCL's
    /// `MmaDefinition::load_matrix`).
    Generic,
}

/// `ldmatrix.x4` (`.trans` if `transpose`) of the lane's 16-byte row at element `start` of
/// `tile`, addressed as `address` says.
#[cube]
fn ldmatrix_x4<F: Float>(
    tile: &Shared<[F]>,
    start: usize,
    #[comptime] ident: MatrixIdent,
    #[comptime] transpose: bool,
    #[comptime] address: LoadAddress,
) -> Array<Pair<F>> {
    let mut fragment = Array::<Pair<F>>::new(4usize);
    if comptime!(address == LoadAddress::Generic) {
        fragment = definition::<F>().load_matrix::<F, Const<2>>(
            &tile[start..start + ROW],
            ident,
            4usize,
            transpose,
        );
    } else {
        let row = shared_address(tile) + u32::cast_from(start * F::size());
        let rows: Vector<u32, Const<4>>;
        if comptime!(transpose) {
            gpu_asm!(
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared::cta.b16 {rows}, [{row}];",
                rows = out(_) rows, row = in(_) row,
            );
        } else {
            gpu_asm!(
                "ldmatrix.sync.aligned.m8n8.x4.shared::cta.b16 {rows}, [{row}];",
                rows = out(_) rows, row = in(_) row,
            );
        }
        #[unroll]
        for i in 0..4usize {
            fragment[i] = Pair::<F>::reinterpret(rows.extract(i));
        }
    }
    fragment
}

/// The `.shared` window address of `tile[0]` (a pure function of the tile: computed once
/// per kernel, however many loads use it).
#[cube]
pub(crate) fn shared_address<F: Float>(tile: &Shared<[F]>) -> u32 {
    let pointer = unsafe { tile.as_ptr_unchecked() };
    let address: u32;
    gpu_asm!(
        "{{ .reg .u64 window; cvta.to.shared.u64 window, {pointer}; cvt.u32.u64 {address}, window; }}",
        pointer = in(_) pointer, address = out(_) address, options(pure, nomem),
    );
    address
}

/// `acc[tile] += A · B` for the A fragment at pairs `a_at..a_at + 4` of `a` and the B fragment
/// at pairs `b_at..b_at + 2` of `b`.
#[cube]
pub fn mma<F: Float>(
    a: &Array<Pair<F>>,
    a_at: usize,
    b: &Array<Pair<F>>,
    b_at: usize,
    acc: &mut Array<Pair<f32>>,
    tile: usize,
) {
    let mut fa = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        fa[i] = a[a_at + i];
    }
    let mut fb = Array::<Pair<F>>::new(2usize);
    fb[0] = b[b_at];
    fb[1] = b[b_at + 1];
    let mut fc = Array::<Pair<f32>>::new(2usize);
    fc[0] = acc[2 * tile];
    fc[1] = acc[2 * tile + 1];
    definition::<F>().execute_inplace(&fa, &fb, &mut fc);
    acc[2 * tile] = fc[0];
    acc[2 * tile + 1] = fc[1];
}

/// `acc += A·Bᵀ` for the plane's 16 rows of `A` (tile `a` from element `a_at`) against
/// `8 · tiles` rows of `B` (tile `b` from element `b_at`), both row-major with stride `ld`,
/// over `steps` reductions of 16 columns; accumulator tiles `0..tiles`. The score-like
/// products of the `mma.sync` kernels: `S = Q·Kᵀ`, `dP = dO·Vᵀ` and their transposes.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn rows_times_rows<F: Float>(
    a: &Shared<[F]>,
    a_at: usize,
    b: &Shared<[F]>,
    b_at: usize,
    #[comptime] ld: usize,
    #[comptime] steps: usize,
    #[comptime] tiles: usize,
    #[comptime] address: LoadAddress,
    acc: &mut Array<Pair<f32>>,
) {
    #[unroll]
    for kk in 0..steps {
        let af = load_a(a, a_at + kk * FRAGMENT, ld, address);
        #[unroll]
        for n in 0..comptime!(tiles / 2) {
            let bf = load_b_transposed(b, b_at + n * FRAGMENT * ld + kk * FRAGMENT, ld, address);
            mma(&af, 0, &bf, 0, acc, 2 * n);
            mma(&af, 0, &bf, 2, acc, 2 * n + 1);
        }
    }
}

/// The A fragment (in the input dtype) of accumulator tiles `tile` and `tile + 1`, side by side.
#[cube]
pub fn accumulators_as_a<F: Float>(acc: &Array<Pair<f32>>, tile: usize) -> Array<Pair<F>> {
    let mut a = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        a[i] = Pair::<F>::cast_from(acc[2 * tile + i]);
    }
    a
}

/// Sets to `value` the lane's elements of row `half` of the `tiles` accumulator tiles from
/// `first` whose column is outside `visible`: pairs `2(first + n) + half` of `acc` are
/// columns `col0 + 8n + 2t` and the next one (`t = lane % 4`, as in the layout above).
#[cube]
pub fn hide_columns(
    acc: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    col0: i32,
    visible: Span,
    value: f32,
) {
    let in_group = i32::cast_from(UNIT_POS_PLANE % 4);
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = acc[at];
        #[unroll]
        for e in 0..2usize {
            let col = col0 + i32::cast_from(n * 8 + e) + 2 * in_group;
            pair.insert(e, select(visible.contains(col), pair.extract(e), value));
        }
        acc[at] = pair;
    }
}

/// As [`hide_columns`], for the columns of row `row` that a block mask's partial block hides
/// ([`BlockTile::keeps`]); nothing in a full block or without a block mask. The lane's
/// columns of four neighbouring 8-column tiles share one 32-bit word of the block's bits.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn hide_unkept(
    acc: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    col0: i32,
    row: i32,
    tile: &BlockTile,
    bits: &Tensor<u32>,
    value: f32,
    #[comptime] view: ViewShape,
) {
    if comptime!(view.is_sparse()) {
        if tile.partial {
            let in_group = i32::cast_from(UNIT_POS_PLANE % 4);
            let row = usize::cast_from(row);
            let per_word = comptime!(tiles.min(4));
            #[unroll]
            for w in 0..comptime!(tiles / per_word) {
                let word = tile.word(bits, row, usize::cast_from(col0) + w * 32, view);
                #[unroll]
                for m in 0..per_word {
                    let n = w * per_word + m;
                    let at = 2 * (first + n) + half;
                    let mut pair = acc[at];
                    #[unroll]
                    for e in 0..2usize {
                        let col = col0 + i32::cast_from(n * 8 + e) + 2 * in_group;
                        let bit = u32::cast_from(col) % 32;
                        let keep = (word >> bit) & 1 == 1;
                        pair.insert(e, select(keep, pair.extract(e), value));
                    }
                    acc[at] = pair;
                }
            }
        }
    }
}

/// `n` zeroed pairs.
#[cube]
pub fn zeros(#[comptime] n: usize) -> Array<Pair<f32>> {
    let mut acc = Array::<Pair<f32>>::new(n);
    #[unroll]
    for i in 0..n {
        acc[i] = Pair::<f32>::cast_from(0.0f32);
    }
    acc
}

/// Writes the lane's elements of row `row` of `t` from accumulator tiles side by side: pairs
/// `first + 2n + half` of `acc` (half 0 for the lane's row `g`, 1 for `g + 8`) are columns
/// `8n + 2·in_group` and the next one, times `factor`. Columns from `dim` on are padding.
///
/// Where the row is contiguous and 4-byte aligned (the usual case), each pair of 16-bit
/// elements is one 32-bit store at a constant offset from the lane's address; otherwise one
/// store per element through the tensor's strides.
#[cube]
#[allow(clippy::too_many_arguments)]
// `%` on a runtime value: `is_multiple_of` has no kernel expansion.
#[allow(clippy::manual_is_multiple_of)]
pub fn store_row<F: Float>(
    t: &mut Tensor<F>,
    batch: usize,
    head: usize,
    row: usize,
    acc: &Array<Pair<f32>>,
    first: usize,
    half: usize,
    factor: f32,
    in_group: usize,
    #[comptime] dim: usize,
) {
    let base = batch * t.stride(0) + head * t.stride(1) + row * t.stride(2);
    let elem_bits = F::size_bits();
    if comptime!(elem_bits == 16 && dim.is_multiple_of(2)) {
        let address = global_address(t) + u64::cast_from((base + 2 * in_group) * 2);
        if t.stride(3) == 1 && address % 4 == 0 {
            store_row_pairs::<F>(address, acc, first, half, factor, in_group, dim);
        } else {
            store_row_elements(t, base, acc, first, half, factor, in_group, dim);
        }
    } else {
        store_row_elements(t, base, acc, first, half, factor, in_group, dim);
    }
}

/// [`store_row`] by 32-bit stores from the lane's address in the row.
#[cube]
fn store_row_pairs<F: Float>(
    address: u64,
    acc: &Array<Pair<f32>>,
    first: usize,
    half: usize,
    factor: f32,
    in_group: usize,
    #[comptime] dim: usize,
) {
    let factor = Pair::<f32>::cast_from(factor);
    // Tiles of 8 columns up to `dim`; only a last partial one needs a bound (a lane's pair
    // never straddles `dim`, which is even).
    #[unroll]
    for n in 0..comptime!(dim.div_ceil(8)) {
        if comptime!(dim.is_multiple_of(8)) || n * 8 + 2 * in_group < dim {
            let bits = u32::reinterpret(Pair::<F>::cast_from(acc[first + 2 * n + half] * factor));
            let at = address + comptime!(16 * n as u64);
            gpu_asm!(
                "st.global.b32 [{at}], {bits};",
                at = in(_) at, bits = in(_) bits,
            );
        }
    }
}

/// [`store_row`] one element at a time, through the tensor's strides.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_row_elements<F: Float>(
    t: &mut Tensor<F>,
    base: usize,
    acc: &Array<Pair<f32>>,
    first: usize,
    half: usize,
    factor: f32,
    in_group: usize,
    #[comptime] dim: usize,
) {
    let col_stride = t.stride(3);
    let factor = Pair::<f32>::cast_from(factor);
    #[unroll]
    for n in 0..comptime!(dim.div_ceil(8)) {
        let pair = acc[first + 2 * n + half] * factor;
        #[unroll]
        for e in 0..2usize {
            let col = n * 8 + 2 * in_group + e;
            if col < dim {
                t[base + col * col_stride] = F::cast_from(pair.extract(e));
            }
        }
    }
}

/// The global-memory address of the first element of `t`.
#[cube]
fn global_address<F: Float>(t: &mut Tensor<F>) -> u64 {
    let pointer = unsafe { t.as_mut_ptr_unchecked() };
    let address: u64;
    gpu_asm!(
        "cvta.to.global.u64 {address}, {pointer};",
        pointer = in(_) pointer, address = out(_) address, options(pure, nomem),
    );
    address
}
