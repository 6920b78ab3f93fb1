// The fused Muon passes (docs/algorithms.md section 1), multi-tensor: one launch serves up to
// kMaxMuonSlots matrices of any shapes and batches, whose arguments travel by value in the
// kernel parameters (one MuonSlotArgs each). A matrix's block reads its own row of the table, so
// its result does not depend on the other matrices of the launch.
//   pass 1  muon_norm:   ||U||_F with U = G + mu (mu B + G) (or mu B + G), status on NaN/Inf
//                        or a momentum that overflows its dtype
//   pass 2  muon_apply:  B <- mu B + G, X = U / (norm_mul ||U|| + eps) cast (and transposed)
// U is formed in double and carried as its scaled float form V, norms are accumulated in double
// (backend/muon_ref.h, the CPU backend's rule): near float's largest value U itself overflows
// float, and the norm of a large matrix does so long before that.
//   pass 3  muon_update: W <- decay W - step O (O read transposed for tall matrices)
// mu and pass 3's coefficients are read from device memory, so that a captured step replays
// with the values uploaded for the step it runs in.
// Flat kernels move 8 elements per thread step with 16-byte accesses where the matrix allows them
// (a flag per matrix: templates on the path, one instance per access kind, ran pass 3 6 %
// slower on pi0 and pass 1 no faster on an H200); transposing kernels go through
// 32x32 shared-memory tiles so that both the read and the write are coalesced.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels/dtype.cuh"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/muon_ref.h"
#include "distmuon/backend.h"

namespace distmuon::cuda {

constexpr int kMaxMuonSlots = 24;

// One matrix of a launch: its operands, shape and layouts, and where its results go. Sides and
// leading dimensions are int32 (checked on the host) so that a table stays within the 4 KB of
// kernel parameters every CUDA 12 driver takes.
struct MuonSlotArgs {
  const void* g;
  void* b;
  void* w;
  void* x;                     // pass 2 writes X here, pass 3 reads O (its ld_x, x_dt)
  const MuonUpdateCoef* coef;  // pass 3 (device memory)
  int64_t* skips;              // pass 2: +1 where the matrix is skipped (null: not counted)
  const float* mu;             // passes 1 and 2 (device memory)
  double* norm;                // pass 1 writes
  int32_t* status;             // pass 1 writes, pass 2 reads, pass 3 reads (null there: ok)
  const double* scale_norm;    // pass 2's factor alpha / (norm_mul * norm + eps); null: alpha
  double norm_mul, eps, alpha;
  int32_t rows, cols, ld_g, ld_b, ld_w, ld_x;
  int32_t blocks;    // flat kernels: this matrix's blocks along x (its grid-stride step)
  int32_t partial0;  // pass 1: where its blocks' partial sums start in the scratch
  int8_t g_dt, b_dt, w_dt, x_dt;
  bool nesterov;
  bool vec;  // flat kernels: packed, 16-byte aligned, numel % 8 == 0 (8-element accesses)
};

struct MuonTable {
  MuonSlotArgs s[kMaxMuonSlots];
  int n;
};
// With the norm kernel's two scratch pointers.
static_assert(sizeof(MuonTable) + 16 <= 4096, "a Muon pass table exceeds 4 KB of parameters");

namespace dev {

using muon_ref::float_precision;
using muon_ref::scaled_input;

// Pass 2's output: V times the matrix's factor, the product in double, rounded once to float.
__device__ __forceinline__ float scaled_out(float g, float bn, float mu, bool nesterov, double f) {
  return static_cast<float>(static_cast<double>(scaled_input(g, bn, mu, nesterov)) * f);
}

// Whether the new momentum bn survives its store into dtype dt (finite once rounded).
__device__ __forceinline__ bool momentum_fits(float bn, int dt) {
  switch (dt) {
    case kBF16: return isfinite(__bfloat162float(__float2bfloat16_rn(bn)));
    case kF16: return isfinite(__half2float(__float2half_rn(bn)));
    default: return isfinite(bn);
  }
}

__device__ __forceinline__ double scale_factor(const MuonSlotArgs& a) {
  if (!a.scale_norm) return a.alpha;
  return a.alpha / (a.norm_mul * *a.scale_norm + a.eps);
}

// What every pass-2 block of a matrix starts from: mu, whether the matrix takes part (a skipped
// one writes X = 0 and keeps B) and its factor. One thread of the matrix's first block counts
// a skip.
struct ApplyStart {
  float mu;
  bool ok;
  double f;
};
__device__ __forceinline__ ApplyStart apply_start(const MuonSlotArgs& a, bool first_block) {
  const bool ok = *a.status == 0;
  if (!ok && first_block && threadIdx.x == 0 && threadIdx.y == 0 && a.skips) *a.skips += 1;
  return {*a.mu, ok, ok ? scale_factor(a) : 0.0};
}

// Pass 1. grid (most blocks of any matrix, n); a matrix uses its first a.blocks blocks.
__global__ void __launch_bounds__(256) muon_norm_kernel(const __grid_constant__ MuonTable t,
                                                        double* partials, unsigned* counters) {
  const MuonSlotArgs& a = t.s[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= a.blocks) return;
  const float mu = *a.mu;
  const int64_t numel = static_cast<int64_t>(a.rows) * a.cols;
  const int64_t stride = static_cast<int64_t>(a.blocks) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0;
  if (a.vec) {
    for (int64_t i = first * 8; i < numel; i += stride * 8) {
      F8 g = load8(a.g, a.g_dt, i), b = load8(a.b, a.b_dt, i);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float bn = mu * b.v[k] + g.v[k];
        const double v = scaled_input(g.v[k], bn, mu, a.nesterov);
        acc += momentum_fits(bn, a.b_dt) ? v * v : INFINITY;
      }
    }
  } else {
    for (int64_t i = first; i < numel; i += stride) {
      const int64_t r = i / a.cols, c = i % a.cols;
      const float g = load1(a.g, a.g_dt, r * a.ld_g + c);
      const float bn = mu * load1(a.b, a.b_dt, r * a.ld_b + c) + g;
      const double v = scaled_input(g, bn, mu, a.nesterov);
      acc += momentum_fits(bn, a.b_dt) ? v * v : INFINITY;
    }
  }
  const double total = block_sum(acc);
  group_sum_last(total, partials + a.partial0, counters + blockIdx.y, a.blocks, blockIdx.x,
                 [&](double sum) {
                   *a.norm = float_precision(sqrt(sum));
                   *a.status = isfinite(sum) ? 0 : 1;
                 });
}

// Pass 2, flat. grid (most blocks of any matrix, n).
__global__ void __launch_bounds__(256) muon_apply_kernel(const __grid_constant__ MuonTable t) {
  const MuonSlotArgs& a = t.s[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= a.blocks || a.rows == 0 || a.cols == 0) return;
  const auto [mu, ok, f] = apply_start(a, blockIdx.x == 0);
  const int64_t numel = static_cast<int64_t>(a.rows) * a.cols;
  const int64_t stride = static_cast<int64_t>(a.blocks) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (a.vec) {
    for (int64_t i = first * 8; i < numel; i += stride * 8) {
      F8 out;
      if (ok) {
        F8 g = load8(a.g, a.g_dt, i), b = load8(a.b, a.b_dt, i);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          b.v[k] = mu * b.v[k] + g.v[k];
          out.v[k] = scaled_out(g.v[k], b.v[k], mu, a.nesterov, f);
        }
        store8(a.b, a.b_dt, i, b);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) out.v[k] = 0.0f;
      }
      store8(a.x, a.x_dt, i, out);
    }
  } else {
    for (int64_t i = first; i < numel; i += stride) {
      const int64_t r = i / a.cols, c = i % a.cols;
      float out = 0.0f;
      if (ok) {
        const float g = load1(a.g, a.g_dt, r * a.ld_g + c);
        const float bn = mu * load1(a.b, a.b_dt, r * a.ld_b + c) + g;
        store1(a.b, a.b_dt, r * a.ld_b + c, bn);
        out = scaled_out(g, bn, mu, a.nesterov, f);
      }
      store1(a.x, a.x_dt, r * a.ld_x + c, out);
    }
  }
}

// Pass 2, transposing: X (cols x rows) = scaled U^T. grid (most 32-column tiles, most 32-row
// tiles of any matrix, n), block (32, 8); a block outside its matrix returns.
__global__ void __launch_bounds__(256) muon_apply_t_kernel(const __grid_constant__ MuonTable t) {
  __shared__ float tile[32][33];
  const MuonSlotArgs& a = t.s[blockIdx.z];
  if (a.rows == 0 || a.cols == 0) return;  // (nothing to write, no skip to count)
  const auto [mu, ok, f] = apply_start(a, blockIdx.x == 0 && blockIdx.y == 0);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
  if (r0 >= a.rows || c0 >= a.cols) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = r0 + threadIdx.y + 8 * k, c = c0 + threadIdx.x;
    float out = 0.0f;
    if (ok && r < a.rows && c < a.cols) {
      const float g = load1(a.g, a.g_dt, r * a.ld_g + c);
      const float bn = mu * load1(a.b, a.b_dt, r * a.ld_b + c) + g;
      store1(a.b, a.b_dt, r * a.ld_b + c, bn);
      out = scaled_out(g, bn, mu, a.nesterov, f);
    }
    tile[threadIdx.y + 8 * k][threadIdx.x] = out;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + threadIdx.y + 8 * k, r = r0 + threadIdx.x;
    if (c < a.cols && r < a.rows)
      store1(a.x, a.x_dt, c * a.ld_x + r, tile[threadIdx.x][threadIdx.y + 8 * k]);
  }
}

// Pass 3, flat. grid (most blocks of any matrix, n).
__global__ void __launch_bounds__(256) muon_update_kernel(const __grid_constant__ MuonTable t) {
  const MuonSlotArgs& a = t.s[blockIdx.y];
  if (static_cast<int>(blockIdx.x) >= a.blocks) return;
  if (a.status && *a.status != 0) return;
  const float decay = a.coef->decay, step = a.coef->step;
  const int64_t numel = static_cast<int64_t>(a.rows) * a.cols;
  const int64_t stride = static_cast<int64_t>(a.blocks) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (a.vec) {
    for (int64_t i = first * 8; i < numel; i += stride * 8) {
      F8 w = load8(a.w, a.w_dt, i), ov = load8(a.x, a.x_dt, i);
#pragma unroll
      for (int k = 0; k < 8; ++k) w.v[k] = decay * w.v[k] - step * ov.v[k];
      store8(a.w, a.w_dt, i, w);
    }
  } else {
    for (int64_t i = first; i < numel; i += stride) {
      const int64_t r = i / a.cols, c = i % a.cols;
      const float w = load1(a.w, a.w_dt, r * a.ld_w + c);
      store1(a.w, a.w_dt, r * a.ld_w + c, decay * w - step * load1(a.x, a.x_dt, r * a.ld_x + c));
    }
  }
}

// Pass 3, transposing: O is cols x rows (the wide orientation). grid and block as pass 2's.
__global__ void __launch_bounds__(256) muon_update_t_kernel(const __grid_constant__ MuonTable t) {
  __shared__ float tile[32][33];
  const MuonSlotArgs& a = t.s[blockIdx.z];
  if (a.status && *a.status != 0) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
  if (r0 >= a.rows || c0 >= a.cols) return;
  const float decay = a.coef->decay, step = a.coef->step;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + threadIdx.y + 8 * k, r = r0 + threadIdx.x;
    tile[threadIdx.y + 8 * k][threadIdx.x] =
        (c < a.cols && r < a.rows) ? load1(a.x, a.x_dt, c * a.ld_x + r) : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = r0 + threadIdx.y + 8 * k, c = c0 + threadIdx.x;
    if (r < a.rows && c < a.cols) {
      const float w = load1(a.w, a.w_dt, r * a.ld_w + c);
      store1(a.w, a.w_dt, r * a.ld_w + c, decay * w - step * tile[threadIdx.x][threadIdx.y + 8 * k]);
    }
  }
}

// Vector forms of the transposing passes for fp32 G, B, W: 64x64 tiles, 256 threads, 16-byte
// accesses on both sides (float4 along the rows of G/B/W, 8-element vectors along the rows of
// X/O). Need rows % 8 == 0, cols % 4 == 0 and 16-byte aligned rows (checked on the host for
// every matrix of the launch). grid (most 64-column tiles, most 64-row tiles, n).
__global__ void __launch_bounds__(256) muon_apply_t64_kernel(const __grid_constant__ MuonTable t) {
  __shared__ float tile[64][65];  // [c][r]
  const MuonSlotArgs& a = t.s[blockIdx.z];
  if (a.rows == 0 || a.cols == 0) return;  // (nothing to write, no skip to count)
  const auto [mu, ok, f] = apply_start(a, blockIdx.x == 0 && blockIdx.y == 0);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 64, c0 = static_cast<int64_t>(blockIdx.x) * 64;
  if (r0 >= a.rows || c0 >= a.cols) return;
  const int q = threadIdx.x & 15, rr = threadIdx.x >> 4;
  const float* g = static_cast<const float*>(a.g);
  float* b = static_cast<float*>(a.b);
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int lr = rr + 16 * pass;
    const int64_t r = r0 + lr, c = c0 + 4 * q;
    float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok && r < a.rows && c < a.cols) {
      const float4 gv = __ldcs(reinterpret_cast<const float4*>(g + r * a.ld_g + c));
      float4 bv = *reinterpret_cast<const float4*>(b + r * a.ld_b + c);
      bv.x = mu * bv.x + gv.x;
      bv.y = mu * bv.y + gv.y;
      bv.z = mu * bv.z + gv.z;
      bv.w = mu * bv.w + gv.w;
      *reinterpret_cast<float4*>(b + r * a.ld_b + c) = bv;
      u[0] = scaled_out(gv.x, bv.x, mu, a.nesterov, f);
      u[1] = scaled_out(gv.y, bv.y, mu, a.nesterov, f);
      u[2] = scaled_out(gv.z, bv.z, mu, a.nesterov, f);
      u[3] = scaled_out(gv.w, bv.w, mu, a.nesterov, f);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[4 * q + k][lr] = u[k];
  }
  __syncthreads();
  const int v = threadIdx.x & 7, cr = threadIdx.x >> 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lc = cr + 32 * pass;
    const int64_t c = c0 + lc, r = r0 + 8 * v;
    if (c < a.cols && r < a.rows) {
      F8 o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = tile[lc][8 * v + k];
      store8(a.x, a.x_dt, c * a.ld_x + r, o);
    }
  }
}

__global__ void __launch_bounds__(256) muon_update_t64_kernel(const __grid_constant__ MuonTable t) {
  __shared__ float tile[64][65];  // [c][r] = O[c][r]
  const MuonSlotArgs& a = t.s[blockIdx.z];
  if (a.status && *a.status != 0) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 64, c0 = static_cast<int64_t>(blockIdx.x) * 64;
  if (r0 >= a.rows || c0 >= a.cols) return;
  const float decay = a.coef->decay, step = a.coef->step;
  const int v = threadIdx.x & 7, cr = threadIdx.x >> 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lc = cr + 32 * pass;
    const int64_t c = c0 + lc, r = r0 + 8 * v;
    F8 ov;
    if (c < a.cols && r < a.rows) {
      ov = load8(a.x, a.x_dt, c * a.ld_x + r);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) ov.v[k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[lc][8 * v + k] = ov.v[k];
  }
  __syncthreads();
  float* w = static_cast<float*>(a.w);
  const int q = threadIdx.x & 15, rr = threadIdx.x >> 4;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int lr = rr + 16 * pass;
    const int64_t r = r0 + lr, c = c0 + 4 * q;
    if (r < a.rows && c < a.cols) {
      float4 wv = *reinterpret_cast<const float4*>(w + r * a.ld_w + c);
      wv.x = decay * wv.x - step * tile[4 * q + 0][lr];
      wv.y = decay * wv.y - step * tile[4 * q + 1][lr];
      wv.z = decay * wv.z - step * tile[4 * q + 2][lr];
      wv.w = decay * wv.w - step * tile[4 * q + 3][lr];
      *reinterpret_cast<float4*>(w + r * a.ld_w + c) = wv;
    }
  }
}

}  // namespace dev
}  // namespace distmuon::cuda
