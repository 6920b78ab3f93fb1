// The measured cost table: times the Orthogonalizer on the active backend for batches of k
// same-shape matrices, and keeps the results in a cache file keyed by device and version.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "distmuon/cost_table.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

using Wide = std::pair<int64_t, int64_t>;

// Total count per wide shape: both orientations run in the same batches.
std::map<Wide, int64_t> wide_counts(const std::vector<ShapeCount>& shapes) {
  std::map<Wide, int64_t> out;
  for (const ShapeCount& s : shapes) {
    DM_CHECK(s.rows >= 1 && s.cols >= 1 && s.count >= 1, "profiler: bad shape ", s.rows, "x",
             s.cols, " (count ", s.count, ")");
    out[{std::min(s.rows, s.cols), std::max(s.rows, s.cols)}] += s.count;
  }
  return out;
}

// The batch sizes to time for a shape with `count` matrices: the requested ones up to count,
// and count itself when it falls between them (the largest batch the plan can ask for).
std::vector<int64_t> wanted_ks(int64_t count, const std::vector<int64_t>& ks) {
  std::set<int64_t> out;
  for (int64_t k : ks) {
    DM_CHECK(k >= 1, "profiler: batch sizes must be >= 1 (got ", k, ")");
    out.insert(std::min(k, count));
  }
  return {out.begin(), out.end()};
}

bool has_point(const ShapeCost* sc, int64_t k) {
  if (!sc) return false;
  return std::any_of(sc->points.begin(), sc->points.end(),
                     [&](const CostPoint& p) { return p.k == k; });
}

CostTable empty_table(Backend& be, const OrthoConfig& cfg) {
  CostTable t;
  t.source = "measured";
  t.device = be.name();
  t.version = DISTMUON_VERSION;
  t.algorithm = algorithm_name(cfg);
  t.work_dtype = dtype_name(cfg.work_dtype);
  return t;
}

// Median seconds of one orthogonalization of k random m x n matrices.
double time_batch(Backend& be, const OrthoConfig& cfg, int64_t m, int64_t n, int64_t k,
                  const ProfileOptions& opts) {
  const OrthoConfig r = resolve(cfg, m, n);
  const DType t = iteration_dtype(r);
  const size_t elems = static_cast<size_t>(k * m * n);
  std::vector<float> host(elems);
  std::mt19937_64 rng(opts.seed + static_cast<uint64_t>(m * 1000003 + n * 101 + k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : host) v = normal(rng);
  Buffer src = be.alloc(elems * sizeof(float));
  Buffer x = be.alloc(elems * dtype_size(t));
  Buffer norms = be.alloc(sizeof(double) * k);
  const size_t ws_bytes = Orthogonalizer::workspace_bytes(r, k, m, n);
  Buffer ws = be.alloc(std::max<size_t>(ws_bytes, 1));
  be.copy_from_host(src.data(), host.data(), elems * sizeof(float));
  const BatchRef u = BatchRef::packed(src.data(), DType::kF32, k, m, n);
  const BatchRef xb = BatchRef::packed(x.data(), t, k, m, n);
  be.frob_norm(u, norms.as<double>());
  Orthogonalizer ortho(be);
  std::vector<double> times;
  for (int rep = 0; rep < opts.warmup + opts.reps; ++rep) {
    // The iteration overwrites its input: restore a fresh normalised batch, untimed.
    be.scale_copy(u, false,
                  ScaleSpec{norms.as<double>(), norm_multiplier(r.coefficients), r.eps, 1.0}, xb);
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    ortho.run(r, xb, xb, ws.data(), ws_bytes);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep >= opts.warmup) times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

CostTable measure_cost_table(Backend& be, const std::vector<ShapeCount>& shapes,
                             const OrthoConfig& cfg, const ProfileOptions& opts,
                             const CostTable* reuse) {
  DM_CHECK(opts.reps >= 1 && opts.warmup >= 0, "profiler: need reps >= 1 and warmup >= 0 (got ",
           opts.reps, ", ", opts.warmup, ")");
  CostTable table = reuse ? *reuse : empty_table(be, cfg);
  std::vector<std::pair<Wide, int64_t>> todo;
  for (const auto& [shape, count] : wide_counts(shapes))
    for (int64_t k : wanted_ks(count, opts.ks))
      if (!has_point(table.find(shape.first, shape.second), k)) todo.push_back({shape, k});

  std::map<Wide, std::vector<CostPoint>> fresh;
  for (size_t i = 0; i < todo.size(); ++i) {
    const auto& [shape, k] = todo[i];
    const double s = time_batch(be, cfg, shape.first, shape.second, k, opts);
    fresh[shape].push_back({k, s});
    if (opts.progress) {
      std::fprintf(stderr, "  profiling [%zu/%zu] %s %lldx%lld k=%lld: %.3f ms (%.3f ms/matrix)\n",
                   i + 1, todo.size(), algorithm_name(cfg).c_str(),
                   static_cast<long long>(shape.first), static_cast<long long>(shape.second),
                   static_cast<long long>(k), s * 1e3, s * 1e3 / static_cast<double>(k));
    }
  }
  for (auto& [shape, pts] : fresh) {
    if (const ShapeCost* old = table.find(shape.first, shape.second))
      pts.insert(pts.end(), old->points.begin(), old->points.end());
    table.set(shape.first, shape.second, std::move(pts));
  }
  return table;
}

CachedCosts cached_cost_table(Backend& be, const std::vector<ShapeCount>& shapes,
                              const OrthoConfig& cfg, const ProfileOptions& opts,
                              const std::string& cache_path) {
  CachedCosts out;
  out.path = cache_path.empty() ? default_cost_cache_path() : cache_path;
  std::vector<CostTable> tables;
  if (std::filesystem::exists(out.path)) tables = read_cost_file(out.path);
  const CostTable want = empty_table(be, cfg);
  const CostTable* cached = nullptr;
  for (const CostTable& t : tables)
    if (t.same_key(want)) cached = &t;

  for (const auto& [shape, count] : wide_counts(shapes)) {
    const ShapeCost* sc = cached ? cached->find(shape.first, shape.second) : nullptr;
    bool all = true;
    for (int64_t k : wanted_ks(count, opts.ks)) all = all && has_point(sc, k);
    (all ? out.shapes_reused : out.shapes_measured) += 1;
  }
  out.table = measure_cost_table(be, shapes, cfg, opts, cached);
  if (out.shapes_measured > 0) {
    std::vector<CostTable> merged;
    for (const CostTable& t : tables)
      if (!t.same_key(want)) merged.push_back(t);
    merged.push_back(out.table);
    write_cost_file(out.path, merged);
  }
  return out;
}

}  // namespace distmuon
