#!/usr/bin/env bash
# The GPU verification (`make test-gpu`): one command on a machine with NVIDIA GPUs that builds
# what it needs and proves every GPU path, writing summary.json and summary.md.
#
#   tests/gpu/verify.sh                       ranks 2, 4, 8 (all on the GPUs this machine has)
#   RANKS=2,4 tests/gpu/verify.sh             other rank counts
#   LANES="python" tests/gpu/verify.sh        some lanes only (cpp, python, sanitizer, bench)
#   OUT_DIR=bench/results/<date>-gpu-verify tests/gpu/verify.sh
#
# What it runs, in four lanes at once (the small test models leave the GPU mostly idle):
#   cpp        the CUDA gtests and the single-process NCCL test; the distributed engine on the
#              NCCL rig (test_nccl_dist_engine: every mode, HSDP 2 x 2 and CacheMuon against the
#              single-process CUDA engine) at each rank count above 2
#   python     the GPU pytest modules (test_gpu.py; test_gpu_distributed.py: DDP, FSDP2, HSDP,
#              dedicate(), mixed precision, DCP 4 -> 2 -> 1 over NCCL; test_gpu_tp.py: TP x
#              FSDP2 and EP at 4 ranks)
#   sanitizer  compute-sanitizer memcheck over the GPU gtests, racecheck and synccheck over the
#              kernels' tests, memcheck over a 2-rank NCCL engine run; the engine on the NCCL
#              rig at 2 ranks (the lanes' times balanced: cpp would run past its limit)
#   bench      distmuon-bench --mode gather,sharded,dedicated at each rank count (bytes and
#              orthogonalization FLOPs per rank) beside distmuon-plan --simulate's prediction;
#              the rig's other suites (test_nccl_dist_comm / _errors / _dedicated) at each rank
#              count; the fault tests (a rank that stops stepping, a rank killed mid-step:
#              tests/gpu/nccl_faults.py)
#
# Several ranks per GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1. When the NCCL that
# torch and the toolkit bring is older, the script uses NCCL_LIB (a libnccl.so.2 >= 2.30) or
# builds one from NCCL_SRC (a copy of NVIDIA/nccl's src, makefiles, Makefile: build_nccl.sh,
# ~100 s on 16 cores beside the build), and preloads it in every multi-rank process. Rank counts it cannot run are skipped
# with the reason.
#
# Build: a CMake build (Release, CUDA, MPI, tests and tools) in build-gpu/ and the Python package
# with pip --no-build-isolation. On a machine without the build dependencies (no network),
# STAGED=<dir> from tests/gpu/stage.sh brings prebuilt binaries and the Debian packages the
# Python build needs (see that script).
#
# Time limits: each lane runs under LANE_TIMEOUT_S (default 480); a lane that times out is
# reported as failed with what it finished. TOTAL_S, where the caller has a limit for the whole
# run (a device call's), shortens the lanes' limit to what is left after the build, less 20 s,
# so that the summary is still written (a fresh machine's build took 191 s of a 480 s call,
# 2026-12-07, and the lanes were cut without one). ONLY_BUILD=1 stops after the builds (and
# leaves the NCCL it built, compressed, in OUT_DIR): a second run on the same machine reuses them,
# for machines lent by the call with a limit per call. Exit status: 0 when every suite passed.
#
# Memory: the lanes share the GPU. The cpp lane's engine suite at 4 ranks and more and the python
# lane's NCCL fixtures take turns (lanes.sh, `heavy`): side by side on an 80 GB H100 they reached
# 74 GB and ran out of memory (2026-12-06). Should a lane still run out, LANES="cpp bench" and
# LANES="python" can run as two calls into two OUT_DIRs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT_DIR=${OUT_DIR:-$ROOT/out/gpu-verify}
RANKS=${RANKS:-2,4,8}
PY=${PYTHON:-python3}
STAGED=${STAGED:-}
LANE_TIMEOUT_S=${LANE_TIMEOUT_S:-480}
WORK=$(mktemp -d /tmp/dm-verify.XXXX)
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/verify.log"
: > "$LOG"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
T0=$(date +%s)
COMMAND="RANKS=$RANKS${LANES:+ LANES=\"$LANES\"} tests/gpu/verify.sh"

# ---- machine ---------------------------------------------------------------------------------
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$NGPU" -gt 0 ] || { say "no NVIDIA GPU visible: nothing to verify"; exit 2; }
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
say "$NGPU x $GPU (sm_$SM), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())))" 2>&1 | tee -a "$LOG"

# ---- NCCL able to share a GPU between ranks, where the rank counts need it ---------------------
nccl_version() {  # the version a libnccl.so.2 reports (e.g. 23007), 0 if it cannot be loaded
  $PY - "$1" <<'EOF' 2>/dev/null || echo 0
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int(); lib.ncclGetVersion(ctypes.byref(v)); print(v.value)
EOF
}
TORCH_NCCL=$($PY -c "import torch; a, b, c = torch.cuda.nccl.version(); print(a * 10000 + b * 100 + c)")
MAX_RANKS=$(tr , '\n' <<< "$RANKS" | sort -n | tail -1)
NCCL_PRELOAD=""
if [ "$MAX_RANKS" -gt "$NGPU" ] && [ "$TORCH_NCCL" -lt 23000 ]; then
  # A library staged (tests/gpu/stage.sh) or built by an earlier run (OUT_DIR/libnccl.so.2.xz).
  if [ -n "$STAGED" ] && [ -f "$STAGED/nccl/libnccl.so.2.xz" ] && [ ! -f /tmp/nccl/lib/libnccl.so.2 ]; then
    mkdir -p /tmp/nccl/lib && xz -dc "$STAGED/nccl/libnccl.so.2.xz" > /tmp/nccl/lib/libnccl.so.2
  fi
  for cand in "${NCCL_LIB:-}" /tmp/nccl/lib/libnccl.so.2; do
    if [ -n "$cand" ] && [ -f "$cand" ] && [ "$(nccl_version "$cand")" -ge 23000 ]; then
      NCCL_PRELOAD=$cand
      break
    fi
  done
  NCCL_SRC=${NCCL_SRC:-${STAGED:+$STAGED/nccl-src}}
  if [ -z "$NCCL_PRELOAD" ] && [ -n "${NCCL_SRC:-}" ] && [ -f "$NCCL_SRC/Makefile" ]; then
    say "building NCCL from $NCCL_SRC for sm_$SM beside the build below (torch's is $TORCH_NCCL)"
    bash tests/gpu/build_nccl.sh "$NCCL_SRC" /tmp/nccl "$SM" > "$WORK/nccl-build.log" 2>&1 &
    NCCL_BUILD_PID=$!
  elif [ -z "$NCCL_PRELOAD" ]; then
    keep=$(tr , '\n' <<< "$RANKS" | awk -v n="$NGPU" '$1 <= n' | paste -sd,)
    say "SKIPPED rank counts above $NGPU: NCCL $TORCH_NCCL cannot put several ranks on one GPU (give NCCL_LIB or NCCL_SRC >= 2.30)"
    RANKS=$keep
  fi
fi

# ---- build ------------------------------------------------------------------------------------
source tests/gpu/build.sh || { say "BUILD FAILED"; exit 1; }
if [ -n "${NCCL_BUILD_PID:-}" ]; then
  wait "$NCCL_BUILD_PID" || tail -20 "$WORK/nccl-build.log" | tee -a "$LOG"
  if [ -f /tmp/nccl/lib/libnccl.so.2 ]; then
    NCCL_PRELOAD=/tmp/nccl/lib/libnccl.so.2
  else
    say "NCCL build failed: rank counts above $NGPU skipped"
    RANKS=$(tr , '\n' <<< "$RANKS" | awk -v n="$NGPU" '$1 <= n' | paste -sd,)
  fi
fi
[ -n "$NCCL_PRELOAD" ] && say "NCCL $(nccl_version "$NCCL_PRELOAD") from $NCCL_PRELOAD for several ranks per GPU"
say "built after $(( $(date +%s) - T0 )) s (C++ binaries in $BIN, Python package installed)"
# The NCCL built here goes back with the results, for later runs to bring (STAGED nccl/).
if [ -n "${NCCL_BUILD_PID:-}" ] && [ -n "$NCCL_PRELOAD" ]; then
  (cp -L "$NCCL_PRELOAD" "$OUT_DIR/libnccl.so.2" && strip "$OUT_DIR/libnccl.so.2" && xz -T0 -f "$OUT_DIR/libnccl.so.2") &
fi
if [ -n "${ONLY_BUILD:-}" ]; then
  wait
  say "ONLY_BUILD: stopping here (a second run on this machine reuses the builds)"
  exit 0
fi
NCCL_USED=$([ -n "$NCCL_PRELOAD" ] && nccl_version "$NCCL_PRELOAD" || echo "$TORCH_NCCL")

# Every process after the build may run several ranks on one GPU.
if [ -n "$NCCL_PRELOAD" ]; then export LD_PRELOAD=$NCCL_PRELOAD; fi
export NCCL_MULTI_RANK_GPU_ENABLE=1 DISTMUON_COMM_TIMEOUT_S=60 DISTMUON_AUTOTUNE=off
if [ -n "${TOTAL_S:-}" ]; then
  left=$(( TOTAL_S - ($(date +%s) - T0) - 20 ))
  [ "$left" -lt "$LANE_TIMEOUT_S" ] && LANE_TIMEOUT_S=$(( left > 30 ? left : 30 ))
fi
export WORK LOG BIN PY RANKS NGPU LANE_TIMEOUT_S LD_LIBRARY_PATH

LANES=${LANES:-cpp python sanitizer bench}
say "lanes: $LANES (ranks $RANKS; each lane at most $LANE_TIMEOUT_S s)"
for lane in $LANES; do
  (timeout -k 10 "$LANE_TIMEOUT_S" bash -c "source tests/gpu/lanes.sh && lane_$lane" \
    || echo "[$lane] lane ended early or failed (limit $LANE_TIMEOUT_S s)" | tee -a "$LOG") &
done
wait
say "summary"
$PY tests/gpu/summarize.py --work "$WORK" --out "$OUT_DIR" --gpu "$GPU" --ngpu "$NGPU" --nccl "$NCCL_USED" \
  --ranks "$RANKS" --command "$COMMAND" --seconds "$(( $(date +%s) - T0 ))" | tee -a "$LOG"
status=${PIPESTATUS[0]}
tar czf "$OUT_DIR/logs.tgz" -C "$WORK" . 2>/dev/null
say "done in $(( $(date +%s) - T0 )) s: $([ "$status" = 0 ] && echo 'all suites passed' || echo FAILURES)"
exit "$status"
