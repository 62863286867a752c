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
/// Every step reads the parts side by side, so that the loads are in flight together: the
/// units take the parts' LSEs for the maximum and the sum (reduced through shared memory),
/// then the weights of `units` parts at a time, and the `units / dim` groups of units each
/// add up their share of those parts' outputs for every column.
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
    let mut scratch = Shared::<[f32]>::new_slice(units);
    let mut weights = Shared::<[f32]>::new_slice(units);

    let mut m = neg_inf;
    let mut s = unit;
    while s < parts {
        m = max(m, partial_lse[s * rows + row]);
        s += units;
    }
    let m = reduce(&mut scratch, m, units, true);
    let mut total = 0.0f32;
    s = unit;
    while s < parts {
        total += weight(partial_lse[s * rows + row], m, neg_inf);
        s += units;
    }
    let total = reduce(&mut scratch, total, units, false);
    let norm = select(total > 0.0, 1.0 / total, 0.0);

    let groups = comptime!(units / dim);
    let c = unit % dim;
    let group = unit / dim;
    let mut o = 0.0f32;
    let mut first = 0;
    while first < parts {
        sync_cube();
        let part = first + unit;
        let mut w = 0.0f32;
        if part < parts {
            w = weight(partial_lse[part * rows + row], m, neg_inf);
        }
        weights[unit] = w;
        sync_cube();
        let count = min(units, parts - first);
        if group < groups {
            // Part `first + j`'s value of column `c` is at `base + j · stride`.
            let stride = rows * dim;
            let base = (first * rows + row) * dim + c;
            let mut j = group;
            // Four parts a round, their loads in flight together.
            while j + 3 * groups < count {
                let a = partial_out[base + j * stride];
                let b = partial_out[base + (j + groups) * stride];
                let e = partial_out[base + (j + 2 * groups) * stride];
                let f = partial_out[base + (j + 3 * groups) * stride];
                o += weights[j] * a + weights[j + groups] * b;
                o += weights[j + 2 * groups] * e + weights[j + 3 * groups] * f;
                j += 4 * groups;
            }
            while j < count {
                o += weights[j] * partial_out[base + j * stride];
                j += groups;
            }
        }
        first += units;
    }
    sync_cube();
    scratch[unit] = o;
    sync_cube();
    if group == 0 {
        let mut sum = 0.0f32;
        #[unroll]
        for g in 0..groups {
            sum += scratch[g * dim + c];
        }
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

/// `exp(LSE_s − m)`, 0 for a part that saw no key.
#[cube]
fn weight(part: f32, m: f32, neg_inf: f32) -> f32 {
    select(part == neg_inf, 0.0, (part - m).exp())
}

/// The maximum (`is_max`) or the sum of every unit's `value`, through `scratch` (`units`
/// values, a power of two).
#[cube]
fn reduce(
    scratch: &mut Shared<[f32]>,
    value: f32,
    #[comptime] units: usize,
    #[comptime] is_max: bool,
) -> f32 {
    let unit = UNIT_POS as usize;
    sync_cube();
    scratch[unit] = value;
    sync_cube();
    #[unroll]
    for level in 0..comptime!(units.trailing_zeros() as usize) {
        let width = comptime!(units >> (level + 1));
        if unit < width {
            let other = scratch[unit + width];
            let mine = scratch[unit];
            if is_max {
                scratch[unit] = max(mine, other);
            } else {
                scratch[unit] = mine + other;
            }
        }
        sync_cube();
    }
    scratch[0]
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
