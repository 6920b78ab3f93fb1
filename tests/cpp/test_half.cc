// The software bf16/fp16 conversions must round exactly like the GPU (nearest, ties to even).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/half.h"

namespace distmuon {

TEST(Half, Bf16RoundTripsRepresentableValues) {
  for (float v : {0.0f, 1.0f, -2.0f, 0.5f, 3.140625f, 65536.0f, std::ldexp(1.0f, -100)})
    EXPECT_EQ(bf16_to_float(float_to_bf16(v)), v) << v;
}

TEST(Half, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: goes to 1 + 2^-6 (even).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(Half, F16RoundTripsAndRounds) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f /* min normal */,
                  5.960464477539063e-08f /* min subnormal */})
    EXPECT_EQ(f16_to_float(float_to_f16(v)), v) << v;
  EXPECT_EQ(f16_to_float(float_to_f16(1.0f + std::ldexp(1.0f, -11))), 1.0f);  // tie -> even
  EXPECT_EQ(f16_to_float(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(70000.0f))));
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  EXPECT_EQ(f16_to_float(float_to_f16(-0.0f)), 0.0f);
}

TEST(Half, F16MatchesCompilerConversionOnManyValues) {
  // _Float16 conversions of the compiler are IEEE round-to-nearest-even.
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    float v = std::ldexp(static_cast<float>(state % 1000003) / 1000003.0f - 0.5f,
                         static_cast<int>(state >> 27) - 20);
    _Float16 h = static_cast<_Float16>(v);
    ASSERT_EQ(f16_to_float(float_to_f16(v)), static_cast<float>(h)) << v;
  }
}

}  // namespace distmuon
