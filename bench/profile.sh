#!/usr/bin/env bash
# Where the one-GPU step's device time goes, and what CacheMuon's calls cost, in one device call
# with the bundle's binaries (.gpubin/bundle.tar.xz from tests/gpu/stage.sh; carry [".gpubin"]):
#   1. TESTS (binary or binary:gtest-filter), then memcheck over MEMCHECK (default: TESTS);
#   2. distmuon-cuda-bench --no-micro --no-tune --workloads "$WL" -> cache.json: CacheMuon per
#      call (hit, refresh, half and half against a fresh solve, eager and replayed) on qwen2.5-7b's
#      MLP shapes and the quality study's, the masked Q X tiles, gpt2-small engine steps under a
#      drifting gradient, and each workload of WL's eager and graph step beside its floor
#      (BENCH=0 leaves it out);
#   3. Nsight Compute's per-kernel time of distmuon-bench steps of each workload of PROFILE_WL,
#      grouped by bench/kernel_profile.py, once per entry of VARIANTS ("tag=distmuon-bench
#      options;..."): profile-<tag>.tgz (one .md and one .csv.xz per workload).
#
#   bash bench/profile.sh PRESET
# Presets (each sets the defaults; environment variables override them):
#   steps          WL and PROFILE_WL gpt2-small, gpt2-large, qwen2.5-7b:8; Gram NS steps
#   cache          CacheMuon per call only: the CUDA tests of conditional graph blocks and of
#                  CacheMuon, memcheck over the captured calls, then step 2 with WL empty
#   cache-kernels  `cache`, then the kernels of the quality study's MLP
#                  (bench/workloads/study-small-mlp.json) fresh and with every entry refreshing,
#                  for each residual: the kernels a refresh adds, one by one
# Output under $OUT (default out/): profile.log, cache.json, profile-<tag>.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
PRESET=${1:-steps}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
case "$PRESET" in
steps)
  : "${WL=gpt2-small,gpt2-large,qwen2.5-7b:8}" "${PROFILE_WL=gpt2-small gpt2-large qwen2.5-7b:8}" ;;
cache | cache-kernels)
  : "${WL=}" "${TESTS=test_cuda_backend:CudaGraphs.* test_cuda_cache}"
  : "${MEMCHECK=test_cuda_cache:*Captured*}"
  if [ "$PRESET" = cache ]; then : "${PROFILE_WL=}"; else
    : "${PROFILE_WL=bench/workloads/study-small-mlp.json}"
    : "${VARIANTS=exact=--algo gram-ns --cache 1e-9 --cache-residual exact;probe=--algo gram-ns --cache 1e-9 --cache-residual probe}"
  fi ;;
*) echo "unknown preset '$PRESET' (steps, cache, cache-kernels)"; exit 2 ;;
esac
VARIANTS=${VARIANTS:-gram-ns=--algo gram-ns}
source bench/lib.sh
bundle_preamble profile || exit 1
export DISTMUON_AUTOTUNE=off
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
rc=0
if [ -n "${TESTS:-}" ]; then run_tests "$TESTS" "${MEMCHECK-$TESTS}" || rc=1; fi
if [ "${BENCH:-1}" = 1 ]; then
  say "distmuon-cuda-bench --no-micro --no-tune --workloads \"$WL\""
  $BIN/distmuon-cuda-bench --no-micro --no-tune --workloads "$WL" --json "$OUT/cache.json" 2>&1 \
    | grep -vE "^\[tune\]" | tee -a "$LOG" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ -n "${PROFILE_WL:-}" ]; then
  IFS=';' read -ra variants <<< "$VARIANTS"
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    profile_steps "$PROFILE_WL" "${v%%=*}" ${v#*=} || rc=1
  done
fi
say "done (rc $rc)"
exit $rc
