// Storage types of the CPU backend and a dispatcher from DType to a C++ type, so that every
// CPU kernel is written once as a template over its input/output storage types.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/half.h"
#include "distmuon/error.h"
#include "distmuon/types.h"

namespace distmuon::cpu {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }
inline float to_float(bf16_t v) { return bf16_to_float(v.bits); }
inline float to_float(f16_t v) { return f16_to_float(v.bits); }

template <typename T>
inline T from_float(double v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else if constexpr (std::is_same_v<T, float>) return static_cast<float>(v);
  else if constexpr (std::is_same_v<T, bf16_t>) return bf16_t{float_to_bf16(static_cast<float>(v))};
  else return f16_t{float_to_f16(static_cast<float>(v))};
}

// The arithmetic type used for a storage type: double for f64, float for everything else
// (the GPU computes half-precision data in fp32 as well).
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Calls f(T{}) with T the storage type of `t`.
template <typename F>
decltype(auto) dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kF64: return f(double{});
    case DType::kF32: return f(float{});
    case DType::kBF16: return f(bf16_t{});
    case DType::kF16: return f(f16_t{});
  }
  DM_FAIL("unsupported dtype ", static_cast<int>(t));
}

}  // namespace distmuon::cpu
