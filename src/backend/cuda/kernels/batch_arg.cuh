// One strided batch as a kernel argument, and the address of its matrix i (device code only).
// Kept apart from the kernels so that several translation units can share it.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels/dtype.cuh"

namespace distmuon::cuda {

struct BatchArg {
  const void* data;
  int64_t stride, ld;
  int dt;
};

namespace dev {

__device__ __forceinline__ int elem_bytes(int dt) { return dt == kF32 ? 4 : dt == kF64 ? 8 : 2; }
__device__ __forceinline__ const void* mat_ptr(const BatchArg& a, int64_t i) {
  return static_cast<const char*>(a.data) + i * a.stride * elem_bytes(a.dt);
}

}  // namespace dev
}  // namespace distmuon::cuda
