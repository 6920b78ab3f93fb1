#!/usr/bin/env bash
# Two builds side by side in one device call: .gpubin/before.tar.xz (build A, a copy of an
# earlier bundle from tests/gpu/stage.sh) against .gpubin/bundle.tar.xz (build B, the change).
#   1. TESTS: gtest binaries of build B to run, then memcheck over them (default:
#      "test_cuda_muon test_cuda_grouped"; "" leaves them out);
#   2. bench/ab_h200.sh A B: distmuon-cuda-bench's steps, the builds alternating (ROUNDS rounds,
#      tuning off), medians and B / A;
#   3. KERNELS: an ncu regex (default "muon_norm|muon_apply|muon_update|lincomb"): per-launch time,
#      registers and achieved occupancy of the matching kernels in gram-ns steps (1 warm-up + 2)
#      of each workload of PROFILE_WL (default "pi0 resnet18"), with each build; per kernel and
#      build by bench/kernel_ab.py ("" leaves this out).
# Output under $OUT: build_ab.log, A-<round>.json, B-<round>.json, ab.md, kernels.md.
set -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WL=${WL-resnet18,gpt2-small,pi0}
ROUNDS=${ROUNDS:-3}
TESTS=${TESTS-test_cuda_muon test_cuda_grouped}
KERNELS=${KERNELS-muon_norm|muon_apply|muon_update|lincomb}
PROFILE_WL=${PROFILE_WL-pi0 resnet18}
cd "$ROOT"
source bench/h200_bundle.sh
bundle_preamble build_ab || exit 1
[ -f .gpubin/before.tar.xz ] || { say "no .gpubin/before.tar.xz (build A)"; exit 1; }
rm -rf /tmp/dm-before && mkdir -p /tmp/dm-before
tar xJf .gpubin/before.tar.xz -C /tmp/dm-before || { say "build A does not unpack"; exit 1; }
export DISTMUON_AUTOTUNE=off
rc=0
for t in $TESTS; do
  say "$t (build B)"
  $BIN/$t --gtest_brief=1 2>&1 | tee -a "$LOG" | grep -E "^\[measure\]|PASSED|FAILED|Failure|error" | head -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  say "memcheck over $t"
  compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$BIN/$t" \
    --gtest_brief=1 2>&1 | tee -a "$LOG" | tail -2
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
if [ -n "$WL" ]; then
  say "steps, A against B: $WL, $ROUNDS rounds"
  # Each build with its own libraries (the bundles ship the same ones).
  bench/ab_h200.sh /tmp/dm-before/bin "$BIN" "$OUT" "$ROUNDS" "$WL" 2>&1 | tee -a "$LOG" || rc=1
fi
if [ -n "$KERNELS" ]; then
  for wl in $PROFILE_WL; do
    for side in A B; do
      bin=/tmp/dm-before/bin; [ "$side" = B ] && bin=$BIN
      say "ncu $wl, build $side, kernels /$KERNELS/"
      ncu --clock-control none --kernel-name "regex:$KERNELS" --print-kernel-base demangled \
        --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        --csv --page raw "$bin/distmuon-bench" --backend cuda --workload "$wl" --algo gram-ns \
        --no-adamw --warmup 1 --steps 2 > "/tmp/ncu-$wl-$side.csv" 2>> "$LOG" || rc=1
    done
  done
  : > "$OUT/kernels.md"
  for wl in $PROFILE_WL; do
    python3 bench/kernel_ab.py --steps 3 --label "$wl" "/tmp/ncu-$wl-A.csv" "/tmp/ncu-$wl-B.csv" \
      >> "$OUT/kernels.md" 2>> "$LOG" || rc=1
  done
  tee -a "$LOG" < "$OUT/kernels.md"
fi
say "done (rc $rc)"
exit $rc
