//! Host side shared by the launchers: checking a problem against a device, building the
//! kernel arguments, and allocating contiguous outputs.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::config::TileConfig;
use crate::error::FlashError;
use crate::problem::{AttentionProblem, FloatDtype};
use crate::tile::RowLayoutLaunch;

/// A device tensor: a buffer with its shape and strides (in elements).
#[derive(Clone, Debug)]
pub struct DeviceTensor {
    pub handle: Handle,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl DeviceTensor {
    /// A new contiguous (row-major) tensor, uninitialized.
    pub fn empty(client: &Client, shape: &[usize], elem_size: usize) -> Self {
        let count: usize = shape.iter().product();
        let handle = client.empty((count * elem_size).max(elem_size));
        Self {
            handle,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// A new contiguous f32 tensor of zeros (CubeCL's vectorized fill).
    pub fn zeros_f32(client: &Client, shape: &[usize]) -> Self {
        let filled = cubecl::std::tensor::TensorHandle::zeros(
            client,
            shape.to_vec(),
            FloatDtype::F32.elem_type(),
        );
        Self {
            handle: filled.handle,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// f32 zeros laid out as `like` (its shape and strides, over a buffer of its span).
    pub fn zeros_f32_like(client: &Client, like: &DeviceTensor) -> Self {
        let filled = cubecl::std::tensor::TensorHandle::zeros(
            client,
            vec![like.span() + 1],
            FloatDtype::F32.elem_type(),
        );
        Self {
            handle: filled.handle,
            shape: like.shape.clone(),
            strides: like.strides.clone(),
        }
    }

    /// Uploads host data as a contiguous tensor.
    pub fn from_bytes(client: &Client, shape: &[usize], bytes: &[u8]) -> Self {
        Self {
            handle: client.create_from_slice(bytes),
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    /// The tensor's [`RowLayout`] as a launch argument; an error naming `arg` where a stride
    /// or the sequence length does not fit 32 bits.
    pub(crate) fn row_layout(&self, arg: &'static str) -> Result<RowLayoutLaunch, FlashError> {
        let [batch, head, row, seq] = row_layout_parts(arg, &self.shape, &self.strides)?;
        Ok(RowLayoutLaunch::new(batch, head, row, seq))
    }

    /// [`DeviceTensor::row_layout`] with the strides counted in vectors of `vector`
    /// elements (which divide them), for kernels that read the tensor vector by vector.
    pub(crate) fn vector_row_layout(
        &self,
        arg: &'static str,
        vector: usize,
    ) -> Result<RowLayoutLaunch, FlashError> {
        let strides: Vec<usize> = self.strides.iter().map(|s| s / vector).collect();
        let [batch, head, row, seq] = row_layout_parts(arg, &self.shape, &strides)?;
        Ok(RowLayoutLaunch::new(batch, head, row, seq))
    }

    /// Elements from the first to the last one the tensor addresses, inclusive.
    pub(crate) fn span(&self) -> usize {
        self.shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| n.saturating_sub(1) * s)
            .sum::<usize>()
            + 1
    }

    pub(crate) fn arg(&self) -> TensorArg {
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                self.strides.clone().into(),
                self.shape.clone().into(),
            )
        }
    }
}

/// The most elements a kernel reaches from a tensor's start: the kernels compute offsets in
/// 32 bits (CubeCL's default address type), so a tensor may span at most `2^32 − 1`.
pub const MAX_SPAN: usize = u32::MAX as usize;

/// Checks that each tensor's elements lie within [`MAX_SPAN`] of its start; an error naming
/// the first that does not, before anything is launched (past it, offsets would wrap).
pub(crate) fn check_spans<'a>(
    tensors: impl IntoIterator<Item = (&'static str, &'a DeviceTensor)>,
) -> Result<(), FlashError> {
    for (arg, t) in tensors {
        if t.span() > MAX_SPAN {
            return Err(FlashError::Shape {
                arg,
                shape: t.shape.clone(),
                expected: format!(
                    "at most 2^32 − 1 elements from its start to its last (the kernels compute \
                     32-bit offsets); it spans {}: split the batch",
                    t.span()
                ),
            });
        }
    }
    Ok(())
}

/// The batch, head and row strides and the sequence length of a `[batch, heads, seq, ·]`
/// tensor as 32-bit launch scalars ([`RowLayout`](crate::tile::RowLayout)).
fn row_layout_parts(
    arg: &'static str,
    shape: &[usize],
    strides: &[usize],
) -> Result<[u32; 4], FlashError> {
    let part = |value: usize| {
        u32::try_from(value).map_err(|_| FlashError::Shape {
            arg,
            shape: shape.to_vec(),
            expected: "strides and a sequence length below 2^32 elements".into(),
        })
    };
    Ok([
        part(strides[0])?,
        part(strides[1])?,
        part(strides[2])?,
        part(shape[2])?,
    ])
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// Fails with a clear message when the device cannot compute in `dtype`.
pub(crate) fn check_dtype(client: &Client, dtype: FloatDtype) -> Result<(), FlashError> {
    let elem = dtype.elem_type();
    if client.properties().supports_type(elem) {
        Ok(())
    } else {
        Err(FlashError::Dtype {
            arg: "query",
            got: format!("{dtype:?}"),
            expected: "a float type this device supports (f32 everywhere; f16/bf16 where the runtime has them)"
                .into(),
        })
    }
}

pub(crate) fn expect_shape(
    arg: &'static str,
    t: &DeviceTensor,
    shape: &[usize],
) -> Result<(), FlashError> {
    if t.shape == shape {
        Ok(())
    } else {
        Err(FlashError::Shape {
            arg,
            shape: t.shape.clone(),
            expected: format!("expected {shape:?}"),
        })
    }
}

/// Window arguments of the mask in kernel form.
pub(crate) fn window_args(problem: &AttentionProblem) -> (i32, i32) {
    problem
        .options
        .mask
        .kernel_window(problem.seq_q, problem.seq_kv)
}

/// The softcap argument (ignored by kernels compiled without softcap).
pub(crate) fn softcap_arg(problem: &AttentionProblem) -> f32 {
    problem.options.softcap.unwrap_or(1.0)
}

/// One cube per block of `rows` rows of `seq`, per batch·head (`heads`).
pub(crate) fn grid(
    config: &TileConfig,
    seq: usize,
    batch: usize,
    heads: usize,
) -> (CubeCount, CubeDim) {
    (
        blocks_by_pairs(seq.div_ceil(config.block_rows), batch * heads),
        CubeDim::new_1d(config.block_rows as u32),
    )
}

/// Cubes in a grid dimension: CUDA, HIP and WebGPU all take at least this many along Y and Z.
pub(crate) const GRID_DIM: usize = u16::MAX as usize;

/// The launch of the training kernels: `blocks` cubes along X (a sequence's blocks) for each
/// of `pairs` (batch, head) pairs, the pairs along Y and, past [`GRID_DIM`], Z as well
/// (`pairs = y · z` or a few less; [`crate::tile::batch_head_index`] reads them back, and a
/// cube past the last pair ends at once). [`AttentionProblem`] keeps `pairs` within
/// `GRID_DIM²`.
pub(crate) fn blocks_by_pairs(blocks: usize, pairs: usize) -> CubeCount {
    let z = pairs.div_ceil(GRID_DIM).max(1);
    CubeCount::Static(blocks as u32, pairs.div_ceil(z) as u32, z as u32)
}

/// Whether every row of `t` starts on a 16-byte boundary and is contiguous.
pub(crate) fn readable_by_16_byte_copies(t: &DeviceTensor, elem: usize) -> bool {
    let offset = t.handle.offset_start.unwrap_or(0) as usize;
    t.strides[3] == 1
        && t.strides[..3].iter().all(|s| (s * elem).is_multiple_of(16))
        && offset.is_multiple_of(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_layouts_take_strides_and_length() {
        let shape = [2, 4, 97, 64];
        let parts = row_layout_parts("query", &shape, &contiguous_strides(&shape)).unwrap();
        assert_eq!(parts, [4 * 97 * 64, 97 * 64, 64, 97]);
    }

    #[test]
    fn row_layouts_beyond_32_bits_name_the_argument() {
        let shape = [2, 1, 8, 64];
        let strides = [1usize << 32, 512, 64, 1];
        let err = row_layout_parts("key", &shape, &strides).unwrap_err();
        assert!(
            matches!(err, FlashError::Shape { arg: "key", .. }),
            "unexpected error: {err}"
        );
        assert!(err.to_string().contains("2^32"), "{err}");
    }
}
