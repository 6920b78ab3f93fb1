// AdamW for the non-matrix parameters in one pass (decoupled weight decay, bias correction),
// its finiteness check, and the skip counter. Multi-tensor: up to kMaxAdamSlots tensors per
// launch, their pointers by value in the kernel parameters, their coefficients in device memory.
#pragma once

#include <cstdint>

#include "backend/adam_ref.h"
#include "backend/cuda/kernels/dtype.cuh"
#include "distmuon/backend.h"

namespace distmuon::cuda {

constexpr int kMaxAdamSlots = 32;

struct AdamTable {
  void* p[kMaxAdamSlots];
  const void* g[kMaxAdamSlots];
  float* m[kMaxAdamSlots];
  float* v[kMaxAdamSlots];
  int64_t numel[kMaxAdamSlots];
  const AdamCoef* coef[kMaxAdamSlots];  // device memory: read at every launch
  int64_t* steps[kMaxAdamSlots];        // device step counters (null: coef->step)
  int8_t p_dt[kMaxAdamSlots], g_dt[kMaxAdamSlots];
  int8_t vec[kMaxAdamSlots];  // 16-byte aligned and numel % 8 == 0
  int n, first;
};

namespace dev {

// status[first + s] |= non-finite(grad s). status zeroed beforehand. grid (blocks, n).
__global__ void __launch_bounds__(256) adamw_check_kernel(AdamTable t, int32_t* status) {
  const int s = blockIdx.y;
  bool bad = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < t.numel[s];
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad |= !isfinite(load1(t.g[s], t.g_dt[s], i));
  if (__syncthreads_or(bad) && threadIdx.x == 0) status[t.first + s] = 1;
}

__device__ __forceinline__ float adam_one(float g, float& m, float& v, float p, float b1, float b2,
                                          float eps, float step_size, float bc2_sqrt, float decay) {
  m = b1 * m + (1.0f - b1) * g;
  v = b2 * v + (1.0f - b2) * g * g;
  return p * decay - step_size * m / (sqrtf(v) / bc2_sqrt + eps);
}

// grid (blocks, n). status may be null. Every block forms its slot's coefficients from device
// memory, as the CPU reference does on the host (adam_ref.h): a slot with a step counter takes
// its bias terms from *steps + 1 (adam_advance_kernel stores that count after this kernel).
__global__ void __launch_bounds__(256) adamw_update_kernel(AdamTable t, const int32_t* status) {
  const int s = blockIdx.y;
  if (status && status[t.first + s] != 0) return;
  const AdamCoef k = *t.coef[s];
  const float b1 = k.beta1, b2 = k.beta2, eps = k.eps;
  const int64_t step = t.steps[s] ? *t.steps[s] + 1 : (k.step < 1 ? 1 : k.step);
  const adam_ref::Bias bias = adam_ref::bias(k.lr, b1, b2, step);
  const float ss = bias.step_size, bc = bias.bc2_sqrt;
  const float dec = adam_ref::decay(k.lr, k.weight_decay);
  const int64_t n = t.numel[s];
  if (t.vec[s]) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
      F8 g = load8(t.g[s], t.g_dt[s], i), p = load8(t.p[s], t.p_dt[s], i);
      F8 m = load8(t.m[s], kF32, i), v = load8(t.v[s], kF32, i);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        p.v[k] = adam_one(g.v[k], m.v[k], v.v[k], p.v[k], b1, b2, eps, ss, bc, dec);
      store8(t.p[s], t.p_dt[s], i, p);
      store8(t.m[s], kF32, i, m);
      store8(t.v[s], kF32, i, v);
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      float m = t.m[s][i], v = t.v[s][i];
      const float p = adam_one(load1(t.g[s], t.g_dt[s], i), m, v, load1(t.p[s], t.p_dt[s], i), b1, b2,
                               eps, ss, bc, dec);
      t.m[s][i] = m;
      t.v[s][i] = v;
      store1(t.p[s], t.p_dt[s], i, p);
    }
  }
}

// steps[s] += 1 for the slots with a counter that adamw_update_kernel updated. One block.
__global__ void __launch_bounds__(32) adam_advance_kernel(AdamTable t, const int32_t* status) {
  const int s = threadIdx.x;
  if (s < t.n && t.steps[s] && !(status && status[t.first + s] != 0)) *t.steps[s] += 1;
}

// counter[0] += #(status != 0). One block.
__global__ void __launch_bounds__(256) count_status_kernel(const int32_t* status, int64_t n,
                                                           unsigned long long* counter) {
  unsigned long long c = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) c += status[i] != 0 ? 1 : 0;
  const double total = block_sum(static_cast<double>(c));
  if (threadIdx.x == 0 && total > 0) atomicAdd(counter, static_cast<unsigned long long>(total));
}

}  // namespace dev
}  // namespace distmuon::cuda
