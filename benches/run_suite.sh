#!/usr/bin/env bash
# The whole benchmark grid in one call on a GPU machine, from prebuilt binaries (nothing is
# built there): our kernels, Burn's attention and materialized attention (examples/bench.rs),
# then PyTorch SDPA's FA2 and cuDNN backends (benches/torch_sdpa.py) on the same problems.
#
#   benches/run_suite.sh BIN_DIR OUT_DIR        # BIN_DIR holds the `bench` binary
#
# Grid: b·s = 16k tokens, s ∈ {512 … 16k}, d ∈ {64, 128}, causal and not, bf16, forward,
# backward and forward+backward; then f16 and d = 256 at three lengths.
# Afterwards, where the sources are: python3 benches/report.py OUT_DIR/*.json --out ALL.json
# and cargo run --release --example plot -- ALL.json --out docs/benchmarks
set -euo pipefail
bin="$1"
out="$2"
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
export BENCH_DATE="${BENCH_DATE:-$(date -u +%F)}"
BENCH_DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null || true)"
BENCH_CARD="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)"
export BENCH_DRIVER BENCH_CARD   # BENCH_COMMIT: set by the caller (the GPU machine may have no git)

grid=(--seqs 512,1024,2048,4096,8192,16384 --dims 64,128 --causal false,true --tokens 16384)
extra=(--seqs 1024,4096,16384 --tokens 16384 --causal false,true)

# IMPLS=ours skips Burn's and the materialized attention (slow, and unchanged by our work).
"$bin/bench" --device cuda "${grid[@]}" --dtypes bf16 --impls "${IMPLS:-ours,burn,materialized}" \
  --seconds 0.2 --json "$out/ours_bf16.json"
python3 "$here/torch_sdpa.py" --seqs 512,1024,2048,4096,8192,16384 --dims 64,128 \
  --dtypes bf16 --json "$out/torch_bf16.json"
"$bin/bench" --device cuda "${extra[@]}" --dims 128 --dtypes f16 --impls ours \
  --seconds 0.2 --json "$out/ours_f16.json"
"$bin/bench" --device cuda "${extra[@]}" --dims 256 --dtypes bf16 --impls ours \
  --seconds 0.2 --json "$out/ours_d256.json"
python3 "$here/torch_sdpa.py" --seqs 1024,4096,16384 --dims 128 --dtypes f16 \
  --json "$out/torch_f16.json"
python3 "$here/torch_sdpa.py" --seqs 1024,4096,16384 --dims 256 --dtypes bf16 \
  --json "$out/torch_d256.json"
