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
/// Fewest key blocks a split reads (when the device is not to be filled otherwise), by
/// [`SplitRule::Fill`].
pub const MIN_BLOCKS_PER_SPLIT: usize = 4;
/// The same by [`SplitRule::Waves`], whose costs count each split's own: measured on the
/// tensor-core kernel (H100, 2026-12-07), 1.16× at GQA 8:1, batch 1, 4k keys (32 splits of
/// 2 steps where 4 steps gave 16), within 1% everywhere else.
pub const MIN_BLOCKS_PER_SPLIT_WAVES: usize = 2;
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
    /// How the count is chosen.
    pub rule: SplitRule,
}

/// How [`choose_splits`] picks the count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitRule {
    /// The fewest splits whose cubes fill the device once (`cubes_per_multiprocessor` per
    /// multiprocessor), each reading at least `min_blocks_per_split` blocks.
    Fill,
    /// The count that costs the fewest waves times blocks per split (see
    /// [`choose_splits`]).
    Waves,
}

impl SplitRule {
    /// The fewest key blocks a split reads by this rule, unless the device is to be filled
    /// otherwise ([`MIN_BLOCKS_PER_SPLIT`], [`MIN_BLOCKS_PER_SPLIT_WAVES`]).
    pub fn min_blocks_per_split(self) -> usize {
        match self {
            SplitRule::Fill => MIN_BLOCKS_PER_SPLIT,
            SplitRule::Waves => MIN_BLOCKS_PER_SPLIT_WAVES,
        }
    }
}

/// What one split costs beyond its key blocks, in key blocks: loading the queries, the
/// first copies' latency, writing the part and merging it.
pub const SPLIT_COST_BLOCKS: usize = 2;

/// The split count, by `rule`. The device runs `multiprocessors · cubes_per_multiprocessor`
/// cubes at once. [`SplitRule::Fill`] takes enough splits to reach that many cubes.
/// [`SplitRule::Waves`] counts waves: a wave lasts as long as its cubes' splits, so a split
/// count is worth `waves · (blocks per split + SPLIT_COST_BLOCKS)`, and the cheapest wins,
/// the fewer splits among equals; a batch that fills a wave unsplit stays unsplit, and a
/// count that would start a second, nearly empty wave (320 cubes where 264 run at once)
/// gives way to one that fits. Either way each split reads at least `min_blocks_per_split`
/// blocks and there are at most [`MAX_SPLITS`]; the loop budget's minimum comes first.
/// Never more splits than key blocks, never fewer than 1.
pub fn choose_splits(inputs: SplitInputs) -> usize {
    let SplitInputs {
        cubes,
        multiprocessors,
        cubes_per_multiprocessor,
        min_blocks_per_split,
        key_blocks,
        max_blocks_per_split,
        rule,
    } = inputs;
    let cubes = cubes.max(1);
    let at_once = cubes_per_multiprocessor.max(1) * multiprocessors.max(1);
    let most = (key_blocks / min_blocks_per_split.max(1)).clamp(1, MAX_SPLITS);
    let cost = |splits: usize| {
        let waves = (cubes * splits).div_ceil(at_once);
        waves * (key_blocks.div_ceil(splits) + SPLIT_COST_BLOCKS)
    };
    let mut splits = match rule {
        SplitRule::Fill => at_once.div_ceil(cubes).min(most),
        SplitRule::Waves => (1..=most).min_by_key(|&s| (cost(s), s)).unwrap_or(1),
    };
    if let Some(most) = max_blocks_per_split {
        splits = splits.max(key_blocks.div_ceil(most.max(1)));
    }
    splits.min(key_blocks).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choose(
        rule: SplitRule,
        cubes: usize,
        cubes_per_multiprocessor: usize,
        key_blocks: usize,
    ) -> usize {
        choose_splits(SplitInputs {
            cubes,
            multiprocessors: 132,
            cubes_per_multiprocessor,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks,
            max_blocks_per_split: None,
            rule,
        })
    }

    fn splits(cubes: usize, key_blocks: usize) -> usize {
        choose(SplitRule::Fill, cubes, CUBES_PER_MULTIPROCESSOR, key_blocks)
    }

    #[test]
    fn a_full_device_is_not_split() {
        // 32 sequences × 8 K/V heads = 256 cubes ≥ 132 · 4 / 2.
        assert_eq!(splits(528, 1024), 1);
        assert_eq!(splits(1024, 1024), 1);
        assert_eq!(choose(SplitRule::Waves, 528, 4, 1024), 1);
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
        for rule in [SplitRule::Fill, SplitRule::Waves] {
            assert_eq!(choose(rule, 8, 4, 8), 2);
            assert_eq!(choose(rule, 8, 4, 3), 1);
            assert_eq!(choose(rule, 8, 4, 0), 1);
            assert_eq!(choose(rule, 1, 4, 100_000), MAX_SPLITS);
        }
    }

    #[test]
    fn splits_fill_the_cubes_a_multiprocessor_holds() {
        // Batch 1, 8 K/V heads, a kernel two cubes of which fit a multiprocessor: one wave.
        assert_eq!(choose(SplitRule::Fill, 8, 2, 512), 33);
    }

    #[test]
    fn waves_are_filled_and_never_started_nearly_empty() {
        let waves = |cubes, key_blocks| choose(SplitRule::Waves, cubes, 2, key_blocks);
        // Two cubes per multiprocessor: 264 at once. Batch 1, 8 K/V heads, 512 blocks: 32
        // splits of 16 blocks, 256 cubes.
        assert_eq!(waves(8, 512), 32);
        // Batch 8 (64 cubes): 4 splits fill 256 of 264 places, where filling the device
        // takes 5 and starts a second wave of 56 cubes that lasts as long as the first.
        assert_eq!(waves(64, 512), 4);
        assert_eq!(choose(SplitRule::Fill, 64, 2, 512), 5);
        // 256 cubes fill a wave unsplit: in two they make two waves of half the blocks, no
        // faster, and pay the splits' cost.
        assert_eq!(waves(256, 512), 1);
        // 288 cubes are one wave and a bit unsplit (2 waves of 2048 blocks); in 11 splits
        // they are 3168 cubes, 12 whole waves of 187 blocks.
        assert_eq!(waves(288, 2048), 11);
    }

    #[test]
    fn waves_split_short_caches_finer() {
        // GQA 8:1, batch 1: one cube of work; 4k keys are 64 steps of 64. Splits of two
        // steps: 32 cubes, where four steps gave 16.
        let inputs = SplitInputs {
            cubes: 1,
            multiprocessors: 132,
            cubes_per_multiprocessor: 2,
            min_blocks_per_split: SplitRule::Waves.min_blocks_per_split(),
            key_blocks: 64,
            max_blocks_per_split: None,
            rule: SplitRule::Waves,
        };
        assert_eq!(choose_splits(inputs), 32);
        let fill = SplitInputs {
            min_blocks_per_split: SplitRule::Fill.min_blocks_per_split(),
            rule: SplitRule::Fill,
            ..inputs
        };
        assert_eq!(choose_splits(fill), 16);
    }

    #[test]
    fn the_loop_budget_takes_precedence() {
        let inputs = SplitInputs {
            cubes: 2048,
            multiprocessors: 16,
            cubes_per_multiprocessor: CUBES_PER_MULTIPROCESSOR,
            min_blocks_per_split: MIN_BLOCKS_PER_SPLIT,
            key_blocks: 1000,
            max_blocks_per_split: Some(100),
            rule: SplitRule::Fill,
        };
        assert_eq!(choose_splits(inputs), 10);
        let inputs = SplitInputs {
            cubes: 1,
            max_blocks_per_split: Some(3),
            ..inputs
        };
        assert_eq!(choose_splits(inputs), 334);
        let waves = SplitInputs {
            rule: SplitRule::Waves,
            ..inputs
        };
        assert_eq!(choose_splits(waves), 334);
    }
}
