#!/usr/bin/env bash
# Decode benchmarks in one call on a GPU machine, from a prebuilt `bench_decode` binary:
# ours (contiguous and paged caches), then PyTorch SDPA's flash and cuDNN backends with the
# device's copy bandwidth (benches/torch_decode.py), on the same shapes.
#
#   benches/run_decode.sh BIN_DIR OUT_DIR
#
# Grid: d 128, bf16, one query token; cache lengths 1k…128k, batch 1/8/32, GQA 32:8
# (contiguous, pages of 1, 16, 64, 256) and 8:1 (contiguous); the queries turned by the
# rotary embedding at 32:8, 4k and 32k (its cost against the plain run). Each side twice:
# launched call by call (ours: wall time, the host's share included; PyTorch: do_bench's
# device time) and as replayed CUDA graphs (`--graph`: device time on both sides, the
# comparison that counts).
set -euo pipefail
bin="$1"
out="$2"
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
lens=1024,4096,16384,32768,131072
"$bin/bench_decode" --device cuda --lens "$lens" --batches 1,8,32 --heads 32:8 \
  --pages 0,1,16,64,256 --seconds 0.1 --json "$out/ours_decode_gqa4.json"
"$bin/bench_decode" --device cuda --lens "$lens" --batches 1,8,32 --heads 8:1 \
  --pages 0 --seconds 0.1 --json "$out/ours_decode_gqa8.json"
"$bin/bench_decode" --device cuda --lens 4096,32768 --batches 1,8,32 --heads 32:8 \
  --pages 0 --seconds 0.1 --rotary --json "$out/ours_decode_rotary.json"
python3 "$here/torch_decode.py" --lens "$lens" --batches 1,8,32 --heads 32:8,8:1 \
  --json "$out/torch_decode.json"
"$bin/bench_decode" --device cuda --lens "$lens" --batches 1,8,32 --heads 32:8,8:1 \
  --pages 0 --seconds 0.1 --graph --json "$out/ours_decode_graph.json"
"$bin/bench_decode" --device cuda --lens "$lens" --batches 1,8,32 --heads 32:8 \
  --pages 1,16 --seconds 0.1 --graph --json "$out/ours_decode_graph_paged.json"
python3 "$here/torch_decode.py" --lens "$lens" --batches 1,8,32 --heads 32:8,8:1 --graph \
  --json "$out/torch_decode_graph.json"
