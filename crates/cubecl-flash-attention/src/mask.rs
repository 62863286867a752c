//! Causal and sliding-window masking, bottom-right aligned.
//!
//! Query `i` and key `j` of a problem with `s_q` queries and `s_kv` keys sit on the
//! diagonal when `j = i + s_kv − s_q` (the last query sees the last key, as in
//! FlashAttention ≥ 2.1 and Burn). Key `j` is visible to query `i` when
//! `diagonal − left ≤ j ≤ diagonal + right`; causal is `right = 0`. An unbounded side is
//! `None` on the host and `s_q + s_kv` (further than any key) in the kernels.

use cubecl::prelude::*;
use serde::{Deserialize, Serialize};

/// Which keys each query sees: causal and/or a sliding window, bottom-right aligned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MaskSpec {
    /// Hide keys after the query's diagonal (`right = 0`).
    pub causal: bool,
    /// Keys visible before the diagonal; `None` is unbounded.
    pub window_left: Option<usize>,
    /// Keys visible after the diagonal; `None` is unbounded. Causal overrides it with 0.
    pub window_right: Option<usize>,
}

impl MaskSpec {
    /// Causal masking only.
    pub fn causal() -> Self {
        Self {
            causal: true,
            ..Self::default()
        }
    }

    /// Whether any key can be hidden (otherwise the kernels compile no mask code).
    pub fn is_masked(&self) -> bool {
        self.causal || self.window_left.is_some() || self.window_right.is_some()
    }

    /// `(left, right)` after causal is applied; `None` is unbounded.
    pub fn window(&self) -> (Option<usize>, Option<usize>) {
        let right = if self.causal {
            Some(0)
        } else {
            self.window_right
        };
        (self.window_left, right)
    }

    /// Whether query `i` sees key `j`.
    pub fn is_visible(&self, i: usize, j: usize, seq_q: usize, seq_kv: usize) -> bool {
        let (left, right) = self.window();
        let diagonal = i as i64 + seq_kv as i64 - seq_q as i64;
        let j = j as i64;
        left.is_none_or(|l| j >= diagonal - l as i64)
            && right.is_none_or(|r| j <= diagonal + r as i64)
    }

    /// The kernels' `(left, right)` arguments: unbounded sides become `s_q + s_kv`.
    pub(crate) fn kernel_window(&self, seq_q: usize, seq_kv: usize) -> (i32, i32) {
        let unbounded = (seq_q + seq_kv) as i64;
        let (left, right) = self.window();
        let clamp = |w: Option<usize>| w.map_or(unbounded, |w| (w as i64).min(unbounded)) as i32;
        (clamp(left), clamp(right))
    }
}

/// The mask as the kernels see it. Positions are `i32` so that the diagonal offset
/// `s_kv − s_q` may be negative.
#[derive(CubeType, Clone, Copy)]
pub struct Mask {
    diagonal: i32,
    left: i32,
    right: i32,
    seq_q: i32,
    seq_kv: i32,
}

#[cube]
impl Mask {
    pub fn new(seq_q: usize, seq_kv: usize, left: i32, right: i32) -> Mask {
        let seq_q = i32::cast_from(seq_q);
        let seq_kv = i32::cast_from(seq_kv);
        Mask {
            diagonal: seq_kv - seq_q,
            left,
            right,
            seq_q,
            seq_kv,
        }
    }

    /// The key on query 0's diagonal, `seq_kv − seq_q` (bottom-right alignment).
    pub fn diagonal(&self) -> i32 {
        self.diagonal
    }

    /// Whether query `i` sees key `j` (rows past either end never do).
    pub fn is_visible(&self, i: i32, j: i32) -> bool {
        let from_diagonal = j - (i + self.diagonal);
        i < self.seq_q
            && j < self.seq_kv
            && from_diagonal <= self.right
            && from_diagonal >= -self.left
    }

    /// First key any query of `[q_begin, q_end)` sees.
    pub fn key_begin(&self, q_begin: i32) -> i32 {
        clamp(q_begin + self.diagonal - self.left, 0, self.seq_kv)
    }

    /// One past the last key any query of `[q_begin, q_end)` sees.
    pub fn key_end(&self, q_end: i32) -> i32 {
        clamp(q_end + self.diagonal + self.right, 0, self.seq_kv)
    }

    /// First query that sees any key of `[k_begin, k_end)`.
    pub fn query_begin(&self, k_begin: i32) -> i32 {
        clamp(k_begin - self.diagonal - self.right, 0, self.seq_q)
    }

    /// One past the last query that sees any key of `[k_begin, k_end)`.
    pub fn query_end(&self, k_end: i32) -> i32 {
        clamp(k_end - self.diagonal + self.left, 0, self.seq_q)
    }

    /// The keys query `i` sees (none for a query past the end).
    pub fn visible_keys(&self, i: i32) -> Span {
        let diagonal = i + self.diagonal;
        let mut span = Span {
            begin: max(diagonal - self.left, 0),
            end: min(diagonal + self.right + 1, self.seq_kv),
        };
        if i >= self.seq_q {
            span.end = span.begin;
        }
        span
    }

    /// The queries that see key `j` (none for a key past the end).
    pub fn visible_queries(&self, j: i32) -> Span {
        let from_diagonal = j - self.diagonal;
        let mut span = Span {
            begin: max(from_diagonal - self.right, 0),
            end: min(from_diagonal + self.left + 1, self.seq_q),
        };
        if j >= self.seq_kv {
            span.end = span.begin;
        }
        span
    }

    /// Whether every query of `[q_begin, q_end)` sees every key of `[k_begin, k_end)`:
    /// such a block needs no mask arithmetic at all.
    pub fn is_block_visible(&self, q_begin: i32, q_end: i32, k_begin: i32, k_end: i32) -> bool {
        // The first query must see the last key, and the last query the first key.
        let last_key_ok = k_end - 1 - (q_begin + self.diagonal) <= self.right;
        let first_key_ok = k_begin - (q_end - 1 + self.diagonal) >= -self.left;
        q_end <= self.seq_q && k_end <= self.seq_kv && last_key_ok && first_key_ok
    }
}

/// The positions `[begin, end)`; empty when `end <= begin`.
#[derive(CubeType, Clone, Copy)]
pub struct Span {
    pub begin: i32,
    pub end: i32,
}

#[cube]
impl Span {
    pub fn contains(&self, position: i32) -> bool {
        position >= self.begin && position < self.end
    }
}

/// A run of `count` blocks of `size` rows, the first starting at row `first`.
#[derive(CubeType, Clone, Copy)]
pub struct Blocks {
    pub first: i32,
    pub count: i32,
}

#[cube]
impl Blocks {
    /// The blocks of `size` rows that cover `[first, last)`.
    pub fn covering(first: i32, last: i32, #[comptime] size: usize) -> Blocks {
        let size = i32::cast_from(size);
        Blocks {
            first,
            count: (max(last - first, 0) + size - 1) / size,
        }
    }

    /// First row of block `block`.
    pub fn start(&self, block: i32, #[comptime] size: usize) -> i32 {
        self.first + block * i32::cast_from(size)
    }
}

#[cube]
impl Mask {
    /// The key blocks of `size` keys the queries `[q_begin, q_end)` visit: every key, or with
    /// `masked` only the range some of them see.
    ///
    /// With `aligned` the first block starts at a multiple of `size` (dropout draws its
    /// random bytes for aligned tiles of keys); the keys added before the first visible one
    /// are masked as in any block that straddles the mask's edge.
    pub fn key_blocks(
        &self,
        q_begin: usize,
        q_end: usize,
        #[comptime] size: usize,
        #[comptime] masked: bool,
        #[comptime] aligned: bool,
    ) -> Blocks {
        let mut first = 0i32;
        let mut last = self.seq_kv;
        if masked {
            first = self.key_begin(i32::cast_from(q_begin));
            last = self.key_end(i32::cast_from(q_end));
            if comptime!(aligned) {
                first -= first % i32::cast_from(size);
            }
        }
        Blocks::covering(first, last, size)
    }

    /// The query blocks of `size` queries that see any key of `[k_begin, k_end)` (every
    /// query unless `masked`); `aligned` as for [`Mask::key_blocks`].
    pub fn query_blocks(
        &self,
        k_begin: usize,
        k_end: usize,
        #[comptime] size: usize,
        #[comptime] masked: bool,
        #[comptime] aligned: bool,
    ) -> Blocks {
        let mut first = 0i32;
        let mut last = self.seq_q;
        if masked {
            first = self.query_begin(i32::cast_from(k_begin));
            last = self.query_end(i32::cast_from(k_end));
            if comptime!(aligned) {
                first -= first % i32::cast_from(size);
            }
        }
        Blocks::covering(first, last, size)
    }
}

#[cube]
fn clamp(x: i32, low: i32, high: i32) -> i32 {
    max(low, min(x, high))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_is_bottom_right_aligned() {
        let m = MaskSpec::causal();
        // s_q = 2, s_kv = 5: query 0 sees keys 0..=3, query 1 sees all.
        assert!(m.is_visible(0, 3, 2, 5));
        assert!(!m.is_visible(0, 4, 2, 5));
        assert!(m.is_visible(1, 4, 2, 5));
        // s_q = 5, s_kv = 2: queries 0..=2 see nothing.
        assert!(!m.is_visible(2, 0, 5, 2));
        assert!(m.is_visible(3, 0, 5, 2));
        assert!(!m.is_visible(3, 1, 5, 2));
    }

    #[test]
    fn window_bounds_both_sides() {
        let m = MaskSpec {
            causal: false,
            window_left: Some(1),
            window_right: Some(2),
        };
        let seen: Vec<usize> = (0..8).filter(|&j| m.is_visible(3, j, 8, 8)).collect();
        assert_eq!(seen, vec![2, 3, 4, 5]);
        assert_eq!(m.kernel_window(8, 8), (1, 2));
        assert_eq!(MaskSpec::default().kernel_window(8, 4), (12, 12));
    }
}
