//! Errors of the launchers. Every message names the offending argument and what was expected.

/// Why a kernel was not launched. `Unavailable` and `InvalidConfig` let a caller fall back
/// to another implementation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlashError {
    #[error("`{arg}` must have rank 4 [batch, heads, seq, dim], got shape {shape:?}")]
    Rank {
        arg: &'static str,
        shape: Vec<usize>,
    },
    #[error("`{arg}` has shape {shape:?}: {expected}")]
    Shape {
        arg: &'static str,
        shape: Vec<usize>,
        expected: String,
    },
    #[error("`{arg}` has dtype {got}, expected {expected}")]
    Dtype {
        arg: &'static str,
        got: String,
        expected: String,
    },
    #[error("`{arg}` is invalid: {expected}")]
    Option { arg: &'static str, expected: String },
    #[error("not available on this device: {0}")]
    Unavailable(String),
    #[error("no kernel configuration fits: {0}")]
    InvalidConfig(String),
}
