//! The loop-iteration budget of llvmpipe, Mesa's CPU driver (lavapipe on Vulkan).
//!
//! llvmpipe guards against endless loops with one counter per shader invocation, shared by
//! every loop of the shader (gallivm's `LP_MAX_TGSI_LOOP_ITERATIONS`, 65 535): once the
//! iterations of all loops together reach it, every loop still running exits after its
//! current iteration. Nothing reports it; the kernel goes on and writes wrong results.
//! A kernel of 64 threads that adds 1 to each of 80 values in a loop run 800 times
//! (80 + 800 · 81 iterations) returns 799 in the first value and leaves the other 79
//! unwritten.
//!
//! The portable kernels' loops are the head-dim loops (a row's columns), the loops over
//! the rows of a staged block and over the blocks, and the cooperative copies. Their
//! head-dim loops run [`TileConfig::columns`] columns per iteration, and before a launch
//! [`check`] counts the iterations of one invocation (an upper bound: every block of the
//! sequence, masked or not) and refuses the problem with [`FlashError::Unavailable`] where
//! the driver would cut the loops short.

use crate::config::{DeviceLimits, TileConfig};
use crate::decode::DecodeConfig;
use crate::error::FlashError;
use crate::problem::AttentionProblem;

/// llvmpipe's loop iterations per shader invocation.
pub const LLVMPIPE_LOOP_ITERATIONS: u64 = 65_535;

/// The loop budget of the driver a device names itself by (`DeviceIdentity::name`, e.g.
/// `llvmpipe (LLVM 15.0.6, 256 bits)`); `None` where loops run to the end.
pub fn driver_loop_iterations(device_name: &str) -> Option<u64> {
    device_name
        .starts_with("llvmpipe")
        .then_some(LLVMPIPE_LOOP_ITERATIONS)
}

/// What one run of a loop of `trips` iterations costs: llvmpipe counts its closing test
/// as one more.
fn run(trips: u64) -> u64 {
    trips + 1
}

/// One run of a head-dim loop over a row of `dim` columns walked `columns` at a time (none
/// where the row is unrolled whole).
fn row(dim: usize, columns: usize) -> u64 {
    let width = columns.min(dim);
    match width >= dim {
        true => 0,
        false => run(dim.div_ceil(width) as u64),
    }
}

/// One run of a cooperative copy of `rows` rows of `dim` values by `units` units.
fn copy(rows: usize, dim: usize, units: usize) -> u64 {
    run((rows * dim).div_ceil(units) as u64)
}

/// Loop iterations of one invocation of the portable forward kernel.
pub fn forward_iterations(problem: &AttentionProblem, config: &TileConfig) -> u64 {
    let (dqk, dv, c) = (config.dim_qk, config.dim_v, config.columns);
    let (rows, block) = (config.block_rows, config.block_stream);
    let keys = block as u64;
    // One key block: its copies, the scores, the rescale, then P·V.
    let per_block = 1
        + copy(block, dqk, rows)
        + copy(block, dv, rows)
        + run(keys)
        + keys * row(dqk, c)
        + row(dv, c)
        + run(keys)
        + keys * row(dv, c);
    let blocks = problem.seq_kv.div_ceil(block) as u64;
    row(dqk, c) + 2 * row(dv, c) + run(0) + blocks * per_block
}

/// Loop iterations of one invocation of the portable dK/dV kernel.
pub fn dkdv_iterations(problem: &AttentionProblem, config: &TileConfig) -> u64 {
    let (dqk, dv, c) = (config.dim_qk, config.dim_v, config.columns);
    let (rows, block) = (config.block_rows, config.block_stream);
    let queries = block as u64;
    // One query block: Q, dO, LSE and D staged, then each query's products.
    let per_block = 1
        + copy(block, dqk, rows)
        + copy(block, dv, rows)
        + 2 * copy(block, 1, rows)
        + run(queries)
        + queries * (2 * row(dqk, c) + 2 * row(dv, c));
    let blocks = problem.seq_q.div_ceil(block) as u64;
    let group = problem.group_size() as u64;
    3 * (row(dqk, c) + row(dv, c)) + run(group) + group * (run(0) + blocks * per_block)
}

/// Loop iterations of one invocation of the portable dQ kernel.
pub fn dq_iterations(problem: &AttentionProblem, config: &TileConfig) -> u64 {
    let (dqk, dv, c) = (config.dim_qk, config.dim_v, config.columns);
    let (rows, block) = (config.block_rows, config.block_stream);
    let keys = block as u64;
    let per_block = 1
        + copy(block, dqk, rows)
        + copy(block, dv, rows)
        + run(keys)
        + keys * (2 * row(dqk, c) + row(dv, c));
    let blocks = problem.seq_kv.div_ceil(block) as u64;
    3 * row(dqk, c) + row(dv, c) + run(0) + blocks * per_block
}

/// Loop iterations the portable dQ kernel adds when it sums a broadcast bias's gradient on a
/// device without float atomics: one compare-and-swap loop per key it visits, counted twice
/// (a retry's worth of margin).
pub fn bias_grad_sum_iterations(problem: &AttentionProblem, config: &TileConfig) -> u64 {
    2 * problem.seq_kv.div_ceil(config.block_stream) as u64 * config.block_stream as u64
}

/// Loop iterations of one invocation of the decode kernel reading `blocks` key blocks.
pub fn decode_iterations(config: &DecodeConfig, blocks: usize) -> u64 {
    let (dqk, dv, c) = (config.dim_qk, config.dim_v, config.columns);
    let (rows, keys, units) = (config.rows, config.block_kv, config.units);
    let pairs = config.pairs_per_unit() as u64;
    let rolled = |n: usize| match config.unrolled {
        true => 0,
        false => run(n as u64),
    };
    let (loads_k, loads_v) = (config.loads_per_unit(dqk), config.loads_per_unit(dv));
    // One key block: K and V stored to shared memory, the next block's loaded, the scores,
    // the softmax of a row, then P·V.
    let per_block = 1
        + 2 * (rolled(loads_k) + rolled(loads_v))
        + pairs * row(dqk, c)
        + 2 * run(keys as u64)
        + config.outputs_per_unit() as u64 * run(keys as u64);
    copy(rows, dqk, units) + rolled(loads_k) + rolled(loads_v) + run(0) + blocks as u64 * per_block
}

/// Most key blocks one invocation of the decode kernel may read within the device's loop
/// budget; `None` where loops run to the end.
pub fn decode_max_blocks(config: &DecodeConfig, limits: &DeviceLimits) -> Option<usize> {
    let budget = limits.loop_iterations?;
    let fixed = decode_iterations(config, 0);
    let per_block = decode_iterations(config, 1) - fixed;
    Some((budget.saturating_sub(fixed + 1) / per_block).max(1) as usize)
}

/// `Ok` where `iterations` loop iterations per invocation of the portable `kernel` run
/// whole on the device; else an error naming the problem and the driver's budget.
pub fn check(
    kernel: &str,
    iterations: u64,
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<(), FlashError> {
    match limits.loop_iterations {
        Some(budget) if iterations >= budget => Err(FlashError::Unavailable(format!(
            "the portable {kernel} kernel would run {iterations} loop iterations per invocation \
             for query/key sequences of {}/{}, {} query heads per key/value head and head dims \
             {}/{}; this device's driver (llvmpipe) stops every loop after {budget} iterations \
             in total and would return wrong results. Shorter sequences fit; a GPU runs any length",
            problem.seq_q,
            problem.seq_kv,
            problem.group_size(),
            problem.dim_qk,
            problem.dim_v,
        ))),
        _ => Ok(()),
    }
}

/// `Ok` where every portable kernel of `problem` (forward, dK/dV and dQ) runs within the
/// device's loop budget, or the device has none; else the first kernel's refusal. A caller
/// can then take another path before anything is launched (the Burn op takes its composed
/// attention).
pub fn check_problem(problem: &AttentionProblem, limits: &DeviceLimits) -> Result<(), FlashError> {
    // An empty problem launches nothing.
    if limits.loop_iterations.is_none() || problem.is_empty() {
        return Ok(());
    }
    crate::forward::portable_config(problem, limits)?;
    crate::backward::dkdv_portable_config(problem, limits)?;
    crate::backward::dq_portable_config(problem, limits)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::choose_portable_tiles;
    use crate::problem::tests::problem;

    /// lavapipe's limits as the wgpu runtime reports them.
    const LAVAPIPE: DeviceLimits = DeviceLimits {
        max_shared_memory: 32_768,
        max_units_per_cube: 1024,
        plane_size: 8,
        plane_ops: false,
        cmma_f16: false,
        cmma_bf16: false,
        mma_sync_f16: false,
        mma_sync_bf16: false,
        paired_f32_atomics: false,
        warpgroup_mma: false,
        loop_iterations: Some(LLVMPIPE_LOOP_ITERATIONS),
        multiprocessors: 2,
    };

    fn sized(
        seq_q: usize,
        seq_kv: usize,
        group: usize,
        dim_qk: usize,
        dim_v: usize,
    ) -> AttentionProblem {
        AttentionProblem {
            heads_q: group,
            heads_kv: 1,
            seq_q,
            seq_kv,
            ..problem(dim_qk, dim_v)
        }
    }

    /// The three kernels' counts for `p` on lavapipe (forward and dQ stage K/V rows,
    /// dK/dV also the LSE and D of each query row).
    fn counts(p: &AttentionProblem) -> [u64; 3] {
        let row_bytes = 4 * (p.dim_qk + p.dim_v);
        let fwd = choose_portable_tiles(p, &LAVAPIPE, row_bytes).unwrap();
        let kv = choose_portable_tiles(p, &LAVAPIPE, row_bytes + 8).unwrap();
        [
            forward_iterations(p, &fwd),
            dkdv_iterations(p, &kv),
            dq_iterations(p, &fwd),
        ]
    }

    #[test]
    fn llvmpipe_is_recognized_by_name() {
        assert_eq!(
            driver_loop_iterations("llvmpipe (LLVM 15.0.6, 256 bits)"),
            Some(65_535)
        );
        assert_eq!(driver_loop_iterations("NVIDIA H200"), None);
        assert_eq!(driver_loop_iterations("AMD Radeon 8060S Graphics"), None);
    }

    /// The head dims and lengths of the test catalogue, and of the problems a user reported
    /// wrong on lavapipe, fit the budget.
    #[test]
    fn tested_problems_fit() {
        for p in [
            sized(128, 97, 4, 80, 80),
            sized(97, 1025, 4, 96, 96),
            sized(128, 97, 2, 256, 256),
            sized(200, 129, 2, 128, 128),
            sized(97, 300, 2, 128, 128),
            sized(333, 1000, 3, 72, 72),
            sized(1000, 333, 1, 96, 96),
            sized(257, 257, 4, 128, 128),
            sized(777, 777, 1, 136, 136),
            sized(600, 600, 1, 192, 128),
            sized(1, 777, 1, 200, 200),
            sized(300, 300, 1, 256, 256),
            sized(1025, 1025, 1, 64, 64),
        ] {
            for (kernel, n) in ["forward", "dK/dV", "dQ"].into_iter().zip(counts(&p)) {
                assert!(
                    check(kernel, n, &p, &LAVAPIPE).is_ok(),
                    "{kernel} {n} iterations: {p:?}"
                );
            }
        }
    }

    /// The problems `problems_just_within_the_loop_budget_are_right` (tests/kernels.rs) runs
    /// on the CPU device bring the dQ and the dK/dV kernel within 10% of the budget, where an
    /// undercount of the formulas would show as wrong results.
    const DQ_NEAR_BUDGET_KEYS: usize = 1920;
    const DKDV_NEAR_BUDGET_QUERIES: usize = 1488;

    #[test]
    fn near_budget_problems_are_near_it() {
        let budget = LLVMPIPE_LOOP_ITERATIONS as f64;
        let [fwd, _, dq] = counts(&sized(1, DQ_NEAR_BUDGET_KEYS, 1, 128, 128));
        assert!((0.6..0.9).contains(&(fwd as f64 / budget)), "forward {fwd}");
        assert!((0.9..1.0).contains(&(dq as f64 / budget)), "dQ {dq}");
        let [_, dkdv, _] = counts(&sized(DKDV_NEAR_BUDGET_QUERIES, 20, 1, 128, 128));
        assert!((0.9..1.0).contains(&(dkdv as f64 / budget)), "dK/dV {dkdv}");
    }

    /// Long sequences are refused on llvmpipe, with the driver named, and run elsewhere.
    #[test]
    fn long_sequences_are_refused_on_llvmpipe_only() {
        let p = sized(64, 65_536, 1, 64, 64);
        let [fwd, _, _] = counts(&p);
        let err = check("forward", fwd, &p, &LAVAPIPE).unwrap_err();
        assert!(matches!(&err, FlashError::Unavailable(m) if m.contains("llvmpipe")));
        let gpu = DeviceLimits {
            loop_iterations: None,
            multiprocessors: 132,
            ..LAVAPIPE
        };
        assert!(check("forward", fwd, &p, &gpu).is_ok());
    }

    /// Walking rows 16 columns at a time divides the head-dim loops' share by 16 (rolled,
    /// d = 128: 24 iterations per key in the forward, against 268 one column at a time).
    #[test]
    fn column_steps_shrink_the_count() {
        let p = sized(64, 1024, 1, 128, 128);
        let row_bytes = 4 * 256;
        let config = choose_portable_tiles(&p, &LAVAPIPE, row_bytes).unwrap();
        assert_eq!(config.columns, 16);
        let one = TileConfig {
            columns: 1,
            ..config
        };
        let per_key = |c: &TileConfig| forward_iterations(&p, c) / 1024;
        assert_eq!(per_key(&config), 24);
        assert_eq!(per_key(&one), 268);
    }
}
