#!/usr/bin/env bash
# Issue 18's "auto never loses", in one device call, with the bundle's binaries
# (.gpubin/bundle.tar.xz from tests/gpu/stage.sh):
#  1. distmuon-cuda-bench --auto-check: per shape class of every workload, the tuner's pick, the
#     cost model's pick with the workload left out of its calibration, and resolve()'s heuristic,
#     each against the fastest of ns5, ns5-sym and Gram NS {2} timed independently
#     (bench/cuda_bench_auto.cc);
#  2. distmuon-bench whole optimizer steps with auto, ns5, ns5-sym and gram-ns on each workload
#     (autotune on, a fresh measurement store: what a user's first run does).
# WL: workloads (built-in names, name:layers, or JSON files such as bench/workloads/llama3.2-1b.json,
# which no built-in shares a shape with).
# Output under $OUT: auto_check.log, auto_check.json, steps.tgz (one distmuon-bench JSON each).
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WL=${WL-gpt2-small,gpt2-large,pi0,qwen2.5-7b:8,deepseek-v2-lite:2,resnet18,bench/workloads/llama3.2-1b.json}
ROUNDS=${ROUNDS:-3}
cd "$ROOT"
source bench/lib.sh
bundle_preamble auto_check || exit 1
rc=0
say "auto against each algorithm per shape class ($WL)"
$BIN/distmuon-cuda-bench --auto-check --rounds "$ROUNDS" --workloads "$WL" \
  --json "$OUT/auto_check.json" 2>&1 | grep -v "^\[tune\]" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
if [ -z "${SKIP_STEPS:-}" ]; then
  say "whole steps: auto against each algorithm (autotune on, fresh store)"
  export DISTMUON_COST_CACHE=/tmp/auto_check_store.json
  rm -f "$DISTMUON_COST_CACHE"
  mkdir -p /tmp/steps
  for spec in ${WL//,/ }; do
    name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
    $BIN/distmuon-bench --backend cuda --algo auto,ns5,ns5-sym,gram-ns --workload "$name" \
      --layers "$layers" --no-adamw --steps 10 --warmup 3 --json "/tmp/steps/$(basename "$name" .json).json" \
      2>&1 | grep -vE "^\[tune" | tail -6 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
  tar czf "$OUT/steps.tgz" -C /tmp/steps .
fi
say "done (rc $rc)"
exit $rc
