#!/usr/bin/env bash
# The mirror in the symmetric kernels' epilogue against the separate mirror pass, in one device
# call, with the bundle's binaries (.gpubin/bundle.tar.xz from tests/gpu/stage.sh): the CUDA
# kernel tests (every symmetric variant against float64, exactly symmetric, masked bit-exact),
# memcheck over the symmetric tests, then distmuon-cuda-bench's workload steps with
# DISTMUON_SYM_EPILOGUE_MIRROR=0 and =1 alternating (ROUNDS rounds), and one ncu profile per
# workload in $PROFILE_WL with the epilogue mirror on (bench/kernel_profile.py).
# Output under $OUT: mirror_ab.log, ab-<setting>-<round>.json, profile.tgz.
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
WL=${WL-gpt2-small,gpt2-large,qwen2.5-7b:8}
PROFILE_WL=${PROFILE_WL-gpt2-large qwen2.5-7b:8}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
LOG="$OUT/mirror_ab.log"
cd "$ROOT"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
sum=$(sha256sum .gpubin/bundle.tar.xz | cut -c1-16)
if [ "$(cat /tmp/dm/bundle.sum 2>/dev/null)" != "$sum" ]; then
  rm -rf /tmp/dm && mkdir -p /tmp/dm
  tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "the bundle does not unpack"; exit 1; }
  echo "$sum" > /tmp/dm/bundle.sum
fi
B=/tmp/dm/bin
CUBLAS_DIRS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=/tmp/dm/lib:$CUBLAS_DIRS${LD_LIBRARY_PATH:-} DISTMUON_AUTOTUNE=off
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
rc=0
for t in test_cuda_backend test_cuda_cache test_cuda_muon; do
  say "$t"
  $B/$t --gtest_brief=1 2>&1 | tee -a "$LOG" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
say "memcheck over the symmetric products"
compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$B/test_cuda_backend" \
  --gtest_brief=1 --gtest_filter='*Sym*' 2>&1 | tee -a "$LOG" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
for r in $(seq 1 "$ROUNDS"); do
  for v in 0 1; do
    say "round $r, DISTMUON_SYM_EPILOGUE_MIRROR=$v"
    DISTMUON_SYM_EPILOGUE_MIRROR=$v $B/distmuon-cuda-bench --no-micro --no-tune --no-cache \
      --workloads "$WL" --json "$OUT/ab-$v-$r.json" 2>&1 | grep "eager" | tee -a "$LOG"
  done
done
mkdir -p /tmp/prof
for spec in $PROFILE_WL; do
  name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
  say "ncu: $spec, gram-ns, epilogue mirror on"
  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --print-kernel-base demangled \
    $B/distmuon-bench --backend cuda --workload "$name" --layers "$layers" --algo gram-ns \
    --no-adamw --warmup 1 --steps 2 > "/tmp/prof/$name.csv" 2>> "$LOG"
  python3 bench/kernel_profile.py "/tmp/prof/$name.csv" --steps 3 --md "/tmp/prof/$name.md" \
    2>&1 | tee -a "$LOG" | head -12
done
xz -9 -f /tmp/prof/*.csv
tar czf "$OUT/profile.tgz" -C /tmp/prof .
say "done (rc $rc)"
exit $rc
