// The lower-triangle symmetric product on Hopper (CUTLASS sm90, launch/sym_gemm_sm90_*.cu):
//   D = alpha * A B^T + beta * C   (row-major, A and B both m x k with k contiguous)
// for the output tiles that touch the lower triangle only; the caller mirrors afterwards.
// Every pointer 16-byte aligned, every leading dimension and batch stride a multiple of 8.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "distmuon/cuda_backend.h"

namespace distmuon::cuda {

struct SymGemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;  // may be null when beta == 0
  void* d = nullptr;
  int64_t m = 0, k = 0, count = 0;
  int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0, stride_d = 0;
  float alpha = 1.0f, beta = 0.0f;
};

// True when this build has the CUTLASS kernels.
bool sym_sm90_built();

// Runs the given CUTLASS variant (kTri128, kTri256x128 or kTri128Cluster2) in bf16 or fp16.
// Returns false when the variant cannot run these arguments (the caller falls back).
bool run_sym_sm90_bf16(SymKernel variant, const SymGemmArgs& args, int sm_count, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);
bool run_sym_sm90_f16(SymKernel variant, const SymGemmArgs& args, int sm_count, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// Output tiles (of the CTA tile shape) a variant computes for one m x m product: the tile-level
// lower triangle, rounded up to whole cluster tiles. Used by the heuristic and the notes.
int64_t sym_tiles(SymKernel variant, int64_t m);

// Pure heuristic for SymKernel::kAuto without a tuning-cache entry: estimates each variant's
// time as (waves of CTA tiles) x (tile time at that variant's expected efficiency) and the dense
// fallback as the full product at cuBLAS's rate plus the mirror, and picks the smallest.
SymKernel heuristic_sym_kernel(int64_t m, int64_t k, int64_t count, int sm_count, bool sm90);

}  // namespace distmuon::cuda
