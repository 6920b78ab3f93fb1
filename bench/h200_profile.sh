#!/usr/bin/env bash
# Where the one-GPU step's device time goes (issue 18) and what CacheMuon's calls cost (issue 20),
# in one device call after tests/gpu/verify.sh (or alone): the bundle's binaries
# (.gpubin/bundle.tar.xz from tests/gpu/stage.sh), no build.
#   distmuon-cuda-bench --no-micro --no-tune --workloads $WL   cache.json: CacheMuon per call on
#                        qwen's MLP shapes, the masked Q X tiles, and each workload's eager and
#                        graph step beside its floor
#   ncu per kernel over distmuon-bench steps (gram-ns) of each workload in $PROFILE_WL, grouped
#                        by bench/kernel_profile.py: profile.tgz (one .md and one .csv each)
# Output under $OUT: profile.log, cache.json, profile.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WL=${WL-gpt2-small,gpt2-large,qwen2.5-7b:8}
PROFILE_WL=${PROFILE_WL-gpt2-small gpt2-large qwen2.5-7b:8}
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble profile || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"

rc=0
say "distmuon-cuda-bench --no-micro --no-tune --workloads $WL"
$BIN/distmuon-cuda-bench --no-micro --no-tune --workloads "$WL" --json "$OUT/cache.json" 2>&1 \
  | grep -vE "^\[tune\]" | tee -a "$LOG" | tail -40 || rc=1

profile_steps "$PROFILE_WL" || rc=1
say "done (rc $rc)"
exit $rc
