//! Merging attention over parts of the key range by their LSE.
//!
//! A query row's attention over keys split into parts `s`, each with its normalized output
//! `O_s` and its `LSE_s`, is `O = Σ_s w_s · O_s` with `w_s = exp(LSE_s − LSE)` and
//! `LSE = log Σ_s exp(LSE_s)`. A part that sees no key has `LSE_s = −∞` and weight 0; a row
//! no part sees gives `O = 0`, `LSE = −∞`.

use cubecl::prelude::*;

/// `partial_out` `[parts, batch, heads, seq, d_v]` and `partial_lse` `[parts, batch, heads,
/// seq]` (f32, contiguous) into `out` `[batch, heads, seq, d_v]` (any strides, the input
/// dtype) and `lse` `[batch, heads, seq]`. One cube of `units` units (a power of two, at
/// least `dim`) per row: the row is `CUBE_POS_Y · CUBE_COUNT_X + CUBE_POS_X`.
///
/// The merge's time is the latency of its chain of loads, not their bytes (the parts were
/// just written and sit in L2), so the chain is kept short. The `units / dim` groups of
/// units take every `groups`-th part, a unit one column; each merges its parts online, as
/// the forward merges key blocks (a running maximum of the LSEs, the weights' total and the
/// weighted sum, rescaled when the maximum grows), [`PARTS_A_ROUND`] parts at a time with
/// all their loads in flight together. The groups then meet once in shared memory and
/// the first merges their results the same way.
#[cube(launch_unchecked)]
pub fn merge_by_lse<F: Float>(
    partial_out: &Tensor<f32>,
    partial_lse: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[comptime] units: usize,
    #[comptime] dim: usize,
    #[define(F)] _dtype: ElemType,
) {
    let parts = partial_lse.shape(0);
    let rows = partial_lse.stride(0);
    let row = CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let groups = comptime!(units / dim);
    let c = unit % dim;
    let group = unit / dim;

    // This unit's share: parts `group`, `group + groups`, … of column `c`.
    let mut top = neg_inf;
    let mut total = 0.0f32;
    let mut o = 0.0f32;
    if group < groups {
        let mut lses = Array::<f32>::new(PARTS_A_ROUND);
        let mut values = Array::<f32>::new(PARTS_A_ROUND);
        let mut first = group;
        while first < parts {
            #[unroll]
            for n in 0..PARTS_A_ROUND {
                // A part past the last reads the last (in bounds) and weighs nothing.
                let part = first + n * groups;
                let at = min(part, parts - 1) * rows + row;
                lses[n] = select(part < parts, partial_lse[at], neg_inf);
                values[n] = partial_out[at * dim + c];
            }
            let mut m = top;
            #[unroll]
            for n in 0..PARTS_A_ROUND {
                m = max(m, lses[n]);
            }
            let rescale = weight(top, m, neg_inf);
            total *= rescale;
            o *= rescale;
            #[unroll]
            for n in 0..PARTS_A_ROUND {
                let w = weight(lses[n], m, neg_inf);
                total += w;
                o += w * values[n];
            }
            top = m;
            first += PARTS_A_ROUND * groups;
        }
    }

    // The groups' results meet: each group's maximum and total (the same in all its
    // units) and its units' sums.
    let mut tops = Shared::<[f32]>::new_slice(groups);
    let mut totals = Shared::<[f32]>::new_slice(groups);
    let mut sums = Shared::<[f32]>::new_slice(units);
    if c == 0 && group < groups {
        tops[group] = top;
        totals[group] = total;
    }
    sums[unit] = o;
    sync_cube();
    if group == 0 {
        let mut m = neg_inf;
        #[unroll]
        for g in 0..groups {
            m = max(m, tops[g]);
        }
        let mut total = 0.0f32;
        let mut sum = 0.0f32;
        #[unroll]
        for g in 0..groups {
            let w = weight(tops[g], m, neg_inf);
            total += w * totals[g];
            sum += w * sums[g * dim + c];
        }
        let norm = select(total > 0.0, 1.0 / total, 0.0);
        let (heads, seq) = (out.shape(1), out.shape(2));
        let (batch, head, i) = (row / (heads * seq), (row / seq) % heads, row % seq);
        let at =
            batch * out.stride(0) + head * out.stride(1) + i * out.stride(2) + c * out.stride(3);
        out[at] = F::cast_from(sum * norm);
        if c == 0 {
            let at = batch * lse.stride(0) + head * lse.stride(1) + i * lse.stride(2);
            lse[at] = select(total > 0.0, m + total.ln(), neg_inf);
        }
    }
}

/// Parts a unit of [`merge_by_lse`] reads at once: a row of 33 parts (the most a split
/// count takes at batch 1 on a 132-multiprocessor GPU) in two rounds where four groups
/// share it.
pub const PARTS_A_ROUND: usize = 8;

/// `exp(LSE_s − m)`, 0 for a part that saw no key (and for every part while `m` is −∞).
#[cube]
fn weight(part: f32, m: f32, neg_inf: f32) -> f32 {
    select(part == neg_inf, 0.0, (part - m).exp())
}

/// Groups of units that share a row's parts, where the device's cubes hold them: a unit
/// then adds a quarter of the parts, so the chain of loads it waits on is a quarter as long.
pub const MERGE_GROUPS: usize = 4;

/// Units of a merge cube for rows of `dim` columns, on a device of at most `max_units`
/// units per cube: a power of two of at least 128 and `dim`, up to [`MERGE_GROUPS`] times
/// `dim` where the device allows.
pub fn merge_units(dim: usize, max_units: usize) -> usize {
    let row = dim.next_power_of_two().max(128);
    let mut units = row;
    while units * 2 <= max_units && units * 2 <= dim.max(1) * MERGE_GROUPS {
        units *= 2;
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_cubes_share_rows_among_groups_where_the_device_allows() {
        // Four groups of a row's 128 columns on a GPU, two on a device of 256 units.
        assert_eq!(merge_units(128, 1024), 512);
        assert_eq!(merge_units(128, 256), 256);
        assert_eq!(merge_units(64, 1024), 256);
        assert_eq!(merge_units(256, 1024), 1024);
        // Whole groups of an odd row: 96 columns, two groups in 256 units.
        assert_eq!(merge_units(96, 1024), 256);
        // Never fewer units than a row has columns, nor than 128.
        assert_eq!(merge_units(256, 128), 256);
        assert_eq!(merge_units(8, 1024), 128);
    }
}
