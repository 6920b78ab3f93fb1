#!/usr/bin/env bash
# Where a CacheMuon refresh's extra time goes on small launch-bound shapes (issue 20), in one
# device call with the bundle's binaries (.gpubin/bundle.tar.xz from tests/gpu/stage.sh):
#   1. bench/h200_cache_graphs.sh: the CUDA tests of the conditional blocks and of CacheMuon,
#      memcheck over the captured calls, and per-call costs (eager and replayed);
#   2. Nsight Compute's per-kernel durations of distmuon-bench steps on the study model's MLP
#      (bench/workloads/study-small-mlp.json: 12 x 384 x 1536), fresh and with every entry
#      refreshing (--cache 1e-9), for each residual: the kernels a refresh adds, one by one.
# Output under $OUT: cache_graphs.log, cache.json, cache_profile.tgz (one raw ncu CSV per
# residual, xz'd; bench/kernel_profile.py groups them).
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash bench/h200_cache_graphs.sh; rc=$?
source bench/h200_bundle.sh
bundle_preamble cache_graphs || exit 1  # the same log, continued
export DISTMUON_AUTOTUNE=off
rm -rf /tmp/cprof && mkdir -p /tmp/cprof
for res in exact probe; do
  say "ncu: study-small-mlp, gram-ns fresh and all-refresh ($res), 1 warm-up + 2 steps each"
  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --print-kernel-base demangled \
    "$BIN/distmuon-bench" --backend cuda --workload bench/workloads/study-small-mlp.json \
    --algo gram-ns --cache 1e-9 --cache-residual "$res" --warmup 1 --steps 2 \
    > "/tmp/cprof/$res.csv" 2>> "$LOG" || rc=1
  grep -c '"' "/tmp/cprof/$res.csv" | sed "s/^/kernels+header lines: /" | tee -a "$LOG"
done
xz -9 -f /tmp/cprof/*.csv
tar czf "$OUT/cache_profile.tgz" -C /tmp/cprof .
say "done (rc $rc)"
exit $rc
