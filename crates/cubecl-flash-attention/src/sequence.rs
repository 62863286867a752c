//! Which sequence a cube works on, in a dense batch or a packed one.
//!
//! A dense batch holds its sequences side by side in `[batch, heads, seq, dim]` tensors,
//! all of the same length. A packed batch (variable lengths, no padding) concatenates them
//! along one token axis, `[total, heads, dim]`, and names where each starts with
//! `cu_seqlens` (`[b + 1]`, `cu_seqlens[i]` the first token of sequence `i`, the last entry
//! the total), as FlashAttention's varlen functions do. The kernels see a packed tensor as
//! `[1, heads, total, dim]` (a view, no copy); a cube finds its sequence's rows and lengths
//! through [`Sequence`] and masks bottom-right aligned within each sequence.
//!
//! The launch grid of a packed batch covers the longest sequence; the cubes past the end of
//! a shorter one stop at once.

use cubecl::prelude::*;

use crate::error::FlashError;
use crate::launch::DeviceTensor;

/// Where the cube's sequence lives: the batch index of its rows (0 in a packed batch), its
/// first query and key row, and its lengths.
#[derive(CubeType, Clone, Copy)]
pub struct Sequence {
    /// Batch index into the tensors (0 in a packed batch's `[1, heads, total, dim]` views).
    pub batch: usize,
    /// Which sequence: the batch entry, or a packed batch's sequence.
    pub index: usize,
    pub q_first: usize,
    pub kv_first: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
}

#[cube]
impl Sequence {
    /// Sequence `batch`: of a dense batch (the lengths of `q` and `k`), or with `packed` the
    /// one `cu_seqlens_q`/`cu_seqlens_kv` delimit. Past the last sequence (a cube of a launch
    /// whose grid holds more (batch, head) pairs than there are, see
    /// [`crate::tile::batch_head_index`]) it is empty: the kernels' first check ends the cube.
    pub fn of<F: Float>(
        batch: usize,
        q: &Tensor<F>,
        k: &Tensor<F>,
        cu_seqlens_q: &Tensor<i32>,
        cu_seqlens_kv: &Tensor<i32>,
        #[comptime] packed: bool,
    ) -> Sequence {
        let mut sequence = Sequence {
            batch,
            index: batch,
            q_first: 0,
            kv_first: 0,
            seq_q: q.shape(2),
            seq_kv: k.shape(2),
        };
        let count = if comptime!(packed) {
            cu_seqlens_q.len() - 1
        } else {
            q.shape(0)
        };
        if batch >= count {
            sequence.seq_q = 0;
            sequence.seq_kv = 0;
        } else if comptime!(packed) {
            let q_first = usize::cast_from(cu_seqlens_q[batch]);
            let kv_first = usize::cast_from(cu_seqlens_kv[batch]);
            sequence.batch = 0;
            sequence.q_first = q_first;
            sequence.kv_first = kv_first;
            sequence.seq_q = usize::cast_from(cu_seqlens_q[batch + 1]) - q_first;
            sequence.seq_kv = usize::cast_from(cu_seqlens_kv[batch + 1]) - kv_first;
        }
        sequence
    }
}

/// The lengths of a packed batch's sequences, checked, and their `cu_seqlens` on the device.
#[derive(Clone, Debug)]
pub struct PackedSequences {
    /// `[b + 1]` i32: the first token of each sequence, then the total.
    pub cu_seqlens: DeviceTensor,
    lengths: Vec<usize>,
}

impl PackedSequences {
    /// The `cu_seqlens` of sequences of the given lengths: 0, then their running sums; an
    /// error unless the total stays below 2^31 tokens.
    pub fn offsets(lengths: &[usize]) -> Result<Vec<i32>, FlashError> {
        let mut starts = Vec::with_capacity(lengths.len() + 1);
        let mut total = 0usize;
        starts.push(0i32);
        for &length in lengths {
            total += length;
            starts.push(i32::try_from(total).map_err(|_| FlashError::Option {
                arg: "cu_seqlens",
                expected: format!("a total below 2^31 tokens, got {total} or more"),
            })?);
        }
        Ok(starts)
    }

    /// Sequences of the given lengths, packed in that order.
    pub fn from_lengths(client: &Client, lengths: &[usize]) -> Result<Self, FlashError> {
        let starts = Self::offsets(lengths)?;
        let bytes: Vec<u8> = starts.iter().flat_map(|s| s.to_le_bytes()).collect();
        Ok(Self {
            cu_seqlens: DeviceTensor::from_bytes(client, &[starts.len()], &bytes),
            lengths: lengths.to_vec(),
        })
    }

    /// Sequences of the given lengths whose `cu_seqlens` (`[b + 1]` i32) is already on the
    /// device; it must hold the offsets of `lengths` (0, then their running sums), which
    /// the kernels read without checking.
    pub fn from_device(cu_seqlens: DeviceTensor, lengths: Vec<usize>) -> Result<Self, FlashError> {
        if cu_seqlens.shape != [lengths.len() + 1] {
            return Err(FlashError::Shape {
                arg: "cu_seqlens",
                shape: cu_seqlens.shape,
                expected: format!(
                    "[{}] (one offset per sequence, then the total)",
                    lengths.len() + 1
                ),
            });
        }
        Self::offsets(&lengths)?;
        Ok(Self {
            cu_seqlens,
            lengths,
        })
    }

    /// The lengths `cu_seqlens` (host values, as read back from the device tensor) gives:
    /// an error naming `arg` unless it starts at 0 and never decreases.
    pub fn lengths_of(arg: &'static str, cu_seqlens: &[i64]) -> Result<Vec<usize>, FlashError> {
        let bad = |expected: String| FlashError::Option { arg, expected };
        match cu_seqlens.first() {
            None => {
                return Err(bad(
                    "at least one entry (`[b + 1]`: 0, then each sequence's end)".into(),
                ));
            }
            Some(&first) if first != 0 => return Err(bad(format!("to start at 0, got {first}"))),
            _ => {}
        }
        cu_seqlens
            .windows(2)
            .enumerate()
            .map(|(i, pair)| {
                usize::try_from(pair[1] - pair[0]).map_err(|_| {
                    bad(format!(
                        "non-decreasing offsets, got {} at {i} then {} at {}",
                        pair[0],
                        pair[1],
                        i + 1
                    ))
                })
            })
            .collect()
    }

    /// Number of sequences.
    pub fn count(&self) -> usize {
        self.lengths.len()
    }

    /// Tokens of all sequences.
    pub fn total(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Length of the longest sequence (0 for none).
    pub fn longest(&self) -> usize {
        self.lengths.iter().copied().max().unwrap_or(0)
    }

    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// An error naming `arg` unless a packed tensor's `total` tokens are those of the
    /// sequences (`cu_seqlens_arg` names the boundaries).
    pub(crate) fn check_total(
        &self,
        arg: &'static str,
        shape: &[usize],
        cu_seqlens_arg: &str,
    ) -> Result<(), FlashError> {
        if shape.first() == Some(&self.total()) {
            Ok(())
        } else {
            Err(FlashError::Shape {
                arg,
                shape: shape.to_vec(),
                expected: format!(
                    "{} tokens first (the total of `{cu_seqlens_arg}`)",
                    self.total()
                ),
            })
        }
    }
}

/// A packed `[total, heads, dim]` tensor (or a `[heads, total]` LSE with `lse`) as the
/// kernels' `[1, heads, total, dim]` (`[1, heads, total]`) view of the same memory.
pub(crate) fn batch_view(t: &DeviceTensor) -> DeviceTensor {
    let (shape, strides) = match (t.shape.as_slice(), t.strides.as_slice()) {
        ([total, heads, dim], [s_total, s_head, s_dim]) => (
            vec![1, *heads, *total, *dim],
            vec![0, *s_head, *s_total, *s_dim],
        ),
        ([heads, total], [s_head, s_total]) => {
            (vec![1, *heads, *total], vec![0, *s_head, *s_total])
        }
        _ => unreachable!("packed tensors are checked to be of rank 3 (LSE: 2) first"),
    };
    DeviceTensor {
        handle: t.handle.clone(),
        shape,
        strides,
    }
}

/// The tensors of the kernels' `cu_seqlens` arguments: the packed batch's, or with `None`
/// a stand-in the dense kernels never read.
pub(crate) fn cu_seqlens<'a>(
    packed: Option<(&'a PackedSequences, &'a PackedSequences)>,
    stand_in: &'a DeviceTensor,
) -> (&'a DeviceTensor, &'a DeviceTensor) {
    match packed {
        Some((q, kv)) => (&q.cu_seqlens, &kv.cu_seqlens),
        None => (stand_in, stand_in),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_come_from_offsets() {
        assert_eq!(
            PackedSequences::lengths_of("cu_seqlens_q", &[0, 3, 3, 10]).unwrap(),
            vec![3, 0, 7]
        );
        assert_eq!(
            PackedSequences::lengths_of("cu_seqlens_q", &[0]).unwrap(),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn bad_offsets_name_the_argument() {
        let err = PackedSequences::lengths_of("cu_seqlens_k", &[0, 5, 4]).unwrap_err();
        assert!(
            matches!(
                err,
                FlashError::Option {
                    arg: "cu_seqlens_k",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("non-decreasing"), "{err}");
        let err = PackedSequences::lengths_of("cu_seqlens_q", &[1, 5]).unwrap_err();
        assert!(err.to_string().contains("start at 0"), "{err}");
        assert!(PackedSequences::lengths_of("cu_seqlens_q", &[]).is_err());
    }
}
