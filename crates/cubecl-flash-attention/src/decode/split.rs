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

/// The split count: enough cubes to fill the device, each split reading at least
/// `min_blocks_per_split` blocks, at most [`MAX_SPLITS`]; and at least what the loop
/// budget needs. Never more splits than key blocks, never fewer than 1.
pub fn choose_splits(inputs: SplitInputs) -> usize {
    let SplitInputs {
        cubes,
        multiprocessors,
        cubes_per_multiprocessor,
        min_blocks_per_split,
        key_blocks,
        max_blocks_per_split,
    } = inputs;
    let target = cubes_per_multiprocessor.max(1) * multiprocessors.max(1);
    let to_fill = target.div_ceil(cubes.max(1));
    let by_length = key_blocks / min_blocks_per_split.max(1);
    let mut splits = to_fill.min(by_length).min(MAX_SPLITS);
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
        // 32 sequences × 8 K/V heads = 256 cubes ≥ 132 · 4 / 2.
        assert_eq!(splits(528, 1024), 1);
        assert_eq!(splits(1024, 1024), 1);
    }

    #[test]
    fn small_batches_fill_the_device() {
        // Batch 1, 8 K/V heads, 32k keys in blocks of 32: 1024 blocks.
        let s = splits(8, 1024);
        assert_eq!(s, 66);
        assert!(8 * s >= 4 * 132);
        // Batch 8: 64 cubes.
        assert_eq!(splits(64, 1024), 9);
    }

    #[test]
    fn short_sequences_keep_several_blocks_per_split() {
        assert_eq!(splits(8, 8), 2);
        assert_eq!(splits(8, 3), 1);
        assert_eq!(splits(8, 0), 1);
        assert_eq!(splits(1, 100_000), MAX_SPLITS);
    }

    #[test]
    fn splits_fill_the_cubes_a_multiprocessor_holds() {
        // Batch 1, 8 K/V heads, a kernel two cubes of which fit a multiprocessor: one wave.
        let s = choose_splits(SplitInputs {
            cubes: 8,
            multiprocessors: 132,
            cubes_per_multiprocessor: 2,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks: 512,
            max_blocks_per_split: None,
        });
        assert_eq!(s, 33);
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
