#!/usr/bin/env bash
# Issue 9: the whole multi-GPU measurement in one call, on a machine of NGPU H200s (device kinds
# nvidia-h200-x2/-x4/-x8; with one GPU it runs the world-size-1 subset). Prepare on the CPU machine:
#   tests/gpu/stage.sh      (carry: [".gpubin"])
# then on the GPU machine:   bench/multi_gpu/run.sh
#
# 1. optimizer step per rank count D (1, 2, 4, 8 as the machine has) on gpt2-large, pi0 and
#    qwen2.5-7b (all 28 layers): distmuon-bench --mode gather,sharded,dedicated (MPI launcher, one
#    NCCL rank per GPU) and, in the same run, FSDP2-sharded fused AdamW and distmuon.torch.Muon on
#    the same shapes (torchrun);
# 2. end-to-end training step of a Qwen2.5-1.5B-sized model (seq 2048) under FSDP2: fused AdamW vs
#    distmuon sharded vs distmuon dedicated, with a profiler trace of each (what overlaps);
# 3. two-level scheduling: HSDP 2 x (D/2), treating the host as two nodes;
# 4. distmuon-plan --simulate predictions for the same D beside the measurements (from costs
#    measured on this GPU, and from the analytic rates).
# Output under $OUT: run.log, results.json (everything), traces.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/out/multi_gpu}
mkdir -p "$OUT" /tmp/mg
LOG="$OUT/run.log"
PY=${PYTHON:-python3}
cd "$ROOT"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

NGPU=$(nvidia-smi -L | wc -l)
WORLDS=${WORLDS:-$(for d in 1 2 4 8; do [ $d -le "$NGPU" ] && echo -n "$d "; done)}
WORKLOADS=${WORKLOADS:-"gpt2-large pi0 qwen2.5-7b"}
say "$NGPU GPUs; world sizes: $WORLDS; workloads: $WORKLOADS"

say "binaries (carried bundle) and the Python extension"
BIN=/tmp/dm/bin
[ -x $BIN/distmuon-bench ] || { mkdir -p /tmp/dm && tar xJf .gpubin/bundle.tar.xz -C /tmp/dm; } || exit 1
# A second invocation on the same machine reuses the installed extension (/tmp/dm/setup.env).
source bench/gpu_python_setup.sh || exit 1
# The bundle uses the machine's own Open MPI (its mpirun and libmpi must match).
if LD_LIBRARY_PATH=/tmp/dm/lib:$CXX_LD_PATH ldd $BIN/distmuon-bench | grep -q "libmpi.*not found"; then
  MPILIB=$(dirname "$(find / -name 'libmpi.so.40' -not -path '/proc/*' 2>/dev/null | head -1)")
  CXX_LD_PATH=$MPILIB:$CXX_LD_PATH
fi
LD_LIBRARY_PATH=/tmp/dm/lib:$CXX_LD_PATH ldd $BIN/distmuon-bench | grep -E "not found|libmpi|nccl" | tee -a "$LOG"
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH=/tmp/dm/lib:$CXX_LD_PATH"

bench() {  # bench MODES SUFFIX: distmuon-bench on workload $w at world size $d
  $MPIRUN -np "$d" $BIN/distmuon-bench --backend cuda --workload "$w" --no-adamw --mode "$1" \
    --steps 5 --warmup 2 --json "/tmp/mg/bench-$w-$d$2.json" > "/tmp/mg/bench-$w-$d$2.log" 2>&1
}

for d in $WORLDS; do
  for w in $WORKLOADS; do
    say "optimizer step: $w, D=$d (distmuon-bench gather,sharded,dedicated)"
    # The three modes side by side, interleaved step by step (same clocks and temperature). They
    # hold their state together: where that does not fit (pi0 and qwen2.5-7b at one rank), each
    # mode runs on its own (bench-$w-$d-MODE.json; report.py merges them).
    if ! bench gather,sharded,dedicated ""; then
      grep -iE "error|what\(\)|out of memory" "/tmp/mg/bench-$w-$d.log" | head -3 | tee -a "$LOG"
      rm -f "/tmp/mg/bench-$w-$d.json"
      for m in gather sharded dedicated; do
        bench "$m" "-$m" || grep -iE "error|out of memory" "/tmp/mg/bench-$w-$d-$m.log" | head -2 | tee -a "$LOG"
        tail -2 "/tmp/mg/bench-$w-$d-$m.log" | tee -a "$LOG"
      done
    fi
    tail -6 "/tmp/mg/bench-$w-$d.log" | tee -a "$LOG"
    say "optimizer step: $w, D=$d (FSDP2 fused AdamW, distmuon.torch sharded)"
    torchrun --nproc-per-node "$d" bench/multi_gpu/opt_step.py --workload "$w" \
      --json "/tmp/mg/torch-$w-$d.json" 2>&1 | grep -E "^\[|Error" | tee -a "$LOG"
    # Predictions from costs measured on this GPU (cached across world sizes) and, beside them,
    # from the analytic rates (what a planner has before it has run on the machine).
    for costs in "--measure --backend cuda --cache /tmp/mg/costs.json" "--analytic"; do
      sfx=$([ "$costs" = --analytic ] && echo -analytic)
      LD_LIBRARY_PATH=/tmp/dm/lib:$CXX_LD_PATH $BIN/distmuon-plan --workload "$w" --world-size "$d" --gpus-per-node "$NGPU" \
        $costs --solver milp --simulate --json "/tmp/mg/plan-$w-$d$sfx.json" > /dev/null 2>>"$LOG"
    done
  done
  say "end to end: Qwen2.5-1.5B-sized, seq 2048, D=$d"
  mkdir -p /tmp/mg/traces-$d
  torchrun --nproc-per-node "$d" bench/multi_gpu/e2e_train.py --config qwen2.5-1.5b --seq 2048 \
    --profile /tmp/mg/traces-$d --json "/tmp/mg/e2e-$d.json" 2>&1 | grep -E "^\[|Error" | tee -a "$LOG"
  if [ "$d" -ge 4 ]; then
    say "end to end, HSDP 2 x $((d / 2)) (the host as two nodes)"
    torchrun --nproc-per-node "$d" bench/multi_gpu/e2e_train.py --config qwen2.5-1.5b --seq 2048 \
      --replicate 2 --json "/tmp/mg/e2e-hsdp-$d.json" 2>&1 | grep -E "^\[|Error" | tee -a "$LOG"
  fi
done

say "report"
$PY bench/multi_gpu/report.py /tmp/mg --out "$OUT/results.json" --md "$OUT/results.md" 2>&1 | tee -a "$LOG"
tar czf "$OUT/traces.tgz" -C /tmp/mg $(cd /tmp/mg && ls -d traces-* *.log 2>/dev/null) 2>/dev/null
say "done"
