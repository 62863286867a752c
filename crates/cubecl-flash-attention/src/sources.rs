//! The source of every shipped kernel variant, generated for a target GPU without a device.
//!
//! Each kernel is expanded against device properties built the way the CUDA and HIP
//! runtimes build them for that GPU (plane size, shared memory, tensor-core fragments), its
//! tiles chosen by the same heuristics the launchers use, and translated to CUDA or HIP C++
//! by the same code generator the runtime hands to NVRTC or hipRTC. `tools/compile_check.py`
//! then compiles the sources offline (see docs/amd.md).

use std::sync::Arc;

use cubecl::Compiler;
use cubecl::ir::features::Plane;
use cubecl::ir::{DeviceIdentity, ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties};
use cubecl::ir::{OpaqueType, VectorSize};
use cubecl::prelude::*;
use cubecl::profile::TimingMethod;
use cubecl::std::FastDivmod;
use cubecl_cpp::register_supported_types;
use cubecl_cpp::shared::{
    CompilationOptions, CppSupportedFeatures, register_mma_features, register_wmma_features,
};

use crate::backward::{
    DELTA_LANES, dkdv_mma_config, dkdv_portable_config, dq_mma_config, dq_portable_config,
    flash_backward_delta, flash_backward_dkdv, flash_backward_dkdv_cmma, flash_backward_dkdv_mma,
    flash_backward_dq, flash_backward_dq_cmma, flash_backward_dq_from_sum, flash_backward_dq_mma,
    register_backward_config,
};
use crate::bias::{ScoreTerms, sum_bias_grad};
use crate::block_mask::{BLOCK_GRANULE, BlockShape, ViewLayoutCompilationArg};
use crate::config::{ATOMIC_DQ_MIN_SEQ_Q, DeviceLimits, KeyGradients, RegisterMmaConfig};
use crate::decode::{
    append::append_to_cache,
    decode_config,
    kernel::{DecodeConfig, flash_decode},
    lanes::{LanesConfig, flash_decode_lanes},
    lanes_config,
    merge::{merge_by_lse, merge_units},
    mma::{MmaDecodeConfig, flash_decode_mma},
    mma_decode_config,
};
use crate::dropout::DropoutArgsCompilationArg;
use crate::forward::{
    flash_forward, flash_forward_cmma, flash_forward_mma, mma_config, portable_config,
    register_mma_config,
};
use crate::mask::MaskSpec;
use crate::problem::{AttentionOptions, AttentionProblem, FloatDtype};
use crate::rotary::RotaryConfig;
use crate::score_mod::{ScoreFn, ScoreMod, ScorePosition, add_grad, cell_type};
use crate::tile::RowLayoutCompilationArg;

/// How the decode kernels divide positions by the page size: by multiplication where the
/// device has 64-bit integers (every target here).
const PAGE_SIZE: <FastDivmod<u32> as LaunchArg>::CompilationArg =
    <FastDivmod<u32> as LaunchArg>::CompilationArg::Fast;

/// A GPU the kernels are generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// NVIDIA A100 (Ampere).
    Sm80,
    /// NVIDIA H100/H200 (Hopper).
    Sm90,
    /// AMD MI200 (CDNA2).
    Gfx90a,
    /// AMD MI300 (CDNA3).
    Gfx942,
}

/// The language a target's sources are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Language {
    Cuda,
    Hip,
}

impl Target {
    pub const ALL: [Target; 4] = [Target::Sm80, Target::Sm90, Target::Gfx90a, Target::Gfx942];

    pub fn name(self) -> &'static str {
        match self {
            Target::Sm80 => "sm_80",
            Target::Sm90 => "sm_90",
            Target::Gfx90a => "gfx90a",
            Target::Gfx942 => "gfx942",
        }
    }

    pub fn language(self) -> Language {
        match self {
            Target::Sm80 | Target::Sm90 => Language::Cuda,
            Target::Gfx90a | Target::Gfx942 => Language::Hip,
        }
    }

    /// Plane size, shared memory per cube (opt-in maximum) and multiprocessors.
    fn hardware(self) -> (u32, usize, u32) {
        match self {
            Target::Sm80 => (32, 166_912, 108),
            Target::Sm90 => (32, 232_448, 132),
            Target::Gfx90a => (64, 65_536, 110),
            Target::Gfx942 => (64, 65_536, 304),
        }
    }

    /// Device properties as the runtime would report them for this GPU.
    pub fn properties(self) -> DeviceProperties {
        let (plane, shared, sms) = self.hardware();
        let hardware = HardwareProperties {
            load_width: 128,
            vector_register_count: None,
            plane_size_min: plane,
            plane_size_max: plane,
            max_bindings: 1024,
            max_shared_memory_size: shared,
            max_cube_count: (2_147_483_647, 65_535, 65_535),
            max_units_per_cube: 1024,
            max_cube_dim: (1024, 1024, 64),
            num_streaming_multiprocessors: Some(sms),
            num_tensor_cores: None,
            min_tensor_cores_dim: Some(16),
            num_cpu_cores: None,
            last_level_cache_size: None,
            max_vector_size: VectorSize::MAX,
            cube_mma_reserved_shared_memory: 0,
        };
        let memory = 64u64 << 30;
        let mut props = DeviceProperties::new(
            Default::default(),
            MemoryDeviceProperties::new(memory / 4, 512).with_max_memory(memory),
            hardware,
            TimingMethod::Device,
            DeviceIdentity {
                name: format!("{} (offline model)", self.name()),
                fingerprint: self.name().into(),
                physical: None,
            },
        );
        register_supported_types(&mut props);
        props.features.plane.insert(Plane::Ops);
        props.features.plane.insert(Plane::NonUniformControlFlow);
        props.features.memory_reinterpret = true;
        props.features.alignment = true;
        props.features.device_memory_scope = true;
        match self.language() {
            Language::Cuda => cuda::register(self, &mut props),
            Language::Hip => hip::register(self, &mut props),
        }
        props
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::CudaRuntime;
    use cubecl::cuda::compiler::{CudaBackend, CudaCompilationOptions, CudaCompiler};
    use cubecl::ir::nvidia::SmArch;
    use cubecl_cpp::cuda::{self as cpp_cuda, arch::CudaArchitecture, mma::CudaCmmaCompiler};

    fn version(target: Target) -> u32 {
        match target {
            Target::Sm80 => 80,
            _ => 90,
        }
    }

    pub(super) fn register(target: Target, props: &mut DeviceProperties) {
        let arch = CudaArchitecture {
            version: version(target),
            tensor_cores: true,
        };
        props.features.plane.insert(Plane::Sync);
        props.register_opaque_type(OpaqueType::Barrier);
        for t in [FloatKind::F16, FloatKind::BF16] {
            props.features.matmul.ldmatrix.insert(ElemType::Float(t));
            props.features.matmul.stmatrix.insert(ElemType::Float(t));
        }
        props.features.copy_async = true;
        if version(target) >= 90 {
            // The tensor memory accelerator, as the runtime registers it on sm_90 and later:
            // the mark of the warpgroup products (`DeviceLimits::warpgroup_mma`).
            props.features.tma.insert(cubecl::ir::features::Tma::Base);
            // Paired f32 atomic additions (`red.global.add.v2.f32`), as the runtime registers
            // them on sm_90 with CUDA ≥ 12.8.
            props.register_atomic_type_usage(
                Type::atomic(Type::new(ElemType::Float(FloatKind::F32)).with_vector_size(2)),
                cubecl::ir::features::AtomicUsage::Add,
            );
        }
        register_wmma_features(
            CudaCmmaCompiler::Cpp.supported_cmma_combinations(&arch),
            props,
        );
        register_mma_features(cpp_cuda::supported_mma_combinations(&arch), props);
    }

    pub(super) fn target_properties() -> Arc<TargetProperties> {
        Arc::new(<CudaRuntime as cubecl::__private::Runtime>::target_properties())
    }

    pub(super) fn compile(target: Target, kernel: &dyn CubeKernel) -> Result<String, String> {
        let options = CudaCompilationOptions {
            cpp: CompilationOptions {
                warp_size: 32,
                supports_features: CppSupportedFeatures {
                    grid_constants: true,
                    clusters: version(target) >= 90,
                    fast_math: true,
                    fast_tanh: true,
                    elect_sync: version(target) >= 90,
                    dp4a: true,
                },
                ..Default::default()
            },
            arch: Some(SmArch::new(version(target), version(target) >= 90)),
            ptx_version: None,
        };
        let definition = cubecl::define_kernel(kernel).map_err(|e| format!("{e:?}"))?;
        CudaCompiler::new(CudaBackend::Cpp)
            .compile(definition, &options)
            .map(|repr| repr.to_string())
            .map_err(|e| format!("{e:?}"))
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;
    pub(super) fn register(_: Target, _: &mut DeviceProperties) {}
    pub(super) fn target_properties() -> Arc<TargetProperties> {
        unreachable!("CUDA targets need the `cuda` feature")
    }
    pub(super) fn compile(_: Target, _: &dyn CubeKernel) -> Result<String, String> {
        Err("built without the `cuda` feature".into())
    }
}

#[cfg(feature = "rocm")]
mod hip {
    use super::*;
    use cubecl::hip::HipRuntime;
    use cubecl::hip::compiler::{HipBackend, HipCompilationOptions, HipCompiler};
    use cubecl::ir::amd::GfxArch;
    use cubecl_cpp::hip::mma::HipCmmaCompiler;
    use cubecl_cpp::shared::Architecture;

    fn gfx(target: Target) -> GfxArch {
        GfxArch::parse(target.name())
    }

    pub(super) fn register(target: Target, props: &mut DeviceProperties) {
        let arch = gfx(target).family();
        register_wmma_features(
            HipCmmaCompiler::RocWmma.supported_cmma_combinations(&arch),
            props,
        );
        register_mma_features(cubecl_cpp::hip::supported_mma_combinations(&arch), props);
    }

    pub(super) fn target_properties() -> Arc<TargetProperties> {
        Arc::new(<HipRuntime as cubecl::__private::Runtime>::target_properties())
    }

    pub(super) fn compile(target: Target, kernel: &dyn CubeKernel) -> Result<String, String> {
        let gfx = gfx(target);
        let options = HipCompilationOptions {
            cpp: CompilationOptions {
                warp_size: gfx.family().warp_size() as usize,
                supports_features: CppSupportedFeatures {
                    fast_math: true,
                    ..Default::default()
                },
                amd_wmma: gfx.wmma(),
            },
            arch: Some(gfx),
        };
        let definition = cubecl::define_kernel(kernel).map_err(|e| format!("{e:?}"))?;
        HipCompiler::new(HipBackend::Cpp)
            .compile(definition, &options)
            .map(|repr| repr.to_string())
            .map_err(|e| format!("{e:?}"))
    }
}

#[cfg(not(feature = "rocm"))]
mod hip {
    use super::*;
    pub(super) fn register(_: Target, _: &mut DeviceProperties) {}
    pub(super) fn target_properties() -> Arc<TargetProperties> {
        unreachable!("AMD targets need the `rocm` feature")
    }
    pub(super) fn compile(_: Target, _: &dyn CubeKernel) -> Result<String, String> {
        Err("built without the `rocm` feature".into())
    }
}

/// Whether this build can generate sources for `target`.
pub fn is_supported(target: Target) -> bool {
    match target.language() {
        Language::Cuda => cfg!(feature = "cuda"),
        Language::Hip => cfg!(feature = "rocm"),
    }
}

/// The generated source of one kernel variant.
#[derive(Clone, Debug)]
pub struct KernelSource {
    /// `<kernel>_<dtype>_d<qk>x<v>_<options>`, unique per target.
    pub name: String,
    /// CUDA or HIP C++.
    pub source: String,
}

/// The problems whose kernels differ in code, as a covering set rather than every
/// combination: each dtype, each head-dim class (multiples of 16 at 64 and 128, one padded,
/// the largest, `d_v ≠ d_qk`) and both forms (plain, and with every option compiled in:
/// causal window and softcap) appear. The kernels' code depends on these axes separately:
/// the dtype changes the element type (and, for f16, the products' instructions), the head
/// dim the tiles and row walks, the options the masked steps (the plain form's code is the
/// masked form's with the masks compiled out). The tensor-core kernels' f16 form is checked
/// plain at d = 64, their bf16 forms with every option at every head dim.
pub fn shipped_problems() -> Vec<AttentionProblem> {
    let plain = AttentionOptions::default();
    let everything = AttentionOptions {
        scale: None,
        mask: MaskSpec {
            causal: true,
            window_left: Some(64),
            window_right: None,
        },
        softcap: Some(30.0),
        deterministic: false,
        dropout: None,
    };
    let forms = [
        (FloatDtype::F32, (64, 64), plain),
        (FloatDtype::F32, (128, 128), everything),
        (FloatDtype::F16, (64, 64), plain),
        (FloatDtype::BF16, (128, 128), everything),
        (FloatDtype::BF16, (40, 40), everything),
        (FloatDtype::BF16, (256, 256), everything),
        (FloatDtype::BF16, (128, 64), everything),
    ];
    forms
        .into_iter()
        .map(|(dtype, (dim_qk, dim_v), options)| {
            AttentionProblem::new(
                &[1, 2, 128, dim_qk],
                &[1, 1, 128, dim_qk],
                &[1, 1, 128, dim_v],
                dtype,
                options,
            )
            .expect("a valid problem")
        })
        .collect()
}

/// Generates the source of every kernel the launchers would run for the shipped problems on
/// `target`: portable kernels everywhere, tensor-core kernels for the dtypes the target has
/// fragments for. Errors name the variant.
pub fn generate(target: Target) -> Vec<Result<KernelSource, String>> {
    let props = Arc::new(target.properties());
    let limits = DeviceLimits::from_properties(&props);
    let mut out: Vec<Result<KernelSource, String>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // Packed batches change only how a cube finds its sequence (and the registers that
    // takes): their forms are checked for one dtype and head dim, with every option.
    // The score terms (bias, ALiBi, the bias's gradient, summed), dropout and a block mask
    // add the same code to every dtype and head dim: checked on those of the packed forms,
    // with every option.
    let none = ScoreTerms::default();
    let every_term = ScoreTerms {
        bias: true,
        alibi: true,
        bias_grad: true,
        bias_grad_sums: true,
        dropout: true,
        block_mask: Some(BlockShape {
            block_q: BLOCK_GRANULE,
            block_kv: BLOCK_GRANULE,
        }),
        score_mod: Some(ScoreFn::of::<CheckedScoreMod>()),
        score_params_grad: true,
    };
    let variants = shipped_problems().into_iter().flat_map(|problem| {
        let one_form =
            problem.dtype == FloatDtype::BF16 && (problem.dim_qk, problem.dim_v) == (128, 128);
        [
            Some((problem, false, none)),
            one_form.then_some((problem, true, none)),
            one_form.then_some((problem, false, every_term)),
        ]
    });
    for (problem, packed, terms) in variants.flatten() {
        for (name, kernel) in kernels(&problem, &limits, target, props.clone(), packed, terms) {
            let packed_suffix = if packed { "_packed" } else { "" };
            let terms_suffix = if terms.any() { "_terms" } else { "" };
            let name = format!(
                "{name}{packed_suffix}{terms_suffix}_{}",
                variant_suffix(&problem)
            );
            if !seen.insert(name.clone()) {
                continue;
            }
            let compiled = match kernel {
                Ok(kernel) => match target.language() {
                    Language::Cuda => cuda::compile(target, &*kernel),
                    Language::Hip => hip::compile(target, &*kernel),
                },
                Err(e) => Err(e),
            };
            out.push(
                compiled
                    .map(|source| KernelSource {
                        name: name.clone(),
                        source,
                    })
                    .map_err(|e| format!("{name} for {}: {e}", target.name())),
            );
        }
    }
    out
}

fn variant_suffix(p: &AttentionProblem) -> String {
    let options = if p.options.mask.is_masked() || p.options.softcap.is_some() {
        "masked_softcap"
    } else {
        "plain"
    };
    format!(
        "{}_d{}x{}_{options}",
        format!("{:?}", p.dtype).to_lowercase(),
        p.dim_qk,
        p.dim_v
    )
}

type KernelResult = Result<Box<dyn CubeKernel>, String>;

/// The compile-time part of a [`crate::tile::RowLayout`] argument (all of it is runtime).
fn row_layout() -> RowLayoutCompilationArg {
    RowLayoutCompilationArg {
        batch_stride: (),
        head_stride: (),
        row_stride: (),
        seq: (),
    }
}

/// The compile-time part of a [`crate::dropout::DropoutArgs`] argument (all of it is runtime).
fn dropout_args() -> DropoutArgsCompilationArg {
    DropoutArgsCompilationArg {
        seed_lo: (),
        seed_hi: (),
        offset: (),
        threshold: (),
        kept_scale: (),
    }
}

/// The compile-time part of a [`crate::block_mask::ViewLayout`] argument (none).
fn view_layout() -> ViewLayoutCompilationArg {
    ViewLayoutCompilationArg {
        lists: (),
        tiles: (),
        bits: (),
        batch: (),
        heads: (),
        rows: (),
        cols: (),
    }
}

fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// The rotary embedding the decode kernels are checked with: none for a contiguous cache,
/// half-split over half the head dim for a paged one (the rotation is the same code for
/// both caches).
fn rotary_variant(paged: bool) -> RotaryConfig {
    match paged {
        false => RotaryConfig::NONE,
        true => RotaryConfig {
            dim: 32,
            interleaved: false,
        },
    }
}

fn settings(units: usize) -> KernelSettings {
    KernelSettings::new(
        CubeDim::new_1d(units as u32).into(),
        ExecutionMode::Unchecked,
        AddressType::U32,
    )
}

/// A score function that uses every hook, for the checks: a bias per query head and
/// clipped distance (`params` `[heads, 65]`), a tanh cap, and keys more than 512 positions
/// ahead of the query hidden.
struct CheckedScoreMod;

#[cube]
impl ScoreMod for CheckedScoreMod {
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
        (score + params[checked_cell(at, params)]).tanh() * 30.0
    }
    fn score_grad(_score: f32, modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
        let t = modded / 30.0;
        1.0 - t * t
    }
    fn params_grad(
        grad: f32,
        score: f32,
        modded: f32,
        at: &ScorePosition,
        params: &Tensor<f32>,
        grads: &mut [Atomic<f32>],
    ) {
        let dx = grad * CheckedScoreMod::score_grad(score, modded, at, params);
        add_grad(grads, checked_cell(at, params), dx);
    }
    fn visible(at: &ScorePosition, _params: &Tensor<f32>) -> bool {
        at.key <= at.query + 512
    }
}

#[cube]
fn checked_cell(at: &ScorePosition, params: &Tensor<f32>) -> usize {
    let distance = clamp(i32::cast_from(at.key) - i32::cast_from(at.query), -32, 32);
    at.head * params.stride(0) + usize::cast_from(distance + 32)
}

/// Every kernel the launchers run for `problem` on a device with `limits`, by name; with
/// `packed`, the training kernels' forms for packed variable-length batches.
fn kernels(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    target: Target,
    props: Arc<DeviceProperties>,
    packed: bool,
    terms: ScoreTerms,
) -> Vec<(&'static str, KernelResult)> {
    let tprops = match target.language() {
        Language::Cuda => cuda::target_properties(),
        Language::Hip => hip::target_properties(),
    };
    let elem = problem.dtype.elem_type();
    let err = |e: crate::FlashError| e.to_string();
    let mut kernels: Vec<(&'static str, KernelResult)> = Vec::new();

    kernels.push((
        "forward",
        portable_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_forward::FlashForward::new(
                settings(c.block_rows),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                c,
                packed,
                terms,
                elem,
            )) as Box<dyn CubeKernel>
        }),
    ));
    // Serving: the decode kernel (one new token, GQA rows packed) contiguous and unsplit,
    // paged and split, at d = 64 and 128; the append and the merge once per dtype.
    if !packed && !terms.any() && matches!((problem.dim_qk, problem.dim_v), (64, 64) | (128, 128)) {
        let decode_problem = AttentionProblem {
            seq_q: 1,
            ..*problem
        };
        // The score terms (bias, ALiBi, a score function) in the paged, split form of a
        // problem with every option.
        let decode_terms = |paged: bool| match paged && problem.options.mask.is_masked() {
            true => ScoreTerms {
                bias: true,
                alibi: true,
                score_mod: Some(ScoreFn::of::<CheckedScoreMod>()),
                ..ScoreTerms::default()
            },
            false => ScoreTerms::default(),
        };
        for (name, paged, split) in [("decode", false, false), ("decode_paged_split", true, true)] {
            kernels.push((
                name,
                decode_config(&decode_problem, limits, paged, split)
                    .map_err(err)
                    .map(|c| DecodeConfig {
                        terms: decode_terms(paged),
                        ..c
                    })
                    .map(|c| {
                        Box::new(flash_decode::FlashDecode::new(
                            settings(c.units),
                            props.clone(),
                            tprops.clone(),
                            tensor(),
                            tensor(),
                            tensor(),
                            row_layout(),
                            row_layout(),
                            tensor(),
                            tensor(),
                            (),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            (),
                            PAGE_SIZE,
                            (),
                            (),
                            (),
                            (),
                            (),
                            c,
                            rotary_variant(paged),
                            elem,
                        )) as Box<dyn CubeKernel>
                    }),
            ));
        }
        for (name, paged, split) in [
            ("decode_lanes", false, false),
            ("decode_lanes_paged_split", true, true),
        ] {
            let Some(c) = lanes_config(&decode_problem, limits, paged, split) else {
                continue;
            };
            let c = LanesConfig {
                terms: decode_terms(paged),
                ..c
            };
            kernels.push((
                name,
                Ok(Box::new(flash_decode_lanes::FlashDecodeLanes::new(
                    settings(c.units()),
                    props.clone(),
                    tprops.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    row_layout(),
                    row_layout(),
                    tensor(),
                    tensor(),
                    (),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    PAGE_SIZE,
                    (),
                    (),
                    (),
                    (),
                    (),
                    c.vector,
                    c,
                    rotary_variant(paged),
                    elem,
                )) as Box<dyn CubeKernel>),
            ));
        }
        for (name, paged, split) in [
            ("decode_mma", false, false),
            ("decode_mma_paged_split", true, true),
        ] {
            let Some(c) = mma_decode_config(&decode_problem, limits, paged, split) else {
                continue;
            };
            let c = MmaDecodeConfig {
                terms: decode_terms(paged),
                ..c
            };
            kernels.push((
                name,
                Ok(Box::new(flash_decode_mma::FlashDecodeMma::new(
                    settings(c.units()),
                    props.clone(),
                    tprops.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    row_layout(),
                    row_layout(),
                    tensor(),
                    tensor(),
                    (),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    PAGE_SIZE,
                    (),
                    (),
                    (),
                    (),
                    (),
                    c,
                    rotary_variant(paged),
                    elem,
                )) as Box<dyn CubeKernel>),
            ));
        }
        if problem.dim_qk == 64 && !problem.options.mask.is_masked() {
            for (name, paged) in [("append", false), ("append_paged", true)] {
                kernels.push((
                    name,
                    Ok(Box::new(append_to_cache::AppendToCache::new(
                        settings(64),
                        props.clone(),
                        tprops.clone(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        PAGE_SIZE,
                        paged,
                        rotary_variant(paged),
                        elem,
                    ))),
                ));
            }
        }
        if !problem.options.mask.is_masked() {
            let units = merge_units(problem.dim_v, limits.max_units_per_cube);
            kernels.push((
                "merge_by_lse",
                Ok(Box::new(merge_by_lse::MergeByLse::new(
                    settings(units),
                    props.clone(),
                    tprops.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    units,
                    problem.dim_v,
                    elem,
                ))),
            ));
        }
    }
    // The deterministic sum of a broadcast bias's gradient, with the terms.
    if terms.bias_grad_sums {
        kernels.push((
            "sum_bias_grad",
            Ok(Box::new(sum_bias_grad::SumBiasGrad::new(
                settings(256),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
            ))),
        ));
    }
    // The D kernel works row by row, the same for packed batches.
    if !packed {
        kernels.push((
            "backward_delta",
            Ok(Box::new(flash_backward_delta::FlashBackwardDelta::new(
                settings(256),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                problem.dim_v,
                256 / DELTA_LANES,
                terms.any(),
                elem,
            ))),
        ));
    }
    kernels.push((
        "backward_dkdv",
        dkdv_portable_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_backward_dkdv::FlashBackwardDkdv::new(
                settings(c.block_rows),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                c,
                packed,
                terms,
                elem,
            )) as Box<dyn CubeKernel>
        }),
    ));
    kernels.push((
        "backward_dq",
        dq_portable_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_backward_dq::FlashBackwardDq::new(
                settings(c.block_rows),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                tensor(),
                tensor(),
                c,
                packed,
                terms,
                elem,
                cell_type(&props),
            )) as Box<dyn CubeKernel>
        }),
    ));
    if limits.has_register_mma(problem.dtype)
        && problem.dim_qk.is_multiple_of(8)
        && problem.dim_v.is_multiple_of(8)
    {
        // On sm_90, where they apply, on warpgroup products, and also without them
        // (`FLASH_WGMMA=0`).
        let without_warpgroup = DeviceLimits {
            warpgroup_mma: false,
            ..*limits
        };
        // The `mma.sync` kernels sm_90 runs with `FLASH_WGMMA=0` are sm_80's code for a
        // larger shared memory: checked for one problem (bf16, d = 128, every option).
        let also_without = problem.dtype == FloatDtype::BF16
            && (problem.dim_qk, problem.dim_v) == (128, 128)
            && !packed
            && !terms.any();
        let mut forwards = vec![register_mma_config(problem, limits)];
        if also_without && forwards[0].as_ref().is_ok_and(|c| c.warpgroup.is_some()) {
            forwards.push(register_mma_config(problem, &without_warpgroup));
        }
        // A bias staged in shared memory, as the launcher runs a bias 16-byte copies read,
        // and with one head's sequences side by side (`FLASH_BIAS_BATCH_INNER=1`).
        if terms.bias
            && let Some(staged) = forwards[0]
                .as_ref()
                .ok()
                .and_then(|c| c.staging_bias(problem.dtype.size(), limits))
        {
            forwards.push(Ok(staged));
            forwards.push(Ok(RegisterMmaConfig {
                batch_inner: true,
                ..staged
            }));
        }
        for config in forwards {
            kernels.push((
                if config.as_ref().is_ok_and(|c| c.batch_inner) {
                    "forward_wgmma_staged_bias_batch_inner"
                } else if config.as_ref().is_ok_and(|c| c.bias_staged) {
                    "forward_wgmma_staged_bias"
                } else if config.as_ref().is_ok_and(|c| c.warpgroup.is_some()) {
                    "forward_wgmma"
                } else {
                    "forward_mma"
                },
                config.map_err(err).map(|c| {
                    Box::new(flash_forward_mma::FlashForwardMma::new(
                        settings(c.units()),
                        props.clone(),
                        tprops.clone(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        row_layout(),
                        row_layout(),
                        row_layout(),
                        (),
                        (),
                        (),
                        (),
                        (),
                        tensor(),
                        tensor(),
                        dropout_args(),
                        tensor(),
                        view_layout(),
                        tensor(),
                        c,
                        packed,
                        terms,
                        elem,
                    )) as Box<dyn CubeKernel>
                }),
            ));
        }
        // The backward's own kernels where its accumulators fit registers (otherwise it runs
        // the `cmma` kernels below): dQ by atomics in the dK/dV kernel (long query sequences),
        // or in its own pass (short ones, or a deterministic backward); on sm_90 as the
        // forward.
        let mut configs = Vec::new();
        for deterministic in [false, true] {
            let problem = AttentionProblem {
                options: AttentionOptions {
                    deterministic,
                    ..problem.options
                },
                seq_q: problem.seq_q.max(ATOMIC_DQ_MIN_SEQ_Q),
                ..*problem
            };
            let variants: &[&DeviceLimits] = match also_without {
                true => &[limits, &without_warpgroup],
                false => &[limits],
            };
            for &limits in variants {
                if let Ok(c) = register_backward_config(&problem, limits) {
                    // A bias staged in shared memory, as the launcher runs a bias 16-byte
                    // copies read.
                    let staged = terms
                        .bias
                        .then(|| c.staging_bias(problem.dtype.size(), limits))
                        .flatten();
                    for c in std::iter::once(c).chain(staged) {
                        if !configs.contains(&c) {
                            configs.push(c);
                        }
                    }
                }
            }
        }
        {
            for c in configs {
                for &gradients in c.key_gradients() {
                    let name = match gradients {
                        KeyGradients::Both if c.bias_staged => "backward_dkdv_wgmma_staged_bias",
                        KeyGradients::Both if c.atomic_dq => "backward_dkdv_dq_mma",
                        KeyGradients::Both if c.warpgroup.is_some() => "backward_dkdv_wgmma",
                        KeyGradients::Both => "backward_dkdv_mma",
                        KeyGradients::Keys => "backward_dk_mma",
                        KeyGradients::Values => "backward_dv_mma",
                    };
                    kernels.push((
                        name,
                        Ok(Box::new(
                            flash_backward_dkdv_mma::FlashBackwardDkdvMma::new(
                                settings(c.units()),
                                props.clone(),
                                tprops.clone(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                row_layout(),
                                row_layout(),
                                row_layout(),
                                row_layout(),
                                row_layout(),
                                row_layout(),
                                row_layout(),
                                (),
                                (),
                                (),
                                (),
                                tensor(),
                                tensor(),
                                dropout_args(),
                                tensor(),
                                view_layout(),
                                tensor(),
                                c,
                                gradients,
                                packed,
                                terms,
                                elem,
                            ),
                        )),
                    ));
                }
                if c.atomic_dq && packed {
                    continue; // the conversion from the f32 sum works element by element
                }
                if c.atomic_dq {
                    kernels.push((
                        "backward_dq_from_sum",
                        Ok(Box::new(
                            flash_backward_dq_from_sum::FlashBackwardDqFromSum::new(
                                settings(256),
                                props.clone(),
                                tprops.clone(),
                                tensor(),
                                tensor(),
                                (),
                                elem,
                            ),
                        )),
                    ));
                    continue;
                }
                kernels.push((
                    if c.bias_staged {
                        "backward_dq_wgmma_staged_bias"
                    } else if c.warpgroup.is_some() {
                        "backward_dq_wgmma"
                    } else {
                        "backward_dq_mma"
                    },
                    Ok(Box::new(flash_backward_dq_mma::FlashBackwardDqMma::new(
                        settings(c.units()),
                        props.clone(),
                        tprops.clone(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        tensor(),
                        row_layout(),
                        row_layout(),
                        row_layout(),
                        row_layout(),
                        (),
                        (),
                        (),
                        (),
                        tensor(),
                        tensor(),
                        dropout_args(),
                        tensor(),
                        view_layout(),
                        tensor(),
                        tensor(),
                        tensor(),
                        c,
                        packed,
                        terms,
                        elem,
                        cell_type(&props),
                    ))),
                ));
            }
        }
    }
    if !limits.has_tensor_cores(problem.dtype) {
        return kernels;
    }
    kernels.push((
        "forward_cmma",
        mma_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_forward_cmma::FlashForwardCmma::new(
                settings(c.units()),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                c,
                packed,
                terms,
                elem,
            )) as Box<dyn CubeKernel>
        }),
    ));
    kernels.push((
        "backward_dkdv_cmma",
        dkdv_mma_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_backward_dkdv_cmma::FlashBackwardDkdvCmma::new(
                settings(c.units()),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                c,
                packed,
                terms,
                elem,
            )) as Box<dyn CubeKernel>
        }),
    ));
    kernels.push((
        "backward_dq_cmma",
        dq_mma_config(problem, limits).map_err(err).map(|c| {
            Box::new(flash_backward_dq_cmma::FlashBackwardDqCmma::new(
                settings(c.units()),
                props.clone(),
                tprops.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                tensor(),
                tensor(),
                dropout_args(),
                tensor(),
                view_layout(),
                tensor(),
                tensor(),
                tensor(),
                c,
                packed,
                terms,
                elem,
                cell_type(&props),
            )) as Box<dyn CubeKernel>
        }),
    ));
    kernels
}
