//! Where a cached key or value lives.
//!
//! A cache is either contiguous, `[batch, heads_kv, capacity, d]` (or a `[batch, capacity,
//! heads_kv, d]` memory viewed so through strides), or paged: `[pages, page_size, heads_kv,
//! d]` with a block table `[batch, max_pages]` naming the page of each `page_size`
//! positions of a sequence, as vLLM and FlashAttention lay them out. The launchers present
//! both to the kernels as `[blocks, heads_kv, rows, d]` tensors (a page view swaps its
//! middle dimensions through strides), so position `p` of sequence `b` is at
//! `(block, row) = (b, p)` in a contiguous cache and `(table[b, p / page_size],
//! p % page_size)` in a paged one. Everything else in a kernel is the same for both. The
//! strides come as launch scalars ([`RowLayout`]), not from the tensors' metadata, which
//! lives in global memory and would be loaded again for every value.

use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use crate::tile::RowLayout;

/// A position of a cache: its block (a sequence's, or a page) and its row there.
#[derive(CubeType, Clone, Copy)]
pub struct CacheSlot {
    pub block: usize,
    pub row: usize,
}

/// The slot of position `position` of sequence `batch`; `table_row` is the block table's
/// row stride (its rows are contiguous).
#[cube]
pub fn cache_slot(
    table: &Tensor<i32>,
    table_row: usize,
    batch: usize,
    position: usize,
    page_size: FastDivmod<u32>,
    #[comptime] paged: bool,
) -> CacheSlot {
    let mut slot = CacheSlot {
        block: batch,
        row: position,
    };
    if paged {
        let (page, row) = page_size.div_mod(u32::cast_from(position));
        slot.block = usize::cast_from(table[batch * table_row + usize::cast_from(page)]);
        slot.row = usize::cast_from(row);
    }
    slot
}

/// Loads positions `[first, first + rows)` of sequence `batch`, head `head`, of a cache whose
/// rows `rows_of` describes (unit column stride), into each unit's `regs`: value `step` of a
/// unit is element `step · units + UNIT_POS` of the `rows × dim` block. Positions at or past
/// `end` read as 0 and are never looked up: the cache past a sequence's length (and the
/// block table past its pages) may hold anything, NaN included. Unrolled (`unrolled`), every
/// load is issued before the first is used, and the block's loads are in flight together
/// while the cube computes on the previous block.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_cache_block<F: Float>(
    t: &Tensor<F>,
    rows_of: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    batch: usize,
    head: usize,
    first: usize,
    end: usize,
    page_size: FastDivmod<u32>,
    regs: &mut Array<F>,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
    #[comptime] paged: bool,
    #[comptime] unrolled: bool,
) {
    let steps = comptime!((rows * dim).div_ceil(units));
    if unrolled {
        #[unroll]
        for step in 0..steps {
            regs[step] = load_cache_value(
                t, rows_of, table, table_row, batch, head, first, end, page_size, step, rows, dim,
                units, paged,
            );
        }
    } else {
        for step in 0..steps {
            regs[step] = load_cache_value(
                t, rows_of, table, table_row, batch, head, first, end, page_size, step, rows, dim,
                units, paged,
            );
        }
    }
}

/// Value `step` of [`load_cache_block`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_cache_value<F: Float>(
    t: &Tensor<F>,
    rows_of: &RowLayout,
    table: &Tensor<i32>,
    table_row: usize,
    batch: usize,
    head: usize,
    first: usize,
    end: usize,
    page_size: FastDivmod<u32>,
    step: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
    #[comptime] paged: bool,
) -> F {
    let idx = step * units + UNIT_POS as usize;
    let r = idx / dim;
    let mut value = F::new(0.0);
    if idx < rows * dim && first + r < end {
        let slot = cache_slot(table, table_row, batch, first + r, page_size, paged);
        value = t[rows_of.offset(slot.block, head, slot.row) + idx % dim];
    }
    value
}

/// Stores a block loaded by [`load_cache_block`] in shared memory as f32, row `r` at
/// `r · stride`.
#[cube]
pub fn store_block<F: Float>(
    regs: &Array<F>,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] stride: usize,
    #[comptime] units: usize,
    #[comptime] unrolled: bool,
) {
    let steps = comptime!((rows * dim).div_ceil(units));
    if unrolled {
        #[unroll]
        for step in 0..steps {
            store_value(regs, tile, step, rows, dim, stride, units);
        }
    } else {
        for step in 0..steps {
            store_value(regs, tile, step, rows, dim, stride, units);
        }
    }
}

/// Value `step` of [`store_block`].
#[cube]
fn store_value<F: Float>(
    regs: &Array<F>,
    tile: &mut Shared<[f32]>,
    step: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] stride: usize,
    #[comptime] units: usize,
) {
    let idx = step * units + UNIT_POS as usize;
    if idx < rows * dim {
        tile[(idx / dim) * stride + idx % dim] = f32::cast_from(regs[step]);
    }
}
