#!/usr/bin/env bash
# One whole H200 run of issue 6: binaries, every GPU correctness test, the ceilings, CacheMuon
# on the device (hit vs fresh on qwen's MLP shapes, gpt2-small steps with the cache), the
# autotuner, the optimizer-step benchmarks, the torch baselines, and the report.
#   bench/run_h200.sh quick   tests + ceilings + X X^T + gpt2-small only
#   bench/run_h200.sh full    everything (the recorded results)
# Binaries: the carried bundle .gpubin/bundle.tar.xz (tests/gpu/stage.sh builds it on the CPU
# machine, where the dependencies are), else a Release build here (cmake, ninja, -j16).
# Output under $OUT (at most 8 files come back): run.log, cuda_bench.json, torch.json,
# tune.json, report.json, report.md, tools.tgz.
# Knobs for a partial rerun: TESTS="test_cuda_muon" (the test binaries), BENCH_ARGS (extra
# distmuon-cuda-bench options, e.g. --no-cache-hit), SKIP_CLI=1, SKIP_TORCH=1 (then merge with
# an earlier torch.json: bench/make_report.py --torch).
set -o pipefail
MODE=${1:-full}
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
cd "$ROOT"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

if [ -f .gpubin/bundle.tar.xz ]; then
  say "unpacking the prebuilt bundle"
  mkdir -p /tmp/dm && tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "the bundle does not unpack (tests/gpu/stage.sh again)"; exit 1; }
  BIN=/tmp/dm/bin
  CUBLAS_DIRS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH=/tmp/dm/lib:$CUBLAS_DIRS${LD_LIBRARY_PATH:-}
else
  say "building (Release, CUDA on, -j16)"
  cmake --preset release -G Ninja -DDISTMUON_WITH_CUDA=ON 2>&1 | tail -5 | tee -a "$LOG"
  cmake --build build -j 16 2>&1 | tail -5 | tee -a "$LOG" || exit 1
  BIN=build/bin
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$LOG"
ldd $BIN/distmuon-cuda-bench | grep -E "not found|cublas" | tee -a "$LOG"

say "correctness: every CUDA kernel against the CPU / float64 references"
fail=0
for t in ${TESTS:-test_cuda_backend test_cuda_muon test_cuda_cache}; do
  $BIN/$t --gtest_brief=1 2>&1 | tee -a "$LOG" | grep -E "^\[measure\]|PASSED|FAILED|SKIPPED|Failure|error" | head -80
  [ "${PIPESTATUS[0]}" = 0 ] || fail=1
done
say "tests: $([ $fail = 0 ] && echo all passed || echo FAILURES)"

# The measurement store (src/measure/store.h) of this run: the autotuner's choices land here.
export DISTMUON_COST_CACHE="$OUT/tune.json"
if [ -n "${WL:-}" ]; then
  :
elif [ "$MODE" = quick ]; then
  WL="gpt2-small"
else
  WL="gpt2-small,gpt2-large,pi0,qwen2.5-7b:8"
fi
say "ceilings, X X^T, CacheMuon, autotuner and steps ($WL)"
$BIN/distmuon-cuda-bench --json "$OUT/cuda_bench.json" --workloads "$WL" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG" \
  | grep -vE "^\[tune\]" | tail -48

say "distmuon-bench (the CLI: auto against each single algorithm, for the report's auto-vs-fastest table)"
mkdir -p /tmp/tools
[ -n "${SKIP_CLI:-}" ] && WL_CLI="" || WL_CLI="$WL"
for spec in ${WL_CLI//,/ }; do
  name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
  $BIN/distmuon-bench --backend cuda --algo auto,ns5,ns5-sym,gram-ns --workload "$name" --layers "$layers" \
    --no-adamw --steps 5 --warmup 2 --json "/tmp/tools/$name.json" 2>&1 | tail -6 | tee -a "$LOG"
done
tar czf "$OUT/tools.tgz" -C /tmp/tools .

say "torch baselines"
# dion's Muon beside them where tests/gpu/stage.sh staged it (DION_REPO=...: .gpubin/dion.tar.xz).
DION_ARG=()
if [ -f .gpubin/dion.tar.xz ]; then
  rm -rf /tmp/dion && mkdir -p /tmp/dion && tar xJf .gpubin/dion.tar.xz -C /tmp/dion && DION_ARG=(--dion /tmp/dion)
fi
[ -z "${SKIP_TORCH:-}" ] && python3 bench/torch_baselines.py --workloads "$WL" --json "$OUT/torch.json" \
  "${DION_ARG[@]}" 2>&1 | tee -a "$LOG"

say "report"
python3 bench/make_report.py --cuda "$OUT/cuda_bench.json" --torch "$OUT/torch.json" \
  --tool /tmp/tools/*.json --out-dir /tmp/report --command "bench/run_h200.sh $MODE" 2>&1 | tee -a "$LOG"
cp /tmp/report/*-h200.json "$OUT/report.json" 2>/dev/null
cp /tmp/report/*-h200.md "$OUT/report.md" 2>/dev/null
say "done (tests $([ $fail = 0 ] && echo passed || echo FAILED))"
exit $fail
