#!/usr/bin/env bash
# compute-sanitizer over the kernels the integration tests launch on a CUDA GPU: each tool
# (memcheck, racecheck, synccheck, initcheck) over each group of tests, one report per pair.
#
#   tools/sanitize.sh TEST_BINARY OUT_DIR [TOOL...]
#
# TEST_BINARY is the integration-test binary of a `--features cuda` build (cargo prints its
# path: target/release/deps/main-*); OUT_DIR receives `<tool>-<group>.log` and a summary
# line per pair in `summary.txt` (the errors the tool counted, the tests' result). The
# groups cover every kernel family: the catalogue's first problems on every path (forward,
# D, dK/dV, dQ, the atomic dQ), score terms and block masks, dropout, packed batches and
# serving (decode kernels, the append, the merge). The sanitizer slows kernels by 10–100×:
# the groups keep to small problems. `FLASH_CASE` limits the kernel catalogue and the
# score-terms problems to one each (default 2); `SANITIZE_GROUPS="decode varlen"` runs
# those groups only; `SANITIZE_TIMEOUT=seconds` stops a pair that runs longer (rc 124).
#
# synccheck reports "Missing wait" at the stage barriers of every kernel that streams
# blocks through `stages.rs` (16-byte copies tied to a barrier by `cp.async.mbarrier.arrive`,
# then `arrive_and_wait`): tools/mbarrier_synccheck.cu shows the same report on CUDA's
# documented form of that pipeline, whose results are right; docs/status.md has the runs.
set -u
bin=${1:?usage: tools/sanitize.sh TEST_BINARY OUT_DIR [TOOL...]}
out=${2:?usage: tools/sanitize.sh TEST_BINARY OUT_DIR [TOOL...]}
shift 2
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
sanitizer=${COMPUTE_SANITIZER:-compute-sanitizer}
command -v "$sanitizer" >/dev/null || sanitizer=/usr/local/cuda/bin/compute-sanitizer
mkdir -p "$out"
export FLASH_DEVICE=cuda FLASH_CASE=${FLASH_CASE:-2}

# Group name, then the test filters (exact names: fast to select, stable to rerun).
groups=(
  "kernels kernels::forward_and_backward_match_the_oracle kernels::atomic_dq_backward_matches_the_oracle"
  "terms bias::score_terms_match_the_oracle_on_every_path"
  "dropout dropout::dropout_matches_the_oracle_on_every_path"
  "varlen varlen::packed_batches_match_the_oracle_per_sequence"
  "decode decode::decode_adds_score_terms decode::many_splits_merge_in_rounds"
)

for tool in "${tools[@]}"; do
  for group in "${groups[@]}"; do
    read -r name filters <<<"$group"
    if [ -n "${SANITIZE_GROUPS:-}" ] && [[ " $SANITIZE_GROUPS " != *" $name "* ]]; then
      continue
    fi
    log="$out/$tool-$name.log"
    # shellcheck disable=SC2086
    timeout "${SANITIZE_TIMEOUT:-0}" "$sanitizer" --tool "$tool" --print-limit 20 --error-exitcode 99 \
      "$bin" $filters --exact --test-threads 1 >"$log" 2>&1
    rc=$?
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1)
    result=$(grep -oE "test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed" "$log" | tail -1)
    echo "$tool $name: rc $rc, ${errors:-no summary}, ${result:-no test result}" | tee -a "$out/summary.txt"
  done
done
