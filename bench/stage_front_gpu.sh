#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what bench/h200_front.sh needs on the GPU machine, which has
# no network and none of OpenBLAS, COIN-OR CBC, nlohmann-json, pkg-config or gtest:
#   .gpubin/debs/*.deb               Debian packages; h200_front.sh unpacks them into /tmp/sysroot
#                                    there (dpkg -x, never into /) and builds the extension
#                                    against them (Python 3.12 there, so it is built there)
#   .gpubin/front/test_nccl_comm     the NCCL communicator test (gtest binary, built here)
#   .gpubin/cutlass-include.tar.xz   CUTLASS/CuTe headers for the sm90 kernels (27 MB unpacked)
#   .gpubin/wheels/                  pytest and its dependencies (pure Python wheels)
# Carry with the device tool: carry: [".gpubin"]. Everything here is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS="libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev libgfortran5 libquadmath0
      coinor-libcbc3 coinor-libcbc-dev coinor-libcgl1 coinor-libcgl-dev coinor-libclp1
      coinor-libclp-dev coinor-libosi1v5 coinor-libosi-dev coinor-libcoinutils3v5
      coinor-libcoinutils-dev nlohmann-json3-dev libbz2-dev zlib1g-dev
      pkgconf pkgconf-bin libpkgconf3"

mkdir -p .gpubin/debs .gpubin/front
echo "[stage] Debian packages"
rm -f .gpubin/debs/*.deb
(cd .gpubin/debs && apt-get download $DEBS 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
ls .gpubin/debs | wc -l

echo "[stage] pytest wheels (in case the GPU image lacks pytest)"
rm -rf .gpubin/wheels && mkdir -p .gpubin/wheels
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --no-deps -d .gpubin/wheels pytest iniconfig pluggy packaging

echo "[stage] CUTLASS headers"
if [ ! -f .cutlass/include/cute/tensor.hpp ]; then
  src=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
  mkdir -p .cutlass/include && cp -r "$src"/. .cutlass/include/
fi
tar cJf .gpubin/cutlass-include.tar.xz -C .cutlass include

echo "[stage] test_nccl_comm (CUDA on, Release, build-gpu/)"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDISTMUON_WITH_CUDA=ON -DDISTMUON_WITH_MPI=OFF \
  -DDISTMUON_BUILD_TOOLS=OFF -DDISTMUON_BUILD_PYTHON=OFF >/dev/null
cmake --build build-gpu -j "${JOBS:-2}" --target test_nccl_comm
cp build-gpu/bin/test_nccl_comm .gpubin/front/
strip .gpubin/front/test_nccl_comm
du -sh .gpubin/debs .gpubin/front .gpubin/cutlass-include.tar.xz
