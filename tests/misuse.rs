//! Misuse and odd input, walked as one list through the Burn ops on the test device:
//! - every wrong argument panics before anything runs, with a message naming it, and the
//!   device computes the next call right;
//! - NaN in the inputs reaches exactly the rows whose math reads it (a NaN key that a mask
//!   hides reaches none), and the next call is clean;
//! - empty batches, heads and sequences give empty outputs, and rows without keys O = 0
//!   and LSE = −∞.

use std::panic::{AssertUnwindSafe, catch_unwind};

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use burn_flash_attention::kernels::reference::{self, Dims, ReferenceOptions};
use burn_flash_attention::kernels::{FloatDtype, MaskSpec};
use burn_flash_attention::{
    AttentionBias, Dropout, FlashAttentionOptions, Fp8Scaling, KvCache, PackedSequences,
    flash_attention, flash_attention_biased, flash_attention_fp8, flash_attention_varlen,
    flash_attention_with_kvcache, flash_attention_with_lse, quantize_fp8,
};

use crate::common::{self, assert_close, naive, tensor, values};

/// A misuse: what it is, the text its message must hold, and the call.
struct Misuse {
    what: &'static str,
    names: &'static str,
    call: Box<dyn Fn(&Device)>,
}

fn misuse(what: &'static str, names: &'static str, call: impl Fn(&Device) + 'static) -> Misuse {
    Misuse {
        what,
        names,
        call: Box::new(call),
    }
}

fn zeros(shape: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::zeros(shape, device)
}

fn ints(data: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = data.len();
    Tensor::from_data(TensorData::new(data, [n]), device)
}

/// A well-formed call's tensors: `q` `[1, 4, 8, 16]`, `k`/`v` `[1, 2, 8, 16]`.
fn qkv(device: &Device) -> [Tensor<4>; 3] {
    [
        zeros([1, 4, 8, 16], device),
        zeros([1, 2, 8, 16], device),
        zeros([1, 2, 8, 16], device),
    ]
}

fn plain(device: &Device, options: FlashAttentionOptions) {
    let [q, k, v] = qkv(device);
    flash_attention(q, k, v, options);
}

fn biased(device: &Device, terms: AttentionBias) {
    let [q, k, v] = qkv(device);
    flash_attention_biased(q, k, v, terms, FlashAttentionOptions::default());
}

fn list() -> Vec<Misuse> {
    vec![
        misuse("q in f64", "`q` has dtype F64", |_| {
            // Flex holds f64 tensors on every machine.
            let device = Device::flex();
            let q = Tensor::<4>::zeros([1, 4, 8, 16], (&device, DType::F64));
            let [_, k, v] = qkv(&device);
            flash_attention(q, k, v, FlashAttentionOptions::default());
        }),
        misuse("k in another dtype", "`k` has dtype", |_| {
            let device = Device::flex();
            let [q, k, v] = qkv(&device);
            flash_attention(q, k.cast(DType::F16), v, FlashAttentionOptions::default());
        }),
        misuse("v on another device", "`v`", |device| {
            let [q, k, _] = qkv(device);
            flash_attention(
                q,
                k,
                zeros([1, 2, 8, 16], &Device::flex()),
                FlashAttentionOptions::default(),
            );
        }),
        misuse("heads that do not divide", "`key`", |device| {
            let [q, _, _] = qkv(device);
            let kv = || zeros([1, 3, 8, 16], device);
            flash_attention(q, kv(), kv(), FlashAttentionOptions::default());
        }),
        misuse("batches that differ", "`key`", |device| {
            let [q, _, _] = qkv(device);
            let kv = || zeros([2, 2, 8, 16], device);
            flash_attention(q, kv(), kv(), FlashAttentionOptions::default());
        }),
        misuse("head dims that differ", "`key`", |device| {
            let [q, _, v] = qkv(device);
            flash_attention(
                q,
                zeros([1, 2, 8, 8], device),
                v,
                FlashAttentionOptions::default(),
            );
        }),
        misuse("values of another length", "`value`", |device| {
            let [q, k, _] = qkv(device);
            flash_attention(
                q,
                k,
                zeros([1, 2, 7, 16], device),
                FlashAttentionOptions::default(),
            );
        }),
        misuse(
            "a head dim past the largest",
            "head dim must be in",
            |device| {
                let t = |h: usize| zeros([1, h, 8, 300], device);
                flash_attention(t(2), t(2), t(2), FlashAttentionOptions::default());
            },
        ),
        misuse("a zero softcap", "`softcap`", |device| {
            plain(
                device,
                FlashAttentionOptions::default().with_softcap(Some(0.0)),
            )
        }),
        misuse("a NaN softcap", "`softcap`", |device| {
            plain(
                device,
                FlashAttentionOptions::default().with_softcap(Some(f32::NAN)),
            )
        }),
        misuse("an infinite scale", "`scale`", |device| {
            plain(
                device,
                FlashAttentionOptions::default().with_scale(Some(f32::INFINITY)),
            )
        }),
        misuse("a dropout of 1", "`dropout`", |device| {
            let dropout = Dropout {
                p: 1.0,
                seed: 0,
                offset: 0,
            };
            plain(
                device,
                FlashAttentionOptions::default().with_dropout(Some(dropout)),
            )
        }),
        misuse("a bias of the wrong shape", "`bias` has shape", |device| {
            biased(
                device,
                AttentionBias::new().with_bias(zeros([1, 4, 8, 9], device)),
            )
        }),
        misuse("a mask on another device", "`mask`", |device| {
            let hidden = TensorData::new(vec![false; 64], [1, 1, 8, 8]);
            let mask = Tensor::<4, Bool>::from_data(hidden, &Device::flex());
            biased(device, AttentionBias::new().with_mask(mask))
        }),
        misuse(
            "ALiBi slopes per batch of another size",
            "`alibi_slopes`",
            |device| {
                let slopes = Tensor::<2>::zeros([3, 4], device);
                biased(device, AttentionBias::new().with_alibi(slopes))
            },
        ),
        misuse(
            "parameters without a score function",
            "`score_params`",
            |device| {
                let params = Tensor::<2>::zeros([1, 1], device);
                biased(device, AttentionBias::new().with_score_params(params))
            },
        ),
        misuse("decreasing offsets", "`cu_seqlens`", |device| {
            PackedSequences::from_cu_seqlens(ints(vec![0, 5, 3], device));
        }),
        misuse(
            "a packed total that disagrees",
            "`cu_seqlens_q`",
            |device| {
                let t = |n: usize| Tensor::<3>::zeros([n, 2, 16], device);
                let sequences = PackedSequences::from_lengths(&[3, 4], device);
                flash_attention_varlen(
                    t(8),
                    t(7),
                    t(7),
                    &sequences,
                    &sequences,
                    Default::default(),
                );
            },
        ),
        misuse("an append past the cache", "`cache_seqlens`", |device| {
            let cache = KvCache::contiguous(1, 2, 8, [16, 16], device);
            let [q, k, v] = [[1, 4, 2, 16], [1, 2, 2, 16], [1, 2, 2, 16]].map(|s| zeros(s, device));
            flash_attention_with_kvcache(
                q,
                cache,
                ints(vec![7], device),
                Some((k, v)),
                None,
                FlashAttentionOptions::default(),
            );
        }),
        misuse(
            "a block-table entry naming no page",
            "`block_table`",
            |device| {
                let cache = KvCache {
                    k: zeros([3, 4, 2, 16], device),
                    v: zeros([3, 4, 2, 16], device),
                    block_table: Some(ints(vec![0, 5], device).reshape([1, 2])),
                };
                flash_attention_with_kvcache(
                    zeros([1, 4, 1, 16], device),
                    cache,
                    ints(vec![6], device),
                    None,
                    None,
                    FlashAttentionOptions::default(),
                );
            },
        ),
        misuse(
            "an FP8 call given a float query",
            "`q` has dtype",
            |device| {
                let [q, k, v] = qkv(device);
                let [k, v] = [k, v].map(|t| quantize_fp8(t, Fp8Scaling::PerTensor));
                let options = FlashAttentionOptions::default();
                flash_attention_fp8(q, k, v, options, DType::F32);
            },
        ),
        misuse("an FP8 call asked for integers", "`out_dtype`", |device| {
            let [q, k, v] = qkv(device).map(|t| quantize_fp8(t, Fp8Scaling::PerRow));
            let options = FlashAttentionOptions::default();
            flash_attention_fp8(q, k, v, options, DType::I32);
        }),
        misuse("FP8 rows of 6 values", "head dim 6", |device| {
            quantize_fp8(zeros([1, 1, 4, 6], device), Fp8Scaling::PerTensor);
        }),
    ]
}

/// The panic's message.
fn message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload
            .downcast::<&str>()
            .map_or_else(|_| "(no message)".into(), |s| s.to_string()),
    }
}

/// A causal GQA call on random inputs against the oracle: the device still computes right.
fn still_right(device: &Device, context: &str) {
    let (seed, mut rng) = common::rng();
    let dims = Dims {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        seq_q: 9,
        seq_kv: 13,
        dim_qk: 16,
        dim_v: 16,
    };
    let f = FloatDtype::F32;
    let x = [dims.q_len(), dims.k_len(), dims.v_len()].map(|n| common::randn(&mut rng, n, f));
    let shape = |h: usize, s: usize| [dims.batch, h, s, dims.dim_qk];
    let (out, lse) = flash_attention_with_lse(
        tensor(&x[0], shape(4, 9), device),
        tensor(&x[1], shape(2, 13), device),
        tensor(&x[2], shape(2, 13), device),
        FlashAttentionOptions::default().with_causal(true),
    );
    let case = common::Case {
        causal: true,
        ..common::case(dims)
    };
    let want = reference::forward(&dims, &case.reference_options(), &x[0], &x[1], &x[2]);
    let zeros = vec![0.0; dims.o_len()];
    let low = naive::attention(&case, f, &x[0], &x[1], &x[2], &zeros);
    let context = format!("{context}, seed {seed}");
    assert_close(f, "O", &values(out), &want.out, &low.out, 2e-5, &context);
    assert_close(f, "LSE", &values(lse), &want.lse, &low.lse, 2e-5, &context);
}

#[test]
fn every_misuse_is_named_and_the_device_keeps_working() {
    let device = common::burn_device();
    let list = list();
    for m in &list {
        let result = catch_unwind(AssertUnwindSafe(|| (m.call)(&device)));
        let Err(payload) = result else {
            panic!(
                "{}: the call ran, expected a panic naming {}",
                m.what, m.names
            );
        };
        let message = message(payload);
        assert!(
            message.contains(m.names),
            "{}: the message does not hold {:?}: {message}",
            m.what,
            m.names
        );
        eprintln!("{}: {message}", m.what);
        still_right(&device, &format!("after {}", m.what));
    }
    eprintln!("{} misuses named, the device right after each", list.len());
}

/// Causal attention of one sequence (`s_q = s_kv = 8`, 2 heads sharing one K/V head) with
/// a NaN planted in query row 2 of head 0, in key 5 and in value 6: rows that read any of
/// them are NaN; every other row (those before key 5, which the causal mask hides from
/// them, but for head 0's row 2) matches the oracle.
#[test]
fn nan_reaches_exactly_the_rows_that_read_it() {
    let device = common::burn_device();
    let (seed, mut rng) = common::rng();
    let dims = Dims {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        seq_q: 8,
        seq_kv: 8,
        dim_qk: 16,
        dim_v: 16,
    };
    let f = FloatDtype::F32;
    let [mut q, mut k, mut v] =
        [dims.q_len(), dims.k_len(), dims.v_len()].map(|n| common::randn(&mut rng, n, f));
    let (nan_row, nan_key, nan_value) = (2, 5, 6);
    q[nan_row * 16 + 3] = f64::NAN;
    k[nan_key * 16 + 7] = f64::NAN;
    v[nan_value * 16 + 2] = f64::NAN;
    let shape = |h: usize| [1, h, 8, 16];
    let (out, lse) = flash_attention_with_lse(
        tensor(&q, shape(2), &device),
        tensor(&k, shape(1), &device),
        tensor(&v, shape(1), &device),
        FlashAttentionOptions::default().with_causal(true),
    );
    let (out, lse) = (values(out), values(lse));
    // The oracle on the same inputs with the NaN replaced: the rows that do not read them.
    let mut clean_q = q.clone();
    let mut clean_k = k.clone();
    let mut clean_v = v.clone();
    clean_q[nan_row * 16 + 3] = 0.0;
    clean_k[nan_key * 16 + 7] = 0.0;
    clean_v[nan_value * 16 + 2] = 0.0;
    let options = ReferenceOptions {
        mask: MaskSpec::causal(),
        ..Default::default()
    };
    let want = reference::forward(&dims, &options, &clean_q, &clean_k, &clean_v);
    for head in 0..2 {
        for row in 0..8 {
            let at = head * 8 + row;
            let reads_nan = (head == 0 && row == nan_row) || row >= nan_key;
            let o = &out[at * 16..][..16];
            let context = format!("head {head}, row {row}, seed {seed}");
            if reads_nan {
                assert!(o.iter().all(|x| x.is_nan()), "O not NaN: {o:?} — {context}");
            } else {
                let w = &want.out[at * 16..][..16];
                let err = o
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(
                    err < 1e-4,
                    "O off by {err}: {o:?} against {w:?} — {context}"
                );
                assert!(
                    (lse[at] - want.lse[at]).abs() < 1e-4,
                    "LSE {} against {} — {context}",
                    lse[at],
                    want.lse[at]
                );
            }
        }
    }
    still_right(&device, "after NaN inputs");
}

/// On the test device and on Flex (the composed path).
#[test]
fn empty_batches_heads_and_sequences_give_empty_outputs() {
    for device in [common::burn_device(), Device::flex()] {
        empty_outputs(&device);
    }
    still_right(&common::burn_device(), "after empty inputs");
}

fn empty_outputs(device: &Device) {
    let run = |q: [usize; 4], kv: [usize; 4]| {
        flash_attention_with_lse(
            zeros(q, device),
            zeros(kv, device),
            zeros(kv, device),
            FlashAttentionOptions::default().with_causal(true),
        )
    };
    for (what, q, kv) in [
        ("no sequences", [0, 4, 8, 16], [0, 2, 8, 16]),
        ("no heads", [1, 0, 8, 16], [1, 0, 8, 16]),
        ("no queries", [1, 4, 0, 16], [1, 2, 8, 16]),
    ] {
        let (out, lse) = run(q, kv);
        assert_eq!(
            out.dims(),
            [q[0], q[1], q[2], 16],
            "O of {what} on {device:?}"
        );
        assert_eq!(
            lse.dims(),
            [q[0], q[1], q[2]],
            "LSE of {what} on {device:?}"
        );
    }
    // No keys: every row sees none.
    let (out, lse) = run([1, 4, 3, 16], [1, 2, 0, 16]);
    assert!(
        values(out).iter().all(|&x| x == 0.0),
        "O without keys on {device:?}"
    );
    assert!(
        values(lse).iter().all(|&x| x == f64::NEG_INFINITY),
        "LSE without keys on {device:?}"
    );
}
