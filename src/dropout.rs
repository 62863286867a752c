//! Dropout's random streams: a process-wide seed and a counter of calls, as PyTorch's
//! default generator hands out Philox offsets.
//!
//! [`FlashMultiHeadAttention`](crate::FlashMultiHeadAttention) takes a new stream for each
//! training call; [`seed_dropout`] makes a run repeatable. Calls made with explicit
//! [`Dropout`] values do not touch the counter.

use std::sync::Mutex;

pub use cubecl_flash_attention::Dropout;

/// The seed until [`seed_dropout`] sets one.
const DEFAULT_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// `(seed, next offset)`.
static STREAMS: Mutex<(u64, u32)> = Mutex::new((DEFAULT_SEED, 0));

/// Sets the seed of the streams [`next_dropout`] hands out and restarts their offsets.
pub fn seed_dropout(seed: u64) {
    *STREAMS.lock().unwrap_or_else(|e| e.into_inner()) = (seed, 0);
}

/// Dropout with probability `p` on a stream no earlier call of this process took (since
/// the last [`seed_dropout`]). After 2³² calls the offsets wrap and the seed moves on.
pub fn next_dropout(p: f32) -> Dropout {
    let mut streams = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    let (seed, offset) = *streams;
    *streams = match offset.checked_add(1) {
        Some(next) => (seed, next),
        None => (seed.wrapping_add(1), 0),
    };
    Dropout { p, seed, offset }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_differ_and_repeat_after_seeding() {
        seed_dropout(7);
        let (a, b) = (next_dropout(0.1), next_dropout(0.1));
        assert_ne!((a.seed, a.offset), (b.seed, b.offset));
        seed_dropout(7);
        assert_eq!(next_dropout(0.1), a);
    }
}
