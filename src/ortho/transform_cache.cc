// TransformCache: storage of the cached transforms and their metadata, checkpoint state views,
// and the statistics (folded from the per-matrix device counters that cache_gate keeps).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cache_ref.h"
#include "common/fnv.h"
#include "distmuon/cache.h"
#include "distmuon/error.h"
#include "ortho/cache_impl.h"
#include "ortho/iteration.h"

namespace distmuon {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

bool additive(int field) {
  return field != kCacheStatResMin && field != kCacheStatResMax && field != kCacheStatResLast;
}

// Merges one entry's counters `src` into `dst` (sums add, extremes combine, last replaces).
void merge_fields(double* dst, const double* src) {
  for (int f = 0; f < kCacheStatFields; ++f)
    if (additive(f)) dst[f] += src[f];
  dst[kCacheStatResMin] = std::min(dst[kCacheStatResMin], src[kCacheStatResMin]);
  dst[kCacheStatResMax] = std::max(dst[kCacheStatResMax], src[kCacheStatResMax]);
  if (src[kCacheStatChecks] > 0) dst[kCacheStatResLast] = src[kCacheStatResLast];
}

void init_fields(double* f) {
  std::fill(f, f + kCacheStatFields, 0.0);
  f[kCacheStatResMin] = kInf;
}

// Quantile q of the residual histogram, interpolated geometrically inside a bin.
double hist_quantile(const std::array<double, kCacheHistBins>& h, double q) {
  double total = 0;
  for (double v : h) total += v;
  if (total <= 0) return 0;
  double target = q * total, seen = 0;
  for (int b = 0; b < kCacheHistBins; ++b) {
    if (seen + h[b] < target) {
      seen += h[b];
      continue;
    }
    const double frac = h[b] > 0 ? (target - seen) / h[b] : 0;
    if (b == 0) return frac * 1e-3;
    if (b == kCacheHistBins - 1) return cache_ref::hist_lower_edge(b);
    const double lo = cache_ref::hist_lower_edge(b), hi = cache_ref::hist_lower_edge(b + 1);
    return lo * std::pow(hi / lo, frac);
  }
  return cache_ref::hist_lower_edge(kCacheHistBins - 1);
}

// Quantiles from the histogram, clamped to the exact extremes (a bin is a quarter decade wide,
// so interpolation alone can land outside the observed range).
void set_quantiles(CacheResidualSummary& r) {
  r.p50 = std::clamp(hist_quantile(r.histogram, 0.5), r.min, r.max);
  r.p90 = std::clamp(hist_quantile(r.histogram, 0.9), r.min, r.max);
}

void fill_summary(CacheResidualSummary& r, const double* f) {
  r.count = static_cast<int64_t>(f[kCacheStatChecks]);
  r.mean = r.count ? f[kCacheStatResSum] / r.count : 0;
  r.min = r.count ? f[kCacheStatResMin] : 0;
  r.max = r.count ? f[kCacheStatResMax] : 0;
  for (int b = 0; b < kCacheHistBins; ++b) r.histogram[b] = f[kCacheStatHist + b];
  set_quantiles(r);
}

}  // namespace

CacheResidual parse_cache_residual(const std::string& s) {
  if (s == "exact") return CacheResidual::kExact;
  if (s == "probe" || s == "probes") return CacheResidual::kProbe;
  DM_FAIL("unknown cache residual '", s, "' (expected exact or probe)");
}
CacheLayout parse_cache_layout(const std::string& s) {
  if (s == "product") return CacheLayout::kProduct;
  if (s == "factors") return CacheLayout::kFactors;
  DM_FAIL("unknown cache layout '", s, "' (expected product or factors)");
}
CacheGate parse_cache_gate(const std::string& s) {
  if (s == "matrix") return CacheGate::kMatrix;
  if (s == "batch") return CacheGate::kBatch;
  DM_FAIL("unknown cache gate '", s, "' (expected matrix or batch)");
}
const char* cache_residual_name(CacheResidual r) {
  return r == CacheResidual::kExact ? "exact" : "probe";
}
const char* cache_layout_name(CacheLayout l) {
  return l == CacheLayout::kProduct ? "product" : "factors";
}
const char* cache_gate_name(CacheGate g) { return g == CacheGate::kBatch ? "batch" : "matrix"; }

DType cache_storage_dtype(const CacheOptions& o, const OrthoConfig& resolved) {
  return o.dtype.value_or(iteration_dtype(resolved));
}

void validate(const CacheOptions& o, const std::string& what) {
  DM_CHECK(o.gamma >= 0 && std::isfinite(o.gamma), what, ": gamma must be finite and >= 0 (got ",
           o.gamma, ")");
  DM_CHECK(o.residual != CacheResidual::kProbe || (o.probes >= 1 && o.probes <= 4096), what,
           ": probe count must be in [1, 4096] (got ", o.probes, ")");
  DM_CHECK(o.max_staleness >= 0, what, ": max staleness must be >= 0 (got ", o.max_staleness, ")");
  DM_CHECK(o.check_backoff >= 0 && o.check_backoff <= 65536, what,
           ": check back-off must be in [0, 65536] (got ", o.check_backoff, ")");
  DM_CHECK(o.gate == CacheGate::kMatrix || o.gate == CacheGate::kBatch, what, ": unknown gate ",
           static_cast<int>(o.gate), " (expected matrix or batch)");
}

double CacheStats::hit_rate() const {
  const int64_t d = hits + refreshes;
  return d ? static_cast<double>(hits) / d : 0.0;
}
double CacheStats::flops_saved_fraction() const {
  return fresh_flops > 0 ? 1.0 - flops / fresh_flops : 0.0;
}

void CacheStats::merge(const CacheStats& o) {
  const double n0 = residual.count, n1 = o.residual.count;
  const double c0 = compared, c1 = o.compared, p0 = probe_compared, p1 = o.probe_compared;
  calls += o.calls;
  matrices += o.matrices;
  hits += o.hits;
  refreshes += o.refreshes;
  forced_refreshes += o.forced_refreshes;
  unchecked_refreshes += o.unchecked_refreshes;
  batch_refreshes += o.batch_refreshes;
  skips += o.skips;
  flops += o.flops;
  fresh_flops += o.fresh_flops;
  memory_bytes += o.memory_bytes;
  if (n1 > 0) {
    residual.min = n0 > 0 ? std::min(residual.min, o.residual.min) : o.residual.min;
    residual.max = std::max(residual.max, o.residual.max);
    residual.mean = (residual.mean * n0 + o.residual.mean * n1) / (n0 + n1);
    residual.count += o.residual.count;
    for (int b = 0; b < kCacheHistBins; ++b) residual.histogram[b] += o.residual.histogram[b];
    set_quantiles(residual);
  }
  if (c1 > 0) {
    update_error_mean = (update_error_mean * c0 + o.update_error_mean * c1) / (c0 + c1);
    update_error_max = std::max(update_error_max, o.update_error_max);
    compared += o.compared;
  }
  if (p1 > 0) {
    probe_ratio_min = p0 > 0 ? std::min(probe_ratio_min, o.probe_ratio_min) : o.probe_ratio_min;
    probe_ratio_max = std::max(probe_ratio_max, o.probe_ratio_max);
    probe_ratio_mean = (probe_ratio_mean * p0 + o.probe_ratio_mean * p1) / (p0 + p1);
    probe_compared += o.probe_compared;
  }
  if (c1 > 0) {
    alignment_mean = (alignment_mean * c0 + o.alignment_mean * c1) / (c0 + c1);
    alignment_min = c0 > 0 ? std::min(alignment_min, o.alignment_min) : o.alignment_min;
  }
  // Means weighted by what each side averaged over.
  auto mix = [](double a, int64_t na, double b, int64_t nb) {
    return na + nb > 0 ? (a * na + b * nb) / static_cast<double>(na + nb) : a;
  };
  latest_hit_rate = mix(latest_hit_rate, latest_entries, o.latest_hit_rate, o.latest_entries);
  latest_mean_residual = mix(latest_mean_residual, latest_with_residual, o.latest_mean_residual,
                             o.latest_with_residual);
  latest_update_error =
      mix(latest_update_error, latest_compared, o.latest_update_error, o.latest_compared);
  latest_alignment = latest_compared + o.latest_compared > 0
                         ? mix(latest_alignment, latest_compared, o.latest_alignment,
                               o.latest_compared)
                         : 1.0;
  latest_entries += o.latest_entries;
  latest_with_residual += o.latest_with_residual;
  latest_compared += o.latest_compared;
  per_matrix.insert(per_matrix.end(), o.per_matrix.begin(), o.per_matrix.end());
}

double cache_key(const OrthoConfig& r, int64_t m, int64_t n, DType qtype, CacheLayout layout) {
  uint64_t h = kFnvOffset;
  const int32_t ints[] = {static_cast<int32_t>(iteration_dtype(r)), static_cast<int32_t>(qtype),
                          static_cast<int32_t>(layout), r.steps};
  h = fnv1a(h, ints, sizeof(ints));
  h = fnv1a(h, &m, sizeof(m));
  h = fnv1a(h, &n, sizeof(n));
  for (const QuinticCoef& k : coefficient_schedule(r)) h = fnv1a(h, &k, sizeof(k));
  for (int i = 1; i < r.steps; ++i) {
    const char at = ortho_detail::restarts_at(r, i) ? 1 : 0;
    h = fnv1a(h, &at, 1);
  }
  const double norm[] = {norm_multiplier(r.coefficients), static_cast<double>(r.eps)};
  h = fnv1a(h, norm, sizeof(norm));
  return static_cast<double>((h >> 12) | 1ull);  // 52 bits, odd: exact in a double, never 0
}

// ---- Impl ---------------------------------------------------------------------------------------

void TransformCache::Impl::reset_device_stats() {
  be.copy_from_host(dstats.data(), stats_init.data(), stats_init.size() * sizeof(double));
  be.synchronize();  // stats_init must outlive the copy on every backend
}

void TransformCache::Impl::fold() {
  if (!prepared || count == 0 || !dirty) return;
  dirty = false;
  std::vector<double> dev(stats_init.size());
  be.synchronize();
  be.copy_to_host(dev.data(), dstats.data(), dev.size() * sizeof(double));
  for (int64_t i = 0; i < count; ++i) {
    const double* d = dev.data() + i * kCacheStatFields;
    flops_charged += d[kCacheStatTested] * test_flops + d[kCacheStatHits] * hit_flops +
                     d[kCacheStatRefreshes] * refresh_flops;
    merge_fields(acc.data() + i * kCacheStatFields, d);
  }
  reset_device_stats();
}

void TransformCache::Impl::charge(double test, double hit, double refresh) {
  if (test == test_flops && hit == hit_flops && refresh == refresh_flops) return;
  fold();  // the counters so far belong to the old constants
  test_flops = test;
  hit_flops = hit;
  refresh_flops = refresh;
}

// ---- TransformCache -----------------------------------------------------------------------------

TransformCache::TransformCache(Backend& backend, const CacheOptions& options)
    : impl_(std::make_unique<Impl>(backend, options)) {
  validate(options, "cache options");
  init_fields(impl_->retired.data());
}
TransformCache::~TransformCache() = default;

void TransformCache::set_options(const CacheOptions& o) {
  validate(o, "cache options");
  impl_->opt = o;
}
const CacheOptions& TransformCache::options() const { return impl_->opt; }
bool TransformCache::prepared() const { return impl_->prepared; }
int64_t TransformCache::count() const { return impl_->count; }
int64_t TransformCache::m() const { return impl_->m; }
int64_t TransformCache::n() const { return impl_->n; }
int TransformCache::segments() const { return impl_->segs; }
double TransformCache::key() const { return impl_->key; }

void TransformCache::prepare(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n) {
  Impl& s = *impl_;
  DM_CHECK(resolved.iteration == Iteration::kGram, "CacheMuon needs Gram NS, got ",
           algorithm_name(resolved), " for ", m, "x", n);
  DM_CHECK(count >= 0 && m >= 1 && m <= n, "cache: bad shape ", count, " x ", m, "x", n);
  const CacheLayout layout = s.opt.layout;
  const int segs = layout == CacheLayout::kProduct ? 1 : ortho_detail::gram_segments(resolved);
  const DType qtype = cache_storage_dtype(s.opt, resolved);
  const double key = cache_key(resolved, m, n, qtype, layout);
  const bool same_storage =
      s.prepared && s.count == count && s.m == m && s.segs == segs && s.qtype == qtype;
  if (!same_storage) {
    // Retire the old entries' statistics, then start from empty entries.
    s.fold();
    for (int64_t i = 0; i < s.count; ++i) {
      merge_fields(s.retired.data(), s.acc.data() + i * kCacheStatFields);
      s.sh_retired_sum += s.sh_sum[i];
      s.sh_retired_max = std::max(s.sh_retired_max, s.sh_max[i]);
      s.sh_retired_cos_sum += s.sh_cos_sum[i];
      s.sh_retired_cos_min = std::min(s.sh_retired_cos_min, s.sh_cos_min[i]);
      s.sh_retired_n += s.sh_n[i];
    }
    s.count = count;
    s.m = m;
    s.segs = segs;
    s.qtype = qtype;
    s.q = s.be.alloc(static_cast<size_t>(count) * s.q_bytes_per_entry());
    s.age = s.be.alloc(sizeof(float) * std::max<int64_t>(count, 1));
    s.keys = s.be.alloc(sizeof(double) * std::max<int64_t>(count, 1));
    s.misses = s.be.alloc(sizeof(float) * std::max<int64_t>(count, 1));
    s.dstats = s.be.alloc(sizeof(double) * kCacheStatFields * std::max<int64_t>(count, 1));
    if (s.q) s.be.fill_zero(s.q.data(), s.q.bytes());
    s.be.fill_zero(s.age.data(), s.age.bytes());
    s.be.fill_zero(s.keys.data(), s.keys.bytes());  // key 0: empty
    s.be.fill_zero(s.misses.data(), s.misses.bytes());
    s.stats_init.assign(static_cast<size_t>(std::max<int64_t>(count, 1)) * kCacheStatFields, 0.0);
    for (size_t i = 0; i < s.stats_init.size(); i += kCacheStatFields)
      init_fields(&s.stats_init[i]);
    s.acc = s.stats_init;
    s.acc.resize(static_cast<size_t>(count) * kCacheStatFields);
    s.sh_sum.assign(count, 0.0);
    s.sh_max.assign(count, 0.0);
    s.sh_cos_sum.assign(count, 0.0);
    s.sh_cos_min.assign(count, 1.0);
    s.sh_n.assign(count, 0);
    s.sh_last_err.assign(count, 0.0);
    s.sh_last_cos.assign(count, 1.0);
    s.sh_seen.assign(count, 0);
    s.prepared = true;
    s.reset_device_stats();
  }
  s.cfg = resolved;
  s.n = n;
  s.layout = layout;
  s.key = key;
}

void TransformCache::invalidate(int64_t first, int64_t n) {
  Impl& s = *impl_;
  if (!s.prepared) return;
  if (n < 0) n = s.count - first;
  DM_CHECK(first >= 0 && n >= 0 && first + n <= s.count, "cache: invalidate [", first, ", ",
           first + n, ") outside ", s.count, " entries");
  s.be.fill_zero(s.key_at(first), sizeof(double) * n);
}

std::vector<std::string> TransformCache::state_names() {
  return {"cache_q", "cache_age", "cache_key", "cache_misses"};
}

void TransformCache::check_state_name(const std::string& name) {
  const std::vector<std::string> names = state_names();
  if (std::find(names.begin(), names.end(), name) != names.end()) return;
  std::string expected;
  for (const std::string& n : names) expected += (expected.empty() ? "" : ", ") + n;
  DM_FAIL("no cache state '", name, "' (expected one of ", expected, ")");
}

TensorView TransformCache::state(const std::string& name, int64_t first, int64_t n,
                                 const std::vector<int64_t>& lead) {
  check_state_name(name);
  Impl& s = *impl_;
  DM_CHECK(s.prepared, "cache state '", name, "' read before the cache was prepared");
  DM_CHECK(first >= 0 && n >= 0 && first + n <= s.count, "cache state: entries [", first, ", ",
           first + n, ") outside ", s.count);
  int64_t lead_n = 1;
  for (int64_t d : lead) lead_n *= d;
  DM_CHECK(lead_n == n, "cache state: leading shape holds ", lead_n, " entries, not ", n);
  std::vector<int64_t> shape = lead;
  Device dev = s.be.device();
  if (name == "cache_q") {
    if (s.layout == CacheLayout::kFactors) shape.push_back(s.segs);
    shape.push_back(s.m);
    shape.push_back(s.m);
    void* p = static_cast<char*>(s.q.data()) + static_cast<size_t>(first) * s.q_bytes_per_entry();
    return TensorView::contiguous(p, shape, s.qtype, dev);
  }
  if (name == "cache_age") return TensorView::contiguous(s.age_at(first), shape, DType::kF32, dev);
  if (name == "cache_key") return TensorView::contiguous(s.key_at(first), shape, DType::kF64, dev);
  return TensorView::contiguous(s.misses_at(first), shape, DType::kF32, dev);  // cache_misses
}

size_t TransformCache::memory_bytes() const {
  const Impl& s = *impl_;
  if (!s.prepared) return 0;
  return s.q.bytes() + s.age.bytes() + s.keys.bytes() + s.misses.bytes() + s.dstats.bytes();
}

void TransformCache::reset_stats() {
  Impl& s = *impl_;
  s.fold();
  s.calls = s.matrices = 0;
  s.flops_fixed = s.flops_charged = s.flops_fresh = 0;
  init_fields(s.retired.data());
  for (size_t i = 0; i < s.acc.size(); i += kCacheStatFields) init_fields(&s.acc[i]);
  std::fill(s.sh_sum.begin(), s.sh_sum.end(), 0.0);
  std::fill(s.sh_max.begin(), s.sh_max.end(), 0.0);
  std::fill(s.sh_cos_sum.begin(), s.sh_cos_sum.end(), 0.0);
  std::fill(s.sh_cos_min.begin(), s.sh_cos_min.end(), 1.0);
  std::fill(s.sh_n.begin(), s.sh_n.end(), 0);
  s.sh_retired_sum = s.sh_retired_max = s.sh_retired_cos_sum = 0;
  s.sh_retired_cos_min = 1;
  s.sh_retired_n = 0;
  s.pr_min = kInf;
  s.pr_max = s.pr_sum = 0;
  s.pr_n = 0;
}

TransformCache::Ledger TransformCache::ledger() const {
  return {impl_->calls, impl_->matrices, impl_->flops_fixed, impl_->flops_fresh};
}

void TransformCache::add_replayed(const Ledger& captured) {
  impl_->calls += captured.calls;
  impl_->matrices += captured.matrices;
  impl_->flops_fixed += captured.flops_fixed;
  impl_->flops_fresh += captured.flops_fresh;
  impl_->dirty = impl_->dirty || captured.calls > 0;  // the device counters moved
}

CacheStats TransformCache::stats(const std::vector<std::string>& names) {
  Impl& s = *impl_;
  s.fold();
  CacheStats st;
  st.calls = s.calls;
  st.matrices = s.matrices;
  st.flops = s.flops_fixed + s.flops_charged;
  st.fresh_flops = s.flops_fresh;
  st.memory_bytes = memory_bytes();
  std::array<double, kCacheStatFields> total = s.retired;
  std::vector<float> ages(static_cast<size_t>(s.count));
  std::vector<double> keys(static_cast<size_t>(s.count));
  if (s.count) {
    s.be.copy_to_host(ages.data(), s.age.data(), ages.size() * sizeof(float));
    s.be.copy_to_host(keys.data(), s.keys.data(), keys.size() * sizeof(double));
  }
  double sh_sum = s.sh_retired_sum, sh_max = s.sh_retired_max;
  double cos_sum = s.sh_retired_cos_sum, cos_min = s.sh_retired_cos_min;
  int64_t sh_n = s.sh_retired_n;
  // Latest call per entry in use: a hit leaves age >= 1, a refresh age 0.
  int64_t in_use = 0, latest_hits = 0, with_residual = 0, with_shadow = 0;
  double latest_res = 0, latest_err = 0, latest_cos = 0;
  for (int64_t i = 0; i < s.count; ++i) {
    const double* f = s.acc.data() + i * kCacheStatFields;
    merge_fields(total.data(), f);
    sh_sum += s.sh_sum[i];
    sh_max = std::max(sh_max, s.sh_max[i]);
    cos_sum += s.sh_cos_sum[i];
    cos_min = std::min(cos_min, s.sh_cos_min[i]);
    sh_n += s.sh_n[i];
    if (keys[i] == s.key) {
      in_use += 1;
      latest_hits += ages[i] > 0 ? 1 : 0;
      if (f[kCacheStatChecks] > 0) {
        with_residual += 1;
        latest_res += f[kCacheStatResLast];
      }
      if (s.sh_seen[i] && ages[i] > 0) {  // its latest call was a hit, compared in shadow mode
        with_shadow += 1;
        latest_err += s.sh_last_err[i];
        latest_cos += s.sh_last_cos[i];
      }
    }
    if (!s.opt.per_matrix_stats) continue;
    CacheMatrixStats pm;
    pm.name = i < static_cast<int64_t>(names.size()) ? names[i]
                                                     : std::string("#").append(std::to_string(i));
    pm.hits = static_cast<int64_t>(f[kCacheStatHits]);
    pm.refreshes = static_cast<int64_t>(f[kCacheStatRefreshes]);
    pm.forced = static_cast<int64_t>(f[kCacheStatForced]);
    pm.skips = static_cast<int64_t>(f[kCacheStatSkips]);
    pm.unchecked = static_cast<int64_t>(f[kCacheStatUnchecked]);
    pm.batch = static_cast<int64_t>(f[kCacheStatBatch]);
    pm.age = ages[i];
    const double checks = f[kCacheStatChecks];
    pm.mean_residual = checks > 0 ? f[kCacheStatResSum] / checks : 0;
    pm.max_residual = checks > 0 ? f[kCacheStatResMax] : 0;
    pm.last_residual = checks > 0 ? f[kCacheStatResLast] : 0;
    pm.max_update_error = s.sh_max[i];
    st.per_matrix.push_back(pm);
  }
  st.hits = static_cast<int64_t>(total[kCacheStatHits]);
  st.refreshes = static_cast<int64_t>(total[kCacheStatRefreshes]);
  st.forced_refreshes = static_cast<int64_t>(total[kCacheStatForced]);
  st.skips = static_cast<int64_t>(total[kCacheStatSkips]);
  st.unchecked_refreshes = static_cast<int64_t>(total[kCacheStatUnchecked]);
  st.batch_refreshes = static_cast<int64_t>(total[kCacheStatBatch]);
  fill_summary(st.residual, total.data());
  st.compared = sh_n;
  st.update_error_mean = sh_n ? sh_sum / sh_n : 0;
  st.update_error_max = sh_max;
  st.alignment_mean = sh_n ? cos_sum / sh_n : 0;
  st.alignment_min = sh_n ? cos_min : 0;
  st.latest_entries = in_use;
  st.latest_with_residual = with_residual;
  st.latest_compared = with_shadow;
  st.latest_hit_rate = in_use ? static_cast<double>(latest_hits) / in_use : 0;
  st.latest_mean_residual = with_residual ? latest_res / with_residual : 0;
  st.latest_update_error = with_shadow ? latest_err / with_shadow : 0;
  st.latest_alignment = with_shadow ? latest_cos / with_shadow : 1;
  st.probe_compared = s.pr_n;
  st.probe_ratio_min = s.pr_n ? s.pr_min : 0;
  st.probe_ratio_max = s.pr_max;
  st.probe_ratio_mean = s.pr_n ? s.pr_sum / s.pr_n : 0;
  return st;
}

}  // namespace distmuon
