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
WL=${WL-gpt2-small,gpt2-large,qwen2.5-7b:8}
PROFILE_WL=${PROFILE_WL-gpt2-large qwen2.5-7b:8}
ROUNDS=${ROUNDS:-2}
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble mirror_ab || exit 1
export DISTMUON_AUTOTUNE=off
rc=0
for t in test_cuda_backend test_cuda_cache test_cuda_muon; do
  say "$t"
  $BIN/$t --gtest_brief=1 2>&1 | tee -a "$LOG" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
say "memcheck over the symmetric products"
compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$BIN/test_cuda_backend" \
  --gtest_brief=1 --gtest_filter='*Sym*' 2>&1 | tee -a "$LOG" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
for r in $(seq 1 "$ROUNDS"); do
  for v in 0 1; do
    say "round $r, DISTMUON_SYM_EPILOGUE_MIRROR=$v"
    DISTMUON_SYM_EPILOGUE_MIRROR=$v $BIN/distmuon-cuda-bench --no-micro --no-tune --no-cache \
      --workloads "$WL" --json "$OUT/ab-$v-$r.json" 2>&1 | grep "eager" | tee -a "$LOG"
  done
done
profile_steps "$PROFILE_WL" || rc=1
say "done (rc $rc)"
exit $rc
