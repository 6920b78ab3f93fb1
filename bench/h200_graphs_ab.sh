#!/usr/bin/env bash
# Whole-step graphs (EngineOptions::graphs) against steps issued eagerly, in one device call, with
# the bundle's binaries (.gpubin/bundle.tar.xz from tests/gpu/stage.sh): distmuon-cuda-bench's
# workload steps with DISTMUON_GRAPHS=0 and =1 alternating (ROUNDS rounds). Each run reports the
# step time as step() is called, its host time, and the same step inside a caller's graph.
# Output under $OUT: graphs_ab.log, ab-<setting>-<round>.json.
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WL=${WL-gpt2-small,gpt2-large,qwen2.5-7b:2}
ROUNDS=${ROUNDS:-2}
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble graphs_ab || exit 1
export DISTMUON_AUTOTUNE=off
rc=0
for r in $(seq 1 "$ROUNDS"); do
  for v in 0 1; do
    say "round $r, DISTMUON_GRAPHS=$v"
    DISTMUON_GRAPHS=$v $BIN/distmuon-cuda-bench --no-micro --no-tune --no-cache --no-cache-hit \
      --workloads "$WL" --json "$OUT/ab-$v-$r.json" 2>&1 | grep "step()" | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
say "done (rc $rc)"
exit $rc
