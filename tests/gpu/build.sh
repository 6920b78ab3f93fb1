# Builds what the GPU verification runs; sourced by tests/gpu/verify.sh (expects ROOT, LOG, PY,
# STAGED and a `say` function). Sets BIN (the C++ test binaries and tools) and LD_LIBRARY_PATH,
# and installs the Python package distmuon.
#
# - A machine with the build dependencies (`make deps`): a Release CMake build with CUDA, MPI,
#   tests and tools in build-gpu/, and `pip install --no-build-isolation .`.
# - STAGED=.gpubin (a machine without them and without network, such as the lent H200): the
#   binaries tests/gpu/stage.sh built elsewhere (.gpubin/bundle.tar.xz) and the Python package
#   built here against the Debian packages it carried (bench/gpu_python_setup.sh).
CUDA_LIBS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | paste -sd:)
if [ -n "$STAGED" ]; then
  [ "$STAGED" = .gpubin ] || { say "STAGED must be .gpubin (what tests/gpu/stage.sh writes)"; return 1; }
  mkdir -p /tmp/dm
  # A warm machine keeps the last call's binaries: unpack again when the bundle differs.
  bundle_sum=$(sha256sum .gpubin/bundle.tar.xz | cut -c1-16)
  if [ ! -x /tmp/dm/bin/test_nccl_dist_engine ] || [ "$(cat /tmp/dm/bundle.sum 2>/dev/null)" != "$bundle_sum" ]; then
    rm -rf /tmp/dm/bin /tmp/dm/lib
    tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "the staged bundle does not unpack"; return 1; }
    echo "$bundle_sum" > /tmp/dm/bundle.sum
  fi
  BIN=/tmp/dm/bin
  source bench/gpu_python_setup.sh || return 1  # the extension; sets CXX_LD_PATH
  export LD_LIBRARY_PATH=/tmp/dm/lib:$CXX_LD_PATH
  # The bundle's MPI programs use this machine's Open MPI (its mpirun and libmpi must match).
  if ldd "$BIN/test_nccl_dist_engine" | grep -q "libmpi.*not found"; then
    mpilib=$(dirname "$(find / -name 'libmpi.so.40' -not -path '/proc/*' 2>/dev/null | head -1)")
    export LD_LIBRARY_PATH=$mpilib:$LD_LIBRARY_PATH
  fi
  if ldd "$BIN/test_nccl_dist_engine" | grep "not found" | tee -a "$LOG" | grep -q .; then
    say "staged binaries miss libraries (above)"
    return 1
  fi
else
  say "building C++ (Release, CUDA, MPI, tests, tools) in build-gpu/"
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDISTMUON_WITH_CUDA=ON \
    -DPython3_EXECUTABLE="$(command -v "$PY")" > "$LOG.cmake" 2>&1 &&
    cmake --build build-gpu -j "$(nproc)" >> "$LOG.cmake" 2>&1 || { tail -30 "$LOG.cmake" | tee -a "$LOG"; return 1; }
  BIN=$ROOT/build-gpu/bin
  [ -x "$BIN/test_nccl_dist_engine" ] || { say "the build has no NCCL tests (NCCL or MPI not found)"; return 1; }
  say "installing the Python package (pip --no-build-isolation)"
  "$PY" -m pip install -q --no-build-isolation --no-deps --root-user-action=ignore \
    --disable-pip-version-check . >> "$LOG.cmake" 2>&1 || { tail -30 "$LOG.cmake" | tee -a "$LOG"; return 1; }
  export LD_LIBRARY_PATH=${CUDA_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
"$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install -q --no-index --find-links .gpubin/wheels \
  --root-user-action=ignore pytest >> "$LOG" 2>&1
(cd /tmp && "$PY" -c "import torch, distmuon; print('distmuon', distmuon.__version__, 'cuda', distmuon.cuda_available())") 2>&1 | tee -a "$LOG"
