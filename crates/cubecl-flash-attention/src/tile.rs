//! Index arithmetic shared by the kernels: which head a cube works on, reading one row of a
//! strided `[batch, heads, seq, dim]` tensor into registers, and staging rows in shared memory.
//!
//! The portable kernels' loops over a row's columns (the head dim) run `columns` columns
//! unrolled per iteration ([`TileConfig::columns`](crate::config::TileConfig)): the whole row
//! where it fits in registers, so that the row's array is indexed by constants; fewer where
//! the row stays in memory, which keeps the kernel's loop iterations within what a CPU
//! driver runs ([`crate::loop_budget`]).

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;

/// The (batch, query head, key/value head) of the cube; the launch enumerates batch·heads
/// along Y, then Z ([`batch_head_index`]).
#[derive(CubeType, Clone, Copy)]
pub struct Head {
    pub batch: usize,
    pub head_q: usize,
    pub head_kv: usize,
}

#[cube]
impl Head {
    /// For kernels with one cube per query head.
    pub fn from_cube(heads_q: usize, heads_kv: usize) -> Head {
        Head::from_index(batch_head_index(), heads_q, heads_kv)
    }

    /// For kernels with one cube per query head, `batch_inner`: the cubes of one head's
    /// `batches` sequences neighbours in the launch (the launch enumerates heads·batch), so
    /// that those running together read a tensor broadcast over the batch once. A cube past
    /// the last pair gets batch `batches` (see [`Sequence::of`](crate::sequence::Sequence)).
    pub fn from_cube_batch_inner(
        heads_q: usize,
        heads_kv: usize,
        batches: usize,
        #[comptime] batch_inner: bool,
    ) -> Head {
        let mut head = Head::from_cube(heads_q, heads_kv);
        if comptime!(batch_inner) {
            let index = batch_head_index();
            head.batch = index % batches;
            head.head_q = index / batches;
            if head.head_q >= heads_q {
                head.batch = batches;
                head.head_q = 0;
            }
            head.head_kv = head.head_q / (heads_q / heads_kv);
        }
        head
    }

    /// For batch·head index `index`.
    pub fn from_index(index: usize, heads_q: usize, heads_kv: usize) -> Head {
        let head_q = index % heads_q;
        Head {
            batch: index / heads_q,
            head_q,
            head_kv: head_q / (heads_q / heads_kv),
        }
    }
}

/// The cube's (batch, head) pair: launches enumerate the pairs along Y, then Z, as
/// [`crate::launch::blocks_by_pairs`] lays them out (a grid dimension holds at most 65535
/// cubes). A cube past the last pair finds its sequence empty ([`crate::sequence::Sequence::of`]).
#[cube]
pub fn batch_head_index() -> usize {
    CUBE_POS_Y as usize + CUBE_POS_Z as usize * CUBE_COUNT_Y as usize
}

/// Where the rows of a `[batch, heads, seq, ·]` tensor (or a `[batch, heads, seq]` vector)
/// are: the element strides of its first three dims and its sequence length. The
/// register-level kernels take one per tensor they stage block after block, as a launch
/// argument: it then lives in the kernel's parameters and is read as constant operands,
/// where a tensor's own shape and strides live in global memory, and the compiled loops
/// loaded them again at every step (SASS: 7 to 21 loads per step before this).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct RowLayout {
    pub batch_stride: u32,
    pub head_stride: u32,
    pub row_stride: u32,
    pub seq: u32,
}

#[cube]
impl RowLayout {
    /// Element offset of `(batch, head, row, 0)`.
    pub fn offset(&self, batch: usize, head: usize, row: usize) -> usize {
        batch * usize::cast_from(self.batch_stride)
            + head * usize::cast_from(self.head_stride)
            + row * usize::cast_from(self.row_stride)
    }

    /// Rows per (batch, head).
    pub fn rows(&self) -> usize {
        usize::cast_from(self.seq)
    }
}

/// Element offset of `(batch, head, row, 0)`.
#[cube]
pub fn row_offset<F: Numeric>(t: &Tensor<F>, batch: usize, head: usize, row: usize) -> usize {
    batch * t.stride(0) + head * t.stride(1) + row * t.stride(2)
}

/// Reads row `row` of head `head` into f32 registers.
#[cube]
pub fn read_row<F: Float>(
    t: &Tensor<F>,
    batch: usize,
    head: usize,
    row: usize,
    dest: &mut Array<f32>,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) {
    let base = row_offset(t, batch, head, row);
    let stride = t.stride(3);
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            dest[c] = f32::cast_from(t[base + c * stride]);
        }
    } else {
        // The count of steps is read from the tensor's shape: a count the compiler cannot
        // see keeps a CPU driver (lavapipe) from unrolling the loop, which makes it hold the
        // row as values across every barrier (minutes to compile); rolled, its array stays
        // one block of memory.
        for step in 0..t.shape(3).div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    dest[c] = f32::cast_from(t[base + c * stride]);
                }
            }
        }
    }
}

/// Writes `row · factor` to row `row` of head `head`, cast to the tensor's dtype.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_row<F: Float>(
    t: &mut Tensor<F>,
    batch: usize,
    head: usize,
    index: usize,
    row: &Array<f32>,
    factor: f32,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) {
    let base = batch * t.stride(0) + head * t.stride(1) + index * t.stride(2);
    let stride = t.stride(3);
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            t[base + c * stride] = F::cast_from(row[c] * factor);
        }
    } else {
        // A step count the compiler cannot see, as in `read_row`.
        for step in 0..t.shape(3).div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    t[base + c * stride] = F::cast_from(row[c] * factor);
                }
            }
        }
    }
}

/// `row[c] ← row[c] · factor` for every column.
#[cube]
pub fn scale_row(
    row: &mut Array<f32>,
    factor: f32,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) {
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            row[c] *= factor;
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    row[c] *= factor;
                }
            }
        }
    }
}

/// `row[c] ← 0` for every column.
#[cube]
pub fn zero_row(
    row: &mut Array<f32>,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) {
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            row[c] = 0.0;
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    row[c] = 0.0;
                }
            }
        }
    }
}

/// `row[c] ← row[c] + factor · tile[offset + c]`: a row staged in shared memory, scaled, added
/// to a row held in registers.
#[cube]
pub fn add_scaled_staged(
    row: &mut Array<f32>,
    factor: f32,
    tile: &Shared<[f32]>,
    offset: usize,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) {
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            row[c] += factor * tile[offset + c];
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    row[c] += factor * tile[offset + c];
                }
            }
        }
    }
}

/// Stages rows `[first, first + rows)` of head `head` in shared memory as f32, `dim` values
/// per row, the cube's `units` units cooperating; rows past the end of the sequence read as 0.
#[cube]
pub fn load_rows<F: Float>(
    t: &Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
) {
    let seq = t.shape(2);
    let base = batch * t.stride(0) + head * t.stride(1);
    let (row_stride, col_stride) = (t.stride(2), t.stride(3));
    for step in 0..(rows * dim).div_ceil(units) {
        let idx = step * units + UNIT_POS as usize;
        if idx < rows * dim {
            let r = idx / dim;
            let c = idx % dim;
            let mut value = 0.0f32;
            if first + r < seq {
                value = f32::cast_from(t[base + (first + r) * row_stride + c * col_stride]);
            }
            tile[idx] = value;
        }
    }
}

/// Stages `rows` values of a `[batch, heads, seq]` f32 vector (LSE, D) in shared memory.
#[cube]
pub fn load_vector(
    t: &Tensor<f32>,
    batch: usize,
    head: usize,
    first: usize,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] units: usize,
) {
    let seq = t.shape(2);
    let base = batch * t.stride(0) + head * t.stride(1);
    for step in 0..rows.div_ceil(units) {
        let r = step * units + UNIT_POS as usize;
        if r < rows {
            let mut value = 0.0f32;
            if first + r < seq {
                value = t[base + (first + r) * t.stride(2)];
            }
            tile[r] = value;
        }
    }
}

/// `row[c] ← row[c] + factor · tile[offset + c]`, returning `Σ_c other[c] · tile[offset + c]`:
/// [`add_scaled_staged`] and [`dot_staged`] over one staged row, read once.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_scaled_and_dot_staged(
    row: &mut Array<f32>,
    factor: f32,
    other: &Array<f32>,
    tile: &Shared<[f32]>,
    offset: usize,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) -> f32 {
    let mut dot = 0.0f32;
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            let t = tile[offset + c];
            row[c] += factor * t;
            dot += other[c] * t;
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    let t = tile[offset + c];
                    row[c] += factor * t;
                    dot += other[c] * t;
                }
            }
        }
    }
    dot
}

/// `Σ_c row[c] · tile[offset + c]`: a row held in registers against a row staged in shared
/// memory.
#[cube]
pub fn dot_staged(
    row: &Array<f32>,
    tile: &Shared<[f32]>,
    offset: usize,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) -> f32 {
    let mut dot = 0.0f32;
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            dot += row[c] * tile[offset + c];
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    dot += row[c] * tile[offset + c];
                }
            }
        }
    }
    dot
}

/// `Σ_c a[a_offset + c] · b[b_offset + c]`: two rows staged in shared memory.
#[cube]
pub fn dot_shared(
    a: &Shared<[f32]>,
    a_offset: usize,
    b: &Shared<[f32]>,
    b_offset: usize,
    len: usize,
    #[comptime] dim: usize,
    #[comptime] columns: usize,
) -> f32 {
    let mut dot = 0.0f32;
    let width = comptime!(columns.min(dim));
    if comptime!(width == dim) {
        #[unroll]
        for c in 0..dim {
            dot += a[a_offset + c] * b[b_offset + c];
        }
    } else {
        // `len` (= `dim`) counts the steps: a count the compiler cannot see, as in `read_row`.
        for step in 0..len.div_ceil(width) {
            #[unroll]
            for i in 0..width {
                let c = step * width + i;
                if comptime!(dim.is_multiple_of(width)) || c < dim {
                    dot += a[a_offset + c] * b[b_offset + c];
                }
            }
        }
    }
    dot
}

/// Stages the key and value rows `[first, first + rows)` of head `head`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_key_value_block<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    k_tile: &mut Shared<[f32]>,
    v_tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] dim_qk: usize,
    #[comptime] dim_v: usize,
    #[comptime] units: usize,
) {
    load_rows(k, batch, head, first, k_tile, rows, dim_qk, units);
    load_rows(v, batch, head, first, v_tile, rows, dim_v, units);
}

/// Stages rows `[first, first + rows)` of head `head` in shared memory in the input dtype:
/// row `r` at `r · stride`, its `dim` values zero-padded to `padded` columns; rows past the
/// end of the sequence read as 0. The cube's `units` units cooperate.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows<F: Float>(
    t: &Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    tile: &mut Shared<[F]>,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] padded: usize,
    #[comptime] stride: usize,
    #[comptime] units: usize,
) {
    let seq = t.shape(2);
    let base = batch * t.stride(0) + head * t.stride(1);
    let (row_stride, col_stride) = (t.stride(2), t.stride(3));
    for step in 0..(rows * padded).div_ceil(units) {
        let idx = step * units + UNIT_POS as usize;
        if idx < rows * padded {
            let r = idx / padded;
            let c = idx % padded;
            let mut value = F::new(0.0);
            if first + r < seq && c < dim {
                value = t[base + (first + r) * row_stride + c * col_stride];
            }
            tile[r * stride + c] = value;
        }
    }
}

/// Writes rows `[first, first + rows)` of head `head` of `t` from an f32 tile in shared
/// memory (row `r` at `r · stride`), cast to the tensor's dtype; rows from `end` (the end
/// of the cube's sequence) on are skipped. The cube's `units` units cooperate.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_rows<F: Float>(
    tile: &Shared<[f32]>,
    t: &mut Tensor<F>,
    batch: usize,
    head: usize,
    first: usize,
    end: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] stride: usize,
    #[comptime] units: usize,
) {
    let base = batch * t.stride(0) + head * t.stride(1);
    let (row_stride, col_stride) = (t.stride(2), t.stride(3));
    for step in 0..(rows * dim).div_ceil(units) {
        let idx = step * units + UNIT_POS as usize;
        let r = idx / dim;
        if idx < rows * dim && first + r < end {
            let c = idx % dim;
            t[base + (first + r) * row_stride + c * col_stride] =
                F::cast_from(tile[r * stride + c]);
        }
    }
}

/// Elements of one 16-byte asynchronous copy.
pub const COPY: usize = 8;

/// How a tile of rows is laid out in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SharedLayout {
    /// Row `r` at `r · stride`: read by `ldmatrix`, whose lanes address one 16-byte row
    /// each (a padded stride keeps their banks apart).
    Rows { stride: usize },
    /// Rows of 128 bytes (64 columns of 16-bit elements) swizzled as the warpgroup
    /// products' 128-byte mode reads them ([`crate::wgmma`]): the tile is cut into atoms of
    /// 8 rows × 64 columns, 1024 contiguous bytes each (the 8-row groups one after the
    /// other, each holding its `cols / 64` atoms in column order); in an atom, the 16-byte
    /// chunk `c` of row `r` sits at chunk `c ^ r`, so the 8 rows of a chunk fall in
    /// different banks. Needs `cols % 64 == 0` and atoms aligned to 1024 bytes.
    Swizzled { cols: usize },
}

impl SharedLayout {
    pub const fn rows(stride: usize) -> Self {
        Self::Rows { stride }
    }
    /// Elements of a tile of `rows` rows.
    pub const fn len(&self, rows: usize) -> usize {
        match *self {
            Self::Rows { stride } => rows * stride,
            Self::Swizzled { cols } => rows * cols,
        }
    }
}

/// Element offset of row `r`, column `c` (a multiple of 8 for [`SharedLayout::Swizzled`]) in
/// a tile laid out as `layout`.
#[cube]
pub fn shared_offset(r: usize, c: usize, #[comptime] layout: SharedLayout) -> usize {
    let (swizzled, width) = comptime!(match layout {
        SharedLayout::Rows { stride } => (false, stride),
        SharedLayout::Swizzled { cols } => (true, cols),
    });
    if comptime!(swizzled) {
        let chunk = (c / COPY) % SWIZZLE_CHUNKS;
        (r / 8) * comptime!(8 * width)
            + (c / SWIZZLE_COLS) * comptime!(8 * SWIZZLE_COLS)
            + (r % 8) * SWIZZLE_COLS
            + (chunk ^ (r % 8)) * COPY
    } else {
        r * width + c
    }
}

/// Columns of one row of a [`SharedLayout::Swizzled`] atom (128 bytes of 16-bit elements).
pub const SWIZZLE_COLS: usize = 64;
/// 16-byte chunks of one row of an atom.
const SWIZZLE_CHUNKS: usize = SWIZZLE_COLS / COPY;

/// [`stage_rows`] with 16-byte asynchronous copies (`cp.async`) into `tile` at `offset`, laid
/// out as `layout`, the rows of `t` found through `rows_of` (its [`RowLayout`]). The copies
/// have not landed when this returns; a barrier the cube commits them to
/// (`Barrier::commit_copy_async`) and waits on makes them visible. Rows past the end of the
/// sequence and the padding columns are zeroed with plain stores, visible after the same
/// wait. Needs `dim % 8 == 0`, a unit column stride, other strides multiples of 8 and a
/// 16-byte aligned buffer (see the launcher's checks).
///
/// A block wholly inside the sequence whose copies divide evenly among the units (the
/// common case) takes a path without per-row checks: each unit copies the same 16 bytes of
/// every `units / per_row`-th row, one address increment apart (swizzled: of every
/// `units / 8`-th row of one atom column). Neighbouring units read neighbouring 16 bytes of
/// a row.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows_async<F: Float>(
    t: &Tensor<F>,
    rows_of: &RowLayout,
    batch: usize,
    head: usize,
    first: usize,
    tile: &mut Shared<[F]>,
    offset: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] padded: usize,
    #[comptime] layout: SharedLayout,
    #[comptime] units: usize,
) {
    let seq = rows_of.rows();
    let base = rows_of.offset(batch, head, 0);
    let row_stride = usize::cast_from(rows_of.row_stride);
    let per_row = comptime!(padded / COPY);
    let total = comptime!(rows * per_row);
    let swizzled = comptime!(matches!(layout, SharedLayout::Swizzled { .. }));
    let regular = comptime!(
        dim == padded
            && units.is_multiple_of(per_row)
            && total.is_multiple_of(units)
            && (!swizzled
                || (units.is_multiple_of(8 * SWIZZLE_CHUNKS)
                    && (rows * SWIZZLE_CHUNKS).is_multiple_of(units)))
    );
    if comptime!(regular && swizzled) && first + rows <= seq {
        // Eight neighbouring units copy the 128 bytes of one row's atom; a pass copies
        // `units / 8` rows of one atom column.
        let rows_per_pass = comptime!(units / SWIZZLE_CHUNKS);
        let passes_per_column = comptime!(rows / rows_per_pass);
        let unit = UNIT_POS as usize;
        let r = unit / SWIZZLE_CHUNKS;
        let c = (unit % SWIZZLE_CHUNKS) * COPY;
        let src = base + (first + r) * row_stride + c;
        let dst = offset + shared_offset(r, c, layout);
        #[unroll]
        for pass in 0..comptime!(total / units) {
            // Rows `dr` further on keep the swizzle (`dr` is a multiple of 8).
            let dr = comptime!((pass % passes_per_column) * rows_per_pass);
            let dc = comptime!((pass / passes_per_column) * SWIZZLE_COLS);
            let from = src + dr * row_stride + dc;
            let to = dst + comptime!(layout.len(dr) + 8 * dc);
            copy_async(&t[from..from + COPY], &mut tile[to..to + COPY], COPY as u32);
        }
    } else if comptime!(regular) && first + rows <= seq {
        let rows_per_pass = comptime!(units / per_row);
        let unit = UNIT_POS as usize;
        let r = unit / per_row;
        let c = (unit % per_row) * COPY;
        let src = base + (first + r) * row_stride + c;
        let dst = offset + shared_offset(r, c, layout);
        let src_pass = rows_per_pass * row_stride;
        let dst_pass = comptime!(layout.len(rows_per_pass));
        #[unroll]
        for pass in 0..comptime!(total / units) {
            let from = src + pass * src_pass;
            let to = dst + comptime!(pass * dst_pass);
            copy_async(&t[from..from + COPY], &mut tile[to..to + COPY], COPY as u32);
        }
    } else {
        #[unroll]
        for step in 0..comptime!(total.div_ceil(units)) {
            let idx = step * units + UNIT_POS as usize;
            if comptime!(total % units == 0) || idx < total {
                let r = idx / per_row;
                let c = (idx % per_row) * COPY;
                let dst = offset + shared_offset(r, c, layout);
                if first + r < seq && c < dim {
                    let src = base + (first + r) * row_stride + c;
                    copy_async(&t[src..src + COPY], &mut tile[dst..dst + COPY], COPY as u32);
                } else {
                    #[unroll]
                    for e in 0..COPY {
                        tile[dst + e] = F::new(0.0);
                    }
                }
            }
        }
    }
}

/// Stages `rows` entries of two `[batch, heads, seq]` f32 vectors (the LSE and D of a query
/// block, laid out as `a_layout` and `b_layout`) with 4-byte asynchronous copies: `a` at
/// `offset`, `b` at `offset + rows`, visible once the barrier they are committed to has been
/// waited on (as [`stage_rows_async`]). Entries past the end of the sequence repeat the last
/// one.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_vectors_async(
    a: &Tensor<f32>,
    b: &Tensor<f32>,
    a_layout: &RowLayout,
    b_layout: &RowLayout,
    batch: usize,
    head: usize,
    first: usize,
    tile: &mut Shared<[f32]>,
    offset: usize,
    #[comptime] rows: usize,
    #[comptime] units: usize,
) {
    let last = a_layout.rows() - 1;
    #[unroll]
    for pass in 0..comptime!((2 * rows).div_ceil(units)) {
        let idx = pass * units + UNIT_POS as usize;
        if comptime!((2 * rows).is_multiple_of(units)) || idx < 2 * rows {
            let r = idx % rows;
            let row = min(first + r, last);
            if idx < rows {
                let at = a_layout.offset(batch, head, row);
                copy_async(
                    &a[at..at + 1],
                    &mut tile[offset + idx..offset + idx + 1],
                    1u32,
                );
            } else {
                let at = b_layout.offset(batch, head, row);
                copy_async(
                    &b[at..at + 1],
                    &mut tile[offset + idx..offset + idx + 1],
                    1u32,
                );
            }
        }
    }
}

/// Position `index` of `count` counted from the end.
#[cube]
pub fn last_first(index: usize, count: usize) -> usize {
    count - 1 - index
}
