"""Merges result files of examples/bench.rs and benches/torch_sdpa.py into one JSON array
and prints a markdown table: TFLOP/s per implementation, and ours as a ratio to each peer.

    python3 benches/report.py ours.json torch.json --out docs/benchmarks/h200.json
"""
import argparse, json

p = argparse.ArgumentParser()
p.add_argument("files", nargs="+")
p.add_argument("--out")
a = p.parse_args()
records = [r for f in a.files for r in json.load(open(f))]
if a.out:
    json.dump(records, open(a.out, "w"), indent=1)
rows = {}
impls = []
for r in records:
    if r.get("header"):
        continue
    key = (r["dtype"], r["d"], r["s_q"], r["causal"], r["b"], r["h"], r["h_kv"], r["pass"])
    rows.setdefault(key, {})[r["impl"]] = r["tflops"]
    if r["impl"] not in impls:
        impls.append(r["impl"])
print("| dtype | d | s | causal | b×h | pass | " + " | ".join(impls) + " | ours / torch_flash |")
print("|" + "---|" * (7 + len(impls)))
for key in sorted(rows):
    dtype, d, s, causal, b, h, h_kv, pass_ = key
    cells = [f"{rows[key][i]:.1f}" if i in rows[key] else "–" for i in impls]
    ratio = rows[key].get("ours", 0) / rows[key]["torch_flash"] if "torch_flash" in rows[key] else float("nan")
    print(f"| {dtype} | {d} | {s} | {'yes' if causal else 'no'} | {b}×{h} | {pass_} | " + " | ".join(cells) + f" | {ratio:.3f} |")
