// The scalar definitions behind the CacheMuon backend operations: the gate (per matrix, and the
// per-batch gate's votes), the residual histogram bins and the counter-based normal generator.
// Every backend calls these (the CPU directly, the host fallback after copying, a CUDA kernel per
// thread), so decisions and probes are identical across backends. Plain arithmetic only:
// compiled for the host and, under nvcc, for the device as well. The device's double
// log/cos/pow are within 1-2 ulp of the host's, so a probe agrees bit for bit once rounded to
// fp32 or a half type (the probes' dtypes) and to an ulp or two in fp64. The gate decides with
// exact comparisons on both; only its diagnostics may differ (a residual within an ulp of a
// histogram edge, the last bit of the sum of squares where nvcc fuses a multiply-add).
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

// The per-matrix rule for matrix i, not skipped, before anything is written (contract in
// backend.h): whether its entry is tested and usable, its residual r, and whether it would hit.
struct Verdict {
  bool tested, usable, finite, hit;
  double r;
};
DM_CACHE_HD inline Verdict verdict(const CacheGateArgs& g, int64_t i) {
  Verdict v;
  const bool entry_ok = g.entry_key[i] == g.key;
  v.tested = entry_ok && (!g.misses || due_for_check(g.misses[i], g.backoff));
  const bool fresh_enough = g.max_age <= 0 || g.age[i] < static_cast<float>(g.max_age);
  v.usable = entry_ok && fresh_enough;
  v.r = v.tested ? static_cast<double>(g.residual[i]) * g.residual_scale : 0.0;
  v.finite = v.tested && std::isfinite(v.r);
  v.hit = v.usable && v.finite && v.r <= g.gamma;
  return v;
}

DM_CACHE_HD inline bool skipped(const CacheGateArgs& g, int64_t i) {
  return g.status && g.status[i] != kStatusOk;
}

// The per-batch gate's vote of matrix i: true where it would hit alone, and where it is skipped
// (it takes no part in the call, so it must not hold the others back). The call hits when every
// vote is true: an AND over the batch, which a device reduces in any order.
DM_CACHE_HD inline bool batch_vote(const CacheGateArgs& g, int64_t i) {
  return skipped(g, i) || verdict(g, i).hit;
}

// Backend::cache_gate for matrix i (contract in backend.h). `batch_hits`: the per-batch gate's
// verdict on the call (the AND of batch_vote over it; always true for the per-matrix gate), read
// before any matrix of the call is written.
DM_CACHE_HD inline void gate_one(const CacheGateArgs& g, int64_t i, bool batch_hits = true) {
  double* st = g.stats && !g.plan ? g.stats + i * kCacheStatFields : nullptr;
  if (skipped(g, i)) {
    g.decision[i] = kCacheSkip;
    if (st) st[kCacheStatSkips] += 1;
    return;
  }
  const Verdict v = verdict(g, i);
  if (g.plan) {
    g.decision[i] = v.tested ? kCacheCheck : kCacheRefresh;
    return;
  }
  const double r = v.r;
  const bool hit = v.hit && batch_hits;
  if (st && v.tested) st[kCacheStatTested] += 1;
  if (st && v.finite) {
    // Stale entries still report their residual: it shows how far staleness had drifted. So
    // does a matrix the per-batch gate refreshes: its residual was measured all the same.
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
    // A matrix the per-batch gate refreshes although it passed its own test counts a miss, as a
    // failed test does: under that gate the call is the unit that hits or misses, so its usable
    // entries count their misses in step, and the check back-off then leaves the test out for
    // all of them on the same calls (which is what lets a captured call skip the test's
    // kernels; reset to 0, this entry would be due on every call and keep the test running for
    // the whole batch). Once the batch fits again a due test finds it within `backoff` calls,
    // as for a single entry.
    if (g.misses) g.misses[i] = v.usable ? one_more_miss(g.misses[i]) : 0.0f;
    if (st) {
      st[kCacheStatRefreshes] += 1;
      if (!v.usable || (v.tested && !v.finite)) st[kCacheStatForced] += 1;
      if (v.usable && !v.tested) st[kCacheStatUnchecked] += 1;
      if (v.hit) st[kCacheStatBatch] += 1;
    }
  }
}

// Backend::cache_gate on the host (the CPU backend, and the fallback on host copies): the
// per-batch gate's votes are all read before the first matrix is written.
inline void gate_call(const CacheGateArgs& g) {
  bool batch_hits = true;
  if (g.batch && !g.plan)
    for (int64_t i = 0; i < g.count && batch_hits; ++i) batch_hits = batch_vote(g, i);
  for (int64_t i = 0; i < g.count; ++i) gate_one(g, i, batch_hits);
}

}  // namespace distmuon::cache_ref
