// The scalar definitions behind the CacheMuon backend operations: the per-matrix gate, the
// residual histogram bins and the counter-based normal generator. Every backend calls these
// (the CPU directly, the host fallback after copying, a CUDA kernel per thread), so decisions
// and probes are identical across backends. Plain arithmetic only: compiled for the host and,
// under nvcc, for the device as well. The device's double log/cos/pow are within 1-2 ulp of the
// host's, so a probe agrees bit for bit once rounded to fp32 or a half type (the probes'
// dtypes) and to an ulp or two in fp64. The gate decides with exact comparisons on both; only
// its diagnostics may differ (a residual within an ulp of a histogram edge, the last bit of
// the sum of squares where nvcc fuses a multiply-add).
#pragma once

#include <cmath>
#include <cstdint>

#include "distmuon/backend.h"

#if defined(__CUDACC__)
#define DM_CACHE_HD __host__ __device__
#else
#define DM_CACHE_HD
#endif

namespace distmuon::cache_ref {

// Bin of residual r in the histogram described at kCacheHistBins.
DM_CACHE_HD inline int hist_bin(double r) {
  if (!(r >= 1e-3)) return 0;
  if (r >= 1e3) return kCacheHistBins - 1;
  int b = 1 + static_cast<int>(std::floor(4.0 * std::log10(r / 1e-3)));
  return b < 1 ? 1 : (b > kCacheHistBins - 2 ? kCacheHistBins - 2 : b);
}

// Lower edge of bin b >= 1 (bin 0 starts at 0).
DM_CACHE_HD inline double hist_lower_edge(int b) { return b <= 0 ? 0.0 : 1e-3 * std::pow(10.0, (b - 1) / 4.0); }

DM_CACHE_HD inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Backend::fingerprint: kFingerprintSamples elements at evenly spaced row-major positions, each
// hashed with its position number, combined by XOR (order-free: a device reduces them in any
// order), then mixed with the shape.
constexpr int kFingerprintSamples = 64;
// Offset, in elements from the matrix's first, of sample t of a rows x cols matrix with leading
// dimension ld (rows * cols > 0).
DM_CACHE_HD inline int64_t fingerprint_offset(int t, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t total = rows * cols;
  const int64_t p =
      total <= 1 ? 0 : static_cast<int64_t>(t) * (total - 1) / (kFingerprintSamples - 1);
  const int64_t r = p / cols;
  return r * ld + (p - r * cols);
}
DM_CACHE_HD inline uint64_t fingerprint_term(uint64_t bits, int t) {
  return splitmix64(bits ^ splitmix64(static_cast<uint64_t>(t) + 1));
}
DM_CACHE_HD inline uint64_t fingerprint_finish(uint64_t terms, int64_t rows, int64_t cols) {
  return splitmix64(terms ^ splitmix64((static_cast<uint64_t>(rows) << 32) ^
                                       static_cast<uint64_t>(cols)));
}
// The key of one matrix, from bits_at(offset): the zero-extended bits of its element there (the
// host backends; the device computes the same terms a thread each).
template <typename BitsAt>
uint64_t fingerprint_matrix(int64_t rows, int64_t cols, int64_t ld, BitsAt&& bits_at) {
  uint64_t terms = 0;
  for (int t = 0; t < kFingerprintSamples; ++t) {
    const uint64_t bits = rows * cols != 0 ? bits_at(fingerprint_offset(t, rows, cols, ld)) : 0;
    terms ^= fingerprint_term(bits, t);
  }
  return fingerprint_finish(terms, rows, cols);
}
// The bits of an element of `size` bytes (2, 4 or 8) at p, zero-extended.
DM_CACHE_HD inline uint64_t element_bits(const void* p, size_t size) {
  if (size == 2) return *static_cast<const uint16_t*>(p);
  if (size == 4) return *static_cast<const uint32_t*>(p);
  return *static_cast<const uint64_t*>(p);
}

// Standard normal sample number `index` of stream `seed` (Box-Muller on two 53-bit uniforms
// derived by hashing; u1 in (0, 1] so the logarithm is finite).
DM_CACHE_HD inline double normal_sample(uint64_t seed, uint64_t index) {
  const uint64_t h1 = splitmix64(seed ^ splitmix64(index));
  const uint64_t h2 = splitmix64(h1);
  const double u1 = (static_cast<double>(h1 >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Whether an entry that has refreshed `misses` times in a row since its last hit is tested
// this call: always after at most one miss; then the interval between tests doubles (tests at 2,
// 4, 8, ... misses) up to the largest power of two <= backoff, and stays there. An entry whose
// transform keeps failing thus costs a test every `backoff` calls instead of every call, and one
// that starts to fit again is found within that many calls.
DM_CACHE_HD inline bool due_for_check(float misses, int32_t backoff) {
  if (backoff <= 1 || misses < 2.0f) return true;
  const int64_t f = static_cast<int64_t>(misses);
  int64_t interval = 1;
  while (interval * 2 <= f && interval * 2 <= backoff) interval *= 2;
  return f % interval == 0;
}

// misses + 1, kept below 2^20 (f32 counts exactly to 2^24) without changing it modulo any
// interval due_for_check uses.
DM_CACHE_HD inline float one_more_miss(float misses) {
  const float f = misses + 1.0f;
  return f >= 1048576.0f ? f - 524288.0f : f;
}

// Backend::cache_gate for matrix i (contract in backend.h).
DM_CACHE_HD inline void gate_one(const CacheGateArgs& g, int64_t i) {
  double* st = g.stats && !g.plan ? g.stats + i * kCacheStatFields : nullptr;
  if (g.status && g.status[i] != kStatusOk) {
    g.decision[i] = kCacheSkip;
    if (st) st[kCacheStatSkips] += 1;
    return;
  }
  const bool entry_ok = g.entry_key[i] == g.key;
  const bool tested = entry_ok && (!g.misses || due_for_check(g.misses[i], g.backoff));
  if (g.plan) {
    g.decision[i] = tested ? kCacheCheck : kCacheRefresh;
    return;
  }
  const bool fresh_enough = g.max_age <= 0 || g.age[i] < static_cast<float>(g.max_age);
  const bool usable = entry_ok && fresh_enough;
  const double r = tested ? static_cast<double>(g.residual[i]) * g.residual_scale : 0.0;
  const bool finite = tested && std::isfinite(r);
  const bool hit = usable && finite && r <= g.gamma;
  if (st && tested) st[kCacheStatTested] += 1;
  if (st && finite) {
    // Stale entries still report their residual: it shows how far staleness had drifted.
    st[kCacheStatChecks] += 1;
    st[kCacheStatResSum] += r;
    st[kCacheStatResSqSum] += r * r;
    st[kCacheStatResMin] = r < st[kCacheStatResMin] ? r : st[kCacheStatResMin];
    st[kCacheStatResMax] = r > st[kCacheStatResMax] ? r : st[kCacheStatResMax];
    st[kCacheStatResLast] = r;
    st[kCacheStatHist + hist_bin(r)] += 1;
  }
  if (hit) {
    g.decision[i] = kCacheHit;
    g.age[i] += 1.0f;
    if (g.misses) g.misses[i] = 0.0f;
    if (st) st[kCacheStatHits] += 1;
  } else {
    g.decision[i] = kCacheRefresh;
    g.age[i] = 0.0f;
    g.entry_key[i] = g.key;
    if (g.misses) g.misses[i] = usable ? one_more_miss(g.misses[i]) : 0.0f;
    if (st) {
      st[kCacheStatRefreshes] += 1;
      if (!usable || (tested && !finite)) st[kCacheStatForced] += 1;
      if (usable && !tested) st[kCacheStatUnchecked] += 1;
    }
  }
}

}  // namespace distmuon::cache_ref
