//! Writing new keys and values into a cache in place: token `i` of sequence `b` goes to
//! position `cache_seqlens[b] + i`, in the sequence's own rows or in the page its block
//! table names. Keys may be turned by the rotary embedding on the way ([`crate::rotary`]),
//! each to its own position.

use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use super::cache::cache_slot;
use crate::rotary::{RotaryConfig, rotated};
use crate::tile::batch_head_index;

/// Copies `new` `[batch, heads_kv, s_new, d]` (rotated by `rotary`, for keys) into `cache` (presented as `[blocks, heads_kv,
/// rows, d]`, see [`super::cache`]). One cube per (token, batch·head), the pairs along Y
/// and Z ([`crate::launch::blocks_by_pairs`]); a cube takes the tokens
/// `CUBE_POS_X + n · CUBE_COUNT_X`, its units the columns.
#[cube(launch_unchecked)]
pub fn append_to_cache<F: Float>(
    new: &Tensor<F>,
    cache: &mut Tensor<F>,
    seqlens: &Tensor<i32>,
    table: &Tensor<i32>,
    rotary_cos: &Tensor<F>,
    rotary_sin: &Tensor<F>,
    page_size: FastDivmod<u32>,
    #[comptime] paged: bool,
    #[comptime] rotary: RotaryConfig,
    #[define(F)] _dtype: ElemType,
) {
    let heads = new.shape(1);
    let tokens = new.shape(2);
    let dim = new.shape(3);
    let pair = batch_head_index();
    if pair >= new.shape(0) * heads {
        terminate!();
    }
    let batch = pair / heads;
    let head = pair % heads;
    let length = usize::cast_from(seqlens[batch * seqlens.stride(0)]);
    let mut token = CUBE_POS_X as usize;
    while token < tokens {
        let slot = cache_slot(
            table,
            table.stride(0),
            batch,
            length + token,
            page_size,
            paged,
        );
        let to = slot.block * cache.stride(0) + head * cache.stride(1) + slot.row * cache.stride(2);
        let from = batch * new.stride(0) + head * new.stride(1) + token * new.stride(2);
        let col_stride = cache.stride(3);
        let mut c = UNIT_POS as usize;
        while c < dim {
            let value = rotated(
                new,
                from,
                new.stride(3),
                c,
                length + token,
                rotary_cos,
                rotary_sin,
                rotary,
            );
            cache[to + c * col_stride] = F::cast_from(value);
            c += CUBE_DIM as usize;
        }
        token += CUBE_COUNT_X as usize;
    }
}
