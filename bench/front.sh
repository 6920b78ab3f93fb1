#!/usr/bin/env bash
# The PyTorch front on the GPU machine: builds and installs the extension there (Python 3.12),
# runs the GPU pytest subset, the NCCL communicator test at world size 1, and the training
# example with distmuon, fused AdamW and torch.optim.Muon (step time split into forward+backward
# and optimizer; final validation losses).
#
#   bench/front.sh            the recorded run (example at its GPU preset)
#   STEPS=300 bench/front.sh  a shorter example run (validation of the script)
#   SKIP_EXAMPLE=1 bench/front.sh   everything but the training example
#   ONLY=dedicated bench/front.sh   build, smoke test, the GPU tests of the dedicated
#                                  runtime and bench/dedicated.py only (a few minutes)
#
# Needs .gpubin/ from tests/gpu/stage.sh (device tool: carry [".gpubin"]). The Debian
# packages are unpacked into /tmp/sysroot (never into /) and CMake, pkg-config and the linker
# are pointed at it. Output under $OUT: run.log, pytest.log, train_gpt.json, train_gpt.png,
# summary.txt, dedicated/ (bench/dedicated.py: dedicated.json, summary.txt).
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/front}
mkdir -p "$OUT"
LOG="$OUT/run.log"
cd "$ROOT"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
PY=${PYTHON:-python3}
status=0

# The extension is built and installed here (Python 3.12) against the carried Debian packages.
source bench/gpu_python_setup.sh || exit 1

say "smoke: a CUDA engine inside a torch process"
SMOKE='import torch
torch.zeros(1, device="cuda")
import distmuon._C as C
e = C.Engine("cuda")
e.set_stream(torch.cuda.current_stream().cuda_stream)
print("cuda engine ok:", e.backend_name)'
echo "$SMOKE" > /tmp/dm_smoke.py
printf 'import distmuon._C\n%s\n' "$SMOKE" > /tmp/dm_smoke_first.py
$PY -X faulthandler /tmp/dm_smoke.py 2>&1 | tail -8 | tee -a "$LOG"
smoke=${PIPESTATUS[0]}
if [ "$smoke" != 0 ]; then
  status=1
  say "smoke FAILED: native backtrace and the libraries loaded (cuda-gdb)"
  cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args $PY /tmp/dm_smoke.py 2>&1 \
    | grep -vE "^\[(New|Thread|Detaching)" | tail -90 | tee -a "$LOG"
  say "variant: distmuon imported before torch"
  $PY -X faulthandler /tmp/dm_smoke_first.py 2>&1 | tail -4 | tee -a "$LOG"
  say "variant: the toolkit's and the NCCL wheel's libraries first"
  LD_LIBRARY_PATH=$CXX_LD_PATH $PY -X faulthandler /tmp/dm_smoke.py 2>&1 | tail -4 | tee -a "$LOG"
  say "variant: no measurement store (no tuned choices, analytic plan costs)"
  DISTMUON_COST_CACHE=/nonexistent/costs.json $PY -X faulthandler /tmp/dm_smoke.py 2>&1 | tail -4 | tee -a "$LOG"
fi

# The dedicated runtime (distmuon.torch.dedicate) against the plain optimizer, one GPU.
dedicated_bench() {
  say "dedicated runtime: GPU tests (test_gpu.py -k dedicated) and bench/dedicated.py"
  $PY -c "import pytest" 2>/dev/null || $PY -m pip install -q --no-index --find-links .gpubin/wheels \
    --root-user-action=ignore pytest >>"$LOG" 2>&1
  OMP_WAIT_POLICY=passive $PY -m pytest tests/python/test_gpu.py -v -rs -k dedicated 2>&1 | tail -12 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  OUT=$OUT/dedicated $PY bench/dedicated.py ${DEDICATED_ARGS:-} 2>&1 | tee -a "$LOG" | tail -14
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
if [ "${ONLY:-}" = dedicated ]; then
  if [ "$smoke" = 0 ]; then dedicated_bench; else status=1; fi
  say "done ($([ $status = 0 ] && echo all passed || echo FAILURES))"
  exit $status
fi

say "NCCL communicator test, world size 1"
[ -x /tmp/dm/bin/test_nccl_comm ] || tar xJf .gpubin/bundle.tar.xz -C /tmp/dm ./bin/test_nccl_comm 2>/dev/null
if [ -x /tmp/dm/bin/test_nccl_comm ]; then
  LD_LIBRARY_PATH=$CXX_LD_PATH /tmp/dm/bin/test_nccl_comm --gtest_brief=1 2>&1 | tail -15 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  say "missing test_nccl_comm in .gpubin/bundle.tar.xz (run tests/gpu/stage.sh)"; status=1
fi

if [ "$smoke" = 0 ]; then
  say "GPU pytest subset (tests/python/test_gpu.py)"
  $PY -c "import pytest" 2>/dev/null || $PY -m pip install -q --no-index --find-links .gpubin/wheels \
    --root-user-action=ignore pytest >>"$LOG" 2>&1
  OMP_WAIT_POLICY=passive $PY -m pytest tests/python/test_gpu.py -v -rs 2>&1 | tee "$OUT/pytest.log" | tail -25 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1

  if [ -z "${SKIP_EXAMPLE:-}" ]; then
    say "example: distmuon, adamw (fused), torch-muon${STEPS:+ ($STEPS steps)}"
    $PY examples/train_gpt.py --device cuda --optimizer distmuon,adamw,torch-muon ${STEPS:+--steps $STEPS} \
      --out "$OUT/train_gpt.png" 2>&1 | grep -vE "^\s*(distmuon|adamw|torch-muon)\s*[\[|:]" | tee -a "$LOG" | tail -12
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    $PY - "$OUT/train_gpt.json" <<'EOF' | tee "$OUT/summary.txt" | tee -a "$LOG"
import json, sys
d = json.load(open(sys.argv[1]))
c = d["config"]
print(f"char GPT {c['n_layer']}x{c['n_embd']}, block {c['block_size']}, batch {d['args']['batch_size']}, "
        f"{d['args']['steps']} steps, bf16 autocast {d['args']['amp']}, torch {d['torch']}")
print(f"{'optimizer':>10} {'fwd+bwd ms':>10} {'optimizer ms':>12} {'final val loss':>14}")
for r in d["results"]:
    print(f"{r['optimizer']:>10} {r['fwd_bwd_ms_median']:10.2f} {r['optimizer_ms_median']:12.2f} {r['final_val_loss']:14.4f}")
EOF
  fi
  dedicated_bench
else
  say "GPU pytest and the example skipped: a CUDA engine cannot be made in a torch process (above)"
fi
say "done ($([ $status = 0 ] && echo all passed || echo FAILURES))"
exit $status
