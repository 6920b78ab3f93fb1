// How the fused Muon passes form the iteration's input and its norm, shared by every backend
// (host and, under nvcc, device code) so that passes, backends and ranks round alike.
//
// Near float's largest value a finite gradient G gives a finite momentum B' = mu B + G but an
// input U = G + mu B' up to (1 + mu) x that value, and a norm ||U|| far beyond it (a 16 x 48
// matrix of 3e38 entries: 1.6e40). In float, both overflowed and the gradient was skipped as
// "non-finite". So U is formed in double and carried as V = fl32(U * kMuonInputScale), which
// cannot overflow, and norms are accumulated in double and kept in double's range.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DM_MUON_HD __host__ __device__
#else
#define DM_MUON_HD
#endif

namespace distmuon::muon_ref {

// Callers normalise V with eps * kMuonInputScale: V / (m ||V|| + eps / 4) = U / (m ||U|| + eps).
constexpr double kMuonInputScale = 0.25;

// V from G, the new momentum B' (as stored) and mu.
DM_MUON_HD inline float scaled_input(float g, float b_new, float mu, bool nesterov) {
  const double u = nesterov ? static_cast<double>(g) + static_cast<double>(mu) * b_new
                            : static_cast<double>(b_new);
  return static_cast<float>(u * kMuonInputScale);
}

// A norm rounded to float's precision in double's range: sums accumulated in another order (by
// another pass, backend or rank) round alike, as float norms did, and no finite matrix has an
// infinite norm.
DM_MUON_HD inline double float_precision(double v) {
  if (!(v > 0) || !std::isfinite(v)) return v;
  int e = 0;
  const double m = std::frexp(v, &e);
  return std::ldexp(static_cast<double>(static_cast<float>(m)), e);
}

}  // namespace distmuon::muon_ref
