// CacheMuon inside the engine (docs/algorithms.md section 5): which process keeps which transform
// cache entries, the orthogonalization through them, their checkpoint views and statistics.
//
// An entry lives where its matrix is orthogonalized, as momentum does: in a single process
// every matrix has one; in the owner modes (replicated, sharded, dedicated) only the owner
// holds the entries of the matrices it owns and decides per matrix on its own device, so nothing
// about the cache is ever exchanged; in gather mode every rank solves every matrix from the same
// all-gathered input, so every rank keeps every entry and reaches the same decisions (bit-equal
// inputs give bit-equal residuals).
#include <algorithm>

#include "distmuon/error.h"
#include "ortho/iteration.h"
#include "runtime/engine_impl.h"

namespace distmuon {

int BatchResources::cache_class_of(int group, int64_t m, int64_t n) {
  for (size_t i = 0; i < caches.size(); ++i)
    if (caches[i].group == group && caches[i].m == m && caches[i].n == n)
      return static_cast<int>(i);
  CacheClass cc;
  cc.group = group;
  cc.m = m;
  cc.n = n;
  caches.push_back(std::move(cc));
  return static_cast<int>(caches.size()) - 1;
}

bool BatchResources::prepare_cache(CacheClass& cc, const OrthoConfig& resolved, int64_t count,
                                   size_t* workspace_bytes) {
  // The options may change between steps; prepare() keeps the entries unless the shape, dtype
  // or algorithm changed (then their key no longer matches and they refresh).
  const CacheOptions& co = groups[cc.group].muon.cache;
  cc.use = co.enabled && resolved.iteration == Iteration::kGram && cc.count() > 0;
  if (!cc.use) return false;
  if (!cc.cache) cc.cache = std::make_unique<TransformCache>(backend, co);
  cc.cache->set_options(co);
  cc.cache->prepare(resolved, cc.count(), cc.m, cc.n);
  if (workspace_bytes)
    *workspace_bytes = Orthogonalizer::cached_workspace_bytes(resolved, co, count, cc.m, cc.n);
  return true;
}

BatchOrtho BatchResources::batch_ortho(int cache, std::span<const int64_t> entries, void* workspace,
                                       size_t workspace_bytes) {
  const bool cached = cache >= 0 && caches[cache].use;
  return {&ortho,
          &stats,
          cached ? caches[cache].cache.get() : nullptr,
          cached ? entries : std::span<const int64_t>{},
          workspace,
          workspace_bytes};
}

BatchOrtho BatchResources::prepare_batch(const OrthoConfig& resolved, int cache,
                                         std::vector<int64_t>& entries, int64_t count, int64_t m,
                                         int64_t n, BatchRef* x) {
  size_t cached_workspace = 0;
  const bool cached =
      cache >= 0 && prepare_cache(caches[cache], resolved, count, &cached_workspace);
  if (!cached) entries.clear();
  ensure_scratch(
      resolved, x ? count : 0, m, n,
      std::max(cached_workspace, Orthogonalizer::workspace_bytes(resolved, count, m, n)));
  if (x) *x = BatchRef::packed(this->x.data(), iteration_dtype(resolved), count, m, n);
  return batch_ortho(cached ? cache : -1, entries, workspace.data(), workspace_size);
}

void BatchResources::ensure_scratch(const OrthoConfig& resolved, int64_t count, int64_t m,
                                    int64_t n, size_t workspace_bytes) {
  const size_t xb = static_cast<size_t>(count * m * n) * dtype_size(iteration_dtype(resolved));
  if (xb > x_bytes) {
    x = backend.alloc(xb);
    x_bytes = xb;
  }
  const size_t wb =
      std::max(workspace_bytes, Orthogonalizer::workspace_bytes(resolved, count, m, n));
  if (wb > workspace_size) {
    workspace = backend.alloc(wb);
    workspace_size = wb;
  }
}

void Engine::Impl::assign_cache_entries() {
  resources.caches.clear();
  // Bucket order, and inside a bucket the sorted order of its runs: the matrices of a run get
  // consecutive entries, so a run is one cached call whenever all of them step.
  for (const Bucket& b : dist.buckets)
    for (int j : b.mats) {
      DistMatrix& m = dist.mats[j];
      if (dist.options.mode != DistMode::kGather && m.owner != dist.rank) continue;
      m.cache = resources.cache_class_of(m.group, m.m(), m.n());
      m.cache_entry = resources.caches[m.cache].count();
      resources.caches[m.cache].names.push_back(matrix_name(j));
    }
}

std::pair<int, int64_t> Engine::Impl::cache_entry_of(int i, int64_t slice) {
  const Param& p = registry.params[i];
  if (!dist.world) {
    if (!built) build_classes();  // freezes the parameter list, as a first step does
    const ShapeClass& c = local.classes[p.cls];
    return {c.cache, p.first_member + slice};
  }
  DM_CHECK(built, "distributed state exists after setup()");
  const DistMatrix& m = dist.mats[p.matrices[slice]];
  return {m.cache, m.cache_entry};
}

CacheStats BatchResources::cache_stats() {
  CacheStats total;
  for (CacheClass& cc : caches) {
    if (!cc.cache) continue;
    CacheStats s = cc.cache->stats(cc.names);
    if (!groups[cc.group].muon.cache.enabled) {
      // The group has turned the cache off: its entries have no latest call under the current
      // configuration (they kept reporting the last one before), only their history.
      s.latest_entries = s.latest_with_residual = s.latest_compared = 0;
      s.latest_hit_rate = s.latest_mean_residual = s.latest_update_error = 0;
      s.latest_alignment = 1;
    }
    total.merge(s);
  }
  return total;
}

namespace {

bool caches_shape(const Engine::Impl& e, int group, const MatrixLayout& l) {
  if (!e.registry.groups[group].muon.cache.enabled) return false;
  const int64_t m = std::min(l.rows, l.cols), n = std::max(l.rows, l.cols);
  return e.tuning.resolve_shape(group, m, n).iteration == Iteration::kGram;
}

}  // namespace

// The cache state `name` of matrices [slice, slice + count) of Muon parameter i, with leading
// shape `lead`. A rank that does not hold the entries (owner modes, not the owner) gets a view
// with the right shape and dtype and data == nullptr, as for momentum.
TensorView Engine::Impl::cache_view(int i, int64_t slice, int64_t count, const std::string& name,
                                    const std::vector<int64_t>& lead) {
  const Param& p = registry.params[i];
  const GroupOptions& g = registry.groups[p.spec.group];
  DM_CHECK(caches_shape(*this, p.spec.group, p.layout), "parameter '", p.spec.name,
           "' has no CacheMuon state (cache off or ", p.layout.rows, "x", p.layout.cols,
           " is not orthogonalized with Gram NS)");
  auto [c, first] = cache_entry_of(i, slice);
  for (int64_t k = 1; k < count; ++k) {
    auto [ck, ek] = cache_entry_of(i, slice + k);
    DM_CHECK(ck == c && (c < 0 || ek == first + k), "parameter '", p.spec.name,
             "': its matrices' cache entries are not held together on rank ", dist.rank,
             "; read them per matrix with matrix_state()");
  }
  if (c >= 0) {
    const OrthoConfig r =
        tuning.resolve_shape(p.spec.group, resources.caches[c].m, resources.caches[c].n);
    DM_CHECK(resources.prepare_cache(resources.caches[c], r, 0, nullptr),
             "internal: cache class not usable");
    return resources.caches[c].cache->state(name, first, count, lead);
  }
  std::vector<int64_t> shape = lead;
  DType t = name == "cache_key" ? DType::kF64 : DType::kF32;
  if (name == "cache_q") {
    const int64_t m = std::min(p.layout.rows, p.layout.cols);
    const OrthoConfig r =
        tuning.resolve_shape(p.spec.group, m, std::max(p.layout.rows, p.layout.cols));
    if (g.muon.cache.layout == CacheLayout::kFactors)
      shape.push_back(ortho_detail::gram_segments(r));
    shape.push_back(m);
    shape.push_back(m);
    t = cache_storage_dtype(g.muon.cache, r);
  } else {
    TransformCache::check_state_name(name);
  }
  return TensorView{nullptr, shape, {}, t, backend.device()};
}

std::vector<std::string> Engine::Impl::muon_state_names(int i) const {
  const Param& p = registry.params[i];
  std::vector<std::string> names = {"momentum_buffer"};
  if (caches_shape(*this, p.spec.group, p.layout))
    for (const std::string& n : TransformCache::state_names()) names.push_back(n);
  return names;
}

}  // namespace distmuon
