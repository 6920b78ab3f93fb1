#!/usr/bin/env bash
# Prepares, on a CPU machine with the build dependencies (`make deps` and the CUDA toolkit), what
# a GPU machine without them and without network needs for tests/gpu/verify.sh (STAGED=.gpubin)
# and the bench/ scripts. Everything lands in .gpubin/ (git-ignored; the device tool carries it):
#   bundle.tar.xz          the C++ test binaries, tools and benchmarks (Release, CUDA, MPI), with
#                          the shared libraries the GPU image lacks (OpenBLAS, COIN-OR CBC & co.)
#   debs/                  Debian packages the Python build there needs (unpacked into a sysroot,
#                          never into /: bench/gpu_python_setup.sh)
#   cutlass-include.tar.xz CUTLASS/CuTe headers for the sm90 kernels
#   wheels/                pytest and its dependencies, in case the GPU image lacks them
#   nccl/libnccl.so.2.xz   NCCL >= 2.30 for several ranks per GPU: NCCL_LIB=<a libnccl.so.2> (e.g.
#                          from tests/gpu/build_nccl.sh), or
#   nccl-src/              NCCL_SRC=<a copy of NVIDIA/nccl's src, makefiles, Makefile> built there
#   dion.tar.xz            DION_REPO=<a clone of microsoft/dion>: its optimizer package, the
#                          yardstick bench/torch_baselines.py --dion times (pure Python + Triton)
# Usage: tests/gpu/stage.sh        (JOBS=2 by default; the CUDA build takes a while on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
JOBS=${JOBS:-2}
mkdir -p .gpubin

targets="test_cuda_backend test_cuda_grouped test_cuda_muon test_cuda_cache test_cuda_tune test_nccl_comm
         test_nccl_dist_comm test_nccl_dist_engine test_nccl_dist_errors test_nccl_dist_dedicated
         nccl_fault_probe
         distmuon-bench distmuon-plan distmuon-cuda-bench"
echo "[stage] C++ binaries (build/, CUDA on)"
cmake --preset release -DDISTMUON_WITH_CUDA=ON -DPython3_EXECUTABLE="$(command -v python3)" > /dev/null
cmake --build build -j "$JOBS" --target $targets
stage=$(mktemp -d)
mkdir -p "$stage/bin" "$stage/lib"
for t in $targets; do cp build/bin/$t "$stage/bin/"; strip "$stage/bin/$t"; done
# Shared libraries outside glibc/libstdc++, MPI and CUDA (those come from the GPU image).
for lib in $(ldd build/bin/distmuon-bench build/bin/test_nccl_dist_engine | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libopenblas*|libgfortran*|libquadmath*|libgomp*|liblapack*) cp -L "$lib" "$stage/lib/" ;;
    libCbc*|libClp*|libCgl*|libOsi*|libCoinUtils*|libbz2*|libnauty*) cp -L "$lib" "$stage/lib/" ;;
  esac
done
# The binaries share most of their bytes (the kernels): a large window compresses them together.
XZ_OPT=-9 tar cJf .gpubin/bundle.tar.xz.tmp -C "$stage" .
mv .gpubin/bundle.tar.xz.tmp .gpubin/bundle.tar.xz  # never a half-written bundle
rm -rf "$stage"

echo "[stage] Debian packages for the Python build there"
DEBS="libopenblas0-pthread libopenblas-pthread-dev libopenblas-dev libgfortran5 libquadmath0
      coinor-libcbc3 coinor-libcbc-dev coinor-libcgl1 coinor-libcgl-dev coinor-libclp1
      coinor-libclp-dev coinor-libosi1v5 coinor-libosi-dev coinor-libcoinutils3v5
      coinor-libcoinutils-dev nlohmann-json3-dev libbz2-dev zlib1g-dev
      pkgconf pkgconf-bin libpkgconf3"
mkdir -p .gpubin/debs
rm -f .gpubin/debs/*.deb
(cd .gpubin/debs && apt-get download $DEBS 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)

echo "[stage] pytest wheels"
rm -rf .gpubin/wheels && mkdir -p .gpubin/wheels
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --no-deps -d .gpubin/wheels pytest iniconfig pluggy packaging

echo "[stage] CUTLASS headers"
if [ ! -f .cutlass/include/cute/tensor.hpp ]; then
  src=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
  mkdir -p .cutlass/include && cp -r "$src"/. .cutlass/include/
fi
tar cJf .gpubin/cutlass-include.tar.xz -C .cutlass include

if [ -n "${NCCL_LIB:-}" ]; then
  echo "[stage] NCCL library $NCCL_LIB"
  mkdir -p .gpubin/nccl && cp -L "$NCCL_LIB" .gpubin/nccl/libnccl.so.2 && strip .gpubin/nccl/libnccl.so.2
  xz -9 -f .gpubin/nccl/libnccl.so.2
elif [ -n "${NCCL_SRC:-}" ]; then
  echo "[stage] NCCL source $NCCL_SRC"
  rm -rf .gpubin/nccl-src && mkdir -p .gpubin/nccl-src
  cp -r "$NCCL_SRC"/{src,makefiles,Makefile,LICENSE.txt} .gpubin/nccl-src/
fi
if [ -n "${DION_REPO:-}" ]; then
  echo "[stage] dion $(git -C "$DION_REPO" rev-parse --short HEAD) from $DION_REPO"
  rev=$(mktemp -d) && git -C "$DION_REPO" rev-parse --short HEAD > "$rev/REV"
  git -C "$DION_REPO" archive --format=tar HEAD dion LICENSE > "$rev/dion.tar"
  tar rf "$rev/dion.tar" -C "$rev" REV && xz -9 -c "$rev/dion.tar" > .gpubin/dion.tar.xz && rm -rf "$rev"
fi
du -sh .gpubin/* | sort -h
