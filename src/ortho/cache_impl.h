// TransformCache internals shared by transform_cache.cc (storage, state, statistics) and
// cached_run.cc (the step itself).
#pragma once

#include <array>
#include <limits>
#include <vector>

#include "distmuon/cache.h"

namespace distmuon {

struct TransformCache::Impl {
  Backend& be;
  CacheOptions opt;

  // The prepared configuration and its storage (entries in index order, each `segs` m x m).
  bool prepared = false;
  OrthoConfig cfg;
  int64_t count = 0, m = 0, n = 0;
  int segs = 1;
  DType qtype = DType::kF32;
  CacheLayout layout = CacheLayout::kProduct;
  double key = 0;
  Buffer q, age, keys, misses, dstats;  // device: Q, f32 age, f64 key, f32 misses in a row,
                                        // stats (count x fields)
  std::vector<double> stats_init;  // device stats after a reset: zeros, +inf minima
  bool dirty = false;  // calls issued since the last fold (device counters may be non-zero)

  // FLOP accounting. The fixed part of a call is known when it is issued; tests, hits and
  // refreshes are charged when the device counters are folded, at the constants of the calls
  // that produced them (a change of constants folds first).
  int64_t calls = 0, matrices = 0;
  double flops_fixed = 0, flops_charged = 0, flops_fresh = 0;
  double test_flops = -1, hit_flops = -1, refresh_flops = -1;

  // Device statistics folded to the host, per entry; `retired` holds the totals of entries of
  // an earlier storage (before a reallocation).
  std::vector<double> acc;
  std::array<double, kCacheStatFields> retired{};

  // Shadow-mode accumulators (host): update error per entry, probe/exact ratio in total.
  std::vector<double> sh_sum, sh_max, sh_cos_sum, sh_cos_min;
  std::vector<int64_t> sh_n;
  std::vector<double> sh_last_err, sh_last_cos;  // latest accepted update: error, alignment
  std::vector<char> sh_seen;                     // the entry has had an accepted update
  double sh_retired_sum = 0, sh_retired_max = 0, sh_retired_cos_sum = 0, sh_retired_cos_min = 1;
  int64_t sh_retired_n = 0;
  double pr_min = std::numeric_limits<double>::infinity(), pr_max = 0, pr_sum = 0;
  int64_t pr_n = 0;

  explicit Impl(Backend& b, const CacheOptions& o) : be(b), opt(o) {}

  size_t q_bytes_per_entry() const { return static_cast<size_t>(segs * m * m) * dtype_size(qtype); }
  // Segment s of entries [first, first + c) as a batch of m x m matrices.
  BatchRef q_segment(int64_t first, int64_t c, int s) const {
    auto* base = static_cast<char*>(q.data()) + (static_cast<size_t>(first) * segs + s) *
                                                    static_cast<size_t>(m * m) * dtype_size(qtype);
    return BatchRef{base, qtype, c, m, m, m, segs * m * m};
  }
  // Entries [first, first + c) each seen as one (segs m) x m matrix (for a dtype conversion).
  BatchRef q_entries(int64_t first, int64_t c) const {
    auto* base = static_cast<char*>(q.data()) + static_cast<size_t>(first) * q_bytes_per_entry();
    return BatchRef{base, qtype, c, segs * m, m, m, segs * m * m};
  }
  float* age_at(int64_t first) const { return age.as<float>() + first; }
  float* misses_at(int64_t first) const { return misses.as<float>() + first; }
  double* key_at(int64_t first) const { return keys.as<double>() + first; }
  double* stats_at(int64_t first) const { return dstats.as<double>() + first * kCacheStatFields; }

  void fold();                              // synchronises; device counters -> acc
  void charge(double test, double hit, double refresh);  // sets the constants, folding on a change
  void reset_device_stats();
};

// Fingerprint of everything that makes a cached transform meaningful: shape, dtypes, layout and
// the exact algorithm. A 52-bit odd integer, exactly representable as a double (never 0).
double cache_key(const OrthoConfig& resolved, int64_t m, int64_t n, DType qtype,
                 CacheLayout layout);

}  // namespace distmuon
