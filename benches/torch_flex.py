"""PyTorch FlexAttention (torch.compile(flex_attention), Triton) on the score terms of
examples/bench.rs --terms: the same problems, FLOPs and record fields.

    python3 benches/torch_flex.py --seqs 4096 --dims 128 --terms none,alibi,relpos,bias,window \
        --json flex.json

Terms as score_mod / mask_mod: `alibi` subtracts slope_h·|i − j| (slopes 2^(−8(h+1)/H)),
`relpos` adds a trained table [h, 2s − 1] at i − j + s − 1, `bias` adds a fixed [h, s, s]
tensor, `window` keeps keys within --window to the left (a block mask, so empty blocks are
skipped); causal through a block mask too. Block masks as examples/bench.rs builds them:
`documents` (8 packed documents, lengths ∝ k + 1, causal within each with --causal true),
`prefix` (prefix-LM, the first quarter of the keys seen by all), `sparse` (128 × 128 blocks
kept at random with probability --density, the same hash). FLOPs as FlashAttention's
benchmark (forward 4·b·h·s²·d, halved when causal; backward 2.5×), over the visible pairs
for `window` and the block masks.
"""
import argparse, json, time

import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
from triton.testing import do_bench

p = argparse.ArgumentParser()
p.add_argument("--seqs", default="4096")
p.add_argument("--dims", default="128")
p.add_argument("--causal", default="false,true")
p.add_argument("--terms", default="none,alibi,relpos,bias,window")
p.add_argument("--window", type=int, default=1024)
p.add_argument("--tokens", type=int, default=16384)
p.add_argument("--density", type=float, default=0.25)
p.add_argument("--json", default="torch_flex.json")
a = p.parse_args()
ints = lambda s: [int(x) for x in s.split(",")]
bools = lambda s: [x == "true" for x in s.split(",")]

dev = "cuda"
torch.manual_seed(0)
flex = torch.compile(flex_attention)
records = [{"header": True, "card": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}]


def pairs(s, causal, window):
    if window is None:
        return s * s / (2 if causal else 1)
    return sum(min(i + 1, window + 1) + (0 if causal else s - 1 - i) for i in range(s))


for d in ints(a.dims):
    for s in ints(a.seqs):
        b, h = max(a.tokens // s, 1), 2048 // d
        for causal in bools(a.causal):
            for terms in a.terms.split(","):
                q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=dev)
                table = torch.randn(h, 2 * s - 1, device=dev, dtype=torch.bfloat16,
                                    requires_grad=True)
                bias = torch.randn(h, s, s, device=dev, dtype=torch.bfloat16)
                window = a.window if terms == "window" else None
                score_mod = {
                    "alibi": lambda sc, b_, h_, i, j: sc - slopes[h_] * (i - j).abs(),
                    "relpos": lambda sc, b_, h_, i, j: sc + table[h_, i - j + s - 1],
                    "bias": lambda sc, b_, h_, i, j: sc + bias[h_, i, j],
                }.get(terms)

                def visible(b_, h_, i, j):
                    ok = (i >= j) if causal else (i >= 0)
                    if window is not None:
                        ok = ok & (i - j <= window)
                    return ok

                if terms == "documents":
                    ends = [s * (k + 1) * (k + 2) // 72 for k in range(8)]
                    ids = torch.bucketize(torch.arange(s, device=dev),
                                          torch.tensor(ends, device=dev), right=True)

                    def visible(b_, h_, i, j):
                        same = ids[i] == ids[j]
                        return (same & (i >= j)) if causal else same
                elif terms == "prefix":
                    def visible(b_, h_, i, j):
                        return (j < s // 4) | (i >= j)
                elif terms == "sparse":
                    n = s // 128
                    r = torch.arange(n, dtype=torch.int64)
                    hsh = ((r[:, None] * 2654435761) & 0xFFFFFFFF) ^ ((r[None, :] * 40503) & 0xFFFFFFFF)
                    kept = (((hsh * 2246822519) & 0xFFFFFFFF) >> 8).double() / 2 ** 24 < a.density
                    kept = kept.to(dev)

                    def visible(b_, h_, i, j):
                        return kept[i // 128, j // 128]

                blocked = terms in ("documents", "prefix", "sparse")
                block_mask = None
                if causal or window is not None or blocked:
                    block_mask = create_block_mask(visible, None, None, s, s, device=dev)
                if blocked:
                    score_mod = None
                run = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
                o = run()
                g = torch.randn_like(o)
                fwd = do_bench(run, warmup=5, rep=50, return_mode="median")
                grads = [q, k, v] + ([table] if terms == "relpos" else [])
                fb = do_bench(lambda: torch.autograd.grad(run(), grads, g), warmup=5, rep=50,
                              return_mode="median")
                flops = 4 * b * h * d * pairs(s, causal, window)
                if blocked:
                    visible_pairs = create_mask(visible, None, None, s, s, device=dev).sum().item()
                    flops = 4 * b * h * d * visible_pairs
                for pas, ms, f in [("fwd", fwd, 1.0), ("fwd_bwd", fb, 3.5)]:
                    rec = {"impl": "torch_flex", "pass": pas, "dtype": "bf16", "b": b, "h": h,
                           "h_kv": h, "s_q": s, "s_kv": s, "d": d, "causal": causal,
                           "tokens": b * s, "mixed": False, "ms": ms,
                           "tflops": f * flops / ms / 1e9}
                    if terms != "none":
                        rec["terms"] = terms
                    print(rec, flush=True)
                    records.append(rec)
                del q, k, v, table, bias
                torch.cuda.empty_cache()
json.dump(records, open(a.json, "w"), indent=1)
