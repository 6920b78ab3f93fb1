// Software bf16/fp16 conversions for the CPU backend (round to nearest even), so that the CPU
// can emulate the rounding of the GPU's half-precision storage bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace distmuon {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;              // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;             // overflow (>= 65520) -> Inf
  if (a < 0x38800000u) {                                   // subnormal or zero in fp16
    float af;
    std::memcpy(&af, &a, 4);
    // value / 2^-24, rounded to nearest even by the FPU's default rounding
    float scaled = std::nearbyint(af * 16777216.0f);
    return sign | static_cast<uint16_t>(scaled);
  }
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  return sign | static_cast<uint16_t>(((rounded - 0x38000000u) >> 13) & 0x7fffu);
}

}  // namespace distmuon
