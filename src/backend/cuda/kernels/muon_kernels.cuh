// The fused Muon passes (docs/algorithms.md section 1), multi-tensor: one launch serves up to
// kMaxMuonSlots matrices whose pointers travel by value in the kernel parameters.
//   pass 1  muon_norm:   ||U||_F with U = G + mu (mu B + G) (or mu B + G), status on NaN/Inf
//                        or a momentum that overflows its dtype
//   pass 2  muon_apply:  B <- mu B + G, X = U / (norm_mul ||U|| + eps) cast (and transposed)
// U is formed in double and carried as its scaled float form V, norms are accumulated in double
// (backend/muon_ref.h, the CPU backend's rule): near float's largest value U itself overflows
// float, and the norm of a large matrix does so long before that.
//   pass 3  muon_update: W <- decay W - step O (O read transposed for tall matrices)
// mu and pass 3's coefficients are read from device memory, so that a captured step replays
// with the values uploaded for the step it runs in.
// Flat kernels move 8 elements per thread step with 16-byte accesses; transposing kernels go
// through 32x32 shared-memory tiles so that both the read and the write are coalesced.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels/dtype.cuh"
#include "backend/cuda/kernels/reduce.cuh"
#include "backend/muon_ref.h"
#include "distmuon/backend.h"

namespace distmuon::cuda {

constexpr int kMaxMuonSlots = 40;

struct MuonTable {
  const void* g[kMaxMuonSlots];
  void* b[kMaxMuonSlots];
  void* w[kMaxMuonSlots];
  const MuonUpdateCoef* coef[kMaxMuonSlots];  // pass 3 (device memory)
  int64_t* skips[kMaxMuonSlots];  // pass 2: +1 where a matrix is skipped (null: not counted)
  int8_t g_dt[kMaxMuonSlots], b_dt[kMaxMuonSlots], w_dt[kMaxMuonSlots];
  int64_t rows, cols;  // every slot of a launch has this shape (checked on the host)
  int64_t ld_g, ld_b, ld_w;
  int n;
  int first;  // index of slot 0 of this launch within the caller's list (norms, status, x)
};

// Where pass 2 writes X and pass 3 reads O: matrix i at data + (first + i) * stride.
struct MatOut {
  void* data;
  int64_t stride, ld;
  int dt;
};

struct ScaleArgs {
  const double* norms;  // null: factor = alpha
  double norm_mul, eps, alpha;
};

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

__device__ __forceinline__ double scale_factor(const ScaleArgs& s, int i) {
  if (!s.norms) return s.alpha;
  return s.alpha / (s.norm_mul * s.norms[i] + s.eps);
}

// Pass 2's bookkeeping of a skipped matrix: one thread of its first block counts it.
__device__ __forceinline__ void count_skip(const MuonTable& t, int s, bool ok, bool first_block) {
  if (!ok && first_block && threadIdx.x == 0 && threadIdx.y == 0 && t.skips[s]) *t.skips[s] += 1;
}

// Pass 1. grid (blocks per matrix, n). Flat (ld == cols) when VEC.
template <bool VEC>
__global__ void __launch_bounds__(256) muon_norm_kernel(MuonTable t, const float* mu_in, bool nesterov,
                                                        double* norms, int32_t* status,
                                                        double* partials, unsigned* counters) {
  const float mu = *mu_in;
  const int s = blockIdx.y;
  const int64_t numel = t.rows * t.cols;
  double acc = 0;
  if constexpr (VEC) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      F8 g = load8(t.g[s], t.g_dt[s], i), b = load8(t.b[s], t.b_dt[s], i);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float bn = mu * b.v[k] + g.v[k];
        const double v = scaled_input(g.v[k], bn, mu, nesterov);
        acc += momentum_fits(bn, t.b_dt[s]) ? v * v : INFINITY;
      }
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t r = i / t.cols, c = i % t.cols;
      const float g = load1(t.g[s], t.g_dt[s], r * t.ld_g + c);
      const float b = load1(t.b[s], t.b_dt[s], r * t.ld_b + c);
      const float bn = mu * b + g;
      const double v = scaled_input(g, bn, mu, nesterov);
      acc += momentum_fits(bn, t.b_dt[s]) ? v * v : INFINITY;
    }
  }
  const double total = block_sum(acc);
  const int slot = t.first + s;
  group_sum_last(total, partials + static_cast<int64_t>(s) * gridDim.x, counters + s, gridDim.x,
                 blockIdx.x, [&](double sum) {
                   norms[slot] = float_precision(sqrt(sum));
                   status[slot] = isfinite(sum) ? 0 : 1;
                 });
}

// Pass 2, flat. grid (blocks per matrix, n).
template <bool VEC>
__global__ void __launch_bounds__(256) muon_apply_kernel(MuonTable t, const float* mu_in, bool nesterov,
                                                         const int32_t* status, ScaleArgs sc,
                                                         MatOut x) {
  const float mu = *mu_in;
  const int s = blockIdx.y, slot = t.first + s;
  const bool ok = status[slot] == 0;
  const double f = ok ? scale_factor(sc, slot) : 0.0;
  count_skip(t, s, ok, blockIdx.x == 0);
  void* xs = static_cast<char*>(x.data) +
             slot * x.stride * (x.dt == kF32 ? 4 : x.dt == kF64 ? 8 : 2);
  const int64_t numel = t.rows * t.cols;
  if constexpr (VEC) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      F8 out;
      if (ok) {
        F8 g = load8(t.g[s], t.g_dt[s], i), b = load8(t.b[s], t.b_dt[s], i);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          b.v[k] = mu * b.v[k] + g.v[k];
          out.v[k] = scaled_out(g.v[k], b.v[k], mu, nesterov, f);
        }
        store8(t.b[s], t.b_dt[s], i, b);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) out.v[k] = 0.0f;
      }
      store8(xs, x.dt, i, out);
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t r = i / t.cols, c = i % t.cols;
      float out = 0.0f;
      if (ok) {
        const float g = load1(t.g[s], t.g_dt[s], r * t.ld_g + c);
        const float bn = mu * load1(t.b[s], t.b_dt[s], r * t.ld_b + c) + g;
        store1(t.b[s], t.b_dt[s], r * t.ld_b + c, bn);
        out = scaled_out(g, bn, mu, nesterov, f);
      }
      store1(xs, x.dt, r * x.ld + c, out);
    }
  }
}

// Pass 2, transposing: X (cols x rows) = scaled U^T. grid (ceil(cols/32), ceil(rows/32), n),
// block (32, 8).
__global__ void __launch_bounds__(256) muon_apply_t_kernel(MuonTable t, const float* mu_in, bool nesterov,
                                                           const int32_t* status, ScaleArgs sc,
                                                           MatOut x) {
  const float mu = *mu_in;
  __shared__ float tile[32][33];
  const int s = blockIdx.z, slot = t.first + s;
  const bool ok = status[slot] == 0;
  const double f = ok ? scale_factor(sc, slot) : 0.0;
  count_skip(t, s, ok, blockIdx.x == 0 && blockIdx.y == 0);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = r0 + threadIdx.y + 8 * k, c = c0 + threadIdx.x;
    float out = 0.0f;
    if (ok && r < t.rows && c < t.cols) {
      const float g = load1(t.g[s], t.g_dt[s], r * t.ld_g + c);
      const float bn = mu * load1(t.b[s], t.b_dt[s], r * t.ld_b + c) + g;
      store1(t.b[s], t.b_dt[s], r * t.ld_b + c, bn);
      out = scaled_out(g, bn, mu, nesterov, f);
    }
    tile[threadIdx.y + 8 * k][threadIdx.x] = out;
  }
  __syncthreads();
  void* xs = static_cast<char*>(x.data) +
             slot * x.stride * (x.dt == kF32 ? 4 : x.dt == kF64 ? 8 : 2);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + threadIdx.y + 8 * k, r = r0 + threadIdx.x;
    if (c < t.cols && r < t.rows) store1(xs, x.dt, c * x.ld + r, tile[threadIdx.x][threadIdx.y + 8 * k]);
  }
}

// Pass 3, flat. status may be null (all ok).
template <bool VEC>
__global__ void __launch_bounds__(256) muon_update_kernel(MuonTable t, const int32_t* status,
                                                          MatOut o) {
  const int s = blockIdx.y, slot = t.first + s;
  if (status && status[slot] != 0) return;
  const float decay = t.coef[s]->decay, step = t.coef[s]->step;
  const void* os = static_cast<const char*>(o.data) +
                   slot * o.stride * (o.dt == kF32 ? 4 : o.dt == kF64 ? 8 : 2);
  const int64_t numel = t.rows * t.cols;
  if constexpr (VEC) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      F8 w = load8(t.w[s], t.w_dt[s], i), ov = load8(os, o.dt, i);
#pragma unroll
      for (int k = 0; k < 8; ++k) w.v[k] = decay * w.v[k] - step * ov.v[k];
      store8(t.w[s], t.w_dt[s], i, w);
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t r = i / t.cols, c = i % t.cols;
      const float w = load1(t.w[s], t.w_dt[s], r * t.ld_w + c);
      store1(t.w[s], t.w_dt[s], r * t.ld_w + c, decay * w - step * load1(os, o.dt, r * o.ld + c));
    }
  }
}

// Pass 3, transposing: O is cols x rows (the wide orientation). grid (ceil(cols/32),
// ceil(rows/32), n), block (32, 8).
__global__ void __launch_bounds__(256) muon_update_t_kernel(MuonTable t, const int32_t* status,
                                                            MatOut o) {
  __shared__ float tile[32][33];
  const int s = blockIdx.z, slot = t.first + s;
  if (status && status[slot] != 0) return;
  const float decay = t.coef[s]->decay, step = t.coef[s]->step;
  const void* os = static_cast<const char*>(o.data) +
                   slot * o.stride * (o.dt == kF32 ? 4 : o.dt == kF64 ? 8 : 2);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + threadIdx.y + 8 * k, r = r0 + threadIdx.x;
    tile[threadIdx.y + 8 * k][threadIdx.x] = (c < t.cols && r < t.rows) ? load1(os, o.dt, c * o.ld + r) : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = r0 + threadIdx.y + 8 * k, c = c0 + threadIdx.x;
    if (r < t.rows && c < t.cols) {
      const float w = load1(t.w[s], t.w_dt[s], r * t.ld_w + c);
      store1(t.w[s], t.w_dt[s], r * t.ld_w + c, decay * w - step * tile[threadIdx.x][threadIdx.y + 8 * k]);
    }
  }
}


// Vector forms of the transposing passes for fp32 G, B, W: 64x64 tiles, 256 threads, 16-byte
// accesses on both sides (float4 along the rows of G/B/W, 8-element vectors along the rows of
// X/O). Need rows % 8 == 0, cols % 4 == 0 and 16-byte aligned rows (checked on the host).
__global__ void __launch_bounds__(256) muon_apply_t64_kernel(MuonTable t, const float* mu_in, bool nesterov,
                                                             const int32_t* status, ScaleArgs sc,
                                                             MatOut x) {
  const float mu = *mu_in;
  __shared__ float tile[64][65];  // [c][r]
  const int s = blockIdx.z, slot = t.first + s;
  const bool ok = status[slot] == 0;
  const double f = ok ? scale_factor(sc, slot) : 0.0;
  count_skip(t, s, ok, blockIdx.x == 0 && blockIdx.y == 0);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 64, c0 = static_cast<int64_t>(blockIdx.x) * 64;
  const int q = threadIdx.x & 15, rr = threadIdx.x >> 4;
  const float* g = static_cast<const float*>(t.g[s]);
  float* b = static_cast<float*>(t.b[s]);
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int lr = rr + 16 * pass;
    const int64_t r = r0 + lr, c = c0 + 4 * q;
    float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok && r < t.rows && c < t.cols) {
      const float4 gv = __ldcs(reinterpret_cast<const float4*>(g + r * t.ld_g + c));
      float4 bv = *reinterpret_cast<const float4*>(b + r * t.ld_b + c);
      bv.x = mu * bv.x + gv.x;
      bv.y = mu * bv.y + gv.y;
      bv.z = mu * bv.z + gv.z;
      bv.w = mu * bv.w + gv.w;
      *reinterpret_cast<float4*>(b + r * t.ld_b + c) = bv;
      u[0] = scaled_out(gv.x, bv.x, mu, nesterov, f);
      u[1] = scaled_out(gv.y, bv.y, mu, nesterov, f);
      u[2] = scaled_out(gv.z, bv.z, mu, nesterov, f);
      u[3] = scaled_out(gv.w, bv.w, mu, nesterov, f);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[4 * q + k][lr] = u[k];
  }
  __syncthreads();
  void* xs = static_cast<char*>(x.data) +
             slot * x.stride * (x.dt == kF32 ? 4 : x.dt == kF64 ? 8 : 2);
  const int v = threadIdx.x & 7, cr = threadIdx.x >> 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lc = cr + 32 * pass;
    const int64_t c = c0 + lc, r = r0 + 8 * v;
    if (c < t.cols && r < t.rows) {
      F8 o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = tile[lc][8 * v + k];
      store8(xs, x.dt, c * x.ld + r, o);
    }
  }
}

__global__ void __launch_bounds__(256) muon_update_t64_kernel(MuonTable t, const int32_t* status,
                                                              MatOut o) {
  __shared__ float tile[64][65];  // [c][r] = O[c][r]
  const int s = blockIdx.z, slot = t.first + s;
  if (status && status[slot] != 0) return;
  const float decay = t.coef[s]->decay, step = t.coef[s]->step;
  const void* os = static_cast<const char*>(o.data) +
                   slot * o.stride * (o.dt == kF32 ? 4 : o.dt == kF64 ? 8 : 2);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 64, c0 = static_cast<int64_t>(blockIdx.x) * 64;
  const int v = threadIdx.x & 7, cr = threadIdx.x >> 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lc = cr + 32 * pass;
    const int64_t c = c0 + lc, r = r0 + 8 * v;
    F8 ov;
    if (c < t.cols && r < t.rows) {
      ov = load8(os, o.dt, c * o.ld + r);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) ov.v[k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[lc][8 * v + k] = ov.v[k];
  }
  __syncthreads();
  float* w = static_cast<float*>(t.w[s]);
  const int q = threadIdx.x & 15, rr = threadIdx.x >> 4;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int lr = rr + 16 * pass;
    const int64_t r = r0 + lr, c = c0 + 4 * q;
    if (r < t.rows && c < t.cols) {
      float4 wv = *reinterpret_cast<const float4*>(w + r * t.ld_w + c);
      wv.x = decay * wv.x - step * tile[4 * q + 0][lr];
      wv.y = decay * wv.y - step * tile[4 * q + 1][lr];
      wv.z = decay * wv.z - step * tile[4 * q + 2][lr];
      wv.w = decay * wv.w - step * tile[4 * q + 3][lr];
      *reinterpret_cast<float4*>(w + r * t.ld_w + c) = wv;
    }
  }
}

}  // namespace dev
}  // namespace distmuon::cuda
