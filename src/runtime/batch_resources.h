// What a batch of Muon matrices needs to be orthogonalized, beyond its own buffers
// (engine_cache.cc): the algorithm of its shape (ShapeTuning), the Orthogonalizer, CacheMuon's
// entries and the scratch the distributed owner computation shares. Every path that
// orthogonalizes asks this part; the runners get it in their RunnerContext, not the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/cache.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"
#include "runtime/muon_batch.h"
#include "runtime/shape_tuning.h"

namespace distmuon {

// CacheMuon entries (distmuon/cache.h) of one group and one wide shape m x n: one entry per
// matrix this process orthogonalizes (single process: every member of a shape class; owner
// modes: the matrices this rank owns, kept beside their momentum; gather: every matrix, since
// every rank solves everything). The TransformCache allocates nothing until the cache is used.
struct CacheClass {
  int group = 0;
  int64_t m = 0, n = 0;
  std::vector<std::string> names;  // per entry ("param" or "param[slice]"), for statistics
  std::unique_ptr<TransformCache> cache;
  bool use = false;  // this step: the group enables the cache and m x n resolves to Gram NS
  int64_t count() const { return static_cast<int64_t>(names.size()); }
};

struct BatchResources {
  BatchResources(Backend& backend, const std::vector<GroupOptions>& groups,
                 const ShapeTuning& tuning, OrthoStats& stats)
      : backend(backend), groups(groups), tuning(tuning), stats(stats), ortho(backend) {}

  // The algorithm the group runs on a wide m x n shape (its tuned choice where there is one).
  OrthoConfig resolve_shape(int group, int64_t m, int64_t n) const {
    return tuning.resolve_shape(group, m, n);
  }
  // Before a batch of `count` m x n matrices is orthogonalized: binds the CacheMuon class
  // `cache` (-1: none) to its group's options, grows the shared workspace -- and, when x is not
  // null, the shared iteration buffer, returned in x -- and says how the batch is
  // orthogonalized: through the cache where this step uses it (matrix k on entry entries[k]),
  // else fresh (entries is then cleared).
  BatchOrtho prepare_batch(const OrthoConfig& resolved, int cache, std::vector<int64_t>& entries,
                           int64_t count, int64_t m, int64_t n, BatchRef* x);
  // The index of the cache class of (group, m, n), created on demand.
  int cache_class_of(int group, int64_t m, int64_t n);
  // Binds a cache class to its group's current options for the resolved config; returns whether
  // this step uses it and, if so, the workspace bytes run_cached needs for `count` matrices.
  bool prepare_cache(CacheClass& cc, const OrthoConfig& resolved, int64_t count,
                     size_t* workspace_bytes);
  // How a batch is orthogonalized: fresh, or through the cache class `cache` (-1: none, or
  // not used in this step) where matrix k uses entry entries[k].
  BatchOrtho batch_ortho(int cache, std::span<const int64_t> entries, void* workspace,
                         size_t workspace_bytes);
  // Grows the shared scratch for `count` matrices of a shape with a resolved config.
  void ensure_scratch(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n,
                      size_t workspace_bytes = 0);
  CacheStats cache_stats();

  Backend& backend;
  const std::vector<GroupOptions>& groups;  // the registry's
  const ShapeTuning& tuning;
  OrthoStats& stats;  // the engine's statistics, where every orthogonalization counts
  Orthogonalizer ortho;
  std::vector<CacheClass> caches;  // CacheMuon entries (single process and distributed)
  // Scratch of the owner computation, grown on demand and shared by all buckets (buckets
  // compute one after another).
  Buffer x, workspace;
  size_t x_bytes = 0, workspace_size = 0;
};

}  // namespace distmuon
