#!/usr/bin/env bash
# Builds the GPU binaries HERE (the GPU machine has no OpenBLAS, CBC, gtest or Eigen) and packs
# them with the shared libraries the GPU image lacks into .gpubin/bundle.tar.xz (git-ignored),
# which the device tool carries (carry: [".gpubin"]); bench/run_h200.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
targets="test_cuda_backend test_cuda_muon test_cuda_cache distmuon-cuda-bench distmuon-bench distmuon-plan"
cmake --preset release -DDISTMUON_WITH_CUDA=ON >/dev/null
cmake --build build -j "${JOBS:-2}" --target $targets
stage=$(mktemp -d)
mkdir -p "$stage/bin" "$stage/lib" .gpubin
for t in $targets; do cp build/bin/$t "$stage/bin/"; strip "$stage/bin/$t"; done
# Non-CUDA shared libraries outside glibc/libstdc++, MPI and CUDA (those come from the GPU
# image): OpenBLAS and its Fortran runtime, COIN-OR CBC (the planner's MILP) and its solvers.
for lib in $(ldd build/bin/distmuon-bench build/bin/test_cuda_muon build/bin/distmuon-cuda-bench | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libopenblas*|libgfortran*|libquadmath*|libgomp*|liblapack*) cp -L "$lib" "$stage/lib/" ;;
    libCbc*|libClp*|libCgl*|libOsi*|libCoinUtils*|libbz2*|libnauty*) cp -L "$lib" "$stage/lib/" ;;
  esac
done
tar cJf .gpubin/bundle.tar.xz -C "$stage" .
rm -rf "$stage"
ls -la .gpubin/bundle.tar.xz
