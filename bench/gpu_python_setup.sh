#!/usr/bin/env bash
# Sourced by the GPU-machine scripts (bench/front.sh, bench/multi_gpu/run.sh): unpacks the
# carried Debian packages (.gpubin/debs, from tests/gpu/stage.sh) into /tmp/sysroot (never
# into /), points CMake, pkg-config and the linker at them, and builds + installs the distmuon
# extension with pip (no network there). Expects ROOT, LOG, PY and a `say` function; sets
# CXX_LD_PATH for C++ binaries that need the toolkit's and the NCCL wheel's libraries, and
# PY_LD_PATH (= LD_LIBRARY_PATH on return) for Python processes.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
# A second script on the same (warm) machine reuses the installed extension (/tmp/dm/setup.env)
# when it was built from these very sources: a later call carries a newer tree to the same machine.
DM_SRC_SUM=$(find CMakeLists.txt pyproject.toml cmake include src python -type f \
  -not -name '*.pyc' -print0 2>/dev/null | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ -f /tmp/dm/setup.env ] && [ -z "${DM_REBUILD:-}" ] &&
   grep -q "DM_BUILT_SUM='$DM_SRC_SUM'" /tmp/dm/setup.env; then
  source /tmp/dm/setup.env
  export LD_LIBRARY_PATH=$PY_LD_PATH
  say "extension already installed from these sources (/tmp/dm/setup.env; DM_REBUILD=1 rebuilds)"
  return 0
fi
say "sysroot from .gpubin/debs"
SR=/tmp/sysroot
rm -rf "$SR" && mkdir -p "$SR"
for d in .gpubin/debs/*.deb; do dpkg -x "$d" "$SR"; done
LIB=$SR/usr/lib/x86_64-linux-gnu
export CMAKE_PREFIX_PATH=$SR/usr
export CMAKE_LIBRARY_PATH=$LIB/openblas-pthread:$LIB
export LIBRARY_PATH=$LIB/openblas-pthread:$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}
export PKG_CONFIG_LIBDIR=$LIB/pkgconfig:$SR/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=$SR
command -v pkg-config >/dev/null || export PKG_CONFIG=$SR/usr/bin/pkgconf
# Python processes find only OpenBLAS & co. here: CUDA, cuBLAS and NCCL are the copies torch
# loads from its own wheels (the extension's NEEDED entries bind to those). The C++ test binary
# gets the toolkit's and the NCCL wheel's directories on top (CXX_LD_PATH).
export LD_LIBRARY_PATH=$LIB/openblas-pthread:$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
NCCL_LIB=$($PY -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
CUDA_LIBS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
CXX_LD_PATH=$LD_LIBRARY_PATH:${NCCL_LIB:+$NCCL_LIB:}$CUDA_LIBS
[ -f .cutlass/include/cute/tensor.hpp ] || { mkdir -p .cutlass && tar xJf .gpubin/cutlass-include.tar.xz -C .cutlass; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" 2>&1 | tee -a "$LOG"

say "build + install the extension (pip --no-build-isolation, CUDA on, -j16)"
t0=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 $PY -m pip install --no-build-isolation --no-deps --root-user-action=ignore \
  --disable-pip-version-check -q . >>"$LOG" 2>&1 || { say "BUILD FAILED"; tail -40 "$LOG"; return 1; }
say "built in $(( $(date +%s) - t0 )) s"
(cd /tmp && $PY -c "
import torch, distmuon, distmuon._C as C, glob, os
print('distmuon', distmuon.__version__, 'cuda', C.cuda_available(), 'nccl', C.nccl_available())
so = glob.glob(os.path.join(os.path.dirname(distmuon.__file__), '_C*.so'))[0]
os.system('ldd ' + so + ' | grep -E \"not found|cublas|nccl|openblas\"')
") 2>&1 | tee -a "$LOG"
PY_LD_PATH=$LD_LIBRARY_PATH
mkdir -p /tmp/dm
echo "export CXX_LD_PATH='$CXX_LD_PATH' PY_LD_PATH='$PY_LD_PATH' DM_BUILT_SUM='$DM_SRC_SUM'" > /tmp/dm/setup.env
