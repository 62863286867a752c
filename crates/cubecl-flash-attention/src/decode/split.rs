//! How many cubes share one sequence's key range (flash-decoding's split count).
//!
//! A decode step has one cube per (sequence, K/V head, block of packed query rows): at
//! batch 1 with 8 K/V heads that is 8 cubes on a device of 132 multiprocessors. Splitting
//! each key range over several cubes fills the device; every split costs a partial output
//! written and read again by the merge, so a split should still read several key blocks.

/// Cubes per multiprocessor the splits aim for where a kernel does not say how many it
/// holds: a memory-bound kernel wants several in flight per multiprocessor to hide the
/// latency of its loads.
pub const CUBES_PER_MULTIPROCESSOR: usize = 4;
/// Fewest key blocks a split reads (when the device is not to be filled otherwise).
pub const MIN_BLOCKS_PER_SPLIT: usize = 4;
/// Most splits per cube of work.
pub const MAX_SPLITS: usize = 128;

/// What the split count depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitInputs {
    /// Cubes without splitting: sequences × K/V heads × row blocks.
    pub cubes: usize,
    /// Multiprocessors (SMs, CUs) of the device.
    pub multiprocessors: usize,
    /// Cubes of the kernel one multiprocessor runs at once (by its shared memory, say):
    /// the splits aim for that many per multiprocessor.
    pub cubes_per_multiprocessor: usize,
    /// Fewest key blocks a split reads where the device is full otherwise (the kernel's
    /// steps; [`MIN_BLOCKS_PER_SPLIT`] by default).
    pub min_blocks_per_split: usize,
    /// Key blocks of the longest sequence.
    pub key_blocks: usize,
    /// Most key blocks one cube may read, where the device limits the loop iterations of a
    /// kernel invocation ([`crate::loop_budget`]).
    pub max_blocks_per_split: Option<usize>,
}

/// What one split costs beyond its key blocks, in key blocks: loading the queries, the
/// first copies' latency, writing the part and merging it.
pub const SPLIT_COST_BLOCKS: usize = 2;

/// The split count. The device runs `multiprocessors · cubes_per_multiprocessor` cubes at
/// once, in waves, and a wave lasts as long as its cubes' splits: a split count is worth
/// `waves · (blocks per split + SPLIT_COST_BLOCKS)`, and the cheapest wins, the fewer
/// splits among equals. So a batch that fills a wave unsplit stays unsplit, and a split
/// count that would start a second, nearly empty wave (320 cubes where 264 run at once)
/// gives way to one that fits. Each split reads at least `min_blocks_per_split` blocks and
/// there are at most [`MAX_SPLITS`]; the loop budget's minimum comes first. Never more
/// splits than key blocks, never fewer than 1.
pub fn choose_splits(inputs: SplitInputs) -> usize {
    let SplitInputs {
        cubes,
        multiprocessors,
        cubes_per_multiprocessor,
        min_blocks_per_split,
        key_blocks,
        max_blocks_per_split,
    } = inputs;
    let cubes = cubes.max(1);
    let at_once = cubes_per_multiprocessor.max(1) * multiprocessors.max(1);
    let most = (key_blocks / min_blocks_per_split.max(1)).clamp(1, MAX_SPLITS);
    let cost = |splits: usize| {
        let waves = (cubes * splits).div_ceil(at_once);
        waves * (key_blocks.div_ceil(splits) + SPLIT_COST_BLOCKS)
    };
    let mut splits = (1..=most).min_by_key(|&s| (cost(s), s)).unwrap_or(1);
    if let Some(most) = max_blocks_per_split {
        splits = splits.max(key_blocks.div_ceil(most.max(1)));
    }
    splits.min(key_blocks).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splits(cubes: usize, key_blocks: usize) -> usize {
        choose_splits(SplitInputs {
            cubes,
            multiprocessors: 132,
            cubes_per_multiprocessor: CUBES_PER_MULTIPROCESSOR,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks,
            max_blocks_per_split: None,
        })
    }

    #[test]
    fn a_full_device_is_not_split() {
        // 132 · 4 cubes run at once: a batch that fills them is not split.
        assert_eq!(splits(528, 1024), 1);
        assert_eq!(splits(1024, 1024), 1);
    }

    #[test]
    fn small_batches_fill_the_device() {
        // Batch 1, 8 K/V heads, 32k keys in blocks of 32: 1024 blocks; 8 · 64 = 512 cubes
        // of the 528 that run at once, 16 blocks each.
        let s = splits(8, 1024);
        assert_eq!(s, 64);
        assert!(8 * s <= 4 * 132);
        // Batch 8: 64 cubes, 8 splits of 128 blocks: one wave of 512.
        assert_eq!(splits(64, 1024), 8);
    }

    #[test]
    fn short_sequences_keep_several_blocks_per_split() {
        assert_eq!(splits(8, 8), 2);
        assert_eq!(splits(8, 3), 1);
        assert_eq!(splits(8, 0), 1);
        assert_eq!(splits(1, 100_000), MAX_SPLITS);
    }

    /// Two cubes per multiprocessor, 132 multiprocessors: 264 cubes at once.
    fn splits_two_resident(cubes: usize, key_blocks: usize) -> usize {
        choose_splits(SplitInputs {
            cubes,
            multiprocessors: 132,
            cubes_per_multiprocessor: 2,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks,
            max_blocks_per_split: None,
        })
    }

    #[test]
    fn splits_fill_one_wave_and_never_start_a_nearly_empty_one() {
        // Batch 1, 8 K/V heads, 512 blocks: 32 splits of 16 blocks, 256 cubes of 264.
        assert_eq!(splits_two_resident(8, 512), 32);
        // Batch 8 (64 cubes), 512 blocks: 4 splits fill 256 of 264 places; 5 would start a
        // second wave of 56 cubes that lasts as long as the first.
        assert_eq!(splits_two_resident(64, 512), 4);
        // 256 cubes fill a wave unsplit: splitting in two makes two waves of half length,
        // no faster, and pays the splits' cost.
        assert_eq!(splits_two_resident(256, 512), 1);
        // 288 cubes are one wave and a bit unsplit (2 waves of 2048 blocks); in 11 splits
        // they are 3168 cubes, 12 whole waves of 187 blocks.
        assert_eq!(splits_two_resident(288, 2048), 11);
    }

    #[test]
    fn the_loop_budget_takes_precedence() {
        let s = choose_splits(SplitInputs {
            cubes: 2048,
            multiprocessors: 16,
            cubes_per_multiprocessor: CUBES_PER_MULTIPROCESSOR,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks: 1000,
            max_blocks_per_split: Some(100),
        });
        assert_eq!(s, 10);
        let s = choose_splits(SplitInputs {
            cubes: 1,
            multiprocessors: 16,
            cubes_per_multiprocessor: CUBES_PER_MULTIPROCESSOR,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks: 1000,
            max_blocks_per_split: Some(3),
        });
        assert_eq!(s, 334);
    }
}
