//! Warpgroup-level tensor-core products for CUDA sm_90 (`wgmma.mma_async`): the four planes
//! of a cube (one warpgroup, 128 units) multiply a 64-row A by a 64-column B in one
//! instruction per 16 of the reduction, B (and A, or A from registers) read by the tensor
//! cores straight from shared memory. Against `mma.sync` ([`crate::mma_sync`]), a shared
//! operand is read once per warpgroup instead of once per plane, and never passes through
//! registers.
//!
//! Shared operands are tiles in [`crate::tile::SharedLayout::Swizzled`] (128-byte swizzle,
//! the layout the tensor cores read fastest: without swizzling, the same products measured
//! slower than `mma.sync`), described to the instruction by a 64-bit matrix descriptor
//! ([`Descriptor`]): the start address, two byte offsets between the layout's atoms
//! ([`SharedOperand::offsets`]) and the swizzle mode. A tile of rows is read K-major when its
//! rows are the product's `M`/`N` (Q, K as in `K·Qᵀ`) and MN-major when its rows are the
//! reduction (Q, dO as in `dSᵀ·Q`, `Pᵀ·dO`).
//!
//! Accumulators are laid out per plane exactly as [`crate::mma_sync`]'s: plane `w` holds
//! rows `16w..16w + 16`, its 8-column tile `n` in pairs `2n` (row `g`) and `2n + 1` (row
//! `g + 8`); the A fragments from registers are [`crate::mma_sync`]'s A fragments. So the
//! element-wise steps in between (softmax, masks, the conversions) are shared with the
//! `mma.sync` kernels.
//!
//! Each product is one inline PTX block, written here by [`chain_ptx`]: it moves the
//! accumulators in, issues the chain of instructions along the reduction, commits and waits
//! for it. The block's operands are numbered as CubeCL's CUDA compiler numbers them: the
//! result vector's elements first, then each input in order, a vector input taking one
//! number per element. The block names its operands once more in a closing PTX comment,
//! as `gpu_asm!` wants every operand named in the template.
//!
//! Products left running across other work (`wgmma.wait_group` later) are checked by the
//! assembler, which inserts waits itself where registers are touched under running
//! products and says so (`ptxas -v`, C7517/C7519); `tools/compile_check.py` reports those
//! lines.

use std::fmt::Write as _;

use cubecl::prelude::*;

use crate::mma_sync::{Pair, shared_address};
use crate::problem::FloatDtype;
use crate::tile::{SWIZZLE_COLS, SharedLayout};

/// Planes of a warpgroup.
pub const WARPGROUP_PLANES: usize = 4;
/// Rows of A (and of the accumulator) per instruction: 16 per plane of the warpgroup.
pub const WARPGROUP_ROWS: usize = 64;
/// Columns of B (and of the accumulator) per instruction of the narrowest products; an
/// instruction may be 64, 128 or 256 wide ([`Chain::n`]).
pub const WARPGROUP_COLS: usize = 64;
/// Reduction per instruction.
pub const WARPGROUP_K: usize = 16;
/// f32 accumulators per unit of one 64×64 product.
pub const ACCUMULATORS: usize = accumulators(WARPGROUP_COLS);

/// f32 accumulators per unit of a 64-row product `n` columns wide. A wider product's
/// accumulators are those of its 64-column parts side by side.
pub const fn accumulators(n: usize) -> usize {
    WARPGROUP_ROWS * n / 128
}

/// How a shared operand's tile is read: along its columns (its rows are the product's
/// `M` or `N`) or along its rows (its rows are the reduction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Major {
    K,
    MN,
}

/// A shared operand: a [`SharedLayout::Swizzled`] tile of `cols` columns read as `major`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SharedOperand {
    pub cols: usize,
    pub major: Major,
}

impl SharedOperand {
    pub const fn new(layout: SharedLayout, major: Major) -> Self {
        match layout {
            SharedLayout::Swizzled { cols } => Self { cols, major },
            SharedLayout::Rows { .. } => panic!("warpgroup products read swizzled tiles"),
        }
    }
    /// Bytes between neighbouring 8-row groups of the tile (16-bit elements).
    const fn row_groups(&self) -> usize {
        16 * self.cols
    }
    /// The descriptor's (leading, stride) byte offsets. K-major: unused (1 in 16-byte units)
    /// and between 8-row groups; MN-major: between 64-column atoms and between 8-row groups.
    pub const fn offsets(&self) -> (usize, usize) {
        match self.major {
            Major::K => (16, self.row_groups()),
            Major::MN => (ATOM_BYTES, self.row_groups()),
        }
    }
    /// Byte offset of reduction step `step` (16 of the reduction) from the operand's start.
    /// K-major, a step moves 32 bytes inside a 128-byte atom row (the tensor cores apply the
    /// swizzle to the address), then on to the next atom; MN-major, two 8-row groups.
    pub const fn k_offset(&self, step: usize) -> usize {
        match self.major {
            Major::K => {
                let per_atom = SWIZZLE_COLS / WARPGROUP_K;
                (step / per_atom) * ATOM_BYTES + (step % per_atom) * 2 * WARPGROUP_K
            }
            Major::MN => step * 2 * self.row_groups(),
        }
    }
    /// Descriptor increment (16-byte units of its start address) from reduction step `step`
    /// to the next.
    pub const fn k_increment(&self, step: usize) -> usize {
        (self.k_offset(step + 1) - self.k_offset(step)) / 16
    }
    /// Element offset, in the tile, of the operand's `M`/`N` index `mn` and reduction index
    /// `k`: multiples of 8 along the tile's rows, of 64 along its columns.
    pub const fn element(&self, mn: usize, k: usize) -> usize {
        let (row, col) = match self.major {
            Major::K => (mn, k),
            Major::MN => (k, mn),
        };
        assert!(row.is_multiple_of(8) && col.is_multiple_of(SWIZZLE_COLS));
        row * self.cols + col * 8
    }
}

/// Bytes of one swizzle atom (8 rows of 128 bytes).
const ATOM_BYTES: usize = 1024;
/// The descriptor's layout mode (bits 62–63 of the descriptor) for 128-byte swizzling.
const SWIZZLE_128B: u32 = 1 << 30;

/// A shared-memory matrix descriptor, as two 32-bit halves: start address (bits 0–13, in
/// 16-byte units), leading byte offset (16–29), stride byte offset (32–45), layout mode
/// (62–63); base offset 0 (swizzle atoms are 1024-byte aligned).
#[derive(CubeType, Clone, Copy)]
pub struct Descriptor {
    pub lo: u32,
    pub hi: u32,
}

/// The descriptor of `operand` in `tile`, starting at element `offset` (16-byte aligned).
#[cube]
pub fn descriptor<F: Float>(
    tile: &Shared<[F]>,
    offset: usize,
    #[comptime] operand: SharedOperand,
) -> Descriptor {
    let (leading, stride) = comptime!(operand.offsets());
    let address = shared_address(tile) + u32::cast_from(offset * F::size());
    Descriptor {
        lo: ((address & 0x3FFFF) >> 4) | comptime!(((leading >> 4) << 16) as u32),
        hi: comptime!((stride >> 4) as u32) | SWIZZLE_128B,
    }
}

/// Where a product's A operand comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ASource {
    /// A shared tile (descriptor input), advanced along the reduction as the operand says.
    Shared(SharedOperand),
    /// Registers: the block's register A inputs from group `group` on, 4 32-bit fragments
    /// per step, a group per 4 steps ([`pack_register_a`]).
    Registers { group: usize },
}

/// One product of a PTX block: `acc (+)= A · B` over `k_steps` steps of 16, `n` columns
/// wide, into `n / 2` accumulators of the block's result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Chain {
    pub a: ASource,
    pub b: SharedOperand,
    pub k_steps: usize,
    /// The accumulators come in as an input (else they start at zero).
    pub accumulate: bool,
    /// Columns of the product: 64, 128 or 256. A wider instruction reads its A operand once
    /// for all its columns, where narrower ones each read it again (from shared memory, when
    /// A is a shared tile).
    pub n: usize,
}

impl Chain {
    /// `A·Bᵀ` of two shared tiles read as `op` (both K-major, the reduction their columns),
    /// `n` rows of B, starting from zero.
    fn scores(op: SharedOperand, n: usize) -> Self {
        Self {
            a: ASource::Shared(op),
            b: op,
            k_steps: op.cols / WARPGROUP_K,
            accumulate: false,
            n,
        }
    }
    fn accumulators(&self) -> usize {
        accumulators(self.n)
    }
}

/// The PTX block of `chains` for `dtype` inputs: chain `i` writes the result elements after
/// those of the chains before it; all are issued, then committed and waited for once. The
/// inputs, in order: the accumulators of each chain that accumulates; `register_a` groups
/// of 16 A fragments ([`ASource::Registers`]); per chain, its shared A descriptor's halves
/// (if any) and its B descriptor's halves.
pub fn chain_ptx(dtype: FloatDtype, chains: &[Chain], register_a: usize) -> String {
    let ty = match dtype {
        FloatDtype::BF16 => "bf16",
        FloatDtype::F16 => "f16",
        FloatDtype::F32 => panic!("warpgroup products take f16 or bf16 inputs"),
    };
    let regs = |first: usize, count: usize| {
        (first..first + count)
            .map(|i| format!("%{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let outputs: usize = chains.iter().map(Chain::accumulators).sum();
    let mut ptx = String::from(
        "{\n.reg .pred zero, one;\n.reg .b32 flag;\n.reg .b64 da, db;\n\
         mov.b32 flag, 1;\nsetp.eq.b32 zero, flag, 0;\nsetp.eq.b32 one, flag, 1;\n",
    );
    // Each chain's accumulators, side by side in the outputs; those that accumulate come in.
    let mut next = outputs;
    let mut at = 0;
    let mut dest = Vec::with_capacity(chains.len());
    for chain in chains {
        let count = chain.accumulators();
        dest.push(at);
        if chain.accumulate {
            for e in 0..count {
                writeln!(ptx, "mov.b32 %{}, %{};", at + e, next + e).unwrap();
            }
            next += count;
        }
        at += count;
    }
    let pool = next;
    next += 16 * register_a;
    ptx.push_str("wgmma.fence.sync.aligned;\n");
    for (chain, &first) in chains.iter().zip(&dest) {
        assert!(
            matches!(chain.n, 64 | 128 | 256),
            "products are 64, 128 or 256 wide"
        );
        if let ASource::Shared { .. } = chain.a {
            writeln!(ptx, "mov.b64 da, {{%{next}, %{}}};", next + 1).unwrap();
            next += 2;
        }
        writeln!(ptx, "mov.b64 db, {{%{next}, %{}}};", next + 1).unwrap();
        next += 2;
        let d = regs(first, chain.accumulators());
        let n = chain.n;
        let transpose_b = (chain.b.major == Major::MN) as u8;
        for step in 0..chain.k_steps {
            let scale_d = if chain.accumulate || step > 0 {
                "one"
            } else {
                "zero"
            };
            let (a_operand, transpose_a) = match chain.a {
                ASource::Shared(op) => (
                    "da".to_string(),
                    format!(", {}", (op.major == Major::MN) as u8),
                ),
                ASource::Registers { group } => {
                    assert!(4 * group + chain.k_steps <= 4 * register_a);
                    let first = pool + 16 * group + 4 * step;
                    (format!("{{{}}}", regs(first, 4)), String::new())
                }
            };
            writeln!(
                ptx,
                "wgmma.mma_async.sync.aligned.m64n{n}k{WARPGROUP_K}.f32.{ty}.{ty} \
                 {{{d}}}, {a_operand}, db, {scale_d}, 1, 1{transpose_a}, {transpose_b};"
            )
            .unwrap();
            if step + 1 < chain.k_steps {
                if let ASource::Shared(op) = chain.a {
                    writeln!(ptx, "add.s64 da, da, {};", op.k_increment(step)).unwrap();
                }
                writeln!(ptx, "add.s64 db, db, {};", chain.b.k_increment(step)).unwrap();
            }
        }
    }
    ptx.push_str("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n}");
    ptx
}

/// What [`shared_products`] computes: `count` (1 or 2) products `acc_i = A_i·B_iᵀ`, both
/// operands shared tiles read as `ops[i]` (K-major: the tiles' rows are the product's rows
/// and columns, their columns the reduction), 64 rows × `n` columns each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SharedProducts {
    pub count: usize,
    pub ops: [SharedOperand; 2],
    pub n: usize,
}

/// The products of `products` in one PTX block (see [`chain_ptx`]), from zero: `descriptors`
/// holds each product's A and B descriptor halves in turn ([`pack_descriptor`]); the result
/// holds `n / 2` accumulators per product (`N`).
#[cube]
pub fn shared_products<N: Size, M: Size>(
    descriptors: Vector<u32, M>,
    #[comptime] products: SharedProducts,
    #[comptime] dtype: FloatDtype,
) -> Vector<f32, N> {
    let chains = comptime!(
        (0..products.count)
            .map(|i| Chain::scores(products.ops[i], products.n))
            .collect::<Vec<_>>()
    );
    let body = comptime!(chain_ptx(dtype, &chains, 0));
    // As in `register_products`: the vector reaches the block as values.
    let descriptors = descriptors | Vector::<u32, M>::cast_from(0u32);
    let acc: Vector<f32, N>;
    gpu_asm!(
        "{body}\n// {acc} {descriptors}",
        body = const body,
        acc = out(_) acc,
        descriptors = in(_) descriptors,
    );
    acc
}

/// Issues `S = A·Bᵀ` for the warpgroup's 64 rows of tile `a` (from element `a_at`) against
/// `rows` rows of tile `b` (from element `b_at`), both laid out as `layout` and read K-major,
/// in one PTX block ([`shared_products`]): one product `rows` wide if `wide`, else one per 64
/// rows. Returns the accumulators, B's rows in order (`N = rows / 2`; `M` is four
/// descriptor halves per product; [`unpack_all`] lays them out as pairs). `S = Q·Kᵀ` in
/// the forward.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores_against_rows<F: Float, N: Size, M: Size>(
    a: &Shared<[F]>,
    a_at: usize,
    b: &Shared<[F]>,
    b_at: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] rows: usize,
    #[comptime] wide: bool,
    #[comptime] dtype: FloatDtype,
) -> Vector<f32, N> {
    let op = comptime!(SharedOperand::new(layout, Major::K));
    let (count, n) = comptime!(if wide {
        (1, rows)
    } else {
        (rows / WARPGROUP_COLS, WARPGROUP_COLS)
    });
    let mut descriptors = Vector::<u32, M>::cast_from(0u32);
    #[unroll]
    for c in 0..count {
        pack_descriptor(descriptor(a, a_at, op), &mut descriptors, comptime!(2 * c));
        pack_descriptor(
            descriptor(b, b_at + comptime!(op.element(c * WARPGROUP_COLS, 0)), op),
            &mut descriptors,
            comptime!(2 * c + 1),
        );
    }
    let products = comptime!(SharedProducts {
        count,
        ops: [op, op],
        n,
    });
    shared_products::<N, M>(descriptors, products, dtype)
}

/// Writes the accumulators `acc` (`N` of them, as products lay them out) to pairs
/// `0..N / 2` of `pairs`.
#[cube]
pub fn unpack_all<N: Size>(acc: Vector<f32, N>, pairs: &mut Array<Pair<f32>>) {
    #[unroll]
    for c in 0..comptime!(N::try_value_const().unwrap() / ACCUMULATORS) {
        unpack(
            acc,
            comptime!(c * ACCUMULATORS),
            pairs,
            c * ACCUMULATORS / 2,
        );
    }
}

/// The score-like products of one block: `first = A₀·B₀ᵀ` over the columns of tiles `a0`,
/// `b0` (laid out as `first_layout`, from elements `a0_at`, `b0_at`), and `second =
/// A₁·B₁ᵀ` over those of `a1`, `b1`, each 64 × 64, in one PTX block ([`shared_products`]);
/// written to the pairs of `first` and `second`. `Sᵀ = K·Qᵀ` with `dPᵀ = V·dOᵀ`, or
/// `S = Q·Kᵀ` with `dP = dO·Vᵀ`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn score_products<F: Float>(
    a0: &Shared<[F]>,
    a0_at: usize,
    b0: &Shared<[F]>,
    b0_at: usize,
    a1: &Shared<[F]>,
    a1_at: usize,
    b1: &Shared<[F]>,
    b1_at: usize,
    #[comptime] first_layout: SharedLayout,
    #[comptime] second_layout: SharedLayout,
    #[comptime] dtype: FloatDtype,
    first: &mut Array<Pair<f32>>,
    second: &mut Array<Pair<f32>>,
) {
    let op0 = comptime!(SharedOperand::new(first_layout, Major::K));
    let op1 = comptime!(SharedOperand::new(second_layout, Major::K));
    let mut descriptors = Vector::<u32, Const<8>>::cast_from(0u32);
    pack_descriptor(descriptor(a0, a0_at, op0), &mut descriptors, 0usize);
    pack_descriptor(descriptor(b0, b0_at, op0), &mut descriptors, 1usize);
    pack_descriptor(descriptor(a1, a1_at, op1), &mut descriptors, 2usize);
    pack_descriptor(descriptor(b1, b1_at, op1), &mut descriptors, 3usize);
    let products = comptime!(SharedProducts {
        count: 2,
        ops: [op0, op1],
        n: WARPGROUP_COLS,
    });
    let acc = shared_products::<Const<64>, Const<8>>(descriptors, products, dtype);
    unpack(acc, 0usize, first, 0);
    unpack(acc, ACCUMULATORS, second, 0);
}

/// `acc += A·B` on warpgroup instructions, in one PTX block: A the plane's accumulator pairs
/// `a` (16 rows × `reduction` columns, converted to the input dtype: [`pack_register_a`]), B
/// the `reduction` rows of `tile` from element `base` (laid out as `layout`, read MN-major),
/// its columns in products `n` wide into the matching accumulators of `acc`. `N`
/// accumulators in all (twice `acc`'s pairs), `M` two descriptor halves per product.
/// `dQ += dS·K`, `O += P·V`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate_from_registers<F: Float, N: Size, M: Size>(
    acc: &mut Array<Pair<f32>>,
    a: &Array<Pair<f32>>,
    tile: &Shared<[F]>,
    base: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] reduction: usize,
    #[comptime] n: usize,
    #[comptime] dtype: FloatDtype,
) {
    let (values, fragments, b) =
        register_operands::<F, N, M>(&*acc, a, tile, base, layout, reduction, n);
    let products = comptime!(RegisterProducts::along(layout, reduction, n));
    let sums = register_products(values, fragments, b, products, dtype);
    unpack_all(sums, acc);
}

/// The operands of [`accumulate_from_registers`]: the accumulators packed, the A fragments
/// and the B descriptors' halves.
#[cube]
fn register_operands<F: Float, N: Size, M: Size>(
    acc: &Array<Pair<f32>>,
    a: &Array<Pair<f32>>,
    tile: &Shared<[F]>,
    base: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] reduction: usize,
    #[comptime] n: usize,
) -> (Vector<f32, N>, Vector<u32, Const<32>>, Vector<u32, M>) {
    let rows = comptime!(SharedOperand::new(layout, Major::MN));
    let pairs = comptime!(ACCUMULATORS / 2);
    let mut values = Vector::<f32, N>::cast_from(0.0f32);
    let mut fragments = Vector::<u32, Const<32>>::cast_from(0u32);
    let mut b = Vector::<u32, M>::cast_from(0u32);
    #[unroll]
    for g in 0..comptime!(reduction / WARPGROUP_COLS) {
        pack_register_a::<F>(a, g * pairs, &mut fragments, g);
    }
    #[unroll]
    for j in 0..comptime!(rows.cols / WARPGROUP_COLS) {
        pack(acc, j * pairs, &mut values, comptime!(j * ACCUMULATORS));
    }
    #[unroll]
    for j in 0..comptime!(rows.cols / n) {
        let at = comptime!(rows.element(j * n, 0));
        pack_descriptor(descriptor(tile, base + at, rows), &mut b, j);
    }
    (values, fragments, b)
}

/// What [`register_products`] computes: `count` (1 to 4) products of `n` columns each,
/// `acc_i += A_(a_of[i]) · B_i` over `16 · k_steps` of the reduction, A from registers
/// (from group `a_of[i]` of two, a group per 64 of the reduction), each B a shared tile read
/// as `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterProducts {
    pub count: usize,
    pub a_of: [usize; 4],
    pub k_steps: usize,
    pub b: SharedOperand,
    pub n: usize,
}

impl RegisterProducts {
    /// The products of `A · B` with B the `reduction` rows of a tile laid out as `layout`
    /// (read MN-major), its columns in products `n` wide, A from registers.
    fn along(layout: SharedLayout, reduction: usize, n: usize) -> Self {
        let b = SharedOperand::new(layout, Major::MN);
        Self {
            count: b.cols / n,
            a_of: [0; 4],
            k_steps: reduction / WARPGROUP_K,
            b,
            n,
        }
    }
    fn chains(&self) -> Vec<Chain> {
        (0..self.count)
            .map(|i| Chain {
                a: ASource::Registers {
                    group: self.a_of[i],
                },
                b: self.b,
                k_steps: self.k_steps,
                accumulate: true,
                n: self.n,
            })
            .collect()
    }
}

/// `acc_i += A · B_i` for the products of `products`, in one PTX block: `acc`
/// holds their accumulators side by side (`N` = `n / 2` per product), `a` the two groups of
/// A fragments ([`pack_register_a`]), `b` the B descriptors' halves (`M` = 2 per product).
#[cube]
pub fn register_products<N: Size, M: Size>(
    acc: Vector<f32, N>,
    a: Vector<u32, Const<32>>,
    b: Vector<u32, M>,
    #[comptime] products: RegisterProducts,
    #[comptime] dtype: FloatDtype,
) -> Vector<f32, N> {
    let body = comptime!(chain_ptx(dtype, &products.chains(), 2));
    // Vector inputs must reach the PTX block as values, one register per element: built
    // element by element, they live in mutable locals, which CubeCL would pass by address.
    // An identity operation reads them out (the compiler folds it away).
    let acc = acc * Vector::<f32, N>::cast_from(1.0f32);
    let a = a | Vector::<u32, Const<32>>::cast_from(0u32);
    let b = b | Vector::<u32, M>::cast_from(0u32);
    let result: Vector<f32, N>;
    gpu_asm!(
        "{body}\n// {result} {acc} {a} {b}",
        body = const body,
        result = out(_) result,
        acc = in(_) acc, a = in(_) a, b = in(_) b,
    );
    result
}

/// Writes pairs `first..first + 16` of `pairs` to accumulators `at..at + 32` of `acc`.
#[cube]
pub fn pack<N: Size>(
    pairs: &Array<Pair<f32>>,
    first: usize,
    acc: &mut Vector<f32, N>,
    #[comptime] at: usize,
) {
    #[unroll]
    for p in 0..comptime!(ACCUMULATORS / 2) {
        let pair = pairs[first + p];
        acc.insert(at + 2 * p, pair.extract(0usize));
        acc.insert(at + 2 * p + 1, pair.extract(1usize));
    }
}

/// Writes accumulator pairs `first..first + 16` of `pairs`, converted to the input dtype, as
/// A fragment group `group` of `a` (16 rows × 64 of the next product's reduction per plane:
/// four steps of [`crate::mma_sync::accumulators_as_a`]).
#[cube]
pub fn pack_register_a<F: Float>(
    pairs: &Array<Pair<f32>>,
    first: usize,
    a: &mut Vector<u32, Const<32>>,
    #[comptime] group: usize,
) {
    #[unroll]
    for i in 0..16usize {
        a.insert(
            16 * group + i,
            u32::reinterpret(Pair::<F>::cast_from(pairs[first + i])),
        );
    }
}

/// Writes `d` as descriptor `i` of the halves [`register_products`] takes.
#[cube]
pub fn pack_descriptor<M: Size>(d: Descriptor, halves: &mut Vector<u32, M>, #[comptime] i: usize) {
    halves.insert(2 * i, d.lo);
    halves.insert(2 * i + 1, d.hi);
}

/// Writes accumulators `from..from + 32` of `acc` (`N` of them) to pairs `first..first + 16`.
#[cube]
pub fn unpack<N: Size>(
    acc: Vector<f32, N>,
    #[comptime] from: usize,
    pairs: &mut Array<Pair<f32>>,
    first: usize,
) {
    #[unroll]
    for p in 0..comptime!(ACCUMULATORS / 2) {
        let mut pair = Pair::<f32>::cast_from(0.0f32);
        pair.insert(0usize, acc.extract(from + 2 * p));
        pair.insert(1usize, acc.extract(from + 2 * p + 1));
        pairs[first + p] = pair;
    }
}

/// Element offset, in a tile laid out as `layout`, of the 64 rows this unit's warpgroup owns
/// (warpgroup `w` of the cube: rows `64w..64w + 64`).
#[cube]
pub fn warpgroup_rows(#[comptime] layout: SharedLayout) -> usize {
    (PLANE_POS as usize / WARPGROUP_PLANES) * comptime!(layout.len(WARPGROUP_ROWS))
}

/// Makes this unit's earlier writes to shared memory (plain stores, `cp.async`) visible to
/// the warpgroup products' reads, which go through the asynchronous proxy. Every unit
/// that wrote runs it, then the cube synchronizes, before the products read.
#[cube]
pub fn fence_shared_for_products() {
    gpu_asm!("fence.proxy.async.shared::cta;");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzled_descriptors_step_inside_the_atoms() {
        let k = SharedOperand::new(SharedLayout::Swizzled { cols: 128 }, Major::K);
        // Leading offset unused; 8-row groups 8 × 256 bytes apart.
        assert_eq!(k.offsets(), (16, 2048));
        // Four steps of 32 bytes through an atom's rows, then the next atom column.
        let offsets: Vec<_> = (0..8).map(|s| k.k_offset(s)).collect();
        assert_eq!(offsets, [0, 32, 64, 96, 1024, 1056, 1088, 1120]);
        assert_eq!((k.k_increment(2), k.k_increment(3)), (2, 58));
        assert_eq!(k.element(16, 64), 2 * 8 * 128 + 64 * 8);
        let mn = SharedOperand::new(SharedLayout::Swizzled { cols: 128 }, Major::MN);
        // Atom columns 1024 bytes apart, 8-row groups 2048.
        assert_eq!(mn.offsets(), (1024, 2048));
        assert_eq!(mn.k_offset(3), 3 * 4096);
        assert_eq!(mn.element(64, 0), 512);
    }

    #[test]
    fn chain_ptx_numbers_operands_in_input_order() {
        let k_major = SharedOperand::new(SharedLayout::Swizzled { cols: 64 }, Major::K);
        let shared = Chain {
            a: ASource::Shared(k_major),
            b: k_major,
            k_steps: 2,
            accumulate: false,
            n: 64,
        };
        let ptx = chain_ptx(FloatDtype::BF16, &[shared, shared], 0);
        // Result %0–%63, then A and B of each chain.
        assert!(ptx.contains("mov.b64 da, {%64, %65};"));
        assert!(ptx.contains("mov.b64 db, {%66, %67};"));
        assert!(ptx.contains("mov.b64 da, {%68, %69};"));
        assert!(ptx.contains("mov.b64 db, {%70, %71};"));
        assert_eq!(ptx.matches("wgmma.mma_async").count(), 4);
        assert!(ptx.contains("m64n64k16.f32.bf16.bf16 {%0, %1,"));
        assert!(ptx.contains("%31}, da, db, zero, 1, 1, 0, 0;"));
        assert!(ptx.contains("%63}, da, db, one, 1, 1, 0, 0;"));
        assert!(ptx.find("wgmma.fence").unwrap() < ptx.find("wgmma.mma_async").unwrap());

        let registers = |group| Chain {
            a: ASource::Registers { group },
            b: SharedOperand::new(SharedLayout::Swizzled { cols: 128 }, Major::MN),
            k_steps: 4,
            accumulate: true,
            n: 64,
        };
        let ptx = chain_ptx(FloatDtype::F16, &[registers(0), registers(1)], 2);
        // Result %0–%63; accumulators in %64–%127; A groups %128–%143, %144–%159; the B
        // descriptors %160–%161, %162–%163.
        assert!(ptx.contains("mov.b32 %0, %64;"));
        assert!(ptx.contains("mov.b32 %63, %127;"));
        assert!(ptx.contains("mov.b64 db, {%160, %161};"));
        assert!(ptx.contains("mov.b64 db, {%162, %163};"));
        assert!(ptx.contains("{%140, %141, %142, %143}, db, one, 1, 1, 1;"));
        assert!(ptx.contains("{%156, %157, %158, %159}, db, one, 1, 1, 1;"));
        assert!(ptx.contains("add.s64 db, db, 256;"));
        assert!(ptx.contains(".f32.f16.f16"));
        assert!(ptx.find("mov.b32 %63").unwrap() < ptx.find("wgmma.fence").unwrap());
        assert_eq!(ptx.matches("wgmma.wait_group").count(), 1);
    }

    #[test]
    fn wide_products_number_their_operands() {
        // One 128-column product: 64 accumulators, then A and B.
        let k_major = SharedOperand::new(SharedLayout::Swizzled { cols: 128 }, Major::K);
        let ptx = chain_ptx(FloatDtype::BF16, &[Chain::scores(k_major, 128)], 0);
        assert!(ptx.contains("m64n128k16.f32.bf16.bf16 {%0, %1,"));
        assert!(ptx.contains("%63}, da, db, zero, 1, 1, 0, 0;"));
        assert!(ptx.contains("mov.b64 da, {%64, %65};"));
        assert!(ptx.contains("mov.b64 db, {%66, %67};"));

        // `O += P·V` at d = 128 as one product: accumulators in %64–%127, A in %128–%159.
        let products = RegisterProducts::along(SharedLayout::Swizzled { cols: 128 }, 128, 128);
        let mn = SharedOperand::new(SharedLayout::Swizzled { cols: 128 }, Major::MN);
        assert_eq!((products.count, products.b, products.k_steps), (1, mn, 8));
        let ptx = chain_ptx(FloatDtype::BF16, &products.chains(), 2);
        assert!(ptx.contains("mov.b32 %63, %127;"));
        assert!(ptx.contains("m64n128k16.f32.bf16.bf16 {%0, %1,"));
        assert!(ptx.contains("%63}, {%128, %129, %130, %131}, db, one, 1, 1, 1;"));
        assert!(ptx.contains("%63}, {%156, %157, %158, %159}, db, one, 1, 1, 1;"));
        assert!(ptx.contains("mov.b64 db, {%160, %161};"));
        assert_eq!(ptx.matches("wgmma.wait_group").count(), 1);
    }
}
