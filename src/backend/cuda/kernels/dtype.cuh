// Device-side element access with the storage type chosen at run time (a uniform branch per
// access): the elementwise kernels are memory-bound, so one kernel per pass serves every
// dtype combination. Vector forms move 8 elements with 16-byte accesses (two for fp32, four for
// fp64); callers guarantee 16-byte alignment and an element index that is a multiple of 8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace distmuon::cuda::dev {

// Same numbering as distmuon::DType.
enum : int { kF64 = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

struct F8 {
  float v[8];
};

__device__ __forceinline__ float load1(const void* p, int dt, int64_t i) {
  switch (dt) {
    case kF32: return static_cast<const float*>(p)[i];
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<float>(static_cast<const double*>(p)[i]);
  }
}

__device__ __forceinline__ void store1(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case kF16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<double*>(p)[i] = v; break;
  }
}

__device__ __forceinline__ double load1d(const void* p, int dt, int64_t i) {
  return dt == kF64 ? static_cast<const double*>(p)[i] : static_cast<double>(load1(p, dt, i));
}

__device__ __forceinline__ void store1d(void* p, int dt, int64_t i, double v) {
  if (dt == kF64)
    static_cast<double*>(p)[i] = v;
  else
    store1(p, dt, i, static_cast<float>(v));
}

__device__ __forceinline__ void unpack_half8(const uint4& q, bool bf, F8& out) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (bf) {
      __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[k]);
      float2 f = __bfloat1622float2(h);
      out.v[2 * k] = f.x;
      out.v[2 * k + 1] = f.y;
    } else {
      __half2 h = *reinterpret_cast<const __half2*>(&w[k]);
      float2 f = __half22float2(h);
      out.v[2 * k] = f.x;
      out.v[2 * k + 1] = f.y;
    }
  }
}

__device__ __forceinline__ uint4 pack_half8(const F8& in, bool bf) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (bf) {
      __nv_bfloat162 h = __floats2bfloat162_rn(in.v[2 * k], in.v[2 * k + 1]);
      w[k] = *reinterpret_cast<uint32_t*>(&h);
    } else {
      __half2 h = __floats2half2_rn(in.v[2 * k], in.v[2 * k + 1]);
      w[k] = *reinterpret_cast<uint32_t*>(&h);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Loads elements [i, i + 8) with streaming hints: every pass reads its data once.
__device__ __forceinline__ F8 load8(const void* p, int dt, int64_t i) {
  F8 r;
  switch (dt) {
    case kF32: {
      const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
      float4 a = __ldcs(q), b = __ldcs(q + 1);
      r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
      r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
      break;
    }
    case kBF16:
    case kF16: {
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
      unpack_half8(__ldcs(q), dt == kBF16, r);
      break;
    }
    default: {
      const double2* q = reinterpret_cast<const double2*>(static_cast<const double*>(p) + i);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        double2 d = q[k];
        r.v[2 * k] = static_cast<float>(d.x);
        r.v[2 * k + 1] = static_cast<float>(d.y);
      }
    }
  }
  return r;
}

__device__ __forceinline__ void store8(void* p, int dt, int64_t i, const F8& r) {
  switch (dt) {
    case kF32: {
      float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
      q[0] = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
      q[1] = make_float4(r.v[4], r.v[5], r.v[6], r.v[7]);
      break;
    }
    case kBF16:
    case kF16: {
      uint4* q = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i);
      *q = pack_half8(r, dt == kBF16);
      break;
    }
    default: {
      double2* q = reinterpret_cast<double2*>(static_cast<double*>(p) + i);
#pragma unroll
      for (int k = 0; k < 4; ++k) q[k] = make_double2(r.v[2 * k], r.v[2 * k + 1]);
    }
  }
}

// Sum over the block of one double per thread; the result is valid in thread 0. Fixed tree:
// deterministic for a given launch shape.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double warp_part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  double s = 0;
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    s = lane < nwarps ? warp_part[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  }
  __syncthreads();  // warp_part may be reused by a following call
  return s;
}

}  // namespace distmuon::cuda::dev
