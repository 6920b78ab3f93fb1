#!/usr/bin/env bash
# Calibration for the simulator (sim-model): per-collective cost of the bench's NCCL path at D = 1
# and D = 2 MPS ranks on one GPU (synthetic workloads of many small tensors), a re-run of one
# recorded step, and the cost table measured on the whole GPU. Modelled on bench/cluster/run.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_MULTI_RANK_GPU_ENABLE=1 DISTMUON_AUTOTUNE=off NCCL_DEBUG=WARN
ROOT=$(pwd); R=$OUT/r; mkdir -p $R; LOG=$R/log.txt
S=$ROOT/out/simcal
say() { echo "=== $* ($(date +%T))" | tee -a $LOG; }
mkdir -p /tmp/dm && tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "no bundle"; exit 1; }
BIN=/tmp/dm/bin
export LD_LIBRARY_PATH=/tmp/dm/lib:$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/extras/CUPTI/lib64 2>/dev/null | paste -sd:)
if ldd $BIN/distmuon-bench | grep -q "libmpi.*not found"; then
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$(find / -name 'libmpi.so.40' -not -path '/proc/*' 2>/dev/null | head -1)")
fi
ldd $BIN/distmuon-bench | grep "not found" | tee -a $LOG
mkdir -p /tmp/nccl && xz -dc .gpubin/nccl/libnccl.so.2.xz > /tmp/nccl/libnccl.so.2 && export LD_PRELOAD=/tmp/nccl/libnccl.so.2
nvidia-smi -L | tee -a $LOG
MPS_CTL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p /tmp/mps-pipe /tmp/mps-log && $MPS_CTL -d && say "MPS on"
bench() { local d=$1 out=$2; shift 2; say "bench D=$d $out $*"
  if [ $d -gt 1 ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / d)); else unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; fi
  timeout -k 5 ${TL:-100} mpirun --allow-run-as-root --oversubscribe --bind-to none -np $d $S/distmuon-bench \
    --backend cuda $( [ $d -gt 1 ] && echo --ranks-per-gpu $d ) --dtype bf16 --no-adamw --planner lpt \
    --calibrate --json $R/$out.json "$@" >> $LOG 2>&1 || say "FAILED rc $?"
  unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; }
M=gather,sharded,dedicated,adamw
T0=$(date +%s); BUDGET_S=${BUDGET_S:-400}
left() { [ $(( $(date +%s) - T0 )) -lt $((BUDGET_S - $1)) ] || { say "SKIPPED (time)"; return 1; }; }
bench 2 tiny256-2 --workload $S/tiny256.json --mode $M --steps 5 --warmup 2
say "contention probe (torch, 2 MPS ranks)"
for q in 0 1; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 RANK=$q WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
    timeout -k 5 60 python3 $S/probe.py $R/probe.json >> $LOG 2>&1 &
done
wait
left 60 && bench 1 tiny256-1 --workload $S/tiny256.json --mode $M --steps 5 --warmup 2
left 60 && bench 2 mid32-2 --workload $S/mid32.json --mode $M --steps 5 --warmup 2
left 60 && bench 2 tiny128-2 --workload $S/tiny128.json --mode $M --steps 5 --warmup 2
echo quit | $MPS_CTL; sleep 1; say "MPS off"
for wl in gpt2-large:0 pi0:6 qwen2.5-7b:4 deepseek-v2-lite:1; do
  left 30 || break; say "costs $wl"
  timeout -k 5 90 $BIN/distmuon-plan --workload ${wl%%:*} --layers ${wl##*:} --measure --backend cuda \
    --cache $R/costs.json --world-size 1 >> $LOG 2>&1 || say "FAILED costs $wl"
done
if left 100; then $MPS_CTL -d; TL=90 bench 2 gpt2-large-2 --workload gpt2-large --layers 0 --mode $M --steps 3 --warmup 1; echo quit | $MPS_CTL; fi
tar czf $OUT/simcal.tgz -C $R . && cp $LOG $OUT/log.txt
