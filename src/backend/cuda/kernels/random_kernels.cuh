// Counter-based Gaussian fill (splitmix64 hash + Box-Muller) for benchmarks and the
// autotuner: fresh random inputs on the device without a host round trip.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels/dtype.cuh"

namespace distmuon::cuda::dev {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void __launch_bounds__(256) fill_normal_kernel(void* data, int dt, int64_t n,
                                                          uint64_t seed, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xffffffull) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    store1(data, dt, i, z * scale);
  }
}

}  // namespace distmuon::cuda::dev
