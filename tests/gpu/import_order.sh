#!/usr/bin/env bash
# Imports distmuon and torch in every order in fresh processes, checks that the process holds one
# copy of each CUDA library distmuon._C links (torch's), and, where a GPU is visible, that a
# CUDA step and an NCCL unique id work after either order.
#
# Needs only python3 with torch and an installed distmuon (run it outside the source tree, or
# the source folder python/distmuon would shadow the installed package):
#     bash tests/gpu/import_order.sh            # PYTHON=/path/to/python to pick another one
# Prints one line per check (PASS / FAIL / SKIP) and exits non-zero when any check fails.
set -u
PY=${PYTHON:-python3}
failed=0

check() {  # check NAME PYTHON-CODE: PASS when the code exits 0, SKIP when it exits 3
  local name=$1 code=$2 out rc
  out=$(cd /tmp && "$PY" -c "$code" 2>&1)
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "PASS $name${out:+: ${out##*$'\n'}}"
  elif [ $rc -eq 3 ]; then
    echo "SKIP $name: ${out##*$'\n'}"
  else
    echo "FAIL $name: $(echo "$out" | tail -n 3 | tr '\n' ' ')"
    failed=1
  fi
}

check "import distmuon, then torch" "import distmuon, torch; print(distmuon.__version__, torch.__version__)"
check "import torch, then distmuon" "import torch, distmuon; print(distmuon.__version__, torch.__version__)"
check "from distmuon.torch import Muon (first import)" "from distmuon.torch import Muon; print('ok')"
check "distmuon.__version__ equals the extension's" \
  "import distmuon, distmuon._C as C; assert distmuon.__version__ == C.__version__, (distmuon.__version__, C.__version__); print(C.__version__)"

# One file per soname, the one torch's own RPATH leads to where torch has nvidia-* wheels. Not
# with LD_PRELOAD: the preloaded library (e.g. a newer NCCL) is what everybody binds to, and torch
# itself then loads its wheel's copy beside it.
ONE_COPY='
import os, sys
from distmuon import _cuda_libs
from distmuon._build_config import CUDA_LIBRARIES
if not CUDA_LIBRARIES:
    print("CPU-only build: no CUDA libraries"); sys.exit(3)
if os.environ.get("LD_PRELOAD"):
    print("LD_PRELOAD is set"); sys.exit(3)
loaded = {os.path.realpath(l.split()[-1]) for l in open("/proc/self/maps") if "/" in l}
site = os.path.dirname(os.path.dirname(torch.__file__))
seen = []
for soname in CUDA_LIBRARIES:
    stem = soname.split(".so")[0] + ".so"
    copies = sorted(p for p in loaded if os.path.basename(p).startswith(stem))
    assert len(copies) == 1, f"{soname}: {copies}"
    wheel = _cuda_libs.find(soname, [site])
    assert wheel is None or os.path.realpath(wheel) == copies[0], f"{soname}: {copies[0]} loaded, torch has {wheel}"
    seen.append(copies[0])
print(" ".join(seen))
'
check "one copy of each CUDA library, torch's (distmuon first)" "import distmuon, torch
$ONE_COPY"
check "one copy of each CUDA library, torch's (torch first)" "import torch, distmuon
$ONE_COPY"

CUDA_STEP='
import sys
import torch
from distmuon.torch import Muon
import distmuon
if not distmuon.cuda_available():
    print("no CUDA backend or no GPU"); sys.exit(3)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).cuda()
opt = Muon(model.named_parameters(), lr=0.02)
before = model[0].weight.detach().clone()
model(torch.randn(8, 64, device="cuda")).square().mean().backward()
opt.step()
torch.cuda.synchronize()
assert not torch.equal(before, model[0].weight) and torch.isfinite(model[0].weight).all()
print("step ok on", torch.cuda.get_device_name())
'
check "CUDA step (distmuon imported first)" "import distmuon
$CUDA_STEP"
check "CUDA step (torch imported first)" "import torch
$CUDA_STEP"
check "NCCL unique id (distmuon imported first)" "
import sys, distmuon, distmuon._C as C
if not (C.nccl_available() and C.cuda_available()):
    print('no NCCL communicator or no GPU'); sys.exit(3)
import torch
uid = C.nccl_unique_id()
print(len(uid), 'bytes')"

exit $failed
