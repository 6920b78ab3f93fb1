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
OUT=${OUT:-$ROOT/out}
WL=${WL-gpt2-small,gpt2-large,qwen2.5-7b:8}
PROFILE_WL=${PROFILE_WL-gpt2-small gpt2-large qwen2.5-7b:8}
mkdir -p "$OUT"
LOG="$OUT/profile.log"
cd "$ROOT"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

sum=$(sha256sum .gpubin/bundle.tar.xz | cut -c1-16)
if [ "$(cat /tmp/dm/bundle.sum 2>/dev/null)" != "$sum" ]; then
  say "unpacking the prebuilt bundle"
  rm -rf /tmp/dm && mkdir -p /tmp/dm
  tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "the bundle does not unpack"; exit 1; }
  echo "$sum" > /tmp/dm/bundle.sum
fi
BIN=/tmp/dm/bin
CUBLAS_DIRS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=/tmp/dm/lib:$CUBLAS_DIRS${LD_LIBRARY_PATH:-}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"

rc=0
say "distmuon-cuda-bench --no-micro --no-tune --workloads $WL"
$BIN/distmuon-cuda-bench --no-micro --no-tune --workloads "$WL" --json "$OUT/cache.json" 2>&1 \
  | grep -vE "^\[tune\]" | tee -a "$LOG" | tail -40 || rc=1

mkdir -p /tmp/prof
for spec in $PROFILE_WL; do
  name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
  say "ncu: $spec, gram-ns, 1 warm-up + 2 steps"
  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --print-kernel-base demangled \
    $BIN/distmuon-bench --backend cuda --workload "$name" --layers "$layers" --algo gram-ns \
    --no-adamw --warmup 1 --steps 2 > "/tmp/prof/$name.csv" 2>> "$LOG" || rc=1
  python3 bench/kernel_profile.py "/tmp/prof/$name.csv" --steps 3 --md "/tmp/prof/$name.md" \
    2>&1 | tee -a "$LOG" | head -24 || rc=1
done
xz -9 /tmp/prof/*.csv
tar czf "$OUT/profile.tgz" -C /tmp/prof .
say "done (rc $rc)"
exit $rc
