//! Dropout on the attention probabilities, regenerated in the backward, never stored.
//!
//! Probability `P[b, h, i, j]` is kept, and scaled by `1/(1 − p)`, when a counter-based
//! random byte is at least `p · 256` (rounded: `p` takes effect in steps of 1/256, as in
//! FlashAttention-2, and the scale uses the rounded `p`); otherwise it is zeroed. The byte
//! is a pure function of the seed, the offset and the coordinates, so the forward and the
//! backward, every kernel path and every device draw the same keep-mask, and
//! [`Dropout::keeps`] computes it on the host for the oracle.
//!
//! The bytes come from Philox-4×32-10 (Salmon et al., *Parallel random numbers: as easy as
//! 1, 2, 3*, SC 2011), keyed by the 64-bit seed. One call gives the 16 bytes of a block of
//! queries `{i, i + 8}` and keys `{j, j + 1} + {0, 8, 16, 24}` (`i % 16 < 8`, `j % 32 < 8`,
//! `j` even): counter `(4 · ⌊j/32⌋ + (j % 8)/2, 8 · ⌊i/16⌋ + i % 8, b · h_q + h, offset)`,
//! byte `8 · (i/8 % 2) + 2 · (j/8 % 4) + j % 2` ([`block_of`]). Those 16 probabilities are
//! what one lane of the register kernels holds of a 16-query × 32-key tile, so the forward
//! and the dQ kernel draw once per 16; the dK/dV kernel, which holds `Sᵀ` (two keys of many
//! queries), uses 4 of each call. Indices are those within a sequence, `b` a packed
//! batch's sequence.
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
    /// Probability that a probability is dropped, in `[0, 1)`; it takes effect rounded to a
    /// multiple of 1/256 ([`Dropout::effective_p`]).
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

    /// A random byte is kept when at least this: `p · 256`, rounded (at most 255).
    pub fn threshold(&self) -> u32 {
        (f64::from(self.p) * 256.0).round().min(255.0) as u32
    }

    /// What a kept probability is multiplied by: `1/(1 − p)` for `p` as rounded.
    pub fn kept_scale(&self) -> f32 {
        256.0 / (256 - self.threshold()) as f32
    }

    /// The probability of a drop as the kernels apply it (`p` rounded to 1/256).
    pub fn effective_p(&self) -> f64 {
        f64::from(self.threshold()) / 256.0
    }

    /// Whether probability `(batch, head, i, j)` of a problem with `heads_q` query heads is
    /// kept: the kernels' decision, on the host.
    pub fn keeps(&self, batch: usize, heads_q: usize, head: usize, i: usize, j: usize) -> bool {
        let (counter, byte) = block_of(i, j);
        let counter = [
            counter[0],
            counter[1],
            (batch * heads_q + head) as u32,
            self.offset,
        ];
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let word = philox(counter, key)[byte / 4];
        (word >> (8 * (byte % 4))) & 0xff >= self.threshold()
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

/// The first two counter words of probability `(i, j)` and its byte among the call's 16.
pub fn block_of(i: usize, j: usize) -> ([u32; 2], usize) {
    let counter = [
        (4 * (j / 32) + j % 8 / 2) as u32,
        (8 * (i / 16) + i % 8) as u32,
    ];
    (counter, 8 * (i / 8 % 2) + 2 * (j / 8 % 4) + j % 2)
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

/// Byte `byte` of `words`.
#[cube]
fn byte_of(words: &Words, byte: u32) -> u32 {
    let word = select(
        byte < 8,
        select(byte < 4, words.x0, words.x1),
        select(byte < 12, words.x2, words.x3),
    );
    (word >> ((byte % 4) * 8)) & 0xff
}

#[cube]
impl DropoutStream {
    /// The 16 bytes of the block whose counter starts with `key_block`, `query_block`
    /// ([`block_of`]).
    fn block(&self, key_block: usize, query_block: usize) -> Words {
        let counter = Words {
            x0: u32::cast_from(key_block),
            x1: u32::cast_from(query_block),
            x2: self.stream,
            x3: self.offset,
        };
        philox_words(counter, self.seed_lo, self.seed_hi)
    }

    /// What probability `(i, j)` is multiplied by: 0 or the kept scale.
    pub fn factor(&self, i: usize, j: usize) -> f32 {
        let words = self.block(4 * (j / 32) + j % 8 / 2, 8 * (i / 16) + i % 8);
        let byte = 8 * (i / 8 % 2) + 2 * (j / 8 % 4) + j % 2;
        select(
            byte_of(&words, u32::cast_from(byte)) >= self.threshold,
            self.kept_scale,
            0.0f32,
        )
    }

    /// The keep-masks of the lane's elements of two lines, `line` and `line + 8`
    /// (`line % 16 < 8`), of `tiles` accumulator tiles side by side (the layout of
    /// [`crate::mma_sync::hide_columns`]): in word `half`, bit `2n + e` for position
    /// `p0 + 8n + 2 · (lane % 4) + e`. The lines are queries against keys (`along_queries`
    /// false: `p0` a multiple of 32, or of 16 with 2 tiles) or keys against queries (`p0` a
    /// multiple of 16).
    pub fn keep_bits(
        &self,
        line: usize,
        p0: usize,
        #[comptime] tiles: usize,
        #[comptime] along_queries: bool,
    ) -> Array<u32> {
        comptime! {
            assert!(
                tiles <= 16 && (tiles % 4 == 0 || tiles == 2),
                "dropout's keep-masks take tiles of 16 or a multiple of 32 positions, at most 128"
            )
        };
        let pair = 2 * (UNIT_POS_PLANE as usize % 4);
        let mut bits = Array::<u32>::new(2usize);
        bits[0] = 0u32;
        bits[1] = 0u32;
        if comptime!(along_queries) {
            // Both keys share each call; it serves queries `q` and `q + 8`.
            let key_block = 4 * (line / 32) + line % 8 / 2;
            let key_byte = 2 * (line / 8 % 4) + line % 2;
            #[unroll]
            for m in 0..comptime!(tiles / 2) {
                #[unroll]
                for e in 0..2usize {
                    let query = p0 + 16 * m + pair + e;
                    let words = self.block(key_block, 8 * (query / 16) + query % 8);
                    #[unroll]
                    for h in 0..2usize {
                        #[unroll]
                        for half in 0..2usize {
                            let byte = 8 * h + key_byte + 2 * half;
                            let kept = byte_of(&words, u32::cast_from(byte)) >= self.threshold;
                            let bit = 2 * (2 * m + h) + e;
                            bits[half] |= select(kept, 1u32, 0u32) << u32::cast_from(bit);
                        }
                    }
                }
            }
        } else {
            // One call per 32 keys serves both lines.
            let query_block = 8 * (line / 16) + line % 8;
            let per_call = comptime!(tiles.min(4));
            #[unroll]
            for g in 0..comptime!(tiles / per_call) {
                let first = p0 + 32 * g + pair;
                let words = self.block(4 * (first / 32) + first % 8 / 2, query_block);
                #[unroll]
                for nn in 0..per_call {
                    let n = g * per_call + nn;
                    let key = first + 8 * nn;
                    #[unroll]
                    for e in 0..2usize {
                        #[unroll]
                        for half in 0..2usize {
                            let byte = 8 * half + 2 * (key / 8 % 4) + e;
                            let kept = byte_of(&words, u32::cast_from(byte)) >= self.threshold;
                            bits[half] |= select(kept, 1u32, 0u32) << u32::cast_from(2 * n + e);
                        }
                    }
                }
            }
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
