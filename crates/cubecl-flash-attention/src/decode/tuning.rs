//! The decode launcher's tuning overrides, for A/B runs on a GPU: read from the environment
//! once per process, so a decode step never pays for them.
//!
//! - `FLASH_DECODE_KERNEL=lanes|staged`: the lanes or the staged kernel instead of the
//!   tensor-core one (`staged`: never the lanes kernel either);
//! - `FLASH_DECODE_MMA=planes,block,stages`: the tensor-core kernel's tiles;
//! - `FLASH_DECODE_LANES=planes,unroll,row_groups[,async copies 0/1,stages]`: the lanes
//!   kernel's;
//! - `FLASH_DECODE_TILES=units,block_kv`: the staged kernel's;
//! - `FLASH_DECODE_RESIDENT=n`: the cubes per multiprocessor the split count fills;
//! - `FLASH_DECODE_MIN_BLOCKS=n`: the fewest key steps a split reads;
//! - `FLASH_DECODE_SPLITS=waves|fill`: the split count by that [`super::SplitRule`] (the
//!   tensor-core kernel's default is `waves`, the others' `fill`).

use std::sync::OnceLock;

/// The overrides set in the environment (`None` where unset or unparsable).
#[derive(Clone, Debug, Default)]
pub(crate) struct Tuning {
    pub kernel: Option<String>,
    pub mma: Option<Vec<usize>>,
    pub lanes: Option<Vec<usize>>,
    pub tiles: Option<(usize, usize)>,
    pub resident: Option<usize>,
    pub min_blocks: Option<usize>,
    pub splits: Option<String>,
}

/// The process's overrides.
pub(crate) fn tuning() -> &'static Tuning {
    static TUNING: OnceLock<Tuning> = OnceLock::new();
    TUNING.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok();
        let numbers = |name: &str| {
            var(name).and_then(|v| v.split(',').map(|x| x.trim().parse().ok()).collect())
        };
        let number = |name: &str| var(name).and_then(|v| v.trim().parse().ok());
        Tuning {
            kernel: var("FLASH_DECODE_KERNEL"),
            mma: numbers("FLASH_DECODE_MMA"),
            lanes: numbers("FLASH_DECODE_LANES"),
            tiles: numbers("FLASH_DECODE_TILES").and_then(|t: Vec<usize>| match *t {
                [units, block_kv] => Some((units, block_kv)),
                _ => None,
            }),
            resident: number("FLASH_DECODE_RESIDENT"),
            min_blocks: number("FLASH_DECODE_MIN_BLOCKS"),
            splits: var("FLASH_DECODE_SPLITS"),
        }
    })
}

impl Tuning {
    /// Whether `FLASH_DECODE_KERNEL` names `kernel`.
    pub fn kernel_is(&self, kernel: &str) -> bool {
        self.kernel.as_deref() == Some(kernel)
    }
}
