#!/usr/bin/env bash
# A long fuzzing run on a GPU: processes of the integration tests' fuzzers (tests/fuzz.rs)
# side by side, each with a seed of its own, for a wall-clock budget; then one line per
# process (kind, path, seed, cases that passed, failures) in OUT_DIR/summary.txt and each
# failure's smallest case in its log, then the totals per kind and path.
#
#   tools/fuzz_long.sh TEST_BINARY OUT_DIR SECONDS [JOB...]
#
# A job is KIND:PATH[:COPIES] — KIND `dense` (training kernels), `terms` (with score terms)
# or `decode` (serving steps; PATH is ignored), PATH `portable`, `tensor-core`,
# `register-mma` or `all`. Default: every kind on every path in 16 processes, the most for
# the register-level path, whose cases compile the most kernels. Seeds are `FUZZ_SEED0`
# (default the date) plus the process's number, so a run is drawn again by the same seeds. On a GPU
# each case with new options compiles its kernels (15–30 s for a register-level case): each
# drawn case runs `FLASH_FUZZ_SHAPES` shapes (default 24) with the same kernels, and the
# processes spread over the CPU cores.
set -u
bin=${1:?usage: tools/fuzz_long.sh TEST_BINARY OUT_DIR SECONDS [JOB...]}
out=${2:?usage: tools/fuzz_long.sh TEST_BINARY OUT_DIR SECONDS [JOB...]}
seconds=${3:?usage: tools/fuzz_long.sh TEST_BINARY OUT_DIR SECONDS [JOB...]}
shift 3
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(dense:portable:2 dense:tensor-core:2 dense:register-mma:3
  terms:portable terms:tensor-core:2 terms:register-mma:3 decode:all:3)
seed0=${FUZZ_SEED0:-$(date +%Y%m%d)000}
mkdir -p "$out"
export FLASH_DEVICE=${FLASH_DEVICE:-cuda} FLASH_FUZZ_SHAPES=${FLASH_FUZZ_SHAPES:-24}

n=0
for job in "${jobs[@]}"; do
  IFS=: read -r kind path copies <<<"$job"
  case $kind in
    dense) test=fuzz::random_problems_match_the_oracle ;;
    terms) test=fuzz::random_problems_with_score_terms_match_the_oracle ;;
    decode) test=fuzz::random_decode_steps_match_the_oracle ;;
    *) echo "unknown kind in job $job" >&2; exit 2 ;;
  esac
  [ "$path" = all ] && path=""
  for _ in $(seq "${copies:-1}"); do
    n=$((n + 1))
    seed=$((seed0 + n))
    FLASH_PATH=$path FLASH_FUZZ_CASES=1000000 FLASH_FUZZ_SEED=$seed \
      timeout "$seconds" "$bin" "$test" --exact --test-threads 1 --nocapture \
      >"$out/$kind-${path:-all}-$seed.log" 2>&1 &
  done
done
wait

for log in "$out"/*.log; do
  name=$(basename "$log" .log)
  # The kernel and score-terms checks print a line per (path, dtype) run, decode one per step.
  cases=$(grep -cE " total [0-9.]+m?s$|: ok$" "$log")
  failures=$(grep -c "smallest failing case" "$log")
  echo "$name: $cases passed, $failures failures"
done | tee "$out/summary.txt"
# Totals per kind and path (the name without its seed).
awk '{ key = $1; sub(/-[0-9]+:$/, "", key); passed[key] += $2; failed[key] += $4 }
  END { for (k in passed) printf "total %s: %d passed, %d failures\n", k, passed[k], failed[k] }' \
  "$out/summary.txt" | sort | tee -a "$out/summary.txt"
