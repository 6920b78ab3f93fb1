#!/usr/bin/env bash
# CacheMuon's refresh and hit paths as conditional graph nodes, in one device call, with the
# bundle's binaries (.gpubin/bundle.tar.xz from tests/gpu/stage.sh): the CUDA tests of the
# conditional blocks and of CacheMuon (captured calls against eager ones bit for bit), memcheck
# over them, then distmuon-cuda-bench's CacheMuon part: per call on qwen2.5-7b's MLP shapes and
# on the 6 x 384 study model's, eager and replayed (fresh, all hits, all refreshes), and
# gpt2-small engine steps under a drifting gradient (cache off, gamma 2, gamma 15).
# Output under $OUT: cache_graphs.log, cache.json.
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble cache_graphs || exit 1
export DISTMUON_AUTOTUNE=off
rc=0
say "test_cuda_backend (conditional blocks) and test_cuda_cache"
$BIN/test_cuda_backend --gtest_brief=1 --gtest_filter='CudaGraphs.*' 2>&1 | tee -a "$LOG" | tail -4
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
$BIN/test_cuda_cache --gtest_brief=1 2>&1 | tee -a "$LOG" | tail -4
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
say "memcheck over the captured CacheMuon calls"
compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$BIN/test_cuda_cache" \
  --gtest_brief=1 --gtest_filter='*Captured*' 2>&1 | tee -a "$LOG" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
say "distmuon-cuda-bench: CacheMuon per call and engine steps"
$BIN/distmuon-cuda-bench --no-micro --no-tune --workloads "" --json "$OUT/cache.json" 2>&1 \
  | grep "^\[cache\]" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
say "done (rc $rc)"
exit $rc
