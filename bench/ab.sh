#!/usr/bin/env bash
# A/B of the optimizer step on one GPU, in one device call: two builds, or two settings of one
# build. The arms alternate (A B A B ...) so that clock and thermal drift fall on both; then the
# median eager and graph-replay step (and host time) per workload and arm, and B / A
# (bench/ab_summary.py).
#
#   bash bench/ab.sh PRESET        (device tool: carry [".gpubin"], from tests/gpu/stage.sh)
#
# Presets (each sets the defaults below; environment variables override them):
#   builds    .gpubin/before.tar.xz (A: an earlier bundle) against .gpubin/bundle.tar.xz (B);
#             B's tests test_cuda_muon, test_cuda_grouped and memcheck; per-kernel time,
#             registers, occupancy and DRAM throughput of the pass kernels with each build
#   grouped   DISTMUON_GROUPED_PRODUCTS=off (A) against =auto (B); test_cuda_grouped, memcheck
#   mirror    DISTMUON_SYM_EPILOGUE_MIRROR=0 (A) against =1 (B); the CUDA kernel tests, memcheck
#             over the symmetric products; then per-kernel time of B's steps (kernel_profile.py)
#   graphs    DISTMUON_GRAPHS=0 (A) against =1 (B): step(), its host time, the caller's graph
#   env       A_ENV against B_ENV (VAR=value ..., one build)
# Knobs:
#   A_ENV, B_ENV    settings of each arm (VAR=value ...)
#   A_BUNDLE        a second build for arm A (B is always .gpubin/bundle.tar.xz); or A_BIN / B_BIN:
#                   folders that hold distmuon-cuda-bench (no bundle needed)
#   WL              workloads (name, name:layers or a JSON file), ROUNDS (default 3)
#   TUNED=1         autotuning on (the user's default) instead of off in both arms
#   TESTS, MEMCHECK gtest binaries (binary or binary:filter) run with arm B first, memcheck over them
#   KERNELS         an ncu kernel-name regex: per kernel and arm, over gram-ns steps of each
#                   workload of PROFILE_WL (bench/kernel_ab.py) -> kernels.md
#   PROFILE_WL      without KERNELS: per-kernel time of arm B's steps (bench/kernel_profile.py)
#                   -> profile.tgz
# Output under $OUT (default out/): ab.log, A-<round>.json, B-<round>.json, ab.md, kernels.md or
# profile.tgz.
set -o pipefail
PRESET=${1:-env}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
case "$PRESET" in
builds)
  : "${A_BUNDLE=.gpubin/before.tar.xz}" "${WL=resnet18,gpt2-small,pi0}"
  : "${TESTS=test_cuda_muon test_cuda_grouped}" "${KERNELS=muon_norm|muon_apply|muon_update|lincomb}"
  : "${PROFILE_WL=pi0 resnet18}" ;;
grouped)
  : "${A_ENV=DISTMUON_GROUPED_PRODUCTS=off}" "${B_ENV=DISTMUON_GROUPED_PRODUCTS=auto}"
  : "${WL=resnet18,gpt2-small,pi0,deepseek-v2-lite:2}" "${TESTS=test_cuda_grouped}" ;;
mirror)
  : "${A_ENV=DISTMUON_SYM_EPILOGUE_MIRROR=0}" "${B_ENV=DISTMUON_SYM_EPILOGUE_MIRROR=1}"
  : "${WL=gpt2-small,gpt2-large,qwen2.5-7b:8}" "${TESTS=test_cuda_backend test_cuda_cache test_cuda_muon}"
  : "${MEMCHECK=test_cuda_backend:*Sym*}" "${PROFILE_WL=gpt2-large qwen2.5-7b:8}" ;;
graphs)
  : "${A_ENV=DISTMUON_GRAPHS=0}" "${B_ENV=DISTMUON_GRAPHS=1}" "${WL=gpt2-small,gpt2-large,qwen2.5-7b:2}"
  : "${ROUNDS=2}" ;;
env) ;;
*) echo "unknown preset '$PRESET' (builds, grouped, mirror, graphs, env)"; exit 2 ;;
esac
WL=${WL-gpt2-small,gpt2-large,pi0,qwen2.5-7b:8}
ROUNDS=${ROUNDS:-3}
source bench/lib.sh
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG="$OUT/ab.log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
rc=0
if [ -z "${A_BIN:-}${B_BIN:-}" ]; then
  use_bundle || exit 1
  A_BIN=$BIN B_BIN=$BIN
  if [ -n "${A_BUNDLE:-}" ]; then
    [ -f "$A_BUNDLE" ] || { say "no $A_BUNDLE (build A)"; exit 1; }
    unpack "$A_BUNDLE" /tmp/dm-a || exit 1
    A_BIN=/tmp/dm-a/bin  # each build with its own libraries (the bundles ship the same ones)
  fi
fi
BIN=$B_BIN
tune=--no-tune
if [ "${TUNED:-0}" = 1 ]; then tune=""; else export DISTMUON_AUTOTUNE=off; fi
say "preset $PRESET: A = ${A_ENV:-} $A_BIN, B = ${B_ENV:-} $B_BIN; $WL, $ROUNDS rounds"
if [ -n "${TESTS:-}" ]; then run_tests "$TESTS" "${MEMCHECK-$TESTS}" || rc=1; fi
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin=$A_BIN settings=${A_ENV:-}
    [ "$side" = B ] && bin=$B_BIN settings=${B_ENV:-}
    say "round $r, arm $side ${settings}"
    # shellcheck disable=SC2086
    env $settings "$bin/distmuon-cuda-bench" --no-micro $tune --no-cache --no-cache-hit \
      --workloads "$WL" --json "$OUT/$side-$r.json" 2>&1 | grep -E "eager|step\(\)" | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
python3 bench/ab_summary.py "$OUT" | tee "$OUT/ab.md" | tee -a "$LOG"
if [ -n "${KERNELS:-}" ]; then
  : > "$OUT/kernels.md"
  for wl in ${PROFILE_WL:-pi0}; do
    for side in A B; do
      bin=$A_BIN settings=${A_ENV:-}
      [ "$side" = B ] && bin=$B_BIN settings=${B_ENV:-}
      say "ncu $wl, arm $side, kernels /$KERNELS/"
      # shellcheck disable=SC2086
      ( [ -z "$settings" ] || export $settings
        NCU_ARGS="--kernel-name regex:$KERNELS --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
        ncu_steps "$bin" "$wl" "/tmp/ncu-$side.csv" ) || rc=1
    done
    python3 bench/kernel_ab.py --steps 3 --label "$wl" /tmp/ncu-A.csv /tmp/ncu-B.csv \
      >> "$OUT/kernels.md" 2>> "$LOG" || rc=1
  done
  tee -a "$LOG" < "$OUT/kernels.md"
elif [ -n "${PROFILE_WL:-}" ]; then
  # shellcheck disable=SC2086
  ( [ -z "${B_ENV:-}" ] || export $B_ENV; profile_steps "$PROFILE_WL" ) || rc=1
fi
say "done (rc $rc)"
exit $rc
