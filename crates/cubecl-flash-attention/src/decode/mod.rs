//! Serving: attention of a few new queries against a key/value cache, contiguous or paged,
//! with the new keys and values written into the cache in place (FlashAttention's
//! `flash_attn_with_kvcache`).
//!
//! - [`decode`]: appends `k_new`/`v_new` at each sequence's length, then runs the decode
//!   kernel ([`kernel`]) over `cache[.. cache_seqlens[b] + s_new]`, the key range split over
//!   cubes ([`split`]) and merged by LSE ([`merge`]);
//! - [`cache`]: where a position of a contiguous or paged cache lives.
//!
//! Causal and window masks are bottom-right aligned as everywhere: the last new query sees
//! the sequence's last key.

pub mod append;
pub mod cache;
pub mod kernel;
pub mod lanes;
pub mod merge;
pub mod mma;
pub mod split;
pub mod stages;
pub mod task;
mod tuning;

use cubecl::prelude::*;

use crate::bias::{ScoreBias, ScoreTerms, TermsGrad};
use crate::config::{DeviceLimits, FRAGMENT, portable_columns};
use crate::error::FlashError;
use crate::launch::{
    DeviceTensor, GRID_DIM, blocks_by_pairs, check_dtype, check_spans, readable_by_16_byte_copies,
    softcap_arg,
};
use crate::loop_budget;
use crate::problem::{AttentionOptions, AttentionProblem, FloatDtype};

pub use kernel::DecodeConfig;
pub use lanes::LanesConfig;
pub use mma::MmaDecodeConfig;

use crate::rotary::{Rotary, RotaryConfig};
pub use split::{SplitInputs, SplitRule, choose_splits};
use tuning::tuning;

/// A key/value cache.
#[derive(Clone, Copy, Debug)]
pub struct KvCache<'a> {
    /// Keys: contiguous `[batch, heads_kv, capacity, d_qk]` (any strides), or with a block
    /// table pages `[pages, page_size, heads_kv, d_qk]`.
    pub k: &'a DeviceTensor,
    /// Values, as the keys with `d_v`.
    pub v: &'a DeviceTensor,
    /// `None` for a contiguous cache; for a paged one the page of each `page_size` positions
    /// of each sequence, `[batch, max_pages]` i32. Entries past a sequence's pages are not
    /// read.
    pub block_table: Option<&'a DeviceTensor>,
}

/// The inputs of a decode step.
#[derive(Clone, Copy, Debug)]
pub struct DecodeInputs<'a> {
    /// New queries `[batch, heads_q, s_q, d_qk]`, any strides.
    pub q: &'a DeviceTensor,
    pub cache: KvCache<'a>,
    /// Positions already in the cache per sequence, `[batch]` i32.
    pub cache_seqlens: &'a DeviceTensor,
    /// Keys `[batch, heads_kv, s_new, d_qk]` and values `[batch, heads_kv, s_new, d_v]` to
    /// write at positions `cache_seqlens[b] ..` before attending (they are then attended).
    pub new: Option<(&'a DeviceTensor, &'a DeviceTensor)>,
    /// How the launcher learns the lengths it checks and splits by.
    pub lengths: Lengths<'a>,
    /// Rotary embedding of the new queries and keys ([`crate::rotary`]): keys to their
    /// positions `cache_seqlens[b] + i`; queries likewise under a causal or window mask,
    /// else all to `cache_seqlens[b]` (FlashAttention's convention).
    pub rotary: Option<Rotary<'a>>,
    /// Score terms, as the training kernels take them ([`crate::bias`],
    /// [`crate::score_mod`]), of query `i` (of the `s_q` new ones) and key `j` (a position
    /// of the sequence, `seq_kv = cache_seqlens[b] + s_new` of them after the append):
    /// - a bias `[batch | 1, heads_q | 1, s_q | 1, capacity | 1]` in the dtype of `q`,
    ///   indexed by key position (a boolean mask is a bias of 0 and −∞);
    /// - ALiBi slopes `[batch | 1, heads_q]` (f32): `−slope · |i + seq_kv − s_q − j|`;
    /// - a score function and its parameters, at batch `b`, query `i`, key `j` and the
    ///   lengths `s_q` and `seq_kv`.
    ///
    /// Block masks describe training-shaped problems and are refused.
    pub terms: ScoreBias<'a>,
}

/// Where the launcher learns each sequence's length.
#[derive(Clone, Copy, Debug, Default)]
pub enum Lengths<'a> {
    /// Read `cache_seqlens` and the block table back and check them (one host round trip
    /// per call: the device finishes the work queued before).
    #[default]
    ReadBack,
    /// The lengths as the host already knows them (a server's own bookkeeping), equal to
    /// `cache_seqlens`: checked against the capacity without a read back; the block table
    /// is the caller's to keep valid.
    Known(&'a [usize]),
}

/// How the key range is split over cubes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Splits {
    /// [`choose_splits`] decides from the device and the lengths.
    #[default]
    Auto,
    /// This many splits (1: no split, no merge).
    Exactly(usize),
}

/// `O` `[batch, heads_q, s_q, d_v]` in the input dtype, the LSE `[batch, heads_q, s_q]` (f32),
/// and the split count that ran.
#[derive(Clone, Debug)]
pub struct DecodeOutput {
    pub out: DeviceTensor,
    pub lse: DeviceTensor,
    pub splits: usize,
}

/// The cache's sizes, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheGeometry {
    pub batch: usize,
    pub heads_kv: usize,
    /// Positions a sequence may hold: the cache's length, or `max_pages · page_size`.
    pub capacity: usize,
    /// `Some(page_size)` for a paged cache.
    pub page_size: Option<usize>,
    /// Sequences (contiguous) or pages (paged) in the cache.
    pub blocks: usize,
    pub dim_qk: usize,
    pub dim_v: usize,
}

fn shape_error(arg: &'static str, t: &DeviceTensor, expected: String) -> FlashError {
    shape_error_of(arg, &t.shape, expected)
}

fn shape_error_of(arg: &'static str, shape: &[usize], expected: String) -> FlashError {
    FlashError::Shape {
        arg,
        shape: shape.to_vec(),
        expected,
    }
}

fn rank(arg: &'static str, t: &DeviceTensor, dims: usize, layout: &str) -> Result<(), FlashError> {
    rank_of(arg, &t.shape, dims, layout)
}

fn rank_of(
    arg: &'static str,
    shape: &[usize],
    dims: usize,
    layout: &str,
) -> Result<(), FlashError> {
    match shape.len() == dims {
        true => Ok(()),
        false => Err(shape_error_of(
            arg,
            shape,
            format!("expected rank {dims}, {layout}"),
        )),
    }
}

impl CacheGeometry {
    /// Checks the cache's tensors against each other and against `batch` sequences.
    pub fn new(cache: &KvCache, batch: usize) -> Result<Self, FlashError> {
        Self::from_shapes(
            &cache.k.shape,
            &cache.v.shape,
            cache.block_table.map(|t| &t.shape[..]),
            batch,
        )
    }

    /// [`CacheGeometry::new`] from the shapes of the keys, the values and the block table
    /// (`None` for a contiguous cache).
    pub fn from_shapes(
        k: &[usize],
        v: &[usize],
        table: Option<&[usize]>,
        batch: usize,
    ) -> Result<Self, FlashError> {
        let layout = match table {
            None => "[batch, heads_kv, capacity, dim]",
            Some(_) => "[pages, page_size, heads_kv, dim]",
        };
        rank_of("k_cache", k, 4, layout)?;
        rank_of("v_cache", v, 4, layout)?;
        let [blocks, a, b, dim_qk] = k[..] else {
            unreachable!()
        };
        if v[..3] != k[..3] {
            return Err(shape_error_of(
                "v_cache",
                v,
                format!(
                    "expected {:?} followed by d_v (the sizes of `k_cache`)",
                    &k[..3]
                ),
            ));
        }
        let dim_v = v[3];
        let geometry = match table {
            None => {
                if blocks != batch {
                    return Err(shape_error_of(
                        "k_cache",
                        k,
                        format!(
                            "expected [{batch}, heads_kv, capacity, dim] (one sequence per query batch entry)"
                        ),
                    ));
                }
                Self {
                    batch,
                    heads_kv: a,
                    capacity: b,
                    page_size: None,
                    blocks,
                    dim_qk,
                    dim_v,
                }
            }
            Some(table) => {
                rank_of("block_table", table, 2, "[batch, max_pages]")?;
                if table[0] != batch {
                    return Err(shape_error_of(
                        "block_table",
                        table,
                        format!("expected [{batch}, max_pages] (one row per sequence)"),
                    ));
                }
                if a == 0 {
                    return Err(shape_error_of(
                        "k_cache",
                        k,
                        "pages must hold at least one position".into(),
                    ));
                }
                Self {
                    batch,
                    heads_kv: b,
                    capacity: table[1] * a,
                    page_size: Some(a),
                    blocks,
                    dim_qk,
                    dim_v,
                }
            }
        };
        Ok(geometry)
    }

    /// Checks new keys and values (shapes `k`, `v`) against the cache; returns `s_new`.
    pub fn check_new(&self, k: &[usize], v: &[usize]) -> Result<usize, FlashError> {
        rank_of("k", k, 4, "[batch, heads_kv, s_new, d_qk]")?;
        let s_new = k[2];
        let (b, h) = (self.batch, self.heads_kv);
        for (arg, shape, expected) in [
            ("k", k, [b, h, s_new, self.dim_qk]),
            ("v", v, [b, h, s_new, self.dim_v]),
        ] {
            if shape != expected {
                return Err(shape_error_of(
                    arg,
                    shape,
                    format!("expected {expected:?} (batch, heads and head dim of the cache)"),
                ));
            }
        }
        Ok(s_new)
    }

    /// The attention problem of `q` (shape `q`) against this cache, options checked.
    pub fn problem(
        &self,
        q: &[usize],
        dtype: FloatDtype,
        options: AttentionOptions,
    ) -> Result<AttentionProblem, FlashError> {
        rank_of("query", q, 4, "[batch, heads_q, s_q, d_qk]")?;
        AttentionProblem::new(
            q,
            &[self.batch, self.heads_kv, self.capacity, self.dim_qk],
            &[self.batch, self.heads_kv, self.capacity, self.dim_v],
            dtype,
            options,
        )
    }

    /// Checks each sequence's length (`cache_seqlens`): at least 0 and, with `s_new` new
    /// positions, at most the capacity; and, given the block table (`[batch, max_pages]`,
    /// row-major), that every page a sequence uses names a page of the cache. Returns the
    /// lengths.
    pub fn check_lengths(
        &self,
        lengths: &[i64],
        s_new: usize,
        table: Option<&[i64]>,
    ) -> Result<Vec<usize>, FlashError> {
        if lengths.len() != self.batch {
            return Err(FlashError::Option {
                arg: "cache_seqlens",
                expected: format!(
                    "{} lengths (one per sequence), got {}",
                    self.batch,
                    lengths.len()
                ),
            });
        }
        for (b, &len) in lengths.iter().enumerate() {
            if len < 0 || len + s_new as i64 > self.capacity as i64 {
                return Err(FlashError::Option {
                    arg: "cache_seqlens",
                    expected: format!(
                        "sequence {b} holds {len} positions and appends {s_new}: lengths must be \
                         at least 0 and with the new keys at most the cache's capacity of {}",
                        self.capacity
                    ),
                });
            }
        }
        if let (Some(table), Some(page_size)) = (table, self.page_size) {
            let max_pages = self.capacity / page_size;
            for (b, &len) in lengths.iter().enumerate() {
                let used = (len as usize + s_new).div_ceil(page_size);
                for (p, &page) in table[b * max_pages..][..used].iter().enumerate() {
                    if page < 0 || page as usize >= self.blocks {
                        return Err(FlashError::Option {
                            arg: "block_table",
                            expected: format!(
                                "sequence {b} uses its page {p}, whose entry is {page}: entries \
                                 must name one of the cache's {} pages",
                                self.blocks
                            ),
                        });
                    }
                }
            }
        }
        Ok(lengths.iter().map(|&l| l as usize).collect())
    }

    /// `t` as the kernels read it, `[blocks, heads_kv, rows, d]`.
    fn kernel_view(&self, t: &DeviceTensor) -> DeviceTensor {
        let mut view = t.clone();
        if self.page_size.is_some() {
            view.shape.swap(1, 2);
            view.strides.swap(1, 2);
        }
        view
    }
}

/// Reads an i32 tensor back.
fn read_i32(client: &Client, t: &DeviceTensor) -> Vec<i32> {
    let bytes = client
        .read_one(t.handle.clone())
        .expect("reading an index tensor back");
    let values: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let count: usize = t.shape.iter().product();
    (0..count)
        .map(|n| {
            let mut offset = 0;
            let mut rest = n;
            for d in (0..t.shape.len()).rev() {
                offset += (rest % t.shape[d]) * t.strides[d];
                rest /= t.shape[d];
            }
            values[offset]
        })
        .collect()
}

/// Checks the lengths (and pages) every sequence will use, reading them back unless the
/// caller knows them; returns the longest length before the append.
fn check_lengths(
    client: &Client,
    inputs: &DecodeInputs,
    geometry: &CacheGeometry,
    s_new: usize,
) -> Result<usize, FlashError> {
    let t = inputs.cache_seqlens;
    if t.shape != [geometry.batch] {
        return Err(shape_error(
            "cache_seqlens",
            t,
            format!("expected [{}] (one length per sequence)", geometry.batch),
        ));
    }
    let lengths = match inputs.lengths {
        Lengths::ReadBack => {
            let lengths: Vec<i64> = read_i32(client, t).into_iter().map(i64::from).collect();
            let table = inputs.cache.block_table.map(|table| {
                read_i32(client, table)
                    .into_iter()
                    .map(i64::from)
                    .collect::<Vec<_>>()
            });
            geometry.check_lengths(&lengths, s_new, table.as_deref())?
        }
        Lengths::Known(lengths) => {
            let lengths: Vec<i64> = lengths.iter().map(|&l| l as i64).collect();
            geometry.check_lengths(&lengths, s_new, None)?
        }
    };
    Ok(lengths.iter().copied().max().unwrap_or(0))
}

/// Checks the new keys and values against the query and the cache; returns `s_new`.
fn check_new(inputs: &DecodeInputs, geometry: &CacheGeometry) -> Result<usize, FlashError> {
    match inputs.new {
        Some((k, v)) => geometry.check_new(&k.shape, &v.shape),
        None => Ok(0),
    }
}

/// The decode kernel's tiles for `problem` on this device.
pub fn decode_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    paged: bool,
    split: bool,
) -> Result<DecodeConfig, FlashError> {
    const UNITS: usize = 128;
    const MAX_ROWS: usize = 32;
    const MAX_ROWS_CPU: usize = 8;
    const BLOCKS_CPU: [usize; 2] = [16, 8];
    const SHARED_BYTES: usize = 48 * 1024;
    const PLANE_SHARED_BYTES: usize = 100 * 1024;
    // Tuning override, for A/B runs: `FLASH_DECODE_TILES=units,block_kv`.
    let tiles = tuning().tiles;
    let units = tiles
        .map_or(UNITS, |t| t.0)
        .min(limits.max_units_per_cube)
        .max(1);
    let packed = problem.group_size() * problem.seq_q;
    // CPU drivers (no plane operations) compile the per-unit loops slowly: fewer rows and
    // keys per cube there.
    let max_rows = if limits.plane_ops {
        MAX_ROWS
    } else {
        MAX_ROWS_CPU
    };
    let rows = packed.next_power_of_two().min(max_rows).min(units);
    let config = |rows: usize, block_kv: usize| DecodeConfig {
        rows,
        block_kv,
        units,
        dim_qk: problem.dim_qk,
        dim_v: problem.dim_v,
        columns: portable_columns(problem.dim_qk.max(problem.dim_v), limits),
        masked: problem.options.mask.is_masked(),
        softcap: problem.options.softcap.is_some(),
        terms: ScoreTerms::default(),
        paged,
        split,
        plane_softmax: limits.plane_ops
            && block_kv == limits.plane_size
            && units.is_multiple_of(limits.plane_size),
        unrolled: limits.plane_ops,
    };
    let fits = |config: &DecodeConfig, budget: usize| config.shared_bytes() <= budget;
    if let Some((_, block_kv)) = tiles {
        let c = config(rows, block_kv);
        return match fits(&c, limits.max_shared_memory) {
            true => Ok(c),
            false => Err(FlashError::InvalidConfig(format!(
                "FLASH_DECODE_TILES: {c:?} does not fit"
            ))),
        };
    }
    // A block one plane wide, its softmax on the plane; else the largest block that fits.
    let plane = config(rows, limits.plane_size);
    if plane.plane_softmax && fits(&plane, PLANE_SHARED_BYTES.min(limits.max_shared_memory)) {
        return Ok(plane);
    }
    let blocks: &[usize] = match limits.plane_ops {
        true => &[64, 32, 16, 8],
        false => &BLOCKS_CPU,
    };
    // The largest block within a budget that leaves the multiprocessor room for several
    // cubes; else (large head dims in f32) within all the shared memory a cube may have,
    // with fewer query rows per cube if need be (more cubes cover the packed rows).
    let budget = SHARED_BYTES.min(limits.max_shared_memory);
    let fewer_rows = std::iter::successors(Some(rows), |&r| (r > 1).then_some(r / 2));
    blocks
        .iter()
        .map(|&block_kv| (config(rows, block_kv), budget))
        .chain(fewer_rows.flat_map(|rows| {
            blocks
                .iter()
                .map(move |&block_kv| (config(rows, block_kv), limits.max_shared_memory))
        }))
        .find(|(c, budget)| fits(c, *budget))
        .map(|(c, _)| c)
        .ok_or_else(|| {
            FlashError::InvalidConfig(format!(
                "head dims {}/{} need more than the {} bytes of shared memory this device \
                 offers a cube, even for one query row and {} keys at a time",
                problem.dim_qk,
                problem.dim_v,
                limits.max_shared_memory,
                blocks[blocks.len() - 1]
            ))
        })
}

/// The tiles of [`mma::flash_decode_mma`] for `problem` on this device, or `None` where that
/// kernel does not apply: no register-level tensor-core products for the dtype (CUDA sm_80+,
/// f16 and bf16), `d_qk ≠ d_v`, or a head dim that is not a multiple of 16 up to 256 (the
/// caches must also take 16-byte copies, which [`decode`] checks).
/// `FLASH_DECODE_MMA=planes,block,stages` sets the tiles (tuning).
pub fn mma_decode_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    paged: bool,
    split: bool,
) -> Option<MmaDecodeConfig> {
    const MAX_DIM: usize = 256;
    let dim = problem.dim_qk;
    let applies = limits.has_register_mma(problem.dtype)
        && problem.dim_v == dim
        && dim.is_multiple_of(FRAGMENT)
        && dim <= MAX_DIM;
    if !applies {
        return None;
    }
    let packed = problem.group_size() * problem.seq_q;
    let config = |planes: usize, block: usize, stages: usize| MmaDecodeConfig {
        rows: packed.next_power_of_two().min(MmaDecodeConfig::TILE_ROWS),
        dim,
        planes: planes.max(1),
        block: block.max(FRAGMENT) / FRAGMENT * FRAGMENT,
        stages: stages.clamp(2, 3),
        masked: problem.options.mask.is_masked(),
        softcap: problem.options.softcap.is_some(),
        terms: ScoreTerms::default(),
        paged,
        split,
    };
    let fits = |config: &MmaDecodeConfig| {
        config.units() <= limits.max_units_per_cube
            && config.shared_bytes(problem.dtype.size()) <= limits.max_shared_memory
    };
    if let Some([p, b, s]) = tuning().mma.as_deref() {
        return Some(config(*p, *b, *s)).filter(fits);
    }
    // Planes of 16 keys a step, 2 stages: 8 planes from d = 128 where they fit (against 4
    // planes, 1.00–1.14× at all 18 points of 4k–32k keys × b = 1, 8, 32 × GQA 32:8 and 8:1
    // in two H100 calls at d = 128, docs/benchmarks.md), else 4 (the shape measured before;
    // smaller head dims and devices short of shared memory).
    let wide = config(8, 16, 2);
    match dim >= 128 && fits(&wide) {
        true => Some(wide),
        false => Some(config(4, 16, 2)).filter(fits),
    }
}

/// The tiles of [`lanes::flash_decode_lanes`] for `problem` on this device, or `None` where
/// that kernel does not apply: no plane operations, `d_qk ≠ d_v`, or a head dim that is not
/// whole 16-byte vectors dividing a plane (the caches must also be readable by 16-byte
/// loads, which [`decode`] checks). `FLASH_DECODE_KERNEL=staged` takes the staged kernel
/// always and `FLASH_DECODE_LANES=planes,unroll,row_groups[,async copies 0/1,stages]` sets the
/// tiles (tuning).
pub fn lanes_config(
    problem: &AttentionProblem,
    limits: &DeviceLimits,
    paged: bool,
    split: bool,
) -> Option<LanesConfig> {
    const PLANES: usize = 4;
    const MAX_ROWS: usize = 8;
    if tuning().kernel_is("staged") {
        return None;
    }
    let elem = problem.dtype.size();
    let vector = 16 / elem;
    let dim = problem.dim_qk;
    let lanes = dim / vector;
    let applies = limits.plane_ops
        && problem.dim_v == dim
        && dim.is_multiple_of(vector)
        && lanes.is_power_of_two()
        && lanes <= limits.plane_size;
    if !applies {
        return None;
    }
    let rows = (problem.group_size() * problem.seq_q)
        .next_power_of_two()
        .min(MAX_ROWS);
    let tiles = tuning().lanes.as_deref();
    let async_copies = match problem.dtype {
        FloatDtype::BF16 => limits.mma_sync_bf16,
        _ => limits.mma_sync_f16,
    };
    // Defaults (H100/H200 A/B runs): 4 planes; on the asynchronous path 4 keys a slot per
    // step, at most 4 rows a lane, 3 stages (2 for 8 rows); through registers 4 keys a slot
    // (2 for 8 rows), every row a lane.
    let (mut planes, mut unroll, mut row_groups, mut stages) = match async_copies {
        true => (PLANES, 4, rows.div_ceil(4), if rows <= 4 { 3 } else { 2 }),
        false => (PLANES, if rows <= 4 { 4 } else { 2 }, 1, 2),
    };
    let mut async_copies = async_copies;
    if let Some(tiles) = tiles {
        match *tiles {
            [p, u, g] => (planes, unroll, row_groups) = (p, u, g),
            [p, u, g, a, st] => {
                (planes, unroll, row_groups, stages) = (p, u, g, st);
                async_copies &= a == 1;
            }
            _ => return None,
        }
    }
    let config = LanesConfig {
        rows,
        dim,
        vector,
        plane_size: limits.plane_size,
        planes: planes.max(1),
        unroll: unroll.max(1),
        row_groups: row_groups.clamp(1, rows),
        async_copies,
        stages: stages.clamp(2, 3),
        masked: problem.options.mask.is_masked(),
        softcap: problem.options.softcap.is_some(),
        terms: ScoreTerms::default(),
        paged,
        split,
    };
    let fits = config.units() <= limits.max_units_per_cube
        && config.units() >= rows
        && rows.is_multiple_of(config.row_groups)
        && config.slots() >= 1
        && config.shared_bytes(elem) <= limits.max_shared_memory;
    fits.then_some(config)
}

/// Writes `inputs.new` into the cache, then attends the new queries to each sequence's
/// `cache_seqlens[b] + s_new` first positions. The cache is written in place; the lengths are
/// not updated (the caller's `cache_seqlens` still counts the positions before the append).
///
/// Bad input — shapes that disagree, an append past the capacity, a negative length, a
/// block-table entry naming no page — is refused before anything is written (the lengths
/// and the block table are read back to be checked).
pub fn decode(
    client: &Client,
    inputs: DecodeInputs,
    dtype: FloatDtype,
    options: AttentionOptions,
    splits: Splits,
) -> Result<DecodeOutput, FlashError> {
    let q = inputs.q;
    rank("query", q, 4, "[batch, heads_q, s_q, d_qk]")?;
    let geometry = CacheGeometry::new(&inputs.cache, q.shape[0])?;
    let problem = geometry.problem(&q.shape, dtype, options)?;
    if options.dropout.is_some_and(|d| d.is_active()) {
        return Err(FlashError::Option {
            arg: "dropout",
            expected: "none: decode serves inference, dropout is for training".into(),
        });
    }
    check_dtype(client, dtype)?;
    if inputs.terms.block_mask.is_some() {
        return Err(FlashError::Option {
            arg: "block_mask",
            expected: "none: decode takes a bias, ALiBi and a score function".into(),
        });
    }
    let terms = inputs.terms.terms(&problem, TermsGrad::default())?;
    // The caches past 32-bit offsets take the lanes kernel (below); the queries and the
    // terms the kernels index by position must stay within them.
    check_spans(
        [("query", q)]
            .into_iter()
            .chain(inputs.terms.indexed_tensors()),
    )?;
    let s_new = check_new(&inputs, &geometry)?;
    let longest_cached = check_lengths(client, &inputs, &geometry, s_new)?;
    let longest = longest_cached + s_new;
    let rotary = RotaryConfig::new(
        inputs.rotary.as_ref(),
        geometry.dim_qk,
        longest_cached + s_new.max(problem.seq_q),
    )?;
    // Without a rotation the tables are never read: `q` stands in for them.
    let (rotary_cos, rotary_sin) = match &inputs.rotary {
        Some(r) => (r.cos, r.sin),
        None => (q, q),
    };

    let limits = DeviceLimits::from_properties(client.properties());
    let paged = geometry.page_size.is_some();
    let page_size = geometry.page_size.unwrap_or(1) as u32;
    // A contiguous cache's kernels never read the table: the lengths stand in for it.
    let table = inputs.cache.block_table.unwrap_or(inputs.cache_seqlens);
    let (k, v) = (
        geometry.kernel_view(inputs.cache.k),
        geometry.kernel_view(inputs.cache.v),
    );
    for (arg, t) in [("k_cache", &k), ("v_cache", &v)] {
        if t.strides[3] != 1 {
            return Err(shape_error(
                arg,
                t,
                format!(
                    "its head dim must be contiguous (stride 1), got strides {:?}",
                    t.strides
                ),
            ));
        }
    }
    let table_row = match inputs.cache.block_table {
        Some(table) if table.strides[1] != 1 => {
            return Err(shape_error(
                "block_table",
                table,
                format!(
                    "its rows must be contiguous (stride 1), got strides {:?}",
                    table.strides
                ),
            ));
        }
        Some(table) => u32::try_from(table.strides[0])
            .map_err(|_| shape_error("block_table", table, "a row stride below 2^32".into()))?,
        None => 0,
    };

    // The kernel, its tiles and the split count, checked before anything is written.
    let vector_loads = [&k, &v]
        .iter()
        .all(|t| readable_by_16_byte_copies(t, dtype.size()));
    // The tensor-core kernel reads the caches element by element: CubeCL's launch takes
    // their lengths as 32-bit scalars, so caches past 2^32 elements go to the lanes
    // kernel, which reads them in 16-byte vectors.
    let element_addressable = [&k, &v].iter().all(|t| t.span() <= u32::MAX as usize);
    let mma = match tuning().kernel.as_deref() {
        Some("lanes" | "staged") => None,
        _ if !element_addressable => None,
        _ => mma_decode_config(&problem, &limits, paged, false),
    };
    let kernel = match (mma, lanes_config(&problem, &limits, paged, false)) {
        (Some(config), _) if vector_loads => Kernel::Mma(config),
        (_, Some(config)) if vector_loads => Kernel::Lanes(config),
        _ => Kernel::Staged(decode_config(&problem, &limits, paged, false)?),
    };
    let packed = problem.group_size() * problem.seq_q;
    let cubes = geometry.batch * geometry.heads_kv * packed.div_ceil(kernel.rows());
    let key_blocks = longest.div_ceil(kernel.step());
    let splits = match splits {
        Splits::Exactly(n) if n >= 1 => n,
        Splits::Exactly(n) => {
            return Err(FlashError::Option {
                arg: "splits",
                expected: format!("at least 1, got {n}"),
            });
        }
        Splits::Auto => {
            let rule = match (tuning().splits.as_deref(), &kernel) {
                (Some("waves"), _) => SplitRule::Waves,
                (Some("fill"), _) => SplitRule::Fill,
                // Measured on the tensor-core kernel (H100): 1.14–1.19× at b = 8.
                (_, Kernel::Mma(_)) => SplitRule::Waves,
                (_, Kernel::Lanes(_) | Kernel::Staged(_)) => SplitRule::Fill,
            };
            choose_splits(SplitInputs {
                cubes,
                multiprocessors: limits.multiprocessors,
                key_blocks,
                cubes_per_multiprocessor: kernel.resident_cubes(&limits, dtype),
                min_blocks_per_split: tuning().min_blocks.unwrap_or(rule.min_blocks_per_split()),
                max_blocks_per_split: match &kernel {
                    Kernel::Staged(config) => loop_budget::decode_max_blocks(config, &limits),
                    Kernel::Lanes(_) | Kernel::Mma(_) => None,
                },
                rule,
            })
        }
    };
    let kernel = kernel.split(splits > 1).terms(terms);
    let vector = match kernel {
        Kernel::Lanes(config) => config.vector,
        Kernel::Staged(_) | Kernel::Mma(_) => 1,
    };
    let (k_rows, v_rows) = (
        k.vector_row_layout("k_cache", vector)?,
        v.vector_row_layout("v_cache", vector)?,
    );
    if let Kernel::Staged(config) = &kernel
        && !problem.is_empty()
    {
        loop_budget::check(
            "decode",
            loop_budget::decode_iterations(config, key_blocks.div_ceil(splits)),
            &problem,
            &limits,
        )?;
    }
    if cubes > GRID_DIM * GRID_DIM || splits > GRID_DIM {
        return Err(FlashError::Shape {
            arg: "query",
            shape: q.shape.clone(),
            expected: format!(
                "batch · heads_kv · query blocks ({cubes}) at most {} and splits ({splits}) at \
                 most {GRID_DIM}",
                GRID_DIM * GRID_DIM
            ),
        });
    }

    if let Some((k_new, v_new)) = inputs.new
        && s_new > 0
        && geometry.batch * geometry.heads_kv > 0
    {
        let count = blocks_by_pairs(s_new.min(GRID_DIM), geometry.batch * geometry.heads_kv);
        // Keys turn by the rotary embedding on their way into the cache; values do not.
        for (new, cache, rotate) in [(k_new, &k, rotary), (v_new, &v, RotaryConfig::NONE)] {
            unsafe {
                append::append_to_cache::launch_unchecked(
                    client,
                    count.clone(),
                    CubeDim::new_1d(64),
                    new.arg(),
                    cache.arg(),
                    inputs.cache_seqlens.arg(),
                    table.arg(),
                    rotary_cos.arg(),
                    rotary_sin.arg(),
                    page_size,
                    paged,
                    rotate,
                    dtype.elem_type(),
                );
            }
        }
    }

    let out = DeviceTensor::empty(client, &problem.out_shape(), dtype.size());
    let lse = DeviceTensor::empty(client, &problem.lse_shape(), 4);
    if problem.is_empty() {
        return Ok(DecodeOutput {
            out,
            lse,
            splits: 0,
        });
    }
    let rows = problem.batch * problem.heads_q * problem.seq_q;
    let (partial_out, partial_lse) = match kernel.is_split() {
        true => (
            DeviceTensor::empty(client, &[splits, rows, problem.dim_v], 4),
            DeviceTensor::empty(client, &[splits, rows], 4),
        ),
        false => (
            DeviceTensor::empty(client, &[1], 4),
            DeviceTensor::empty(client, &[1, 1], 4),
        ),
    };
    // Absent terms are never read: the queries and the lengths stand in for them.
    let [bias, alibi_slopes, score_params] = inputs.terms.args(q, inputs.cache_seqlens);
    let mask = problem
        .options
        .mask
        .kernel_window(problem.seq_q, geometry.capacity);
    let count = blocks_by_pairs(splits, cubes);
    match kernel {
        Kernel::Staged(config) => unsafe {
            kernel::flash_decode::launch_unchecked(
                client,
                count,
                CubeDim::new_1d(config.units as u32),
                q.arg(),
                k.arg(),
                v.arg(),
                k_rows,
                v_rows,
                inputs.cache_seqlens.arg(),
                table.arg(),
                table_row,
                out.arg(),
                lse.arg(),
                partial_out.arg(),
                partial_lse.arg(),
                rotary_cos.arg(),
                rotary_sin.arg(),
                bias.arg(),
                alibi_slopes.arg(),
                score_params.arg(),
                s_new as u32,
                page_size,
                problem.scale(),
                softcap_arg(&problem),
                mask.0,
                mask.1,
                f32::NEG_INFINITY,
                config,
                rotary,
                dtype.elem_type(),
            );
        },
        Kernel::Lanes(config) => unsafe {
            lanes::flash_decode_lanes::launch_unchecked(
                client,
                count,
                CubeDim::new_1d(config.units() as u32),
                config.vector,
                q.arg(),
                k.arg(),
                v.arg(),
                k_rows,
                v_rows,
                inputs.cache_seqlens.arg(),
                table.arg(),
                table_row,
                out.arg(),
                lse.arg(),
                partial_out.arg(),
                partial_lse.arg(),
                rotary_cos.arg(),
                rotary_sin.arg(),
                bias.arg(),
                alibi_slopes.arg(),
                score_params.arg(),
                s_new as u32,
                page_size,
                problem.scale(),
                softcap_arg(&problem),
                mask.0,
                mask.1,
                f32::NEG_INFINITY,
                config,
                rotary,
                dtype.elem_type(),
            );
        },
        Kernel::Mma(config) => unsafe {
            mma::flash_decode_mma::launch_unchecked(
                client,
                count,
                CubeDim::new_1d(config.units() as u32),
                q.arg(),
                k.arg(),
                v.arg(),
                k_rows,
                v_rows,
                inputs.cache_seqlens.arg(),
                table.arg(),
                table_row,
                out.arg(),
                lse.arg(),
                partial_out.arg(),
                partial_lse.arg(),
                rotary_cos.arg(),
                rotary_sin.arg(),
                bias.arg(),
                alibi_slopes.arg(),
                score_params.arg(),
                s_new as u32,
                page_size,
                problem.scale(),
                softcap_arg(&problem),
                mask.0,
                mask.1,
                f32::NEG_INFINITY,
                config,
                rotary,
                dtype.elem_type(),
            );
        },
    }
    if kernel.is_split() {
        let merge_units = merge::merge_units(problem.dim_v, limits.max_units_per_cube);
        let x = rows.min(GRID_DIM);
        unsafe {
            merge::merge_by_lse::launch_unchecked(
                client,
                CubeCount::Static(x as u32, rows.div_ceil(x) as u32, 1),
                CubeDim::new_1d(merge_units as u32),
                partial_out.arg(),
                partial_lse.arg(),
                out.arg(),
                lse.arg(),
                f32::NEG_INFINITY,
                merge_units,
                problem.dim_v,
                dtype.elem_type(),
            );
        }
    }
    Ok(DecodeOutput { out, lse, splits })
}

/// The decode kernel that runs, with its tiles.
#[derive(Clone, Copy, Debug)]
enum Kernel {
    /// [`lanes::flash_decode_lanes`], on GPUs.
    Lanes(LanesConfig),
    /// [`kernel::flash_decode`], everywhere else.
    Staged(DecodeConfig),
    /// [`mma::flash_decode_mma`], on CUDA sm_80+ in f16 and bf16.
    Mma(MmaDecodeConfig),
}

impl Kernel {
    /// Packed query rows per cube.
    fn rows(&self) -> usize {
        match self {
            Self::Lanes(c) => c.rows,
            Self::Staged(c) => c.rows,
            Self::Mma(_) => MmaDecodeConfig::TILE_ROWS,
        }
    }

    /// Keys per step of a cube: splits are whole steps.
    fn step(&self) -> usize {
        match self {
            Self::Lanes(c) => c.step(),
            Self::Staged(c) => c.block_kv,
            Self::Mma(c) => c.step(),
        }
    }

    fn split(self, split: bool) -> Self {
        match self {
            Self::Lanes(c) => Self::Lanes(LanesConfig { split, ..c }),
            Self::Staged(c) => Self::Staged(DecodeConfig { split, ..c }),
            Self::Mma(c) => Self::Mma(MmaDecodeConfig { split, ..c }),
        }
    }

    fn terms(self, terms: ScoreTerms) -> Self {
        match self {
            Self::Lanes(c) => Self::Lanes(LanesConfig { terms, ..c }),
            Self::Staged(c) => Self::Staged(DecodeConfig { terms, ..c }),
            Self::Mma(c) => Self::Mma(MmaDecodeConfig { terms, ..c }),
        }
    }

    fn is_split(&self) -> bool {
        match self {
            Self::Lanes(c) => c.split,
            Self::Staged(c) => c.split,
            Self::Mma(c) => c.split,
        }
    }

    /// Cubes a multiprocessor holds at once, which the split count fills: the tensor-core
    /// kernel's, by its shared memory (one wave of splits, each as long as it can be); the
    /// others', [`split::CUBES_PER_MULTIPROCESSOR`]. `FLASH_DECODE_RESIDENT=n` sets it (tuning).
    fn resident_cubes(&self, limits: &DeviceLimits, dtype: FloatDtype) -> usize {
        if let Some(n) = tuning().resident {
            return n;
        }
        match self {
            Self::Mma(c) => (limits.max_shared_memory / c.shared_bytes(dtype.size()))
                .clamp(1, split::CUBES_PER_MULTIPROCESSOR),
            _ => split::CUBES_PER_MULTIPROCESSOR,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::NVIDIA;

    /// f32 at d = 256 with 4 query heads per K/V head and 5 new queries: 32 packed rows
    /// need more than the 48 KB the tiles keep to by default; the device has room for them.
    #[test]
    fn large_head_dims_take_the_whole_shared_memory_before_refusing() {
        let problem = AttentionProblem::new(
            &[1, 4, 5, 256],
            &[1, 1, 64, 256],
            &[1, 1, 64, 256],
            FloatDtype::F32,
            AttentionOptions::default(),
        )
        .unwrap();
        let config = decode_config(&problem, &NVIDIA, false, true).unwrap();
        assert_eq!(config.rows, 32);
        assert!(config.shared_bytes() > 48 * 1024);
        assert!(config.shared_bytes() <= NVIDIA.max_shared_memory);
        // Where even one key block of 32 rows does not fit, fewer rows per cube.
        let small = DeviceLimits {
            max_shared_memory: 40 * 1024,
            ..NVIDIA
        };
        let config = decode_config(&problem, &small, false, true).unwrap();
        assert!(config.rows < 32 && config.shared_bytes() <= small.max_shared_memory);
    }
}
