// Batched helpers of the Backend interface on strided batches of same-shape matrices:
// lincomb (out = alpha a + beta b + diag I), frob_norm and scale_copy (optionally transposed).
// Compute type C is float, or double when any operand is fp64.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels/batch_arg.cuh"
#include "backend/cuda/kernels/dtype.cuh"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/muon_ref.h"

namespace distmuon::cuda {

constexpr int kMaxLincombSlots = 48;

// One matrix of a grouped lincomb launch. int32 sides (checked on the host) keep a table of 48
// within the 4 KB of kernel parameters.
struct LincombSlotArgs {
  const void* a;
  const void* b;  // null: no b term
  void* out;
  float alpha, beta, diag;
  int32_t rows, cols, ld_a, ld_b, ld_out;
  int32_t blocks;  // this matrix's blocks along x (its grid-stride step)
  int8_t a_dt, b_dt, out_dt;
};

struct LincombTable {
  LincombSlotArgs s[kMaxLincombSlots];
  int n;
};
static_assert(sizeof(LincombTable) <= 4096, "a lincomb table exceeds 4 KB of parameters");

// Backend::copy_blocks: up to kMaxBlockCopies contiguous copies per launch.
constexpr int kMaxBlockCopies = 128;

struct BlockCopyTable {
  const void* src[kMaxBlockCopies];
  void* dst[kMaxBlockCopies];
  int64_t numel[kMaxBlockCopies];
  int8_t src_dt[kMaxBlockCopies], dst_dt[kMaxBlockCopies];
  int n;
};
static_assert(sizeof(BlockCopyTable) <= 4096, "a copy table exceeds 4 KB of parameters");

namespace dev {

// grid (blocks per matrix, count). VEC: every operand packed (ld == cols) and 16-byte aligned.
template <typename C, bool VEC>
__global__ void __launch_bounds__(256) lincomb_kernel(int64_t rows, int64_t cols, C alpha, BatchArg a,
                                                      C beta, BatchArg b, bool has_b, C diag,
                                                      BatchArg out) {
  const int64_t m = blockIdx.y, numel = rows * cols;
  const void* pa = mat_ptr(a, m);
  const void* pb = has_b ? mat_ptr(b, m) : nullptr;
  void* po = const_cast<void*>(mat_ptr(out, m));
  if constexpr (VEC && sizeof(C) == 4) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      F8 va = load8(pa, a.dt, i), r;
      F8 vb;
      if (has_b) vb = load8(pb, b.dt, i);
      int64_t row = i / cols, col = i - row * cols;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float v = alpha * va.v[k];
        if (has_b) v += beta * vb.v[k];
        if (row == col) v += diag;
        r.v[k] = v;
        if (++col == cols) { col = 0; ++row; }
      }
      store8(po, out.dt, i, r);
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t r = i / cols, c = i - r * cols;
      C v = alpha * static_cast<C>(load1d(pa, a.dt, r * a.ld + c));
      if (has_b) v += beta * static_cast<C>(load1d(pb, b.dt, r * b.ld + c));
      if (r == c) v += diag;
      store1d(po, out.dt, r * out.ld + c, static_cast<double>(v));
    }
  }
}

// Backend::lincomb_grouped: up to kMaxLincombSlots matrices of any shapes per launch, one table
// row each, computed in float exactly as lincomb_kernel<float, VEC> computes them (the same
// expression per element, so the same bits; fp64 problems take lincomb itself). grid (most
// blocks of any matrix, n); a matrix uses its first `blocks` blocks.
template <bool VEC>
__global__ void __launch_bounds__(256) lincomb_grouped_kernel(const __grid_constant__ LincombTable t) {
  const LincombSlotArgs& s = t.s[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= s.blocks) return;
  const int64_t cols = s.cols, numel = static_cast<int64_t>(s.rows) * cols;
  const int64_t stride = static_cast<int64_t>(s.blocks) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool has_b = s.b != nullptr;
  if constexpr (VEC) {
    for (int64_t i = first * 8; i < numel; i += stride * 8) {
      F8 va = load8(s.a, s.a_dt, i), r;
      F8 vb;
      if (has_b) vb = load8(s.b, s.b_dt, i);
      int64_t row = i / cols, col = i - row * cols;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float v = s.alpha * va.v[k];
        if (has_b) v += s.beta * vb.v[k];
        if (row == col) v += s.diag;
        r.v[k] = v;
        if (++col == cols) { col = 0; ++row; }
      }
      store8(s.out, s.out_dt, i, r);
    }
  } else {
    for (int64_t i = first; i < numel; i += stride) {
      const int64_t r = i / cols, c = i - r * cols;
      float v = s.alpha * static_cast<float>(load1d(s.a, s.a_dt, r * s.ld_a + c));
      if (has_b) v += s.beta * static_cast<float>(load1d(s.b, s.b_dt, r * s.ld_b + c));
      if (r == c) v += s.diag;
      store1d(s.out, s.out_dt, r * s.ld_out + c, static_cast<double>(v));
    }
  }
}

// norms[i] = ||a_i||_F (double accumulation of the exact squares). grid (blocks per matrix,
// count). VEC: packed (ld == cols), 16-byte aligned and not fp64: 8 elements per load and no
// index division (the scalar path's 64-bit division per element made a 384 x 384 batch take
// 20 us; every non-fp64 value converts to float exactly, so the squares are the same).
template <bool VEC>
__global__ void __launch_bounds__(256) frob_norm_kernel(int64_t rows, int64_t cols, BatchArg a,
                                                        double* norms, double* partials,
                                                        unsigned* counters, int first) {
  const int64_t m = blockIdx.y, numel = rows * cols;
  const void* pa = mat_ptr(a, first + m);
  double acc = 0;
  if constexpr (VEC) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      const F8 v = load8(pa, a.dt, i);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc += static_cast<double>(v.v[k]) * v.v[k];
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t r = i / cols, c = i - r * cols;
      const double v = load1d(pa, a.dt, r * a.ld + c);
      acc += v * v;
    }
  }
  const double total = block_sum(acc);
  group_sum_last(total, partials + m * gridDim.x, counters + m, gridDim.x, blockIdx.x,
                 [&](double sum) { norms[first + m] = muon_ref::float_precision(sqrt(sum)); });
}

__device__ __forceinline__ double copy_factor(const double* norms, double norm_mul, double eps,
                                              double alpha, int64_t i) {
  return norms ? alpha / (norm_mul * norms[i] + eps) : alpha;
}

// dst_i = factor_i * src_i. grid (blocks per matrix, count).
template <typename C>
__global__ void __launch_bounds__(256) scale_copy_kernel(int64_t rows, int64_t cols, BatchArg src,
                                                         BatchArg dst, const double* norms,
                                                         double norm_mul, double eps, double alpha) {
  const int64_t m = blockIdx.y;
  // The product in double, rounded once to C: the factor of a huge norm (1e-40) is not a
  // normal float.
  const double f = copy_factor(norms, norm_mul, eps, alpha, m);
  const void* ps = mat_ptr(src, m);
  void* pd = const_cast<void*>(mat_ptr(dst, m));
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    store1d(pd, dst.dt, r * dst.ld + c,
            static_cast<double>(static_cast<C>(f * load1d(ps, src.dt, r * src.ld + c))));
  }
}

// dst_i (cols x rows) = factor_i * src_i^T. grid (ceil(cols/32), ceil(rows/32), count),
// block (32, 8).
template <typename C>
__global__ void __launch_bounds__(256) scale_copy_t_kernel(int64_t rows, int64_t cols, BatchArg src,
                                                           BatchArg dst, const double* norms,
                                                           double norm_mul, double eps,
                                                           double alpha) {
  __shared__ C tile[32][33];
  const int64_t m = blockIdx.z;
  const double f = copy_factor(norms, norm_mul, eps, alpha, m);
  const void* ps = mat_ptr(src, m);
  void* pd = const_cast<void*>(mat_ptr(dst, m));
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = r0 + threadIdx.y + 8 * k, c = c0 + threadIdx.x;
    tile[threadIdx.y + 8 * k][threadIdx.x] =
        (r < rows && c < cols) ? static_cast<C>(f * load1d(ps, src.dt, r * src.ld + c)) : C(0);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + threadIdx.y + 8 * k, r = r0 + threadIdx.x;
    if (c < cols && r < rows)
      store1d(pd, dst.dt, c * dst.ld + r, static_cast<double>(tile[threadIdx.x][threadIdx.y + 8 * k]));
  }
}

// Elements of type U (1 to 16 bytes) from src to dst, grid-stride from `start`; returns the
// bytes it covered (the whole units).
template <typename U>
__device__ __forceinline__ int64_t copy_units(const char* src, char* dst, int64_t bytes,
                                              int64_t start, int64_t step) {
  const int64_t units = bytes / static_cast<int64_t>(sizeof(U));
  for (int64_t i = start; i < units; i += step)
    reinterpret_cast<U*>(dst)[i] = reinterpret_cast<const U*>(src)[i];
  return units * static_cast<int64_t>(sizeof(U));
}

// Copy c = blockIdx.y of the table, grid-stride over its elements along x. The same type moves in
// the widest units both ends' alignment allows (16 bytes down to 2), then the tail bytes; a
// conversion goes through double and rounds as the CPU backend does (f64 to a half type through
// float, as scale_copy).
__global__ void __launch_bounds__(256) copy_blocks_kernel(BlockCopyTable t) {
  const int c = blockIdx.y;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int sdt = t.src_dt[c], ddt = t.dst_dt[c];
  if (sdt != ddt) {
    for (int64_t i = start; i < t.numel[c]; i += step) store1d(t.dst[c], ddt, i, load1d(t.src[c], sdt, i));
    return;
  }
  const int64_t bytes = t.numel[c] * elem_bytes(sdt);
  const char* src = static_cast<const char*>(t.src[c]);
  char* dst = static_cast<char*>(t.dst[c]);
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  int64_t done;
  if ((align & 15u) == 0) done = copy_units<uint4>(src, dst, bytes, start, step);
  else if ((align & 7u) == 0) done = copy_units<uint2>(src, dst, bytes, start, step);
  else if ((align & 3u) == 0) done = copy_units<uint32_t>(src, dst, bytes, start, step);
  else done = copy_units<uint16_t>(src, dst, bytes, start, step);  // every element is 2-byte aligned
  for (int64_t i = done + start; i < bytes; i += step) dst[i] = src[i];
}

}  // namespace dev
}  // namespace distmuon::cuda
