//! The attention problem: sizes, dtype and options, validated once before any launch.

use crate::dropout::{Dropout, DropoutArgsLaunch};
use crate::error::FlashError;
use crate::mask::MaskSpec;
use serde::{Deserialize, Serialize};

/// Largest head dimension the kernels take.
pub const MAX_HEAD_DIM: usize = 256;
/// Largest batch · query heads of a problem: the kernels' launch grids enumerate them along
/// two dimensions (Y, then Z), each at most 65535 cubes on CUDA, HIP and WebGPU. (The decode
/// kernels enumerate batch · K/V heads along one and check their own bound.)
pub const MAX_BATCH_HEADS: usize = crate::launch::GRID_DIM * crate::launch::GRID_DIM;

/// Floating-point type of Q, K, V, O and the gradients. Accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FloatDtype {
    F16,
    BF16,
    F32,
}

impl FloatDtype {
    pub fn size(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::F32 => 4,
        }
    }

    pub fn elem_type(self) -> cubecl::ir::ElemType {
        use cubecl::ir::{ElemType, FloatKind};
        ElemType::Float(match self {
            Self::F16 => FloatKind::F16,
            Self::BF16 => FloatKind::BF16,
            Self::F32 => FloatKind::F32,
        })
    }
}

/// Options of an attention call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AttentionOptions {
    /// Softmax scale; `None` is `1/√d_qk`.
    pub scale: Option<f32>,
    /// Causal / sliding-window masking.
    pub mask: MaskSpec,
    /// `cap · tanh(s / cap)` on the scores before masking; must be positive.
    pub softcap: Option<f32>,
    /// A backward whose gradients are bitwise identical from run to run: no atomics (the
    /// register-level path then computes dQ in a pass of its own at every length).
    #[serde(default)]
    pub deterministic: bool,
    /// Dropout on the probabilities ([`crate::dropout`]).
    #[serde(default)]
    pub dropout: Option<Dropout>,
}

/// Sizes of one attention call: Q `[batch, heads_q, seq_q, dim_qk]`,
/// K `[batch, heads_kv, seq_kv, dim_qk]`, V `[batch, heads_kv, seq_kv, dim_v]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionProblem {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    pub dtype: FloatDtype,
    pub options: AttentionOptions,
}

fn rank4(arg: &'static str, shape: &[usize]) -> Result<[usize; 4], FlashError> {
    shape.try_into().map_err(|_| FlashError::Rank {
        arg,
        shape: shape.to_vec(),
    })
}

impl AttentionProblem {
    /// Validates the shapes of Q, K and V and the options.
    pub fn new(
        q: &[usize],
        k: &[usize],
        v: &[usize],
        dtype: FloatDtype,
        options: AttentionOptions,
    ) -> Result<Self, FlashError> {
        let [batch, heads_q, seq_q, dim_qk] = rank4("query", q)?;
        let [kb, heads_kv, seq_kv, kd] = rank4("key", k)?;
        let [vb, vh, vs, dim_v] = rank4("value", v)?;
        let shape_err = |arg, shape: [usize; 4], expected: String| FlashError::Shape {
            arg,
            shape: shape.to_vec(),
            expected,
        };
        let kshape = [kb, heads_kv, seq_kv, kd];
        if kb != batch || kd != dim_qk {
            return Err(shape_err(
                "key",
                kshape,
                format!(
                    "expected [{batch}, heads_kv, seq_kv, {dim_qk}] (batch and head dim of `query`)"
                ),
            ));
        }
        // No heads at all is an empty problem; otherwise K/V heads divide the query's.
        if (heads_kv == 0 && heads_q != 0) || (heads_kv != 0 && heads_q % heads_kv != 0) {
            return Err(shape_err(
                "key",
                kshape,
                format!(
                    "its {heads_kv} heads must divide the {heads_q} heads of `query` (GQA/MQA)"
                ),
            ));
        }
        if [vb, vh, vs] != [batch, heads_kv, seq_kv] {
            return Err(shape_err(
                "value",
                [vb, vh, vs, dim_v],
                format!(
                    "expected [{batch}, {heads_kv}, {seq_kv}, dim_v] (batch, heads and seq of `key`)"
                ),
            ));
        }
        for (arg, shape, d) in [("query", q, dim_qk), ("value", v, dim_v)] {
            if d == 0 || d > MAX_HEAD_DIM {
                return Err(FlashError::Shape {
                    arg,
                    shape: shape.to_vec(),
                    expected: format!("head dim must be in 1..={MAX_HEAD_DIM}"),
                });
            }
        }
        // Kernels enumerate batch·heads along the second and third dimensions of their grid.
        if batch * heads_q > MAX_BATCH_HEADS {
            return Err(shape_err(
                "query",
                [batch, heads_q, seq_q, dim_qk],
                format!(
                    "batch · heads must be at most {MAX_BATCH_HEADS}, got {}",
                    batch * heads_q
                ),
            ));
        }
        if let Some(cap) = options.softcap
            && !(cap > 0.0 && cap.is_finite())
        {
            return Err(FlashError::Option {
                arg: "softcap",
                expected: format!("a positive finite number, got {cap}"),
            });
        }
        if let Some(scale) = options.scale
            && !scale.is_finite()
        {
            return Err(FlashError::Option {
                arg: "scale",
                expected: format!("a finite number, got {scale}"),
            });
        }
        if let Some(dropout) = options.dropout {
            dropout.check()?;
        }
        Ok(Self {
            batch,
            heads_q,
            heads_kv,
            seq_q,
            seq_kv,
            dim_qk,
            dim_v,
            dtype,
            options,
        })
    }

    /// The softmax scale, `1/√d_qk` unless given.
    pub fn scale(&self) -> f32 {
        self.options
            .scale
            .unwrap_or_else(|| 1.0 / (self.dim_qk as f32).sqrt())
    }

    /// Query heads per K/V head (0 for a problem without heads).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv.max(1)
    }

    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.heads_q, self.seq_q, self.dim_v]
    }

    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seq_q]
    }

    /// The kernels' dropout arguments (never read where the kernels take no dropout).
    pub(crate) fn dropout_args(&self) -> DropoutArgsLaunch {
        match self.options.dropout {
            Some(dropout) => dropout.args(),
            None => Dropout::inactive_args(),
        }
    }

    /// Whether there is nothing to compute (an empty dimension).
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.heads_q == 0 || self.seq_q == 0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn problem(dim_qk: usize, dim_v: usize) -> AttentionProblem {
        AttentionProblem::new(
            &[2, 8, 100, dim_qk],
            &[2, 2, 90, dim_qk],
            &[2, 2, 90, dim_v],
            FloatDtype::F16,
            AttentionOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn errors_name_the_argument() {
        let o = AttentionOptions::default();
        let f = FloatDtype::F32;
        let msg = |r: Result<AttentionProblem, FlashError>| r.unwrap_err().to_string();
        assert!(
            msg(AttentionProblem::new(
                &[1, 2, 3],
                &[1, 2, 3, 4],
                &[1, 2, 3, 4],
                f,
                o
            ))
            .contains("`query` must have rank 4")
        );
        assert!(
            msg(AttentionProblem::new(
                &[1, 2, 3, 4],
                &[1, 2, 3, 5],
                &[1, 2, 3, 4],
                f,
                o
            ))
            .contains("`key`")
        );
        assert!(
            msg(AttentionProblem::new(
                &[1, 3, 3, 4],
                &[1, 2, 3, 4],
                &[1, 2, 3, 4],
                f,
                o
            ))
            .contains("GQA")
        );
        assert!(
            msg(AttentionProblem::new(
                &[1, 2, 3, 4],
                &[1, 2, 3, 4],
                &[1, 2, 7, 4],
                f,
                o
            ))
            .contains("`value`")
        );
        assert!(
            msg(AttentionProblem::new(
                &[1, 2, 3, 300],
                &[1, 2, 3, 300],
                &[1, 2, 3, 4],
                f,
                o
            ))
            .contains("head dim")
        );
        let capped = AttentionOptions {
            softcap: Some(-1.0),
            ..o
        };
        assert!(
            msg(AttentionProblem::new(
                &[1, 2, 3, 4],
                &[1, 2, 3, 4],
                &[1, 2, 3, 4],
                f,
                capped
            ))
            .contains("`softcap`")
        );
    }

    #[test]
    fn too_many_batch_heads_name_the_query() {
        // Past the 65 535² pairs the grid's Y and Z dimensions hold.
        let err = AttentionProblem::new(
            &[65536, 65536, 16, 64],
            &[65536, 65536, 16, 64],
            &[65536, 65536, 16, 64],
            FloatDtype::BF16,
            AttentionOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, FlashError::Shape { arg: "query", .. }),
            "unexpected error: {err}"
        );
        assert!(err.to_string().contains("4294967296"), "{err}");
        // Past the 65 535 of one dimension: taken.
        let fits = AttentionProblem::new(
            &[2048, 64, 16, 64],
            &[2048, 64, 16, 64],
            &[2048, 64, 16, 64],
            FloatDtype::BF16,
            AttentionOptions::default(),
        );
        assert!(fits.is_ok());
    }

    #[test]
    fn gqa_group_and_default_scale() {
        let p = problem(64, 32);
        assert_eq!(p.group_size(), 4);
        assert_eq!(p.out_shape(), [2, 8, 100, 32]);
        assert!((p.scale() - 0.125).abs() < 1e-7);
    }
}
