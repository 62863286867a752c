//! Compile-time shape of a kernel variant, and the one pure function that picks it.

use cubecl::ir::features::Tma;

use crate::error::FlashError;
use crate::problem::{AttentionProblem, FloatDtype};
use crate::tile::SharedLayout;

/// Which implementation of the kernels runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// Choose the fastest path the device supports.
    #[default]
    Auto,
    /// Register and shared-memory tiles, one query (or key) row per unit. Needs no
    /// tensor cores and no plane operations: runs on every CubeCL runtime, lavapipe included.
    Portable,
    /// Tensor cores through CubeCL's `cmma` (16×16×16 f16/bf16 fragments, f32 accumulation;
    /// wmma on CUDA, rocWMMA on HIP). Score tiles pass through shared memory for the softmax.
    TensorCore,
    /// Register-level tensor-core instructions (`mma.sync` m16n8k16, `ldmatrix`, `cp.async`;
    /// CUDA sm_80 and later): scores, probabilities and the output stay in registers, K/V
    /// tiles are double-buffered in shared memory; the same in the backward's dK/dV and dQ
    /// kernels.
    RegisterMma,
}

/// What the tile heuristic needs to know about a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Shared memory one cube may use, in bytes.
    pub max_shared_memory: usize,
    /// Units one cube may hold.
    pub max_units_per_cube: usize,
    /// Units of a plane (warp/wavefront): 32 on NVIDIA, 64 on AMD CDNA, varies on CPUs.
    pub plane_size: usize,
    /// Whether the device has plane operations. Used as the mark of a GPU with a SIMT
    /// register file, where unrolled head-dim loops keep per-row arrays in registers; CPU
    /// Vulkan drivers (lavapipe) have none, and take minutes to compile such unrolled loops.
    pub plane_ops: bool,
    /// 16×16×16 `cmma` fragments with f32 accumulation, for f16 and for bf16 inputs.
    pub cmma_f16: bool,
    pub cmma_bf16: bool,
    /// Register-level m16n8k16 products with f32 accumulation plus `ldmatrix`, for f16 and
    /// bf16 inputs, and asynchronous global→shared copies (CUDA sm_80+).
    pub mma_sync_f16: bool,
    pub mma_sync_bf16: bool,
    /// Atomic addition of two neighbouring f32 values in one instruction
    /// (`red.global.add.v2.f32`, CUDA sm_90+).
    pub paired_f32_atomics: bool,
    /// Warpgroup-level products (`wgmma.mma_async`), which CUDA has on sm_90 alone: the
    /// runtime marks sm_90 and later with the tensor memory accelerator, and sm_100 and
    /// later also with its wide im2col mode.
    pub warpgroup_mma: bool,
    /// Most loop iterations one kernel invocation may run in total, where the driver stops
    /// loops past a budget instead of running them ([`crate::loop_budget`]); `None` where
    /// loops run to the end.
    pub loop_iterations: Option<u64>,
    /// Multiprocessors (SMs, CUs) the device runs cubes on; CPU cores on a CPU device; 1
    /// where the runtime does not say.
    pub multiprocessors: usize,
}

impl DeviceLimits {
    pub fn from_properties(props: &cubecl::prelude::DeviceProperties) -> Self {
        let hw = &props.hardware;
        Self {
            max_shared_memory: hw.max_shared_memory_size,
            max_units_per_cube: hw.max_units_per_cube as usize,
            plane_size: hw.plane_size_max as usize,
            plane_ops: props
                .features
                .plane
                .contains(cubecl::ir::features::Plane::Ops),
            cmma_f16: has_cmma(props, FloatDtype::F16),
            cmma_bf16: has_cmma(props, FloatDtype::BF16),
            mma_sync_f16: has_mma_sync(props, FloatDtype::F16),
            mma_sync_bf16: has_mma_sync(props, FloatDtype::BF16),
            paired_f32_atomics: props
                .atomic_type_usage(cubecl::ir::Type::atomic(
                    cubecl::ir::Type::new(FloatDtype::F32.elem_type()).with_vector_size(2),
                ))
                .contains(cubecl::ir::features::AtomicUsage::Add),
            warpgroup_mma: props.features.tma.contains(Tma::Base)
                && !props.features.tma.contains(Tma::Im2colWide),
            loop_iterations: crate::loop_budget::driver_loop_iterations(&props.identity.name),
            multiprocessors: hw
                .num_streaming_multiprocessors
                .or(hw.num_cpu_cores)
                .unwrap_or(1)
                .max(1) as usize,
        }
    }

    /// Whether the register-level path can run `dtype` on this device. Its fragment layouts
    /// are the PTX ones, defined for planes of 32 units.
    pub fn has_register_mma(&self, dtype: FloatDtype) -> bool {
        self.plane_ops
            && self.plane_size == MMA_SYNC_PLANE
            && match dtype {
                FloatDtype::F16 => self.mma_sync_f16,
                FloatDtype::BF16 => self.mma_sync_bf16,
                FloatDtype::F32 => false,
            }
    }

    /// Whether the tensor-core path can run `dtype` on this device.
    pub fn has_tensor_cores(&self, dtype: FloatDtype) -> bool {
        // Plane operations reduce the softmax rows held by several units.
        self.plane_ops
            && match dtype {
                FloatDtype::F16 => self.cmma_f16,
                FloatDtype::BF16 => self.cmma_bf16,
                FloatDtype::F32 => false,
            }
    }
}

fn has_cmma(props: &cubecl::prelude::DeviceProperties, dtype: FloatDtype) -> bool {
    let elem = dtype.elem_type();
    let acc = FloatDtype::F32.elem_type();
    props.features.matmul.cmma.iter().any(|c| {
        c.a_type == elem
            && c.b_type == elem
            && c.cd_type == acc
            && (c.m, c.n, c.k) == (FRAGMENT as u32, FRAGMENT as u32, FRAGMENT as u32)
    })
}

pub(crate) fn has_mma_sync(props: &cubecl::prelude::DeviceProperties, dtype: FloatDtype) -> bool {
    let elem = dtype.elem_type();
    let acc = FloatDtype::F32.elem_type();
    let matmul = &props.features.matmul;
    props.features.copy_async
        && matmul.ldmatrix.contains(&elem)
        && matmul.mma.iter().any(|c| {
            c.a_type == elem
                && c.b_type == elem
                && c.cd_type == acc
                && (c.m, c.n, c.k) == (16, 8, 16)
        })
}

/// The compile-time configuration of one portable kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    /// Rows of the cube's own operand (query rows in the forward and dQ kernels, key rows
    /// in the dK/dV kernel): one unit each.
    pub block_rows: usize,
    /// Rows of the streamed operand staged in shared memory per step.
    pub block_stream: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    /// Causal or sliding-window masking compiled in.
    pub masked: bool,
    /// Softcap compiled in.
    pub softcap: bool,
    /// Columns the loops over a head dim run unrolled per iteration (see [`crate::tile`]):
    /// at least the larger head dim where the whole row is unrolled, so that the per-row
    /// arrays stay in registers.
    pub columns: usize,
}

impl TileConfig {
    /// Whether the loops over the head dims are unrolled whole.
    pub fn unrolled(&self) -> bool {
        self.columns >= self.dim_qk.max(self.dim_v)
    }
}

/// Largest head dim whose loops are unrolled on GPUs (larger rows would not fit in
/// registers anyway).
const MAX_UNROLLED_DIM: usize = 128;
/// Largest head dim whose loops are unrolled on devices without plane operations (CPU
/// Vulkan drivers): lavapipe (Mesa 22.3) takes minutes to compile unrolled loops over
/// larger rows (seconds up to 64).
const MAX_UNROLLED_DIM_CPU: usize = 64;
/// Columns per iteration of the head-dim loops of larger rows on those devices: llvmpipe
/// runs at most 65 535 loop iterations per invocation ([`crate::loop_budget`]), so rows
/// are walked 16 columns at a time.
const COLUMNS_CPU: usize = 16;

/// Rows of the cube's own operand: one unit each, a whole number of planes where possible.
const ROWS_PER_CUBE: usize = 64;
/// Most rows staged at once.
const MAX_STREAM_ROWS: usize = 64;

/// Picks the portable tiles: `stream_row_bytes` is what one staged row costs in shared
/// memory (all staged operands together), `fixed_bytes` what the cube stages besides.
pub fn choose_portable_tiles(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    stream_row_bytes: usize,
) -> Result<TileConfig, FlashError> {
    let block_rows = ROWS_PER_CUBE.min(limits.max_units_per_cube).max(1);
    let budget = limits.max_shared_memory;
    let fit = budget / stream_row_bytes.max(1);
    if fit == 0 {
        return Err(FlashError::InvalidConfig(format!(
            "head dims {}/{} need {stream_row_bytes} bytes of shared memory per staged row; the device offers {budget}",
            problem.dim_qk, problem.dim_v
        )));
    }
    // Largest power of two that fits, at most MAX_STREAM_ROWS.
    let block_stream = 1usize << (usize::BITS - 1 - fit.min(MAX_STREAM_ROWS).leading_zeros());
    Ok(TileConfig {
        block_rows,
        block_stream,
        dim_qk: problem.dim_qk,
        dim_v: problem.dim_v,
        masked: problem.options.mask.is_masked(),
        softcap: problem.options.softcap.is_some(),
        columns: portable_columns(problem.dim_qk.max(problem.dim_v), limits),
    })
}

/// Columns per iteration of the portable head-dim loops over rows of `dim` columns.
pub(crate) fn portable_columns(dim: usize, limits: &DeviceLimits) -> usize {
    match limits.plane_ops {
        true if dim <= MAX_UNROLLED_DIM => dim,
        true => 1,
        false if dim <= MAX_UNROLLED_DIM_CPU => dim,
        false => COLUMNS_CPU,
    }
}

/// Side of the square `cmma` fragments (m = n = k).
pub const FRAGMENT: usize = 16;

/// The compile-time configuration of one tensor-core kernel variant.
///
/// The cube's `planes` planes each own 16 rows of the cube's operand (query rows in the
/// forward); the streamed operand comes `block_stream` rows at a time. Head dims are padded
/// to a multiple of 16 in shared memory (the padding reads as zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaConfig {
    pub planes: usize,
    pub plane_size: usize,
    pub block_stream: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    pub masked: bool,
    pub softcap: bool,
}

impl MmaConfig {
    /// Rows of the cube's own operand.
    pub fn block_rows(&self) -> usize {
        self.planes * FRAGMENT
    }
    pub fn units(&self) -> usize {
        self.planes * self.plane_size
    }
    pub fn dim_qk_padded(&self) -> usize {
        self.dim_qk.next_multiple_of(FRAGMENT)
    }
    pub fn dim_v_padded(&self) -> usize {
        self.dim_v.next_multiple_of(FRAGMENT)
    }
    /// Units sharing one row of a plane's 16-row tile.
    pub fn units_per_row(&self) -> usize {
        self.plane_size / FRAGMENT
    }
    /// Row stride of a staged half-precision operand with `dim` padded columns: 8 more
    /// elements (16 bytes) than the row, against shared-memory bank conflicts.
    pub fn half_stride(dim: usize) -> usize {
        dim + 8
    }
    /// Row stride of an f32 tile of `cols` columns (4 more, for the same reason).
    pub fn f32_stride(cols: usize) -> usize {
        cols + 4
    }
}

/// Most planes per cube of the tensor-core path.
const MMA_PLANES: usize = 4;
/// Most streamed rows per step of the tensor-core path.
const MMA_STREAM_ROWS: usize = 64;

/// Picks the tensor-core tiles: the largest cube and streamed block whose shared memory,
/// as `shared_bytes` computes it for a candidate, fits the device.
pub fn choose_mma_tiles(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    shared_bytes: impl Fn(&MmaConfig, usize) -> usize,
) -> Result<MmaConfig, FlashError> {
    if !limits.has_tensor_cores(problem.dtype) {
        return Err(FlashError::Unavailable(format!(
            "the tensor-core path needs 16×16×16 {:?} cmma fragments with f32 accumulation and plane operations",
            problem.dtype
        )));
    }
    if !limits.plane_size.is_multiple_of(FRAGMENT) {
        return Err(FlashError::Unavailable(format!(
            "the tensor-core path needs a plane size that is a multiple of {FRAGMENT}, the device has {}",
            limits.plane_size
        )));
    }
    let elem = problem.dtype.size();
    let mut planes = MMA_PLANES.min(limits.max_units_per_cube / limits.plane_size);
    while planes >= 1 {
        let mut block_stream = MMA_STREAM_ROWS;
        while block_stream >= FRAGMENT {
            let config = MmaConfig {
                planes,
                plane_size: limits.plane_size,
                block_stream,
                dim_qk: problem.dim_qk,
                dim_v: problem.dim_v,
                masked: problem.options.mask.is_masked(),
                softcap: problem.options.softcap.is_some(),
            };
            if shared_bytes(&config, elem) <= limits.max_shared_memory {
                return Ok(config);
            }
            block_stream /= 2;
        }
        planes /= 2;
    }
    Err(FlashError::InvalidConfig(format!(
        "head dims {}/{} do not fit the device's {} bytes of shared memory on the tensor-core path",
        problem.dim_qk, problem.dim_v, limits.max_shared_memory
    )))
}

/// Units of a plane the register-level path is written for: `mma.sync` and `ldmatrix` are
/// warp-wide instructions with fixed fragment layouts over 32 lanes.
pub const MMA_SYNC_PLANE: usize = 32;

/// The compile-time configuration of one register-level (`mma.sync`) kernel variant.
///
/// Each of the cube's `planes` planes owns `16 · m_tiles` query rows; key/value blocks of
/// `block_kv` rows are double-buffered in shared memory. Head dims are padded to 16 in
/// shared memory (zeros), and must be a multiple of 8 in memory (16-byte copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterMmaConfig {
    pub planes: usize,
    /// 16-row tiles of queries per plane: two halve the shared-memory reads per product.
    pub m_tiles: usize,
    pub block_kv: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    pub masked: bool,
    pub softcap: bool,
    /// Keep the plane's Q fragments in registers for the whole loop (otherwise they are
    /// re-read from shared memory per key block).
    pub q_in_registers: bool,
    /// The products on warpgroup instructions ([`crate::wgmma`]) for inputs of this dtype,
    /// Q, K and V swizzled in shared memory, each warpgroup (4 planes) owning 64 query rows
    /// (`m_tiles = 1`, Q read from shared memory): sm_90, `d_qk = d_v ∈ {64, 128}`, 64- or
    /// 128-key blocks ([`warpgroup_products`]).
    pub warpgroup: Option<FloatDtype>,
    /// Await K and V of a key block together at its start, one cube-wide barrier per block
    /// (and both copies of the next block issued there), rather than V just before
    /// `O += P·V`, which takes a second barrier per block where warpgroups fence their
    /// reads.
    pub kv_together: bool,
    /// Warpgroup products as wide as the tile allows: `S = Q·Kᵀ` of a 128-key block as one
    /// 128-column product (Q read from shared memory once, not once per 64 keys), and
    /// `O += P·V` at `d_v = 128` likewise. Measured on the H100 (d = 128, s = 1k–16k,
    /// docs/benchmarks.md): 1.04–1.06× the forward of 64-column products. Off until the
    /// oracle tests have run with it on a GPU (`FLASH_WGMMA_WIDE=1` turns it on).
    pub wide_products: bool,
    /// Read a key block's bias into registers before the block's `S` product, so that the
    /// loads run under the product rather than after it (when the problem has a bias): the
    /// warpgroup kernels, whose accumulators leave room for the block's bias pairs.
    pub bias_ahead: bool,
    /// Stage a key block's bias in shared memory a block ahead, with K and V
    /// ([`crate::bias::BiasTile`]), and read it from there: the warpgroup forward, for a
    /// bias whose rows 16-byte copies can read ([`crate::bias::stageable`]), where the two
    /// stages fit beside Q, K and V. Set by the launcher, which sees the bias.
    pub bias_staged: bool,
    /// Launch the cubes of one head's sequences side by side
    /// ([`crate::tile::Head::from_cube_batch_inner`]): for a bias broadcast over the batch,
    /// which those cubes then read from L2 once. Set by the launcher (on request).
    pub batch_inner: bool,
}

impl RegisterMmaConfig {
    pub fn block_rows(&self) -> usize {
        self.planes * FRAGMENT * self.m_tiles
    }
    pub fn units(&self) -> usize {
        self.planes * MMA_SYNC_PLANE
    }
    pub fn dim_qk_padded(&self) -> usize {
        self.dim_qk.next_multiple_of(FRAGMENT)
    }
    pub fn dim_v_padded(&self) -> usize {
        self.dim_v.next_multiple_of(FRAGMENT)
    }
    /// Row stride in shared memory: 16 bytes more than the row, so that the eight 16-byte
    /// rows one `ldmatrix` reads fall in different banks.
    pub fn stride(dim: usize) -> usize {
        dim + 8
    }
    /// Bytes of shared memory of the forward kernel with `elem`-byte inputs: Q, two stages
    /// of K and V, and two of the bias where it is staged.
    pub fn forward_shared_bytes(&self, elem: usize) -> usize {
        let (qk, v, _) = self.shared_layouts();
        let bias = if self.bias_staged {
            2 * self.block_rows() * self.block_kv
        } else {
            0
        };
        elem * (qk.len(self.block_rows())
            + qk.len(2 * self.block_kv)
            + v.len(2 * self.block_kv)
            + bias)
    }
    /// This configuration staging the bias ([`RegisterMmaConfig::bias_staged`]), where it
    /// can: the warpgroup kernel, its two stages fitting in shared memory.
    pub fn staging_bias(&self, elem: usize, limits: &DeviceLimits) -> Option<Self> {
        let staged = Self {
            bias_staged: true,
            ..*self
        };
        (self.warpgroup.is_some() && staged.forward_shared_bytes(elem) <= limits.max_shared_memory)
            .then_some(staged)
    }
    /// How the forward stages Q, K (first layout) and V in shared memory, and the tiles'
    /// alignment.
    pub fn shared_layouts(&self) -> (SharedLayout, SharedLayout, usize) {
        tile_layouts(
            self.dim_qk_padded(),
            self.dim_v_padded(),
            self.warpgroup.is_some(),
        )
    }
    /// f32 registers of one unit's accumulators and fragments (scores, output, Q).
    pub fn accumulator_registers(&self) -> usize {
        let scores = self.m_tiles * self.block_kv / 2;
        let output = self.m_tiles * self.dim_v_padded() / 2;
        let q = if self.q_in_registers {
            self.m_tiles * self.dim_qk_padded() / 4
        } else {
            0
        };
        scores + output + q
    }
}

/// Shared-memory layouts of tiles of `dqk`- and `dv`-column rows, and their alignment:
/// swizzled for warpgroup products (atoms aligned to 1024 bytes), else rows padded by 16
/// bytes for `ldmatrix`.
fn tile_layouts(dqk: usize, dv: usize, warpgroup: bool) -> (SharedLayout, SharedLayout, usize) {
    if warpgroup {
        (
            SharedLayout::Swizzled { cols: dqk },
            SharedLayout::Swizzled { cols: dv },
            1024,
        )
    } else {
        (
            SharedLayout::rows(RegisterMmaConfig::stride(dqk)),
            SharedLayout::rows(RegisterMmaConfig::stride(dv)),
            16,
        )
    }
}

/// Smallest softmax scale the register-level forward takes without a softcap. It compares
/// unscaled scores (the maximum of `scale·s` is `scale·max s` only for a positive scale) and
/// marks hidden keys with [`crate::softmax::MASKED`], whose scaled value must stay far below
/// any visible score's.
pub const MIN_FOLDED_SCALE: f32 = 1e-20;

/// Registers a unit may spend on accumulators and fragments, out of the 255 a CUDA thread
/// has: the rest holds addresses, the softmax state and the operands in flight.
const MMA_SYNC_REGISTER_BUDGET: usize = 192;

/// Picks the register-level tiles for `problem`: 4 planes; two 16-row query tiles per plane
/// and 128-key blocks where those accumulators fit the register budget (head dims up to 64,
/// as FA2; Q fragments then come from shared memory each block: holding them too spilled),
/// else 64-key blocks, one tile and smaller blocks for large head dims. Measured on the H200
/// (bf16, d = 64, docs/benchmarks.md): 128-key blocks ran the forward −1…+5% faster than
/// 64-key blocks with Q in registers.
pub fn choose_register_mma_tiles(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<RegisterMmaConfig, FlashError> {
    if !limits.has_register_mma(problem.dtype) {
        return Err(FlashError::Unavailable(format!(
            "the register-level path needs m16n8k16 {:?} mma with f32 accumulation, ldmatrix, \
             asynchronous copies and planes of {MMA_SYNC_PLANE} units (CUDA sm_80 or later)",
            problem.dtype
        )));
    }
    if !problem.dim_qk.is_multiple_of(8) || !problem.dim_v.is_multiple_of(8) {
        return Err(FlashError::Unavailable(format!(
            "the register-level path copies 16-byte rows: head dims {}/{} must be multiples of 8",
            problem.dim_qk, problem.dim_v
        )));
    }
    // Written negated so that a NaN scale is refused too.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let scale_too_small = !(problem.scale() >= MIN_FOLDED_SCALE);
    if problem.options.softcap.is_none() && scale_too_small {
        return Err(FlashError::Unavailable(format!(
            "the register-level forward takes row maxima of unscaled scores and folds the \
             softmax scale into the exponent's multiply-add, which needs a scale of at least \
             {MIN_FOLDED_SCALE:e}; got {}",
            problem.scale()
        )));
    }
    let elem = problem.dtype.size();
    let planes = 4.min(limits.max_units_per_cube / MMA_SYNC_PLANE).max(1);
    let base = RegisterMmaConfig {
        planes,
        m_tiles: 1,
        block_kv: 64,
        dim_qk: problem.dim_qk,
        dim_v: problem.dim_v,
        masked: problem.options.mask.is_masked(),
        softcap: problem.options.softcap.is_some(),
        q_in_registers: true,
        warpgroup: None,
        kv_together: false,
        wide_products: false,
        bias_ahead: false,
        bias_staged: false,
        batch_inner: false,
    };
    // sm_90: warpgroup products, two warpgroups of 64 query rows sharing the key blocks:
    // 64 keys at d = 64, 128 at d = 128. Swept on the H200 (bf16, s = 1k/4k, causal and not,
    // docs/benchmarks.md): 8 planes × 64 keys ran d = 64 at 1.05–1.16× the `mma.sync`
    // forward, 8 × 128 ran d = 128 at 1.02–1.15×; 4 × 64 was slower than `mma.sync` at s = 1k.
    if let Some(dtype) = warpgroup_products(problem, limits)
        && limits.max_units_per_cube >= 8 * MMA_SYNC_PLANE
    {
        let config = RegisterMmaConfig {
            planes: 8,
            block_kv: problem.dim_qk,
            q_in_registers: false,
            warpgroup: Some(dtype),
            kv_together: true,
            wide_products: false,
            bias_ahead: true,
            ..base
        };
        if config.forward_shared_bytes(elem) <= limits.max_shared_memory {
            return Ok(config);
        }
    }
    let candidates = [
        (2, 128, false),
        (2, 64, true),
        (2, 64, false),
        (1, 64, true),
        (1, 64, false),
        (1, 32, false),
        (1, 16, false),
    ];
    candidates
        .into_iter()
        .map(|(m_tiles, block_kv, q_in_registers)| RegisterMmaConfig {
            m_tiles,
            block_kv,
            q_in_registers,
            ..base
        })
        .find(|c| {
            c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET
                && c.forward_shared_bytes(elem) <= limits.max_shared_memory
        })
        .ok_or_else(|| {
            FlashError::InvalidConfig(format!(
                "head dims {}/{} do not fit the register-level path's registers and {} bytes of shared memory",
                problem.dim_qk, problem.dim_v, limits.max_shared_memory
            ))
        })
}

/// The compile-time configuration of the register-level backward kernels.
///
/// Each of the cube's `planes` planes owns 16 rows: keys in the dK/dV kernel, queries in
/// the dQ kernel. Blocks of `block_stream` rows of the other side (queries, keys) are
/// double-buffered in shared memory. Head dims as in [`RegisterMmaConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterBackwardConfig {
    pub planes: usize,
    pub block_stream: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
    pub masked: bool,
    pub softcap: bool,
    /// dK and dV in two launches of the dK/dV kernel ([`KeyGradients`]), for head dims whose
    /// two accumulators do not fit registers together.
    pub split: bool,
    /// The dK/dV kernel also accumulates `dQ`, adding each block pair's `dS·K` to an f32
    /// buffer with atomics: five matrix products per block pair instead of seven (the dQ
    /// kernel recomputes `S` and `dP`), at the price of bitwise determinism.
    pub atomic_dq: bool,
    /// Those atomics add two neighbouring values per instruction
    /// ([`DeviceLimits::paired_f32_atomics`]).
    pub paired_atomics: bool,
    /// The dK/dV and dQ kernels' products on warpgroup instructions ([`crate::wgmma`]) for
    /// inputs of this dtype, their shared tiles swizzled: sm_90, cubes of one or two
    /// warpgroups (4 or 8 planes, each warpgroup owning 64 rows), 64-row streamed blocks,
    /// `d_qk = d_v ∈ {64, 128}`, dQ in its own pass ([`warpgroup_products`]). The default
    /// where it applies (`FLASH_WGMMA=0` turns it off for comparison, see `backward::tuned`).
    pub warpgroup: Option<FloatDtype>,
    /// Read a streamed block's bias into registers before the block's products (when the
    /// problem has a bias), as [`RegisterMmaConfig::bias_ahead`]: the warpgroup kernels.
    pub bias_ahead: bool,
    /// Stage a streamed block's bias in shared memory with it, as
    /// [`RegisterMmaConfig::bias_staged`]. Set by the launcher.
    pub bias_staged: bool,
}

/// How the dK/dV kernel with [`RegisterBackwardConfig::atomic_dq`] shares a query block's
/// `dQ` (`block_stream × d_qk`, summed over the cube's keys) among its planes: plane `p`
/// computes the 16 queries of group `p % groups` and the `width` columns of part
/// `p / groups`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DqSplit {
    pub groups: usize,
    pub width: usize,
}

/// The gradients one launch of the register-level dK/dV kernel accumulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyGradients {
    Both,
    /// dK alone (`Sᵀ`, `dPᵀ`, `dSᵀ`, `dK += dSᵀ·Q`).
    Keys,
    /// dV alone (`Sᵀ`, `Pᵀ`, `dV += Pᵀ·dO`).
    Values,
}

impl RegisterBackwardConfig {
    pub fn block_rows(&self) -> usize {
        self.planes * FRAGMENT
    }
    pub fn units(&self) -> usize {
        self.planes * MMA_SYNC_PLANE
    }
    pub fn dim_qk_padded(&self) -> usize {
        self.dim_qk.next_multiple_of(FRAGMENT)
    }
    pub fn dim_v_padded(&self) -> usize {
        self.dim_v.next_multiple_of(FRAGMENT)
    }
    /// Bytes of shared memory of either kernel with `elem`-byte inputs: the cube's own rows
    /// of two tensors (K and V, or Q and dO), and two stages of the streamed two.
    pub fn shared_bytes(&self, elem: usize) -> usize {
        let (qk, v, _) = self.shared_layouts();
        let rows = self.block_rows() + 2 * self.block_stream;
        let scores = if self.atomic_dq {
            self.block_rows() * RegisterMmaConfig::stride(self.block_stream)
        } else {
            0
        };
        let bias = if self.bias_staged {
            2 * self.block_rows() * self.block_stream
        } else {
            0
        };
        elem * (qk.len(rows) + v.len(rows) + scores + bias)
    }
    /// This configuration staging the bias ([`RegisterBackwardConfig::bias_staged`]), where
    /// it can: the warpgroup kernels, their two stages fitting in shared memory.
    pub fn staging_bias(&self, elem: usize, limits: &DeviceLimits) -> Option<Self> {
        let staged = Self {
            bias_staged: true,
            ..*self
        };
        (self.warpgroup.is_some()
            && self.block_stream.is_multiple_of(64)
            && staged.shared_bytes(elem) <= limits.max_shared_memory)
            .then_some(staged)
    }
    /// How both kernels stage the rows of Q or K and of V or dO in shared memory, and the
    /// tiles' alignment: swizzled for warpgroup products (atoms aligned to 1024 bytes), else
    /// rows padded by 16 bytes.
    pub fn shared_layouts(&self) -> (SharedLayout, SharedLayout, usize) {
        tile_layouts(
            self.dim_qk_padded(),
            self.dim_v_padded(),
            self.warpgroup.is_some(),
        )
    }
    /// The planes' shares of `dQ` under [`Self::atomic_dq`]; `None` where they cannot be
    /// equal (the planes not a multiple of the query groups, or the head dim's 16-column
    /// fragments not a multiple of the parts).
    pub fn dq_split(&self) -> Option<DqSplit> {
        let groups = self.block_stream / FRAGMENT;
        if groups == 0 || !self.planes.is_multiple_of(groups) {
            return None;
        }
        let parts = self.planes / groups;
        let fragments = self.dim_qk_padded() / FRAGMENT;
        fragments.is_multiple_of(parts).then_some(DqSplit {
            groups,
            width: fragments / parts * FRAGMENT,
        })
    }
    /// The launches of the dK/dV kernel.
    pub fn key_gradients(&self) -> &'static [KeyGradients] {
        if self.split {
            &[KeyGradients::Keys, KeyGradients::Values]
        } else {
            &[KeyGradients::Both]
        }
    }
    /// f32 registers of one unit's accumulators in the dK/dV kernel, the largest of the
    /// kernels: dK and/or dV of the plane's 16 keys, and `Sᵀ`, `dPᵀ` of a query block or,
    /// once those are spent, the plane's share of `dQ` (the dQ kernel holds dQ, `S` and
    /// `dP`: never more).
    pub fn accumulator_registers(&self) -> usize {
        let (dk, dv) = (self.dim_qk_padded() / 2, self.dim_v_padded() / 2);
        let scores = self.block_stream / 2;
        if self.atomic_dq {
            let dq = self
                .dq_split()
                .map_or(usize::MAX / 4, |split| split.width / 2);
            dk + dv + (2 * scores).max(dq)
        } else if self.split {
            (dk + 2 * scores).max(dv + scores)
        } else {
            dk + dv + 2 * scores
        }
    }
}

/// Shortest query sequence for which the register-level backward computes dQ by atomics
/// (unless asked to be deterministic). Measured on the H200 (bf16, d = 64 and 128,
/// docs/benchmarks.md): the atomic form's backward ran 1–8% faster at s = 16k, −3…+1% at 4k,
/// and 2–16% slower at 1k, where each cube streams few query blocks.
pub const ATOMIC_DQ_MIN_SEQ_Q: usize = 8192;

/// Picks the register-level backward tiles for `problem`. For query sequences of at least
/// [`ATOMIC_DQ_MIN_SEQ_Q`], unless the options ask for a deterministic backward, first dQ by
/// atomics in the dK/dV kernel: 8 planes (128 keys, as FA2, halving the atomics per key of
/// 64-key cubes) and 64-query blocks, where they fit.
/// Otherwise the dQ pass and 4 planes of 16 rows, with the largest streamed block (64, 32 or
/// 16 rows) whose accumulators fit the register budget and whose stages fit shared memory;
/// dK and dV in one launch where they fit, else in two (then 8 planes and 32-row blocks
/// where they fit).
pub fn choose_register_backward_tiles(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
) -> Result<RegisterBackwardConfig, FlashError> {
    // The forward's conditions: the instructions, and head dims the 16-byte copies read.
    choose_register_mma_tiles(problem, limits)?;
    let planes = 4.min(limits.max_units_per_cube / MMA_SYNC_PLANE).max(1);
    // Split launches hold half the accumulators: 8 planes of 32-row blocks ran 22% faster
    // than 4 of 64 at d256 on the H200 (docs/benchmarks.md).
    let wide = 8.min(limits.max_units_per_cube / MMA_SYNC_PLANE).max(1);
    // sm_90: warpgroup products with dQ in its own pass, at every length (1.4–1.6× the
    // `mma.sync` kernels on the H200, docs/benchmarks.md); deterministic.
    let warpgroup = warpgroup_products(problem, limits);
    // Two warpgroups per cube (128 rows sharing the streamed blocks) ran d = 64 without a
    // mask 3–5% faster, causal 3–4% slower, d = 128 −7…+2% (H200, docs/benchmarks.md).
    let warpgroups = if problem.dim_qk == 64 && !problem.options.mask.is_masked() {
        2
    } else {
        1
    };
    let first = match warpgroup {
        Some(_) => Some((false, false, 4 * warpgroups, 64, warpgroup)),
        None => (!problem.options.deterministic && problem.seq_q >= ATOMIC_DQ_MIN_SEQ_Q)
            .then_some((true, false, wide, 64, None)),
    };
    first
        .into_iter()
        .chain([
            (false, false, planes, 64, None),
            (false, false, planes, 32, None),
            (false, false, planes, 16, None),
            (false, true, wide, 32, None),
            (false, true, planes, 32, None),
            (false, true, planes, 16, None),
        ])
        .map(
            |(atomic_dq, split, planes, block_stream, warpgroup)| RegisterBackwardConfig {
                planes,
                block_stream,
                dim_qk: problem.dim_qk,
                dim_v: problem.dim_v,
                masked: problem.options.mask.is_masked(),
                softcap: problem.options.softcap.is_some(),
                split,
                atomic_dq,
                paired_atomics: limits.paired_f32_atomics,
                warpgroup,
                bias_ahead: warpgroup.is_some(),
                bias_staged: false,
            },
        )
        .find(|c| {
            (!c.atomic_dq || c.dq_split().is_some())
                && c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET
                && c.shared_bytes(problem.dtype.size()) <= limits.max_shared_memory
        })
        .ok_or_else(|| {
            FlashError::InvalidConfig(format!(
                "head dims {}/{}: dK or dV of 16 keys does not fit the register-level backward's \
                 {MMA_SYNC_REGISTER_BUDGET}-register budget and {} bytes of shared memory",
                problem.dim_qk, problem.dim_v, limits.max_shared_memory
            ))
        })
}

/// The input dtype of the register-level kernels' warpgroup products
/// ([`RegisterMmaConfig::warpgroup`], [`RegisterBackwardConfig::warpgroup`]), or `None`
/// where they do not apply: a device
/// without them (anything but sm_90), cubes of fewer than 4 planes, head dims other than
/// `d_qk = d_v ∈ {64, 128}` (each product is 64 columns wide).
pub fn warpgroup_products(problem: &AttentionProblem, limits: &DeviceLimits) -> Option<FloatDtype> {
    (limits.warpgroup_mma
        && limits.has_register_mma(problem.dtype)
        && limits.max_units_per_cube >= 4 * MMA_SYNC_PLANE
        && problem.dim_qk == problem.dim_v
        && matches!(problem.dim_qk, 64 | 128))
    .then_some(problem.dtype)
}

/// Applies the tuning override in environment variable `var` (comma-separated numbers) to
/// `config`: `apply` sets the tiles and returns false for numbers it does not take
/// (`expected` describes them). Overridden tiles must fit the device's shared memory
/// (`shared_bytes`); either failure is an error naming the variable.
pub(crate) fn apply_tile_override<C>(
    var: &str,
    expected: &str,
    mut config: C,
    apply: impl FnOnce(&mut C, &[usize]) -> bool,
    shared_bytes: impl Fn(&C) -> usize,
    limits: &DeviceLimits,
) -> Result<C, FlashError> {
    let Ok(tiles) = std::env::var(var) else {
        return Ok(config);
    };
    let parts: Vec<usize> = tiles
        .split(',')
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    if !apply(&mut config, &parts) {
        return Err(FlashError::InvalidConfig(format!(
            "{var}={tiles}: expected {expected}"
        )));
    }
    let bytes = shared_bytes(&config);
    if bytes > limits.max_shared_memory {
        return Err(FlashError::InvalidConfig(format!(
            "{var}={tiles} needs {bytes} bytes of shared memory; the device offers {}",
            limits.max_shared_memory
        )));
    }
    Ok(config)
}

/// Resolves `Auto` to the fastest path the device has for `dtype`; a requested path the
/// device lacks is an error.
pub fn choose_path(
    requested: KernelPath,
    dtype: FloatDtype,
    limits: &DeviceLimits,
) -> Result<KernelPath, FlashError> {
    match requested {
        KernelPath::Auto if limits.has_register_mma(dtype) => Ok(KernelPath::RegisterMma),
        KernelPath::Auto if limits.has_tensor_cores(dtype) => Ok(KernelPath::TensorCore),
        KernelPath::Auto | KernelPath::Portable => Ok(KernelPath::Portable),
        KernelPath::TensorCore if limits.has_tensor_cores(dtype) => Ok(KernelPath::TensorCore),
        KernelPath::TensorCore => Err(FlashError::Unavailable(format!(
            "the tensor-core path needs 16×16×16 {dtype:?} cmma fragments with f32 accumulation \
             and plane operations; this device has {}",
            if limits.plane_ops {
                "no such fragments"
            } else {
                "no plane operations"
            }
        ))),
        KernelPath::RegisterMma if limits.has_register_mma(dtype) => Ok(KernelPath::RegisterMma),
        KernelPath::RegisterMma => Err(FlashError::Unavailable(format!(
            "the register-level path needs m16n8k16 {dtype:?} mma with f32 accumulation, \
             ldmatrix, asynchronous copies and planes of {MMA_SYNC_PLANE} units (CUDA sm_80 or later)"
        ))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::problem::tests::problem;

    /// An H100's limits (sm_90).
    pub(crate) const NVIDIA: DeviceLimits = DeviceLimits {
        max_shared_memory: 232_448,
        max_units_per_cube: 1024,
        plane_size: 32,
        plane_ops: true,
        cmma_f16: true,
        cmma_bf16: true,
        mma_sync_f16: true,
        mma_sync_bf16: true,
        paired_f32_atomics: true,
        warpgroup_mma: true,
        loop_iterations: None,
        multiprocessors: 132,
    };
    /// As [`NVIDIA`] (sm_90), without the warpgroup products (sm_80).
    const SM80: DeviceLimits = DeviceLimits {
        warpgroup_mma: false,
        ..NVIDIA
    };
    const AMD: DeviceLimits = DeviceLimits {
        max_shared_memory: 65_536,
        max_units_per_cube: 1024,
        plane_size: 64,
        plane_ops: true,
        cmma_f16: true,
        cmma_bf16: true,
        mma_sync_f16: false,
        mma_sync_bf16: false,
        paired_f32_atomics: false,
        warpgroup_mma: false,
        loop_iterations: None,
        multiprocessors: 132,
    };
    const WEBGPU: DeviceLimits = DeviceLimits {
        max_shared_memory: 16_384,
        max_units_per_cube: 256,
        plane_size: 1,
        plane_ops: false,
        cmma_f16: false,
        cmma_bf16: false,
        mma_sync_f16: false,
        mma_sync_bf16: false,
        paired_f32_atomics: false,
        warpgroup_mma: false,
        loop_iterations: None,
        multiprocessors: 132,
    };

    #[test]
    fn tiles_fit_shared_memory_on_every_device() {
        for limits in [NVIDIA, AMD, WEBGPU] {
            for d in [40, 64, 96, 111, 128, 256] {
                let p = problem(d, d);
                let row_bytes = 4 * (p.dim_qk + p.dim_v);
                let t = choose_portable_tiles(&p, &limits, row_bytes).unwrap();
                assert!(t.block_stream.is_power_of_two());
                assert!(
                    t.block_stream * row_bytes <= limits.max_shared_memory,
                    "{limits:?} d={d}"
                );
                assert!(t.block_rows <= limits.max_units_per_cube);
                let unrolled_up_to = if limits.plane_ops { 128 } else { 64 };
                assert_eq!(t.unrolled(), d <= unrolled_up_to, "{limits:?} d={d}");
                if !t.unrolled() {
                    assert_eq!(t.columns, if limits.plane_ops { 1 } else { 16 });
                }
            }
        }
    }

    #[test]
    fn mma_tiles_fit_shared_memory_on_every_device() {
        type SharedBytes = fn(&MmaConfig, usize) -> usize;
        let kernels: [(&str, SharedBytes); 3] = [
            ("forward", crate::forward::cmma_shared_bytes),
            ("dK/dV", crate::backward::dkdv_cmma_shared_bytes),
            ("dQ", crate::backward::dq_cmma_shared_bytes),
        ];
        for limits in [NVIDIA, AMD] {
            for d in [40, 64, 96, 111, 128, 256] {
                for dtype in [FloatDtype::F16, FloatDtype::BF16] {
                    let mut p = problem(d, d);
                    p.dtype = dtype;
                    for (name, bytes) in kernels {
                        let c = choose_mma_tiles(&p, &limits, bytes).unwrap();
                        assert!(
                            bytes(&c, 2) <= limits.max_shared_memory,
                            "{name} {limits:?} d={d}"
                        );
                        assert!(c.units() <= limits.max_units_per_cube);
                        assert_eq!(c.plane_size, limits.plane_size);
                        assert_eq!(c.block_stream % FRAGMENT, 0);
                        assert_eq!(c.dim_qk_padded() % FRAGMENT, 0);
                        assert!(c.dim_qk_padded() >= d && c.dim_qk_padded() < d + FRAGMENT);
                        assert_eq!(c.units_per_row(), limits.plane_size / FRAGMENT);
                    }
                }
            }
        }
    }

    #[test]
    fn the_path_follows_the_device() {
        use KernelPath::*;
        assert_eq!(
            choose_path(Auto, FloatDtype::BF16, &NVIDIA),
            Ok(RegisterMma)
        );
        assert_eq!(
            choose_path(TensorCore, FloatDtype::BF16, &NVIDIA),
            Ok(TensorCore)
        );
        assert!(matches!(
            choose_path(RegisterMma, FloatDtype::F16, &AMD),
            Err(FlashError::Unavailable(_))
        ));
        assert_eq!(choose_path(Auto, FloatDtype::F16, &AMD), Ok(TensorCore));
        assert_eq!(choose_path(Auto, FloatDtype::F32, &NVIDIA), Ok(Portable));
        assert_eq!(choose_path(Auto, FloatDtype::BF16, &WEBGPU), Ok(Portable));
        assert_eq!(
            choose_path(Portable, FloatDtype::BF16, &NVIDIA),
            Ok(Portable)
        );
        assert!(matches!(
            choose_path(TensorCore, FloatDtype::F32, &NVIDIA),
            Err(FlashError::Unavailable(_))
        ));
        assert!(matches!(
            choose_path(TensorCore, FloatDtype::BF16, &WEBGPU),
            Err(FlashError::Unavailable(_))
        ));
        let p = problem(64, 64);
        assert!(matches!(
            choose_mma_tiles(&p, &WEBGPU, crate::forward::cmma_shared_bytes),
            Err(FlashError::Unavailable(_))
        ));
    }

    #[test]
    fn register_mma_tiles_fit_registers_and_shared_memory() {
        for d in [40, 64, 96, 128, 256] {
            for dtype in [FloatDtype::F16, FloatDtype::BF16] {
                let mut p = problem(d, d);
                p.dtype = dtype;
                let c = choose_register_mma_tiles(&p, &NVIDIA).unwrap();
                assert!(
                    c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET,
                    "d={d}"
                );
                assert!(
                    c.forward_shared_bytes(2) <= NVIDIA.max_shared_memory,
                    "d={d}"
                );
                let planes = if c.warpgroup.is_some() { 8 } else { 4 };
                assert_eq!(c.units(), planes * MMA_SYNC_PLANE);
                assert_eq!(c.block_kv % FRAGMENT, 0);
                assert_eq!(c.dim_v_padded() % FRAGMENT, 0);
            }
        }
        // On sm_90, warpgroup products where they apply: two warpgroups of 64 query rows,
        // as many keys per block as the head dim.
        for (d, applies) in [
            (40, false),
            (64, true),
            (96, false),
            (128, true),
            (256, false),
        ] {
            let c = choose_register_mma_tiles(&problem(d, d), &NVIDIA).unwrap();
            assert_eq!(c.warpgroup, applies.then_some(FloatDtype::F16), "d={d}");
            if applies {
                assert_eq!((c.planes, c.m_tiles, c.block_kv), (8, 1, d));
                assert!(!c.q_in_registers);
            }
            let c = choose_register_mma_tiles(&problem(d, d), &SM80).unwrap();
            assert_eq!(c.warpgroup, None);
        }
        // Without them, two query tiles per plane where they fit; one for the largest head
        // dims. 128-key blocks up to d = 64, 64-key blocks above.
        let c = choose_register_mma_tiles(&problem(64, 64), &SM80).unwrap();
        assert_eq!((c.m_tiles, c.block_kv, c.q_in_registers), (2, 128, false));
        let c = choose_register_mma_tiles(&problem(128, 128), &SM80).unwrap();
        assert_eq!((c.m_tiles, c.block_kv), (2, 64));
        assert_eq!(
            choose_register_mma_tiles(&problem(256, 256), &NVIDIA)
                .unwrap()
                .m_tiles,
            1
        );
        // Head dims the 16-byte copies cannot read, and devices without the instructions.
        assert!(matches!(
            choose_register_mma_tiles(&problem(111, 111), &NVIDIA),
            Err(FlashError::Unavailable(_))
        ));
        // Scales the folded exponent cannot take, unless a softcap bounds the scores first.
        for scale in [-0.125, 0.0, 1e-30] {
            let mut p = problem(64, 64);
            p.options.scale = Some(scale);
            assert!(
                matches!(
                    choose_register_mma_tiles(&p, &NVIDIA),
                    Err(FlashError::Unavailable(_))
                ),
                "scale {scale}"
            );
            p.options.softcap = Some(30.0);
            assert!(
                choose_register_mma_tiles(&p, &NVIDIA).is_ok(),
                "scale {scale}"
            );
        }
        assert!(matches!(
            choose_register_mma_tiles(&problem(64, 64), &AMD),
            Err(FlashError::Unavailable(_))
        ));
    }

    #[test]
    fn register_backward_tiles_fit_registers_and_shared_memory() {
        for d in [40, 64, 96, 128] {
            let mut p = problem(d, d);
            p.options.deterministic = true;
            let c = choose_register_backward_tiles(&p, &NVIDIA).unwrap();
            assert!(
                c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET,
                "d={d}"
            );
            assert!(c.shared_bytes(2) <= NVIDIA.max_shared_memory, "d={d}");
            assert_eq!(
                (c.block_stream, c.split, c.atomic_dq),
                (64, false, false),
                "d={d}"
            );
            let planes = if c.warpgroup.is_some() && d == 64 {
                8
            } else {
                4
            };
            assert_eq!(c.block_rows(), planes * FRAGMENT, "d={d}");
        }
        // Without warpgroup products (sm_80), long query sequences take dQ by atomics, with
        // 128-key cubes, where the planes share it evenly; short ones the dQ pass.
        let sm80 = SM80;
        let long = |d: usize| {
            let mut p = problem(d, d);
            p.seq_q = ATOMIC_DQ_MIN_SEQ_Q;
            p
        };
        for d in [64, 96, 128] {
            assert!(
                !choose_register_backward_tiles(&problem(d, d), &sm80)
                    .unwrap()
                    .atomic_dq
            );
            let c = choose_register_backward_tiles(&long(d), &sm80).unwrap();
            assert!(c.atomic_dq && c.paired_atomics && !c.split, "d={d}");
            assert_eq!((c.planes, c.block_stream), (8, 64), "d={d}");
            assert!(c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET);
            assert!(c.shared_bytes(2) <= NVIDIA.max_shared_memory, "d={d}");
            let split = c.dq_split().unwrap();
            let parts = c.planes / split.groups;
            assert_eq!(split.groups * FRAGMENT, c.block_stream);
            assert_eq!(parts * split.width, c.dim_qk_padded(), "d={d}");
        }
        // On sm_90, warpgroup products with dQ in its own pass, at every length, where the
        // head dims are 64 or 128; nowhere else.
        for (d, applies) in [(40, false), (64, true), (96, false), (128, true)] {
            for p in [problem(d, d), long(d)] {
                let c = choose_register_backward_tiles(&p, &NVIDIA).unwrap();
                assert_eq!(c.warpgroup, applies.then_some(FloatDtype::F16), "d={d}");
                if applies {
                    assert!(!c.atomic_dq && !c.split, "d={d}");
                    let planes = if d == 64 { 8 } else { 4 };
                    assert_eq!((c.planes, c.block_stream), (planes, 64));
                    assert!(c.shared_bytes(2) <= NVIDIA.max_shared_memory, "d={d}");
                }
                let c = choose_register_backward_tiles(&p, &sm80).unwrap();
                assert_eq!(c.warpgroup, None, "d={d}");
            }
        }
        assert_eq!(warpgroup_products(&problem(128, 64), &NVIDIA), None);
        // d40 pads to three 16-column fragments: two parts cannot share them.
        let c = choose_register_backward_tiles(&long(40), &NVIDIA).unwrap();
        assert!(!c.atomic_dq && c.planes == 4);
        // 16 keys of dK and dV in d256 take 256 registers: two launches.
        let c = choose_register_backward_tiles(&problem(256, 256), &NVIDIA).unwrap();
        assert!(c.split && c.accumulator_registers() <= MMA_SYNC_REGISTER_BUDGET);
        assert_eq!((c.planes, c.block_stream), (8, 32));
        assert!(c.shared_bytes(2) <= NVIDIA.max_shared_memory);
        assert_eq!(c.key_gradients().len(), 2);
        let c = choose_register_backward_tiles(&problem(192, 128), &NVIDIA).unwrap();
        assert!(!c.split && c.block_stream == 32);
        assert_eq!(c.key_gradients(), &[KeyGradients::Both]);
        // Nothing fits a device with too little shared memory for the rows of d256.
        let small = DeviceLimits {
            max_shared_memory: 48 * 1024,
            ..NVIDIA
        };
        assert!(matches!(
            choose_register_backward_tiles(&problem(256, 256), &small),
            Err(FlashError::InvalidConfig(_))
        ));
        assert!(matches!(
            choose_register_backward_tiles(&problem(111, 111), &NVIDIA),
            Err(FlashError::Unavailable(_))
        ));
        assert!(matches!(
            choose_register_backward_tiles(&problem(64, 64), &AMD),
            Err(FlashError::Unavailable(_))
        ));
    }

    #[test]
    fn too_little_shared_memory_is_an_error() {
        let tiny = DeviceLimits {
            max_shared_memory: 1000,
            ..WEBGPU
        };
        let p = problem(256, 256);
        assert!(matches!(
            choose_portable_tiles(&p, &tiny, 4 * 512),
            Err(FlashError::InvalidConfig(_))
        ));
    }
}
