"""PyTorch peers of examples/bench_decode.rs: one query token per sequence against a
contiguous KV cache, SDPA's flash (FlashAttention-2) and cuDNN backends with GQA, and the
device's copy bandwidth. Reports K/V bytes read per second.

    python3 benches/torch_decode.py --json torch_decode.json

With --graph each backend's call is captured 20 times in one CUDA graph and timed by
replays (records "graph": true), as examples/bench_decode.rs --graph times ours: the
device's time per call without the host's launch path. Without it, triton's do_bench.
"""
import argparse, json, time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

p = argparse.ArgumentParser()
p.add_argument("--lens", default="1024,4096,16384,32768,131072")
p.add_argument("--batches", default="1,8,32")
p.add_argument("--heads", default="32:8,8:1")
p.add_argument("--dim", type=int, default=128)
p.add_argument("--max-gib", type=float, default=40.0)
p.add_argument("--json", default="torch_decode.json")
p.add_argument("--graph", action="store_true")
a = p.parse_args()
ints = lambda s: [int(x) for x in s.split(",")]

dev = "cuda"
buf = torch.empty(1 << 31, device=dev, dtype=torch.uint8)
out = torch.empty_like(buf)
cp = do_bench(lambda: out.copy_(buf), warmup=10, rep=50, return_mode="median")
del buf, out
header = {"header": True, "card": torch.cuda.get_device_name(), "torch": torch.__version__,
          "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
          "ceiling_copy_gbps": 2 * (1 << 31) / cp / 1e6}
print(json.dumps(header), flush=True)
records = [header]
CALLS = 20


def graph_ms(f):
    """Median time per call of replays of `f` captured CALLS times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return sorted(times)[len(times) // 2]


backends = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}
for heads in a.heads.split(","):
    h_q, h_kv = (int(x) for x in heads.split(":"))
    for b in ints(a.batches):
        for n in ints(a.lens):
            d = a.dim
            kv_bytes = b * h_kv * n * 2 * d * 2
            if kv_bytes / 2**30 > a.max_gib:
                continue
            q = torch.randn(b, h_q, 1, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, h_kv, n, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, h_kv, n, d, device=dev, dtype=torch.bfloat16)
            for name, backend in backends.items():
                rec = {"impl": name, "b": b, "h_q": h_q, "h_kv": h_kv, "cache_len": n, "d": d,
                       "page_size": 0}
                try:
                    with sdpa_kernel([backend]):
                        f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        f()
                        ms = graph_ms(f) if a.graph else do_bench(
                            f, warmup=10, rep=50, return_mode="median")
                    rec.update(graph=a.graph, ms=ms, kv_gbps=kv_bytes / ms / 1e6)
                except Exception as e:  # a backend that refuses the shape
                    rec.update(error=str(e).splitlines()[0][:200])
                print(json.dumps(rec), flush=True)
                records.append(rec)
            del q, k, v
            torch.cuda.empty_cache()
json.dump(records, open(a.json, "w"), indent=1)
