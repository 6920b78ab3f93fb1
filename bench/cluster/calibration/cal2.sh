#!/usr/bin/env bash
# Contention probe 2 (see probe2.py): two MPS ranks on one GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN
S=$(pwd)/out/simcal; LOG=$OUT/log2.txt
mkdir -p /tmp/nccl && xz -dc .gpubin/nccl/libnccl.so.2.xz > /tmp/nccl/libnccl.so.2 && export LD_PRELOAD=/tmp/nccl/libnccl.so.2
MPS_CTL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p /tmp/mps-pipe /tmp/mps-log && $MPS_CTL -d
for q in 0 1; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 RANK=$q WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29534 \
    timeout -k 5 120 python3 $S/probe2.py $OUT/probe2.json >> $LOG 2>&1 &
done
wait
echo quit | $MPS_CTL
grep PROBE2 $LOG || tail -30 $LOG
