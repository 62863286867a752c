//! Where a cached key or value lives.
//!
//! A cache is either contiguous, `[batch, heads_kv, capacity, d]` (or a `[batch, capacity,
//! heads_kv, d]` memory viewed so through strides), or paged: `[pages, page_size, heads_kv,
//! d]` with a block table `[batch, max_pages]` naming the page of each `page_size`
//! positions of a sequence, as vLLM and FlashAttention lay them out. The launchers present
//! both to the kernels as `[blocks, heads_kv, rows, d]` tensors (a page view swaps its
//! middle dimensions through strides), so position `p` of sequence `b` is at
//! `(block, row) = (b, p)` in a contiguous cache and `(table[b, p / page_size],
//! p % page_size)` in a paged one. Everything else in a kernel is the same for both.

use cubecl::prelude::*;

/// A position of a cache: its block (a sequence's, or a page) and its row there.
#[derive(CubeType, Clone, Copy)]
pub struct CacheSlot {
    pub block: usize,
    pub row: usize,
}

/// The slot of position `position` of sequence `batch`.
#[cube]
pub fn cache_slot(
    table: &Tensor<i32>,
    batch: usize,
    position: usize,
    page_size: usize,
    #[comptime] paged: bool,
) -> CacheSlot {
    let mut slot = CacheSlot {
        block: batch,
        row: position,
    };
    if paged {
        let entry = batch * table.stride(0) + (position / page_size) * table.stride(1);
        slot.block = usize::cast_from(table[entry]);
        slot.row = position % page_size;
    }
    slot
}

/// Element offset of `(slot, head, 0)` in a cache presented as `[blocks, heads, rows, d]`.
#[cube]
pub fn slot_offset<F: Numeric>(t: &Tensor<F>, slot: CacheSlot, head: usize) -> usize {
    slot.block * t.stride(0) + head * t.stride(1) + slot.row * t.stride(2)
}

/// Stages positions `[first, first + rows)` of sequence `batch`, head `head`, in shared
/// memory as f32: position `first + r` at `r · stride`, `dim` values. Positions at or past
/// `end` read as 0 and are never looked up: the cache past a sequence's length (and the
/// block table past its pages) may hold anything, NaN included. The cube's `units` units
/// cooperate.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_cache_rows<F: Float>(
    t: &Tensor<F>,
    table: &Tensor<i32>,
    batch: usize,
    head: usize,
    first: usize,
    end: usize,
    page_size: usize,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] stride: usize,
    #[comptime] units: usize,
    #[comptime] paged: bool,
) {
    let col_stride = t.stride(3);
    for step in 0..(rows * dim).div_ceil(units) {
        let idx = step * units + UNIT_POS as usize;
        if idx < rows * dim {
            let r = idx / dim;
            let c = idx % dim;
            let mut value = 0.0f32;
            if first + r < end {
                let slot = cache_slot(table, batch, first + r, page_size, paged);
                value = f32::cast_from(t[slot_offset(t, slot, head) + c * col_stride]);
            }
            tile[r * stride + c] = value;
        }
    }
}
