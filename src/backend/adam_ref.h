// AdamW's bias-correction terms, shared by every backend (host and, under nvcc, device code) so
// that a step count read on the device gives the coefficients the CPU computes from the same
// count. 1 - beta^t is formed in double (as torch does) and rounded once to fp32; the device's
// double pow is within an ulp of the host's, far below that rounding.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DM_ADAM_HD __host__ __device__
#else
#define DM_ADAM_HD
#endif

namespace distmuon::adam_ref {

struct Bias {
  float step_size;  // lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
};

DM_ADAM_HD inline Bias bias(float lr, float beta1, float beta2, int64_t t) {
  const double td = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), td));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), td));
  return Bias{lr / bc1, std::sqrt(bc2)};
}

// The decoupled decay factor 1 - lr * wd: the product of two floats is exact in double, so
// host and device round it alike whether or not the compiler fuses a multiply-add.
DM_ADAM_HD inline float decay(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
}

}  // namespace distmuon::adam_ref
