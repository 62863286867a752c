//! Merging attention over parts of the key range by their LSE.
//!
//! A query row's attention over keys split into parts `s`, each with its normalized output
//! `O_s` and its `LSE_s`, is `O = Σ_s w_s · O_s` with `w_s = exp(LSE_s − LSE)` and
//! `LSE = log Σ_s exp(LSE_s)`. A part that sees no key has `LSE_s = −∞` and weight 0; a row
//! no part sees gives `O = 0`, `LSE = −∞`.
//!
//! Two ways to run it: a kernel of its own after the decode kernel ([`merge_by_lse`]), or
//! inside the decode kernel, by whichever of a row block's split cubes finishes last
//! ([`merge_when_last`]), where the runtime orders memory across cubes: no second launch,
//! and the merges of row blocks that finish early overlap the cubes still reading keys.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::{self, ThreadId};

use cubecl::client::Client;
use cubecl::device::DeviceId;
use cubecl::prelude::*;

use super::task::DecodeTask;
use crate::launch::DeviceTensor;

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

/// Counts the split cubes of the cube's row block (`CUBE_POS_Y`) that have written their
/// parts and, in the last of them (`CUBE_COUNT_X` counted), merges the block's rows into
/// `out` and `lse`; every other cube returns at once. `arrivals` holds one counter per row
/// block, zero before the call; the last cube sets its counter back to zero, so the same
/// counters serve the next call on the stream (and a replayed graph).
///
/// Every unit of the cube must call it, after the cube's parts are written. Needs a runtime
/// whose storage barrier (`sync_storage`) orders memory across cubes (CUDA, HIP): the
/// barrier publishes the parts before the count, and the last cube's barrier after the
/// count makes every other cube's parts visible to it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn merge_when_last<F: Float>(
    task: &DecodeTask,
    arrivals: &mut Tensor<Atomic<u32>>,
    partial_out: &mut Tensor<f32>,
    partial_lse: &mut Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
) {
    let mut last = Shared::<[u32]>::new_slice(1usize);
    sync_storage();
    if UNIT_POS == 0 {
        let counter = &arrivals[CUBE_POS_Y as usize];
        let arrived = counter.fetch_add(1u32) + 1;
        let is_last = arrived == CUBE_COUNT_X;
        if is_last {
            counter.store(0u32);
        }
        last[0] = u32::cast_from(is_last);
    }
    sync_storage();
    if last[0] == 1 {
        merge_rows(
            task,
            partial_out,
            partial_lse,
            out,
            lse,
            neg_inf,
            rows,
            dim,
            units,
        );
    }
}

/// The merge of [`merge_when_last`]: the `rows` rows of the cube's row block over the
/// `CUBE_COUNT_X` parts. A unit per row first finds the row's largest LSE and its weights'
/// total in one pass; then every unit adds up its elements of the rows over the parts,
/// [`PARTS_A_ROUND`] parts at a time, so that a unit has that many times its elements' loads
/// in flight at once (the parts were just written: the loads hit L2, and their latency,
/// not their bytes, sets the merge's time).
#[cube]
#[allow(clippy::too_many_arguments)]
fn merge_rows<F: Float>(
    task: &DecodeTask,
    partial_out: &mut Tensor<f32>,
    partial_lse: &mut Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    neg_inf: f32,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] units: usize,
) {
    let parts = CUBE_COUNT_X as usize;
    let (part_rows, part_lses) = (partial_out.stride(0), partial_lse.stride(0));
    let mut row_top = Shared::<[f32]>::new_slice(rows);
    let mut row_norm = Shared::<[f32]>::new_slice(rows);
    let own = UNIT_POS as usize;
    if own < rows {
        let mut m = neg_inf;
        let mut total = 0.0f32;
        if task.has_row(own) {
            let row = task.row_index(own);
            for s in 0..parts {
                let part = partial_lse[s * part_lses + row];
                if part != neg_inf {
                    let top = max(m, part);
                    total = total * (m - top).exp() + (part - top).exp();
                    m = top;
                }
            }
            let row_lse = select(total > 0.0, m + total.ln(), neg_inf);
            task.write_lse(lse, partial_lse, own, row_lse, false);
        }
        row_top[own] = m;
        row_norm[own] = select(total > 0.0, 1.0 / total, 0.0);
    }
    sync_cube();

    // The unit's elements: element `n` is column `idx % dim` of row `r`, at `out_at[n]` in a
    // part's outputs and `lse_at[n]` in its LSEs.
    let per_unit = comptime!((rows * dim).div_ceil(units));
    let mut out_at = Array::<usize>::new(per_unit);
    let mut lse_at = Array::<usize>::new(per_unit);
    let mut top = Array::<f32>::new(per_unit);
    let mut acc = Array::<f32>::new(per_unit);
    #[unroll]
    for n in 0..per_unit {
        let idx = n * units + own;
        let r = min(idx / dim, rows - 1);
        // An element past the rows reads row 0 (in bounds) and is never written.
        let row = select(idx < rows * dim && task.has_row(r), task.row_index(r), 0);
        out_at[n] = row * partial_out.stride(1) + idx % dim;
        lse_at[n] = row;
        top[n] = row_top[r];
        acc[n] = 0.0;
    }
    let mut s = 0;
    while s + PARTS_A_ROUND <= parts {
        #[unroll]
        for j in 0..PARTS_A_ROUND {
            #[unroll]
            for n in 0..per_unit {
                let part = s + j;
                let w = weight(partial_lse[part * part_lses + lse_at[n]], top[n], neg_inf);
                acc[n] += w * partial_out[part * part_rows + out_at[n]];
            }
        }
        s += PARTS_A_ROUND;
    }
    while s < parts {
        #[unroll]
        for n in 0..per_unit {
            let w = weight(partial_lse[s * part_lses + lse_at[n]], top[n], neg_inf);
            acc[n] += w * partial_out[s * part_rows + out_at[n]];
        }
        s += 1;
    }
    #[unroll]
    for n in 0..per_unit {
        let idx = n * units + own;
        let r = idx / dim;
        if idx < rows * dim && task.has_row(r) {
            let value = acc[n] * row_norm[r];
            task.write_output(out, partial_out, r, idx % dim, value, false);
        }
    }
}

/// Parts a unit of [`merge_rows`] reads at once.
const PARTS_A_ROUND: usize = 4;

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

/// Arrival counters for `count` row blocks ([`merge_when_last`]), zero. They are kept per
/// device and thread and reused by every call after the first, whose last cubes leave them
/// at zero again: allocated (and zeroed by a fill kernel) only the first time, or when a
/// call needs more. A thread's calls go to its own stream and run one after another, so
/// two calls never count on the same counters at once.
pub fn arrival_counters(client: &Client, count: usize) -> DeviceTensor {
    type Key = (DeviceId, TypeId, ThreadId);
    static COUNTERS: Mutex<Option<HashMap<Key, DeviceTensor>>> = Mutex::new(None);
    let service = client.service_id();
    let key = (service.device, service.service, thread::current().id());
    let mut kept = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let kept = kept.get_or_insert_with(HashMap::new);
    let counters = match kept.get(&key) {
        Some(counters) if counters.shape[0] >= count => counters.clone(),
        _ => {
            // f32 zeros are u32 zeros.
            let size = count.next_power_of_two().max(1024);
            let counters = client
                .memory_persistent_allocation((), |_| DeviceTensor::zeros_f32(client, &[size]));
            kept.insert(key, counters.clone());
            counters
        }
    };
    DeviceTensor {
        shape: vec![count],
        ..counters
    }
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
