// Device side of Backend::gemm_grouped: D = alpha * A op(B) + beta * C for the matrices of several
// batches of different shapes in one launch (bf16 or fp16 in, fp32 accumulation, rounded once).
//
// It serves products too small to fill the device, where a launch per batch costs more than the
// product (ResNet convolutions as matrices, narrow projections): one block per 32 x 32 output
// tile of any matrix of any problem, found from a table that travels in the kernel parameters
// (no device-side list to build, so a graph captures it like any launch). Four warps each own
// a quarter of the tile through WMMA fragments; stages of k = 64 go through shared memory
// while the next stage's loads are in flight in registers. A matrix's tiles do not depend on
// the other problems of the launch, so its result is the same alone or in any group.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

namespace distmuon::cuda::dev {

constexpr int kGroupedTile = 32;          // output tile: kGroupedTile x kGroupedTile
constexpr int kGroupedK = 64;             // k per shared-memory stage
constexpr int kGroupedThreads = 128;      // four warps, 2 x 2 over the tile
constexpr int kGroupedMaxProblems = 24;   // per launch, so that the table fits the parameters

struct GroupedProblem {
  const void* a;  // m x k, row-major
  const void* b;  // k x n row-major, or n x k row-major when b_trans
  const void* c;  // m x n source, or null
  void* d;        // m x n output
  int64_t stride_a, stride_b, stride_c, stride_d;  // elements from one matrix to the next
  int32_t m, n, k;
  int32_t lda, ldb, ldc, ldd;
  int32_t b_trans;
  int32_t vec;          // A's and B's rows start 16-byte aligned: 8-element loads
  int32_t tiles_n;      // column tiles of one matrix
  int32_t tiles;        // tiles of one matrix
  int32_t first_block;  // the problem's first block in the launch
  float alpha, beta;
};

struct GroupedTable {
  GroupedProblem p[kGroupedMaxProblems];
  int32_t count;
};

__device__ __forceinline__ float grouped_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float grouped_to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T grouped_from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else
    return __float2half_rn(v);
}

// Eight consecutive elements (row, col .. col + 7) of a rows x cols matrix as one 16-byte
// register, zeros outside the matrix.
template <typename T>
__device__ __forceinline__ uint4 grouped_load8(const T* src, int row, int rows, int col, int cols,
                                               int ld, bool vec) {
  if (vec && row < rows && col + 8 <= cols)
    return *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row) * ld + col);
  union {
    uint4 v;
    T e[8];
  } u;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    u.e[i] = row < rows && col + i < cols ? src[static_cast<int64_t>(row) * ld + col + i]
                                          : grouped_from_float<T>(0.0f);
  return u.v;
}

template <typename T, bool kTransB>
__global__ void __launch_bounds__(kGroupedThreads)
    grouped_gemm_kernel(const __grid_constant__ GroupedTable table) {
  namespace wmma = nvcuda::wmma;
  constexpr int BM = kGroupedTile, BN = kGroupedTile, BK = kGroupedK;
  constexpr int LDA = BK + 8;                      // padded rows: fewer bank conflicts
  constexpr int LDB = kTransB ? BK + 8 : BN + 8;   // B as n x k rows, or as k x n rows
  constexpr int LDC = BN + 4;
  // Chunks of eight elements per thread and stage: A's BM x BK, B's BK x BN.
  constexpr int kChunksA = BM * BK / 8 / kGroupedThreads, kChunksB = BK * BN / 8 / kGroupedThreads;
  // A's and B's stage, and after the last stage the fp32 tile for the epilogue, in one buffer.
  constexpr int kBytesA = BM * LDA * 2, kBytesB = (kTransB ? BN : BK) * LDB * 2;
  constexpr int kBytesC = BM * LDC * 4;
  __shared__ __align__(128) unsigned char smem[kBytesA + kBytesB > kBytesC ? kBytesA + kBytesB
                                                                           : kBytesC];
  T* a_s = reinterpret_cast<T*>(smem);
  T* b_s = reinterpret_cast<T*>(smem + kBytesA);
  float* c_s = reinterpret_cast<float*>(smem);

  int pi = 0;
  while (pi + 1 < table.count && static_cast<int>(blockIdx.x) >= table.p[pi + 1].first_block) ++pi;
  const GroupedProblem& P = table.p[pi];
  const int local = static_cast<int>(blockIdx.x) - P.first_block;
  const int mat = local / P.tiles, tile = local % P.tiles;
  const int row0 = tile / P.tiles_n * BM, col0 = tile % P.tiles_n * BN;
  const T* A = static_cast<const T*>(P.a) + mat * P.stride_a;
  const T* B = static_cast<const T*>(P.b) + mat * P.stride_b;
  const bool vec = P.vec != 0;

  // The next stage's operands travel in registers while the current one is multiplied, so that
  // a block waits on memory once per stage at most, not load then compute in turn.
  uint4 ra[kChunksA], rb[kChunksB];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kChunksA; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kGroupedThreads;
      const int r = q / (BK / 8), kc = q % (BK / 8) * 8;
      ra[i] = grouped_load8(A, row0 + r, P.m, k0 + kc, P.k, P.lda, vec);
    }
#pragma unroll
    for (int i = 0; i < kChunksB; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kGroupedThreads;
      if constexpr (kTransB) {
        const int r = q / (BK / 8), kc = q % (BK / 8) * 8;
        rb[i] = grouped_load8(B, col0 + r, P.n, k0 + kc, P.k, P.ldb, vec);
      } else {
        const int r = q / (BN / 8), nc = q % (BN / 8) * 8;
        rb[i] = grouped_load8(B, k0 + r, P.k, col0 + nc, P.n, P.ldb, vec);
      }
    }
  };
  auto stage = [&] {
#pragma unroll
    for (int i = 0; i < kChunksA; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kGroupedThreads;
      *reinterpret_cast<uint4*>(&a_s[q / (BK / 8) * LDA + q % (BK / 8) * 8]) = ra[i];
    }
#pragma unroll
    for (int i = 0; i < kChunksB; ++i) {
      const int q = static_cast<int>(threadIdx.x) + i * kGroupedThreads;
      if constexpr (kTransB)
        *reinterpret_cast<uint4*>(&b_s[q / (BK / 8) * LDB + q % (BK / 8) * 8]) = rb[i];
      else
        *reinterpret_cast<uint4*>(&b_s[q / (BN / 8) * LDB + q % (BN / 8) * 8]) = rb[i];
    }
  };

  // Warp (wm, wn) of the 2 x 2 owns rows wm * WT .. and columns wn * WT .. of the tile: F x F
  // fragments of 16 x 16.
  constexpr int WT = BM / 2, F = WT / 16;
  static_assert(BM == BN && WT % 16 == 0, "square tiles of whole fragments per warp");
  const int warp = static_cast<int>(threadIdx.x) / 32, wm = warp / 2, wn = warp % 2;
  using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[F][F];
#pragma unroll
  for (int i = 0; i < F; ++i)
#pragma unroll
    for (int j = 0; j < F; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  if (P.k > 0) fetch(0);
  for (int k0 = 0; k0 < P.k; k0 += BK) {
    stage();
    __syncthreads();
    if (k0 + BK < P.k) fetch(k0 + BK);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[F];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb[F];
#pragma unroll
      for (int i = 0; i < F; ++i)
        wmma::load_matrix_sync(fa[i], &a_s[(wm * WT + 16 * i) * LDA + kk], LDA);
#pragma unroll
      for (int j = 0; j < F; ++j) {
        if constexpr (kTransB)
          wmma::load_matrix_sync(fb[j], &b_s[(wn * WT + 16 * j) * LDB + kk], LDB);
        else
          wmma::load_matrix_sync(fb[j], &b_s[kk * LDB + wn * WT + 16 * j], LDB);
      }
#pragma unroll
      for (int i = 0; i < F; ++i)
#pragma unroll
        for (int j = 0; j < F; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < F; ++i)
#pragma unroll
    for (int j = 0; j < F; ++j)
      wmma::store_matrix_sync(&c_s[(wm * WT + 16 * i) * LDC + wn * WT + 16 * j], acc[i][j], LDC,
                              wmma::mem_row_major);
  __syncthreads();
  const T* C = P.c ? static_cast<const T*>(P.c) + mat * P.stride_c : nullptr;
  T* D = static_cast<T*>(P.d) + mat * P.stride_d;
  for (int e = threadIdx.x; e < BM * BN; e += kGroupedThreads) {
    const int r = e / BN, col = e % BN, gr = row0 + r, gc = col0 + col;
    if (gr >= P.m || gc >= P.n) continue;
    float v = P.alpha * c_s[r * LDC + col];
    if (C) v += P.beta * grouped_to_float(C[static_cast<int64_t>(gr) * P.ldc + gc]);
    D[static_cast<int64_t>(gr) * P.ldd + gc] = grouped_from_float<T>(v);
  }
}

}  // namespace distmuon::cuda::dev
