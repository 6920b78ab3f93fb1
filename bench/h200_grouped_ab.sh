#!/usr/bin/env bash
# Grouped products (DISTMUON_GROUPED_PRODUCTS=auto, build "B") against one launch per shape class
# and product (=off, "A"), in one device call with the bundle's binaries (.gpubin/bundle.tar.xz
# from tests/gpu/stage.sh): the grouped kernel's tests and memcheck over them, then
# distmuon-cuda-bench's workload steps with the two settings alternating (ROUNDS rounds, tuning
# off so that both run the same algorithms), and their medians (bench/ab_summary.py).
# TUNED=1: with tuning on (the default of a user's run) instead; TESTS=0 leaves the tests out.
# Output under $OUT: grouped_ab.log, A-<round>.json, B-<round>.json, ab.md.
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WL=${WL-resnet18,gpt2-small,pi0,deepseek-v2-lite:2}
ROUNDS=${ROUNDS:-3}
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble grouped_ab || exit 1
tune=--no-tune
if [ "${TUNED:-0}" = 1 ]; then tune=""; else export DISTMUON_AUTOTUNE=off; fi
rc=0
if [ "${TESTS:-1}" = 1 ]; then
say "test_cuda_grouped"
$BIN/test_cuda_grouped --gtest_brief=1 2>&1 | tee -a "$LOG" | grep -E "^\[measure\]|PASSED|FAILED|Failure|error" | head -40
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
say "memcheck over the grouped kernel"
compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$BIN/test_cuda_grouped" \
  --gtest_brief=1 2>&1 | tee -a "$LOG" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    setting=off; [ "$side" = B ] && setting=auto
    say "round $r, DISTMUON_GROUPED_PRODUCTS=$setting"
    DISTMUON_GROUPED_PRODUCTS=$setting $BIN/distmuon-cuda-bench --no-micro $tune --no-cache \
      --workloads "$WL" --json "$OUT/$side-$r.json" 2>&1 | grep "eager" | tee -a "$LOG"
  done
done
python3 bench/ab_summary.py "$OUT" | tee "$OUT/ab.md" | tee -a "$LOG"
say "done (rc $rc)"
exit $rc
