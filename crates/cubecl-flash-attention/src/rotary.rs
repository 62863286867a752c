//! Rotary position embedding (RoPE) of the new queries and keys of a decode step, applied
//! as they are read, as FlashAttention's `flash_attn_with_kvcache` does with `rotary_cos`
//! and `rotary_sin` (`[positions, rotary_dim / 2]`).
//!
//! The first `rotary_dim` columns of a row at position `p` turn by the angles of row `p` of
//! the tables; the rest pass unchanged. Pairs are `(i, i + rotary_dim / 2)` (GPT-NeoX,
//! half-split) or `(2i, 2i + 1)` (GPT-J, interleaved): `x_i' = x_i cos_i − x_j sin_i`,
//! `x_j' = x_j cos_i + x_i sin_i`.

use cubecl::prelude::*;

use crate::error::FlashError;
use crate::launch::DeviceTensor;

/// The cos and sin tables, `[positions, rotary_dim / 2]` in the input dtype, and the layout
/// of the pairs.
#[derive(Clone, Copy, Debug)]
pub struct Rotary<'a> {
    pub cos: &'a DeviceTensor,
    pub sin: &'a DeviceTensor,
    /// Pairs `(2i, 2i + 1)`; otherwise `(i, i + rotary_dim / 2)`.
    pub interleaved: bool,
}

/// The rotation as the kernels compile it; `dim = 0` is none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RotaryConfig {
    /// Columns rotated (even, at most the head dim).
    pub dim: usize,
    pub interleaved: bool,
}

impl RotaryConfig {
    pub const NONE: Self = Self {
        dim: 0,
        interleaved: false,
    };

    /// Checks `rotary`'s tables against rows of `head_dim` columns at positions below
    /// `positions`.
    pub fn new(
        rotary: Option<&Rotary>,
        head_dim: usize,
        positions: usize,
    ) -> Result<Self, FlashError> {
        match rotary {
            None => Ok(Self::NONE),
            Some(r) => Self::from_shapes(
                &r.cos.shape,
                &r.sin.shape,
                r.interleaved,
                head_dim,
                positions,
            ),
        }
    }

    /// [`RotaryConfig::new`] from the shapes of the cos and sin tables.
    pub fn from_shapes(
        cos: &[usize],
        sin: &[usize],
        interleaved: bool,
        head_dim: usize,
        positions: usize,
    ) -> Result<Self, FlashError> {
        let expected = |what: String| FlashError::Shape {
            arg: "rotary_cos",
            shape: cos.to_vec(),
            expected: what,
        };
        let [rows, half] = cos[..] else {
            return Err(expected(
                "expected rank 2, [positions, rotary_dim / 2]".into(),
            ));
        };
        if half == 0 || 2 * half > head_dim {
            return Err(expected(format!(
                "expected [positions, rotary_dim / 2] with 2 ≤ rotary_dim ≤ {head_dim} (the head dim)"
            )));
        }
        if rows < positions {
            return Err(expected(format!(
                "expected at least {positions} positions (the longest sequence with its new tokens)"
            )));
        }
        if sin != cos {
            return Err(FlashError::Shape {
                arg: "rotary_sin",
                shape: sin.to_vec(),
                expected: format!("expected {cos:?} (the shape of `rotary_cos`)"),
            });
        }
        Ok(Self {
            dim: 2 * half,
            interleaved,
        })
    }
}

/// Column `c` of the row of `t` whose column 0 is at `at` (columns `stride` apart), in f32,
/// rotated to `position` by `rotary` (`cos`/`sin` as in [`Rotary`]; not read without one) and
/// rounded to `F`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn rotated<F: Float>(
    t: &Tensor<F>,
    at: usize,
    stride: usize,
    c: usize,
    position: usize,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    #[comptime] rotary: RotaryConfig,
) -> f32 {
    let x = f32::cast_from(t[at + c * stride]);
    let mut value = x;
    if comptime!(rotary.dim > 0) {
        let half = comptime!(rotary.dim / 2);
        if c < rotary.dim {
            // The angle `i` of column `c`, its partner column and the sign of the sine term.
            let mut i = c / 2;
            let mut partner = c + 1 - 2 * (c % 2);
            let mut first = c % 2 == 0;
            if !rotary.interleaved {
                first = c < half;
                i = select(first, c, c - half);
                partner = select(first, c + half, c - half);
            }
            let y = f32::cast_from(t[at + partner * stride]);
            let cos_i = f32::cast_from(cos[position * cos.stride(0) + i * cos.stride(1)]);
            let sin_i = f32::cast_from(sin[position * sin.stride(0) + i * sin.stride(1)]);
            // Rounded to the input dtype, as a turned tensor of that dtype holds it (and as
            // the tensor-core kernels take it): every kernel sees the same queries.
            value = f32::cast_from(F::cast_from(x * cos_i + select(first, -y, y) * sin_i));
        }
    }
    value
}
