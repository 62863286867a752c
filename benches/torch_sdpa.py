"""PyTorch SDPA peers (flash = FlashAttention-2, cuDNN) on the same grid as examples/bench.rs,
with the card's measured ceilings (bf16 matmul, device copy bandwidth).

    python3 benches/torch_sdpa.py --seqs 512,1024,2048,4096 --dims 64,128 --json out.json

Records use the same fields as the Rust bench; FLOPs as FlashAttention's benchmark
(forward 4*b*h*s*s*d, halved when causal; backward 2.5x forward).
"""
import argparse, json, subprocess, time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

p = argparse.ArgumentParser()
p.add_argument("--seqs", default="512,1024,2048,4096")
p.add_argument("--dims", default="64,128")
p.add_argument("--causal", default="false,true")
p.add_argument("--dtypes", default="bf16")
p.add_argument("--tokens", type=int, default=16384)
p.add_argument("--dropout", type=float, default=0.0, help="dropout_p on the probabilities")
p.add_argument("--json", default="torch_sdpa.json")
a = p.parse_args()
ints = lambda s: [int(x) for x in s.split(",")]
bools = lambda s: [x == "true" for x in s.split(",")]
dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

dev = "cuda"
torch.manual_seed(0)
driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                        capture_output=True, text=True).stdout.strip()
n = 8192
x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
mm = do_bench(lambda: x @ x, warmup=10, rep=50, return_mode="median")
buf = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
out = torch.empty_like(buf)
cp = do_bench(lambda: out.copy_(buf), warmup=10, rep=50, return_mode="median")
del x, buf, out
header = {"header": True, "card": torch.cuda.get_device_name(), "driver": driver,
          "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
          "date": time.strftime("%Y-%m-%d"),
          "ceiling_bf16_matmul_tflops": 2 * n**3 / mm / 1e9,
          "ceiling_copy_gbps": 2 * (1 << 30) / cp / 1e6}
print(header, flush=True)
records = [header]
backends = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}
for dname in a.dtypes.split(","):
    dtype = dtypes[dname]
    for d in ints(a.dims):
        for s in ints(a.seqs):
            for causal in bools(a.causal):
                b, h = max(1, a.tokens // s), 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
                do = torch.randn(b, h, s, d, device=dev, dtype=dtype)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                for name, backend in backends.items():
                    try:
                        with sdpa_kernel([backend]):
                            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=a.dropout)
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            fwd()
                            torch.cuda.synchronize()
                            mem = (torch.cuda.max_memory_allocated() - base) / 2**20
                            t = do_bench(fwd, warmup=25, rep=100, return_mode="median")
                            def fb():
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=a.dropout).backward(do)
                            tb = do_bench(fb, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v])
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            fb()
                            torch.cuda.synchronize()
                            mem_fb = (torch.cuda.max_memory_allocated() - base) / 2**20
                            q.grad = k.grad = v.grad = None
                            # The backward alone, as FlashAttention's benchmark times it: the
                            # graph of one forward kept and walked again.
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=a.dropout)
                            tbw = do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100,
                                           return_mode="median", grad_to_none=[q, k, v])
                            del o
                    except Exception as e:  # a backend refusing a shape is a result too
                        print(name, "error", str(e)[:100], flush=True)
                        continue
                    for pass_, ms, fl, peak in (("fwd", t, flops, mem), ("bwd", tbw, 2.5 * flops, None),
                                                ("fwd_bwd", tb, 3.5 * flops, mem_fb)):
                        r = {"impl": name, "pass": pass_, "dtype": dname, "b": b, "h": h, "h_kv": h,
                             "s_q": s, "s_kv": s, "d": d, "causal": causal, "ms": ms,
                             "tflops": fl / ms / 1e9, "peak_extra_mib": peak,
                             **({"dropout": a.dropout} if a.dropout else {})}
                        records.append(r)
                        print(f"{dname} b{b} h{h} s{s} d{d} causal={causal} {name:>12} {pass_:>7}: {ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s", flush=True)
json.dump(records, open(a.json, "w"), indent=1)
