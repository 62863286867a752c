//! From a dot product `q·k` to the score the softmax sees: the softmax scale, then the
//! optional softcap `cap · tanh(s / cap)`. Masking happens after (see [`crate::mask`]).

use cubecl::prelude::*;

/// `q·k · scale`, soft-capped when `has_softcap`.
#[cube]
pub fn score(dot: f32, scale: f32, softcap: f32, #[comptime] has_softcap: bool) -> f32 {
    let s = dot * scale;
    if has_softcap {
        softcap * (s / softcap).tanh()
    } else {
        s
    }
}

/// `d score / d (q·k)` at a score `s` returned by [`score`]: the scale, times the
/// softcap's `1 − tanh²` (recovered from the capped score itself).
#[cube]
pub fn score_grad(s: f32, scale: f32, softcap: f32, #[comptime] has_softcap: bool) -> f32 {
    if has_softcap {
        let t = s / softcap;
        scale * (1.0 - t * t)
    } else {
        scale
    }
}
