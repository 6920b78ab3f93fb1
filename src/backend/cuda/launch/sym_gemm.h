// The lower-triangle symmetric product on Hopper (CUTLASS sm90, launch/sym_gemm_sm90_*.cu):
//   D = alpha * A B^T + beta * C   (row-major, A and B both m x k with k contiguous)
// for the output tiles that touch the lower triangle only; the caller mirrors afterwards: the
// whole upper triangle, or with SymGemmArgs::mirror only the diagonal blocks (the epilogue stores
// the rest of it transposed).
// The same kernels with `lower` off compute every tile of an m x n product (masked dense
// products), and dense_nn runs D = alpha * A B + beta * C with B row-major k x n.
// With `flags`, matrix l of the batch is computed only when flags[l] == flag_value (device
// memory, read by the tile scheduler): the others are neither read nor written.
// Every pointer 16-byte aligned, every leading dimension and batch stride a multiple of 8.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "distmuon/cuda_backend.h"

namespace distmuon::cuda {

// The order in which a dense (lower == false) product's output tiles are handed out.
// kAuto: column by column when A is the smaller operand (m <= n), else row by row.
enum class TileOrder { kAuto, kRows, kColumns };

// The dense_nn kernel's CTA tile: 256 x 128 (1 x 1 cluster), or 128 x 256 with two CTAs stacked
// along M sharing each B tile through TMA multicast (the shape cuBLASLt's kernels favour for
// large bf16/fp16 products).
enum class DenseTile { k256x128, k128x256Cluster2 };

struct SymGemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;  // may be null when beta == 0
  void* d = nullptr;
  int64_t m = 0, k = 0, count = 0;
  int64_t n = 0;  // columns of D; 0: m (symmetric)
  int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0, stride_d = 0;
  float alpha = 1.0f, beta = 0.0f;
  bool lower = true;  // only the tiles touching the lower triangle (needs n == m)
  const int32_t* flags = nullptr;
  int32_t flag_value = 1;
  TileOrder order = TileOrder::kAuto;  // dense products only
  DenseTile tile = DenseTile::k256x128;  // run_dense_nn_* only
  // Symmetric products (lower): the epilogue also stores every tile that lies left of its
  // diagonal block transposed, so that only the diagonal blocks (sym_diagonal_block rows) are
  // left for the mirror kernel.
  bool mirror = false;
};

// The arguments of D = alpha * op(A) op(B) + beta * Cin for batches of the backend (Cin null or
// beta 0: no source), before the kernel-specific fields (lower, flags) are set.
inline SymGemmArgs make_sym_args(const BatchRef& a, const BatchRef& b, const BatchRef* cin,
                                 const BatchRef& c, int64_t k, double alpha, double beta) {
  const bool src = cin && beta != 0.0;
  SymGemmArgs g;
  g.a = a.data;
  g.b = b.data;
  g.c = src ? cin->data : c.data;
  g.d = c.data;
  g.m = c.rows;
  g.n = c.cols;
  g.k = k;
  g.count = c.count;
  g.lda = a.ld;
  g.ldb = b.ld;
  g.ldc = src ? cin->ld : c.ld;
  g.ldd = c.ld;
  g.stride_a = a.stride;
  g.stride_b = b.stride;
  g.stride_c = src ? cin->stride : c.stride;
  g.stride_d = c.stride;
  g.alpha = static_cast<float>(alpha);
  g.beta = src ? static_cast<float>(beta) : 0.0f;
  return g;
}

// The CTA tile (bm x bn) and the CTAs a cluster stacks along M (cm) of each lower-triangle
// variant: the one table that the kernels' template arguments (sym_gemm_sm90_run.h), the
// heuristic's tile counts and the mirror's diagonal blocks are read from. A cluster row of
// cm * bm rows is computed whole up to its diagonal (cm * bm a multiple of bn).
struct SymTileShape {
  int bm, bn, cm;
};
constexpr SymTileShape sym_tile_shape(SymKernel v) {
  switch (v) {
    case SymKernel::kTri256x128: return {256, 128, 1};
    case SymKernel::kTri128Cluster2: return {128, 128, 2};
    default: return {128, 128, 1};  // kTri128, kTri128Pingpong
  }
}

// Part of the tuning fingerprint: bumped when the symmetric kernels change in a way that makes
// measurements of earlier builds stale (2: the mirror in the epilogue).
constexpr int kSymKernelRevision = 2;

// True when this build has the CUTLASS kernels.
bool sym_sm90_built();

// Runs the given CUTLASS variant (kTri128, kTri256x128, kTri128Cluster2 or kTri128Pingpong) in
// bf16 or fp16.
// Returns false when the variant cannot run these arguments (the caller falls back).
bool run_sym_sm90_bf16(SymKernel variant, const SymGemmArgs& args, int sm_count, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);
bool run_sym_sm90_f16(SymKernel variant, const SymGemmArgs& args, int sm_count, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

// D = alpha * A B + beta * C (A m x k, B k x n, both row-major; every tile) with the cooperative
// kernel of args.tile. Returns false when it cannot run these arguments.
bool run_dense_nn_sm90_bf16(const SymGemmArgs& args, int sm_count, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);
bool run_dense_nn_sm90_f16(const SymGemmArgs& args, int sm_count, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

// Height of the diagonal blocks a variant computes whole (its cluster tile's rows): with
// SymGemmArgs::mirror the epilogue stores the upper triangle outside them, and the mirror kernel
// copies only inside them. 0 for the dense fallback (it leaves the whole triangle).
int64_t sym_diagonal_block(SymKernel variant);

// Whether the symmetric kernels mirror in their epilogue (SymGemmArgs::mirror): on unless
// DISTMUON_SYM_EPILOGUE_MIRROR=0, which runs the kernels built without the transposed store (and
// without its shared memory) and the whole mirror pass, as before.
bool sym_epilogue_mirror();

// Output tiles (of the CTA tile shape) a variant computes for one m x m product: the tile-level
// lower triangle, rounded up to whole cluster tiles. Used by the heuristic and the notes.
int64_t sym_tiles(SymKernel variant, int64_t m);

// Pure heuristic for SymKernel::kAuto without a tuning-cache entry: estimates each variant's
// time as (waves of CTA tiles) x (tile time at that variant's expected efficiency) and the dense
// fallback as the full product at cuBLAS's rate plus the mirror, and picks the smallest.
SymKernel heuristic_sym_kernel(int64_t m, int64_t k, int64_t count, int sm_count, bool sm90);

}  // namespace distmuon::cuda
