//! Score and mask functions written as CubeCL code ([`ScoreMod`]), compiled into the
//! forward and backward kernels, as FlexAttention's `score_mod` and `mask_mod`.
//!
//! A kernel that carries a function ([`ScoreTerms::score_mod`](crate::ScoreTerms)) passes
//! each score through it after the built-in terms: the softmax sees
//! `f(softcap(q·k · scale) + bias + alibi, position)`, and `f` may hide the score
//! ([`ScoreMod::visible`]). The backward multiplies `dS` by `f′` and hands `dS` to
//! [`ScoreMod::params_grad`], which adds the gradient of the function's parameters: one f32
//! tensor of any shape, read by every kernel, whose gradient the dQ kernels accumulate
//! atomically ([`add_grad`]).
//!
//! ```
//! use cubecl::prelude::*;
//! use cubecl_flash_attention::score_mod::{ScoreMod, ScorePosition, add_grad};
//!
//! /// A learned bias per query head and clipped distance `key − query`: `params`
//! /// `[heads, 2 · 64 + 1]`.
//! struct RelativeBias;
//!
//! #[cube]
//! impl ScoreMod for RelativeBias {
//!     fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32 {
//!         score + params[cell(at, params)]
//!     }
//!     fn score_grad(_score: f32, _modded: f32, _at: &ScorePosition, _params: &Tensor<f32>) -> f32 {
//!         1.0
//!     }
//!     fn params_grad(
//!         grad: f32,
//!         _score: f32,
//!         _modded: f32,
//!         at: &ScorePosition,
//!         params: &Tensor<f32>,
//!         grads: &mut [Atomic<f32>],
//!     ) {
//!         add_grad(grads, cell(at, params), grad);
//!     }
//!     fn visible(_at: &ScorePosition, _params: &Tensor<f32>) -> bool {
//!         true
//!     }
//! }
//!
//! #[cube]
//! fn cell(at: &ScorePosition, params: &Tensor<f32>) -> usize {
//!     let distance = clamp(i32::cast_from(at.key) - i32::cast_from(at.query), -64, 64);
//!     at.head * params.stride(0) + usize::cast_from(distance + 64)
//! }
//! # fn main() {}
//! ```
//!
//! The function is a type; [`ScoreFn::of`] names it to the kernels, which compile once per
//! function (and per the rest of their configuration).

use std::any::TypeId;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;

use cubecl::intrinsic;
use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{DeviceProperties, ElemType, FloatKind, Type, UIntKind};
use cubecl::prelude::*;

use crate::bias::ScoreTerms;
use crate::mma_sync::Pair;
use crate::softmax::MASKED;

/// Where a score lies: batch (the sequence of a batch), query head, query row and key
/// position (counted from the start of their sequences), and the sequences' lengths (the
/// masks align queries to the end of the keys: query `i` sits at key position
/// `i + seq_kv − seq_q`).
#[derive(CubeType, Clone, Copy)]
pub struct ScorePosition {
    pub batch: usize,
    pub head: usize,
    pub query: usize,
    pub key: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
}

/// A score function and mask, written with `#[cube]` methods (see the [module](self)).
/// Scores are in natural-log units, as the softmax `exp(s − LSE)` sees them; `params` is
/// the function's f32 tensor (a placeholder where none is passed).
#[cube]
pub trait ScoreMod: Send + Sync + 'static {
    /// The score the softmax sees, from `score` (the score with the built-in terms).
    fn score(score: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32;

    /// `d score(x) / dx` at `x = score`, where `modded = score(x)`.
    fn score_grad(score: f32, modded: f32, at: &ScorePosition, params: &Tensor<f32>) -> f32;

    /// Adds the gradient of `params` at this score to `grads` (f32 cells with `params`'s
    /// shape and strides; add only with [`add_grad`]), where `grad` is the loss's derivative with
    /// respect to the modified score. Runs only where `params`'s gradient is asked for,
    /// once per visible score.
    fn params_grad(
        grad: f32,
        score: f32,
        modded: f32,
        at: &ScorePosition,
        params: &Tensor<f32>,
        grads: &mut [Atomic<f32>],
    );

    /// Whether the query sees the key (on top of the causal, window and block masks).
    fn visible(at: &ScorePosition, params: &Tensor<f32>) -> bool;
}

/// Adds `value` to element `index` of a gradient, atomically ([`add_f32_at`]).
#[cube]
pub fn add_grad(grads: &mut [Atomic<f32>], index: usize, value: f32) {
    add_f32_at(grads, index, value);
}

/// `cells[index] += value` on f32 gradient cells, atomically, the result unused: as
/// [`add_f32`], but on CUDA sm_80+ by a reduction (`red`), which no unit waits on, where an
/// atomic would return the old value into a register (`FLASH_GRAD_RED=0` keeps the atomic,
/// for comparison).
#[cube]
pub fn add_f32_at<G: CubePrimitive>(cells: &mut [Atomic<G>], index: usize, value: f32) {
    intrinsic!(|scope| {
        if reduces_in_ptx(scope) {
            red_f32::expand::<G>(scope, cells, index, value)
        } else {
            add_f32_indexed::expand::<G>(scope, cells, index, value)
        }
    })
}

#[cube]
fn add_f32_indexed<G: CubePrimitive>(cells: &mut [Atomic<G>], index: usize, value: f32) {
    add_f32(&cells[index], value);
}

/// `red.relaxed.gpu.global.add.f32` on `cells[index]` (bound as f32).
#[cube]
fn red_f32<G: CubePrimitive>(cells: &mut [Atomic<G>], index: usize, value: f32) {
    let cell = &mut cells[index..index + 1];
    let pointer = unsafe { cell.as_mut_ptr_unchecked() };
    // A value of its own (`× 1`, exact, which the compiler folds): a caller's mutable
    // variable would reach the operand as its address.
    let addend = value * f32::new(1.0);
    gpu_asm!(
        "red.relaxed.gpu.global.add.f32 [{pointer}], {addend};",
        pointer = in(_) pointer,
        addend = in(_) addend,
    );
}

/// Whether the kernel being expanded adds gradient cells by PTX reductions: CUDA sm_80+
/// (the register-level instructions' mark) with native float atomics, unless
/// `FLASH_GRAD_RED=0`.
fn reduces_in_ptx(scope: &Scope) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("FLASH_GRAD_RED").is_ok_and(|v| v == "0"));
    !off && scope
        .state()
        .device_properties
        .as_ref()
        .is_some_and(|props| {
            float_atomics(props) && crate::config::has_mma_sync(props, crate::FloatDtype::F16)
        })
}

/// `cell += value` on an f32 gradient cell, atomically: a native float atomic add where the
/// device has one ([`float_atomics`]), else a compare-and-swap loop on the float's bits
/// (WGSL without its float-atomics extension). The kernels bind the cells as [`cell_type`]
/// says; whatever their nominal type `G`, the instruction follows the same property.
#[cube]
pub fn add_f32<G: CubePrimitive>(cell: &Atomic<G>, value: f32) {
    intrinsic!(|scope| match BoundCell::of(scope, cell) {
        BoundCell::Float(cell) => {
            cell.__expand_fetch_add_method(scope, value);
        }
        BoundCell::Bits(cell) => add_f32_bits::expand(scope, &cell, value),
    })
}

/// `cell = value` on an f32 gradient cell (bound as [`add_f32`] says).
#[cube]
pub fn store_f32<G: CubePrimitive>(cell: &Atomic<G>, value: f32) {
    intrinsic!(|scope| match BoundCell::of(scope, cell) {
        BoundCell::Float(cell) => cell.__expand_store_method(scope, value),
        BoundCell::Bits(cell) => store_f32_bits::expand(scope, &cell, value),
    })
}

/// A gradient cell as its kernel binds it: f32 where the device adds floats atomically,
/// else u32 holding f32 bits.
enum BoundCell {
    Float(Expand<Atomic<f32>>),
    Bits(Expand<Atomic<u32>>),
}

impl BoundCell {
    fn of<G: CubePrimitive>(scope: &Scope, cell: &Expand<Atomic<G>>) -> Self {
        let native = scope
            .state()
            .device_properties
            .as_ref()
            .is_some_and(|props| float_atomics(props));
        match native {
            true => Self::Float(cell.expand.clone().into()),
            false => Self::Bits(cell.expand.clone().into()),
        }
    }
}

/// `cell += value` on f32 bits, by compare-and-swap.
#[cube]
fn add_f32_bits(cell: &Atomic<u32>, value: f32) {
    let mut old = cell.load();
    loop {
        let new = u32::reinterpret(f32::reinterpret(old) + value);
        let seen = cell.compare_exchange_weak(old, new);
        if seen == old {
            break;
        }
        old = seen;
    }
}

#[cube]
fn store_f32_bits(cell: &Atomic<u32>, value: f32) {
    cell.store(u32::reinterpret(value));
}

/// Whether the device adds f32 atomically in hardware: the kernels then bind gradient cells
/// as f32, else as u32 holding f32 bits.
pub fn float_atomics(props: &DeviceProperties) -> bool {
    props
        .atomic_type_usage(Type::atomic(ElemType::Float(FloatKind::F32)))
        .contains(AtomicUsage::Add)
}

/// The element type the kernels bind gradient cells with on a device ([`float_atomics`]).
pub fn cell_type(props: &DeviceProperties) -> ElemType {
    if float_atomics(props) {
        ElemType::Float(FloatKind::F32)
    } else {
        ElemType::UInt(UIntKind::U32)
    }
}

type Expand<T> = <T as CubeType>::ExpandType;

/// A [`ScoreMod`] behind a pointer: the kernels' expansion calls it without being generic
/// over the function.
trait ExpandScoreMod: Send + Sync + std::panic::RefUnwindSafe {
    fn id(&self) -> TypeId;
    fn name(&self) -> &'static str;
    fn score(
        &self,
        scope: &Scope,
        score: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<f32>;
    fn score_grad(
        &self,
        scope: &Scope,
        score: Expand<f32>,
        modded: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<f32>;
    #[allow(clippy::too_many_arguments)]
    fn params_grad(
        &self,
        scope: &Scope,
        grad: Expand<f32>,
        score: Expand<f32>,
        modded: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
        grads: &mut Expand<[Atomic<f32>]>,
    );
    fn visible(
        &self,
        scope: &Scope,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<bool>;
}

struct Erased<M>(PhantomData<fn() -> M>);

impl<M: ScoreMod> ExpandScoreMod for Erased<M> {
    fn id(&self) -> TypeId {
        TypeId::of::<M>()
    }
    fn name(&self) -> &'static str {
        std::any::type_name::<M>()
    }
    fn score(
        &self,
        scope: &Scope,
        score: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<f32> {
        M::__expand_score(scope, score, at, params)
    }
    fn score_grad(
        &self,
        scope: &Scope,
        score: Expand<f32>,
        modded: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<f32> {
        M::__expand_score_grad(scope, score, modded, at, params)
    }
    fn params_grad(
        &self,
        scope: &Scope,
        grad: Expand<f32>,
        score: Expand<f32>,
        modded: Expand<f32>,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
        grads: &mut Expand<[Atomic<f32>]>,
    ) {
        M::__expand_params_grad(scope, grad, score, modded, at, params, grads)
    }
    fn visible(
        &self,
        scope: &Scope,
        at: &Expand<ScorePosition>,
        params: &Expand<Tensor<f32>>,
    ) -> Expand<bool> {
        M::__expand_visible(scope, at, params)
    }
}

/// A [`ScoreMod`] as the kernels' compile-time configuration names it: equal, and hashed
/// alike, for the same type.
#[derive(Clone, Copy)]
pub struct ScoreFn(&'static dyn ExpandScoreMod);

impl ScoreFn {
    /// The function `M`.
    pub fn of<M: ScoreMod>() -> Self {
        // `Erased<M>` has no size: leaking it allocates nothing.
        Self(Box::leak(Box::new(Erased::<M>(PhantomData))))
    }

    /// The function's type name.
    pub fn name(&self) -> &'static str {
        self.0.name()
    }
}

impl PartialEq for ScoreFn {
    fn eq(&self, other: &Self) -> bool {
        self.0.id() == other.0.id()
    }
}

impl Eq for ScoreFn {}

impl Hash for ScoreFn {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.id().hash(state);
    }
}

impl fmt::Debug for ScoreFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScoreFn({})", self.name())
    }
}

/// What the kernels call: the function `f` (compiled in) at a score, with the positions
/// clamped into the sequences (positions past the end are masked by the caller, but the
/// function may index by them).
#[derive(CubeType, Clone, Copy)]
pub struct ScoreCall {
    batch: usize,
    head: usize,
    seq_q: usize,
    seq_kv: usize,
}

#[cube]
impl ScoreCall {
    /// Scores of `(batch, head)` of sequences `seq_q × seq_kv`.
    pub fn new(batch: usize, head: usize, seq_q: usize, seq_kv: usize) -> ScoreCall {
        ScoreCall {
            batch,
            head,
            seq_q,
            seq_kv,
        }
    }

    /// The position of `(query, key)`.
    pub fn at(&self, query: usize, key: usize) -> ScorePosition {
        ScorePosition {
            batch: self.batch,
            head: self.head,
            query: min(query, self.seq_q - 1),
            key: min(key, self.seq_kv - 1),
            seq_q: self.seq_q,
            seq_kv: self.seq_kv,
        }
    }

    /// The score `x` of `(query, key)` through `f` ([`modded`]), or as is without one.
    pub fn apply(
        &self,
        x: f32,
        query: usize,
        key: usize,
        params: &Tensor<f32>,
        #[comptime] f: Option<ScoreFn>,
    ) -> f32 {
        let mut y = x;
        if comptime!(f.is_some()) {
            y = modded(x, &self.at(query, key), params, comptime!(f.unwrap()));
        }
        y
    }

    /// `dL/dx` from `ds = dL/dy` at `(query, key)`, where `y` = [`ScoreCall::apply`]`(x)`
    /// (0 where `ds` is).
    #[allow(clippy::too_many_arguments)]
    pub fn grad(
        &self,
        ds: f32,
        x: f32,
        y: f32,
        query: usize,
        key: usize,
        params: &Tensor<f32>,
        #[comptime] f: Option<ScoreFn>,
    ) -> f32 {
        let mut dx = ds;
        if comptime!(f.is_some()) {
            // A hidden score (`y` = MASKED) has `ds = 0`, whatever `f′` makes of it.
            let slope = modded_grad(x, y, &self.at(query, key), params, comptime!(f.unwrap()));
            dx = select(ds == 0.0, 0.0, ds * slope);
        }
        dx
    }

    /// The dQ kernels' step: from `ds = dL/dy` at `(query, key)`, adds the parameters'
    /// gradient where `terms` asks for it and the score `counts` (visible, in the
    /// sequences), and returns `dL/dx` ([`ScoreCall::grad`]).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<G: CubePrimitive>(
        &self,
        ds: f32,
        x: f32,
        y: f32,
        query: usize,
        key: usize,
        counts: bool,
        params: &Tensor<f32>,
        grads: &mut Tensor<Atomic<G>>,
        #[comptime] terms: ScoreTerms,
    ) -> f32 {
        if counts {
            self.add_params_grad(ds, x, y, query, key, params, grads, terms);
        }
        self.grad(ds, x, y, query, key, params, terms.score_mod)
    }

    /// Adds the parameters' gradient for `ds = dL/dy` at `(query, key)` (a visible score of
    /// the sequences), where `terms` asks for it.
    #[allow(clippy::too_many_arguments)]
    pub fn add_params_grad<G: CubePrimitive>(
        &self,
        ds: f32,
        x: f32,
        y: f32,
        query: usize,
        key: usize,
        params: &Tensor<f32>,
        grads: &mut Tensor<Atomic<G>>,
        #[comptime] terms: ScoreTerms,
    ) {
        if comptime!(terms.score_params_grad) {
            // Hidden scores have no gradient: no atomics for them.
            if ds != 0.0 {
                let f = comptime!(terms.score_mod.unwrap());
                modded_params_grad(ds, x, y, &self.at(query, key), params, grads, f);
            }
        }
    }
}

/// `f(x)` at `at`, or [`MASKED`] where `f` hides the score or `x` is already hidden.
#[cube]
pub fn modded(x: f32, at: &ScorePosition, params: &Tensor<f32>, #[comptime] f: ScoreFn) -> f32 {
    let y = call_score(x, at, params, f);
    let visible = call_visible(at, params, f);
    select(visible && x > f32::new(MASKED), y, f32::new(MASKED))
}

/// `f′(x)` at `at`, where `y = f(x)`.
#[cube]
pub fn modded_grad(
    x: f32,
    y: f32,
    at: &ScorePosition,
    params: &Tensor<f32>,
    #[comptime] f: ScoreFn,
) -> f32 {
    intrinsic!(|scope| f.0.score_grad(scope, x, y, at, params))
}

/// Adds the parameters' gradient at `at` for `grad = dL/dy`.
#[cube]
pub fn modded_params_grad<G: CubePrimitive>(
    grad: f32,
    x: f32,
    y: f32,
    at: &ScorePosition,
    params: &Tensor<f32>,
    grads: &mut Tensor<Atomic<G>>,
    #[comptime] f: ScoreFn,
) {
    intrinsic!(|scope| {
        // The cells' binding is the device's ([`cell_type`]); [`add_f32`] chooses its
        // instruction by the same property, whatever the nominal type.
        let cells = unsafe { grads.__expand_downcast_mut_unchecked_method::<Atomic<f32>>(scope) };
        f.0.params_grad(scope, grad, x, y, at, params, cells)
    })
}

#[cube]
fn call_score(x: f32, at: &ScorePosition, params: &Tensor<f32>, #[comptime] f: ScoreFn) -> f32 {
    intrinsic!(|scope| f.0.score(scope, x, at, params))
}

#[cube]
fn call_visible(at: &ScorePosition, params: &Tensor<f32>, #[comptime] f: ScoreFn) -> bool {
    intrinsic!(|scope| f.0.visible(scope, at, params))
}

/// Positions of the lane's elements in accumulator tiles side by side (the layout of
/// [`crate::mma_sync::hide_columns`]): pair `2 · (first + n) + half`, element `e`, is
/// position `p0 + 8n + 2 · (lane % 4) + e` along a line of scores, which runs along the keys
/// of query `fixed` or, with `by_key`, along the queries of key `fixed`.
#[derive(CubeType, Clone, Copy)]
pub struct ColumnLine {
    fixed: usize,
    p0: usize,
}

#[cube]
impl ColumnLine {
    pub fn new(fixed: usize, p0: usize) -> ColumnLine {
        ColumnLine {
            fixed,
            p0: p0 + 2 * (UNIT_POS_PLANE as usize % 4),
        }
    }

    /// `(query, key)` of element `e` of tile `n`.
    fn at(&self, call: &ScoreCall, n: usize, e: usize, #[comptime] by_key: bool) -> ScorePosition {
        let p = self.p0 + 8 * n + e;
        let mut query = self.fixed;
        let mut key = p;
        if comptime!(by_key) {
            query = p;
            key = self.fixed;
        }
        call.at(query, key)
    }
}

/// `x` (in units of `unit` per natural-log unit) through `f` at `at`, in the same units; a
/// hidden score gives [`MASKED`].
#[cube]
fn modded_in_units(
    x: f32,
    unit: f32,
    at: &ScorePosition,
    params: &Tensor<f32>,
    #[comptime] f: ScoreFn,
) -> f32 {
    let y = modded(x / unit, at, params, f);
    select(y > f32::new(MASKED), y * unit, f32::new(MASKED))
}

/// `f` on one line's scores in the lane's accumulator tiles (see [`ColumnLine`]), in units
/// of `unit` per natural-log unit: the forward's form.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn modify_columns(
    acc: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    line: &ColumnLine,
    call: &ScoreCall,
    params: &Tensor<f32>,
    unit: f32,
    #[comptime] by_key: bool,
    #[comptime] f: ScoreFn,
) {
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = acc[at];
        #[unroll]
        for e in 0..2usize {
            let position = line.at(call, n, e, by_key);
            pair.insert(
                e,
                modded_in_units(pair.extract(e), unit, &position, params, f),
            );
        }
        acc[at] = pair;
    }
}

/// [`modify_columns`] for the backward: `acc` holds `x` and gets `f(x)`; `slopes` gets
/// `f′(x)` and, where `unmodded` is kept (`keep_x`), `unmodded` gets `x`, as the
/// parameters' gradient needs it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn modify_columns_with_slopes(
    acc: &mut Array<Pair<f32>>,
    slopes: &mut Array<Pair<f32>>,
    unmodded: &mut Array<Pair<f32>>,
    first: usize,
    #[comptime] tiles: usize,
    half: usize,
    line: &ColumnLine,
    call: &ScoreCall,
    params: &Tensor<f32>,
    unit: f32,
    #[comptime] by_key: bool,
    #[comptime] keep_x: bool,
    #[comptime] f: ScoreFn,
) {
    #[unroll]
    for n in 0..tiles {
        let at = 2 * (first + n) + half;
        let mut pair = acc[at];
        let mut slope_pair = slopes[at];
        let mut x_pair = pair;
        #[unroll]
        for e in 0..2usize {
            let position = line.at(call, n, e, by_key);
            let x = pair.extract(e);
            let y = modded_in_units(x, unit, &position, params, f);
            let slope = modded_grad(x / unit, y / unit, &position, params, f);
            pair.insert(e, y);
            // A hidden score's slope is never read (its dS is 0), but must not be NaN.
            slope_pair.insert(e, select(y > f32::new(MASKED), slope, 0.0));
            x_pair.insert(e, x);
        }
        acc[at] = pair;
        slopes[at] = slope_pair;
        if comptime!(keep_x) {
            unmodded[at] = x_pair;
        }
    }
}

/// Adds the parameters' gradient at the lane's elements of one line (see [`ColumnLine`])
/// whose position is in the sequences, for `dS = p ⊙ dp_minus_d` with respect to `f(x)`,
/// `x` in `unmodded` in units of `unit` per natural-log unit.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn add_params_grad_columns<G: CubePrimitive>(
    p: &Array<Pair<f32>>,
    dp_minus_d: &Array<Pair<f32>>,
    unmodded: &Array<Pair<f32>>,
    #[comptime] tiles: usize,
    half: usize,
    line: &ColumnLine,
    call: &ScoreCall,
    params: &Tensor<f32>,
    grads: &mut Tensor<Atomic<G>>,
    unit: f32,
    #[comptime] f: ScoreFn,
) {
    #[unroll]
    for n in 0..tiles {
        let at = 2 * n + half;
        #[unroll]
        for e in 0..2usize {
            let ds = p[at].extract(e) * dp_minus_d[at].extract(e);
            let position = line.at(call, n, e, false);
            let in_sequences = line.p0 + 8 * n + e < call.seq_kv && line.fixed < call.seq_q;
            if ds != 0.0 && in_sequences {
                let x = unmodded[at].extract(e) / unit;
                let y = modded(x, &position, params, f);
                modded_params_grad(ds, x, y, &position, params, grads, f);
            }
        }
    }
}
