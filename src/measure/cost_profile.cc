// The planner's measured cost table: the Orthogonalizer timed on the active backend
// (time_ortho.h) for batches of k same-shape matrices, kept in the measurement store under the
// device name and library version.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "measure/store.h"
#include "measure/time_ortho.h"

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

// Median seconds of one orthogonalization of k random m x n matrices.
double time_batch(Backend& be, const OrthoConfig& cfg, int64_t m, int64_t n, int64_t k,
                  const ProfileOptions& opts) {
  const uint64_t seed = opts.seed + static_cast<uint64_t>(m * 1000003 + n * 101 + k);
  const measure::OrthoInput input = measure::make_ortho_input(be, m, n, k, cfg, seed);
  return measure::time_orthogonalizer(be, cfg, input.batch, {opts.warmup, opts.reps}) * 1e-3;
}

}  // namespace

CostTable measure_cost_table(Backend& be, const std::vector<ShapeCount>& shapes,
                             const OrthoConfig& cfg, const ProfileOptions& opts,
                             const CostTable* reuse) {
  DM_CHECK(opts.reps >= 1 && opts.warmup >= 0, "profiler: need reps >= 1 and warmup >= 0 (got ",
           opts.reps, ", ", opts.warmup, ")");
  CostTable table = reuse ? *reuse : CostTable::empty("measured", be.name(), cfg);
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
  out.path = cache_path.empty() ? measure::store_path() : cache_path;
  const CostTable want = CostTable::empty("measured", be.name(), cfg);
  const std::vector<CostTable> tables = measure::read_store(out.path).tables;
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
    measure::update_store(out.path, [&](measure::StoreContents& s) {
      std::erase_if(s.tables, [&](const CostTable& t) { return t.same_key(want); });
      s.tables.push_back(out.table);
    });
  }
  return out;
}

}  // namespace distmuon
