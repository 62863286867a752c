//! Dropout on the attention probabilities, regenerated in the backward, never stored.
//!
//! Probability `P[b, h, i, j]` is kept, and scaled by `1/(1 − p)`, when a counter-based
//! random word is at least `p · 2³²`; otherwise it is zeroed. The word is a pure function of
//! the seed, the offset and the coordinates, so the forward and the backward, every kernel
//! path and every device draw the same keep-mask, and [`Dropout::keeps`] computes it on the
//! host for the oracle.
//!
//! The words come from Philox-4×32-10 (Salmon et al., *Parallel random numbers: as easy as
//! 1, 2, 3*, SC 2011): keyed by the 64-bit seed, one call gives the four words of a 2 × 2
//! block of the score matrix, counter `(j / 2, i / 2, b · h_q + h, offset)`, word
//! `2 · (i % 2) + j % 2`. A lane of the register kernels holds two adjacent keys of a query
//! (or, in the dK/dV kernels that hold `Sᵀ`, two adjacent queries of a key), so one call
//! serves both. Indices are those within a sequence, `b` a packed batch's sequence.
//!
//! The forward keeps `O = (P ⊙ Z)·V / rowsum(P)` with `Z` the scaled keep-mask; the
//! backward takes `dV = (P ⊙ Z)ᵀ·dO` and `dS = P ⊙ (dP ⊙ Z − D)`, `D = rowsum(dO ⊙ O)` as
//! without dropout (FlashAttention-2's algorithm).

use cubecl::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::FlashError;
use crate::mma_sync::Pair;

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;
const PHILOX_ROUNDS: u32 = 10;

/// Dropout of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dropout {
    /// Probability that a probability is dropped, in `[0, 1)`.
    pub p: f32,
    /// The random stream's key.
    pub seed: u64,
    /// The call's stream under `seed`: calls that share a seed must differ in offset to draw
    /// independent masks (a training loop's step or layer counter).
    pub offset: u32,
}

impl Dropout {
    /// Checks `p`.
    pub fn check(&self) -> Result<(), FlashError> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(FlashError::Option {
                arg: "dropout",
                expected: format!("a probability in [0, 1), got {}", self.p),
            });
        }
        Ok(())
    }

    /// Whether anything is dropped.
    pub fn is_active(&self) -> bool {
        self.p > 0.0
    }

    /// A random word is kept when at least this (`p · 2³²`, rounded).
    pub fn threshold(&self) -> u32 {
        (f64::from(self.p) * 4_294_967_296.0)
            .round()
            .min(f64::from(u32::MAX)) as u32
    }

    /// What a kept probability is multiplied by.
    pub fn kept_scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// Whether probability `(batch, head, i, j)` of a problem with `heads_q` query heads is
    /// kept: the kernels' decision, on the host.
    pub fn keeps(&self, batch: usize, heads_q: usize, head: usize, i: usize, j: usize) -> bool {
        let counter = [
            (j / 2) as u32,
            (i / 2) as u32,
            (batch * heads_q + head) as u32,
            self.offset,
        ];
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        philox(counter, key)[2 * (i % 2) + j % 2] >= self.threshold()
    }

    /// The kernels' arguments.
    pub(crate) fn args(&self) -> DropoutArgsLaunch {
        DropoutArgsLaunch::new(
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.offset,
            self.threshold(),
            self.kept_scale(),
        )
    }

    /// The arguments of a kernel compiled without dropout (never read).
    pub(crate) fn inactive_args() -> DropoutArgsLaunch {
        DropoutArgsLaunch::new(0, 0, 0, 0, 1.0)
    }
}

/// Philox-4×32-10 on the host: the four words of `counter` under `key`.
pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for _ in 0..PHILOX_ROUNDS {
        let product0 = u64::from(PHILOX_M0) * u64::from(c0);
        let product1 = u64::from(PHILOX_M1) * u64::from(c2);
        let (hi0, lo0) = ((product0 >> 32) as u32, product0 as u32);
        let (hi1, lo1) = ((product1 >> 32) as u32, product1 as u32);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
        k0 = k0.wrapping_add(PHILOX_W0);
        k1 = k1.wrapping_add(PHILOX_W1);
    }
    [c0, c1, c2, c3]
}

/// The kernels' dropout arguments ([`Dropout`] split into 32-bit words).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct DropoutArgs {
    pub(crate) seed_lo: u32,
    pub(crate) seed_hi: u32,
    pub(crate) offset: u32,
    pub(crate) threshold: u32,
    pub(crate) kept_scale: f32,
}

/// The dropout of one (batch, query head).
#[derive(CubeType, Clone, Copy)]
pub struct DropoutStream {
    seed_lo: u32,
    seed_hi: u32,
    stream: u32,
    offset: u32,
    threshold: u32,
    /// What a kept probability is multiplied by.
    pub kept_scale: f32,
}

/// Four random words.
#[derive(CubeType)]
struct Words {
    x0: u32,
    x1: u32,
    x2: u32,
    x3: u32,
}

#[cube]
fn philox_words(counter: Words, key0: u32, key1: u32) -> Words {
    let mut c0 = counter.x0;
    let mut c1 = counter.x1;
    let mut c2 = counter.x2;
    let mut c3 = counter.x3;
    let mut k0 = key0;
    let mut k1 = key1;
    #[unroll]
    for _ in 0..PHILOX_ROUNDS {
        let hi0 = u32::mul_hi(u32::new(comptime!(PHILOX_M0 as i64)), c0);
        let lo0 = u32::new(comptime!(PHILOX_M0 as i64)) * c0;
        let hi1 = u32::mul_hi(u32::new(comptime!(PHILOX_M1 as i64)), c2);
        let lo1 = u32::new(comptime!(PHILOX_M1 as i64)) * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += u32::new(comptime!(PHILOX_W0 as i64));
        k1 += u32::new(comptime!(PHILOX_W1 as i64));
    }
    Words {
        x0: c0,
        x1: c1,
        x2: c2,
        x3: c3,
    }
}

#[cube]
impl DropoutArgs {
    /// The stream of query head `head` of sequence `batch`, of `heads_q`.
    pub fn stream(&self, batch: usize, heads_q: usize, head: usize) -> DropoutStream {
        DropoutStream {
            seed_lo: self.seed_lo,
            seed_hi: self.seed_hi,
            stream: u32::cast_from(batch * heads_q + head),
            offset: self.offset,
            threshold: self.threshold,
            kept_scale: self.kept_scale,
        }
    }
}

#[cube]
impl DropoutStream {
    /// The words of the 2 × 2 block of queries `2a, 2a + 1` and keys `2b, 2b + 1`.
    fn block(&self, query_pair: usize, key_pair: usize) -> Words {
        let counter = Words {
            x0: u32::cast_from(key_pair),
            x1: u32::cast_from(query_pair),
            x2: self.stream,
            x3: self.offset,
        };
        philox_words(counter, self.seed_lo, self.seed_hi)
    }

    /// What probability `(i, j)` is multiplied by: 0 or the kept scale.
    pub fn factor(&self, i: usize, j: usize) -> f32 {
        let words = self.block(i / 2, j / 2);
        let word = select(
            i % 2 == 0,
            select(j % 2 == 0, words.x0, words.x1),
            select(j % 2 == 0, words.x2, words.x3),
        );
        select(word >= self.threshold, self.kept_scale, 0.0f32)
    }

    /// The keep-mask of the lane's elements of one line of `tiles` accumulator tiles side by
    /// side (the layout of [`crate::mma_sync::hide_columns`]): bit `2n + e` for position
    /// `p0 + 8n + 2 · (lane % 4) + e` of the line (`p0` even). The line is query `line` against keys
    /// (`along_queries` false) or key `line` against queries.
    pub fn keep_bits(
        &self,
        line: usize,
        p0: usize,
        #[comptime] tiles: usize,
        #[comptime] along_queries: bool,
    ) -> u32 {
        comptime! { assert!(2 * tiles <= 32, "a line's keep-mask holds 32 bits") };
        let first = p0 + 2 * (UNIT_POS_PLANE as usize % 4);
        let odd_line = line % 2 == 1;
        let mut bits = 0u32;
        #[unroll]
        for n in 0..tiles {
            let pair = (first + n * 8) / 2;
            let words = if comptime!(along_queries) {
                self.block(pair, line / 2)
            } else {
                self.block(line / 2, pair)
            };
            // The line's two words: for a query, its row of the block (words 0, 1 or 2, 3);
            // for a key, its column (words 0, 2 or 1, 3).
            let (even_second, odd_first) = if comptime!(along_queries) {
                (words.x2, words.x1)
            } else {
                (words.x1, words.x2)
            };
            let w0 = select(odd_line, odd_first, words.x0);
            let w1 = select(odd_line, words.x3, even_second);
            bits |= select(w0 >= self.threshold, 1u32, 0u32) << u32::cast_from(2 * n);
            bits |= select(w1 >= self.threshold, 2u32, 0u32) << u32::cast_from(2 * n);
        }
        bits
    }
}

/// Multiplies the lane's elements of row `half` of the `tiles` accumulator tiles from
/// `first` by the kept scale or 0, as `bits` ([`DropoutStream::keep_bits`]) say.
#[cube]
pub fn apply_keep_bits(
    acc: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    bits: u32,
    kept_scale: f32,
) {
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = acc[at];
        #[unroll]
        for e in 0..2usize {
            let kept = (bits >> u32::cast_from(2 * n + e)) & 1 == 1;
            pair.insert(e, select(kept, pair.extract(e) * kept_scale, 0.0f32));
        }
        acc[at] = pair;
    }
}
