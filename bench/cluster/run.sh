#!/usr/bin/env bash
# The one-GPU cluster (docs/distributed.md): D MPI ranks running at the same time on one GPU under
# CUDA MPS, each on 100/D % of its SMs, measured in one call on a GPU machine. With D GPUs the
# same command runs one rank per GPU instead (no MPS). Prepare on the CPU machine:
# tests/gpu/stage.sh (carry [".gpubin"]), then
#
#   bench/cluster/run.sh                         every stage below
#   STAGES="step costs" bench/cluster/run.sh     some stages
#   RANKS=1,2,4,8 WORKLOADS="gpt2-large:0 pi0:8" bench/cluster/run.sh
#   OUT=out/cl-b BENCH_ARGS=--batches-per-bucket DISTMUON_NCCL_BLOCKING=1 bench/cluster/run.sh
#   OUT=out/cl-e MODES=dedicated DISTMUON_DEDICATED_EARLY_BROADCAST=1 bench/cluster/run.sh
#   OUT=out/cl-m PLAN_COSTS=parts STAGES=step bench/cluster/run.sh
#                             owners placed on measured costs, as a machine with D GPUs places
#                             them after its start-up measurement: each D's part of the GPU first
#                             measures its own table (distmuon-plan --measure under MPS, alone;
#                             costs-part-<D>.json), which the ranks plan on. Without it MPS ranks
#                             plan on analytic costs, and a table of the whole GPU does not serve
#                             them (its device key names all the SMs, a part sees its own share:
#                             the engine refuses it). BENCH_ARGS="--planner lpt" places them by
#                             LPT instead of the MILP
#
# Stages (output under $OUT, default out/cluster):
#   step   mpirun -np D distmuon-bench --calibrate --profile: modes gather, sharded, dedicated and
#          the AdamW baseline (fused AdamW on FSDP2 shards of the same matrices), bf16 parameters,
#          per workload and D: step-<workload>-<D>.json (calibration, per-rank breakdown); from
#          D = 4 on one process per mode (memory; SPLIT_MODES): step-<workload>-<D>-<mode>.json
#   costs  distmuon-plan --measure on the whole GPU: the cost table the simulator scales to a part
#   e2e    FSDP2 training (bench/multi_gpu/e2e_train.py) with one process per rank under CUDA MPS
#          (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / D), each of E2E_OPTIMIZERS in a torchrun of
#          its own; where MPS cannot start it says so and runs nothing (time-sliced processes
#          would not measure speed): e2e-<D>-<optimizer>.json
# then bench/cluster/report.py merges everything into cluster.json, cluster.md and cluster.png
# (it also runs on the CPU machine over a fetched $OUT).
#
# Several ranks per GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1: the library staged in
# .gpubin/nccl (tests/gpu/stage.sh with NCCL_LIB) or NCCL_LIB is preloaded.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_MULTI_RANK_GPU_ENABLE=1 DISTMUON_AUTOTUNE=${DISTMUON_AUTOTUNE:-off} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A collective that waits longer than this raises, naming itself and its ranks, before the
# watchdogs below (90 s the smoke run, 150 s a run) kill the ranks without a word.
export DISTMUON_COMM_TIMEOUT_S=${DISTMUON_COMM_TIMEOUT_S:-60}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out/cluster}
RANKS=${RANKS:-1,2,4,8}
# name:layers (0: all). Sized so that 8 ranks' weights, gradients, shards and four engines fit in
# one 80 GB GPU (bf16): 0.6-0.9 B Muon parameters each.
WORKLOADS=${WORKLOADS:-"gpt2-large:0 pi0:6 qwen2.5-7b:4 deepseek-v2-lite:1"}
STEPS=${STEPS:-3}
MODES=${MODES:-gather,sharded,dedicated,adamw}  # of the step stage (an A/B may need one)
SPLIT_MODES=${SPLIT_MODES:-auto}  # 1: each mode in a process of its own; auto: from D = 4 on
STAGES=${STAGES:-step costs e2e}
E2E_RANKS=${E2E_RANKS:-1,8}
# Sized for eight ranks on one 80 GB GPU: each rank holds a whole data-parallel micro-batch's
# activations, and its loss a chunk of logits at a time (a 1.5B model or the whole logits ran out).
E2E_ARGS=${E2E_ARGS:---config qwen2.5-0.5b --seq 2048 --loss-chunk 512 --steps 5 --warmup 2}
E2E_OPTIMIZERS=${E2E_OPTIMIZERS:-adamw,distmuon-sharded,distmuon-dedicated,distmuon-gather,distmuon-sharded-bf16wire}
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-300}  # per optimizer and D
# Training runs two NCCL communicators on each rank's device (FSDP2's, distmuon's): NCCL orders
# kernels of several communicators only as a whole program orders them, or, since 2.26, in the
# order the host launched them with NCCL_LAUNCH_ORDER_IMPLICIT=1 (its documentation: otherwise
# "deadlocks could ensue"). E2E_COMMS: the communicators that may have kernels in flight at once,
# whose CTAs share half a rank's SMs (partition_env).
E2E_ORDER=${NCCL_LAUNCH_ORDER_IMPLICIT:-1}
E2E_COMMS=${E2E_COMMS:-2}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG=$OUT/run.log
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH

# ---- binaries and NCCL -----------------------------------------------------------------------
if [ -n "${BIN:-}" ]; then :
elif [ -x build/bin/distmuon-bench ]; then BIN=$ROOT/build/bin
else
  BIN=/tmp/dm/bin
  sum=$(sha256sum .gpubin/bundle.tar.xz | cut -c1-16)
  if [ ! -x $BIN/distmuon-bench ] || [ "$(cat /tmp/dm/bundle.sum 2>/dev/null)" != "$sum" ]; then
    rm -rf /tmp/dm/bin /tmp/dm/lib && mkdir -p /tmp/dm && tar xJf .gpubin/bundle.tar.xz -C /tmp/dm &&
      echo "$sum" > /tmp/dm/bundle.sum || { say "no binaries (.gpubin/bundle.tar.xz)"; exit 1; }
  fi
  export LD_LIBRARY_PATH=/tmp/dm/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
CUDA_LIBS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/extras/CUPTI/lib64 2>/dev/null | paste -sd:)
TORCH_NCCL=$($PY -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$CUDA_LIBS${TORCH_NCCL:+:$TORCH_NCCL}
if ldd $BIN/distmuon-bench | grep -q "libmpi.*not found"; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$(find / -name 'libmpi.so.40' -not -path '/proc/*' 2>/dev/null | head -1)")
fi
ldd $BIN/distmuon-bench | grep "not found" | tee -a "$LOG" | grep -q . && { say "libraries missing"; exit 1; }
NCCL_LIB=${NCCL_LIB:-}
if [ -z "$NCCL_LIB" ] && [ -f .gpubin/nccl/libnccl.so.2.xz ]; then
  mkdir -p /tmp/nccl/lib && xz -dc .gpubin/nccl/libnccl.so.2.xz > /tmp/nccl/lib/libnccl.so.2 && NCCL_LIB=/tmp/nccl/lib/libnccl.so.2
fi
# Preloaded into the ranks only (`ranks_env`), not into this shell and every tool it starts: the
# MPS daemon and the shell's own pipes ran with it once and the shell died of a segmentation
# fault after the daemon started.
ranks_env=(env)
[ -n "$NCCL_LIB" ] && ranks_env=(env "LD_PRELOAD=$NCCL_LIB")
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
say "$(nvidia-smi -L | wc -l) x $GPU, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); NCCL ${NCCL_LIB:-of torch}; ranks $RANKS; workloads $WORKLOADS"

# ---- optimizer step --------------------------------------------------------------------------
T0=$(date +%s)
# Seconds this call may spend (the device tool's calls end at 600 s): runs that would start later
# are skipped and named, so that the report still comes back.
BUDGET_S=${BUDGET_S:-540}
over_budget() { [ $(( $(date +%s) - T0 )) -gt "$1" ]; }
NGPU=$(nvidia-smi -L | wc -l)
MPS_CTL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
MPS_ON=""
mps_start() { [ -n "$MPS_ON" ] && return 0; [ -n "$MPS_CTL" ] || return 1
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  # A daemon left by a run that was killed answers on our pipe and makes -d fail ("An instance of
  # this daemon is already running"; the 6th session's e2e runs were skipped so): end it first.
  if echo get_server_list | timeout 10 $MPS_CTL > /dev/null 2>&1; then
    say "an MPS daemon of an earlier run was still up: stopping it"
    echo quit | timeout 10 $MPS_CTL; sleep 2
  fi
  $MPS_CTL -d && MPS_ON=1 && say "MPS daemon started"; }
mps_stop() { [ -n "$MPS_ON" ] && echo quit | timeout 10 $MPS_CTL && MPS_ON="" && sleep 1 && say "MPS daemon stopped"; }
# The run in flight (a process group: `timeout` leads its own), ended with this script: a caller's
# limit that stops run.sh must not leave ranks holding the GPU for the next measurement (bash runs
# a trap only between commands, hence runs in the background and `wait`).
RUN_PID="" WATCHED_PID=""
limited() {  # limited SECONDS COMMAND...: the command under timeout, ended if this script is
  timeout -k 10 "$@" & RUN_PID=$!
  wait $RUN_PID; local rc=$?; RUN_PID=""; return $rc
}
on_signal() {
  [ -n "$RUN_PID" ] && kill -TERM -- -"$RUN_PID" 2>/dev/null && sleep 2 && kill -KILL -- -"$RUN_PID" 2>/dev/null
  [ -n "$WATCHED_PID" ] && kill -9 $WATCHED_PID $(pgrep -f "$BIN/distmuon-bench") 2>/dev/null
  exit 143; }
trap on_signal TERM INT
trap mps_stop EXIT
# D ranks sharing GPU 0 under MPS: each gets 100/D % of the SMs, and NCCL at most half of those
# as CTAs. NCCL's several-ranks-per-GPU mode gives each rank its own channels and hangs when the
# device cannot hold them all (its documentation says so, and advises capping NCCL_MAX_CTAS): at
# D = 8 on an H100 (14 SMs a rank) the calibration's first all-gather never completed with NCCL's
# own channel count (2026-12-06; D = 2 and 4 ran). $2 (default 1) is how many communicators can
# have a kernel in flight at once on a rank (training: FSDP2's and distmuon's): they share the half,
# so that their kernels fit side by side (the 6th session's FSDP2 runs at D = 4 stopped in a forward
# pass with each at half). NCCL_MAX_CTAS given by the caller wins.
SMS=${SMS:-$($PY -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)' 2>/dev/null || echo 0)}
partition_env() {
  local d=$1 comms=${2:-1} ctas
  echo "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / d))"
  ctas=$(( SMS / d / 2 / comms ))
  [ "$d" -gt 1 ] && [ "$SMS" -gt 0 ] && [ -z "${NCCL_MAX_CTAS:-}" ] && echo "NCCL_MAX_CTAS=$(( ctas > 1 ? ctas : 1 ))"
}
# distmuon-bench on D ranks: one per GPU where there are D GPUs, else D MPS clients of GPU 0 with
# 100/D % of its SMs each; the rest of the arguments follow.
bench() {
  local d=$1; shift
  if [ "$d" -gt 1 ] && [ "$d" -gt "$NGPU" ]; then
    "${ranks_env[@]}" $(partition_env "$d") mpirun --allow-run-as-root \
      --oversubscribe --bind-to none -np "$d" $BIN/distmuon-bench --backend cuda --ranks-per-gpu "$d" "$@"
  else
    "${ranks_env[@]}" mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$d" \
      $BIN/distmuon-bench --backend cuda "$@"
  fi
}
# Runs a command with a watchdog: past $1 seconds, every thread's stack goes to the log, then it
# is killed (so that a hang says where it hangs).
watched() {
  local limit=$1; shift
  "$@" >> "$LOG" 2>&1 & local pid=$!; WATCHED_PID=$pid
  for _ in $(seq "$limit"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    say "still running after $limit s: the threads' stacks"
    # cuda-gdb cannot attach to MPS clients (2026-12-06): then gdb, for the host's stacks.
    for q in $(pgrep -f "$BIN/distmuon-bench"); do
      for dbg in /usr/local/cuda/bin/cuda-gdb gdb; do
        command -v $dbg > /dev/null || continue
        stacks=$(timeout 60 $dbg -p "$q" -batch -ex "thread apply all bt 14" 2>&1 | grep -E "^#|^Thread")
        [ -n "$stacks" ] && { echo "--- rank process $q ($dbg)"; echo "$stacks" | head -n 150; } >> "$LOG" && break
      done
    done
    kill -9 $pid $(pgrep -f "$BIN/distmuon-bench") 2>/dev/null; wait $pid 2>/dev/null; WATCHED_PID=""
    return 124
  fi
  wait $pid; local rc=$?; WATCHED_PID=""; return $rc
}
# distmuon-plan --measure of workload $2 (name:layers) into the cost cache $1, on one process with
# the environment after them (a part's share of the SMs, for instance).
measure_costs() {
  local cache=$1 wl=$2; shift 2
  env "$@" timeout -k 10 120 $BIN/distmuon-plan --workload "${wl%%:*}" --layers "${wl##*:}" \
    --measure --backend cuda --cache "$cache" --world-size 1 >> "$LOG" 2>&1
}
SMOKE=(--workload gpt2-large --layers 1 --dtype bf16 --no-adamw --mode gather,sharded,dedicated,adamw
       --steps 1 --warmup 1)
# BENCH_ARGS: more distmuon-bench options for every step run (e.g. --batches-per-bucket, for an
# A/B into another OUT); DISTMUON_NCCL_BLOCKING=1 reaches the ranks too.
EXTRA=(--calibrate --profile ${BENCH_ARGS:-})
if [[ " $STAGES " == *" step "* ]]; then
  [ "$NGPU" -ge "${RANKS##*,}" ] || mps_start || { say "no CUDA MPS here: ranks sharing the GPU would be time-sliced, nothing to measure"; exit 1; }
  # A small run first: if the ranks cannot run here, say why (and where they hang) in seconds.
  say "smoke: 2 ranks"
  watched 90 bench 2 "${SMOKE[@]}" "${EXTRA[@]}" || { say "the smoke run failed:"; tail -n 80 "$LOG"; exit 1; }
  for d in ${RANKS//,/ }; do
    if [ "${PLAN_COSTS:-}" = parts ]; then  # this part's own cost table (usage above)
      for wl in $WORKLOADS; do
        say "costs: ${wl%%:*} on one part of $d"
        measure_costs "$OUT/costs-part-$d.json" "$wl" $(partition_env "$d") ||
          say "FAILED: costs of ${wl%%:*} on one part of $d"
      done
      export DISTMUON_PLAN_COSTS=$OUT/costs-part-$d.json
    fi
    for wl in $WORKLOADS; do
      name=${wl%%:*} layers=${wl##*:}
      if over_budget $((BUDGET_S - 90)); then say "SKIPPED (time): $name on $d ranks"; continue; fi
      # From D = 4 on, each mode in a process of its own: four modes' engines per rank outgrow
      # an 80 GB GPU there (2026-12-06: qwen2.5-7b, gpt2-large, deepseek-v2-lite at D = 4).
      if [ "$SPLIT_MODES" = 1 ] || { [ "$SPLIT_MODES" = auto ] && [ "$d" -ge 4 ]; }; then
        groups=${MODES//,/ } sfx=1
      else
        groups=$MODES sfx=""
      fi
      for m in $groups; do
        if [ -n "$sfx" ] && over_budget $((BUDGET_S - 60)); then say "SKIPPED (time): $name $m on $d ranks"; continue; fi
        say "step: $name (layers $layers) on $d ranks, $m"
        watched 150 bench "$d" --workload "$name" --layers "$layers" --dtype bf16 --no-adamw \
          --mode "$m" --steps "$STEPS" --warmup 1 "${EXTRA[@]}" \
          --json "$OUT/step-$name-$d${sfx:+-$m}.json" || say "FAILED: $name $m on $d ranks (rc $?)"
        tail -n 16 "$LOG" | grep -E "^(gather|sharded|dedicated|adamw) |rank [0-9]+:|calibration" || true
      done
    done
  done
  mps_stop
fi

# ---- the cost table the simulator scales ------------------------------------------------------
if [[ " $STAGES " == *" costs "* ]]; then
  for wl in $WORKLOADS; do
    name=${wl%%:*} layers=${wl##*:}
    if over_budget $((BUDGET_S - 40)); then say "SKIPPED (time): costs of $name"; continue; fi
    say "costs: $name (whole GPU)"
    measure_costs "$OUT/costs.json" "$wl" || say "FAILED: costs of $name"
  done
fi

# ---- end to end: FSDP2 training, one process per rank under MPS ---------------------------------
if [[ " $STAGES " == *" e2e "* ]]; then
  source bench/gpu_python_setup.sh > /dev/null || say "the Python extension did not build"
  if mps_start; then
    for d in ${E2E_RANKS//,/ }; do
      # One process group per optimizer: a model torch's FSDP2 has run forward stays alive after
      # its last reference goes (hooks held from C++), so configurations run one after another
      # in one process pile up (the fifth ran out of an H200's memory at D = 1).
      for opt in ${E2E_OPTIMIZERS//,/ }; do
        say "e2e: FSDP2 training on $d ranks, $((100 / d)) % of the SMs each (MPS; NCCL_LAUNCH_ORDER_IMPLICIT=$E2E_ORDER, CTAs shared by $E2E_COMMS communicators): $opt"
        # A step longer than a quarter of the limit prints every rank's stacks (E2E_ARGS may set
        # --stall-s again): a slow run says where it waits before the limit stops it.
        limited "$E2E_TIMEOUT_S" "${ranks_env[@]}" $(partition_env "$d" "$E2E_COMMS") \
          NCCL_LAUNCH_ORDER_IMPLICIT="$E2E_ORDER" \
          $PY -m torch.distributed.run --standalone --nproc-per-node "$d" bench/multi_gpu/e2e_train.py \
          --stall-s $((E2E_TIMEOUT_S / 4)) $E2E_ARGS --optimizers "$opt" --progress \
          --json "$OUT/e2e-$d-$opt.json" >> "$LOG" 2>&1 ||
          { say "FAILED: e2e $opt on $d ranks (rc $?)"
            # A client that dies mid-kernel leaves the MPS server refusing new clients ("MPS server
            # is not ready", every later run failed at its first CUDA call): start a fresh one.
            mps_stop; mps_start || { say "MPS did not restart: the remaining e2e runs skipped"; break 2; }; }
        grep -E "^\[$d ranks" "$LOG" | tail -n 1
      done
    done
    mps_stop
  else
    say "e2e SKIPPED: no CUDA MPS on this machine (nvidia-cuda-mps-control ${MPS_CTL:-not found} would not start)"
    echo '{"skipped": "no CUDA MPS daemon could be started"}' > "$OUT/e2e-skipped.json"
  fi
fi

say "report"
$PY bench/cluster/report.py --out "$OUT" --plan "$BIN/distmuon-plan" 2>&1 | tee -a "$LOG" | tail -n 40
