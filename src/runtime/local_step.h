// The single-process step's own state (local_step.cc, step_graph.cc): the shape classes, each
// one batch per step with its persistent iteration buffer and workspace, and the whole-step
// graph (EngineOptions::graphs) with the key it was captured under.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/cache.h"
#include "distmuon/engine_types.h"
#include "distmuon/ortho.h"
#include "runtime/batch_resources.h"
#include "runtime/registry.h"

namespace distmuon {

// Muon matrices of one group and one wide shape m x n (single process), tall and wide weights
// together: their orthogonalization runs as one batch in the wide orientation, and the fused
// momentum and update passes run once per orientation on the two slices of that batch (the wide
// members come first).
struct ShapeClass {
  int group = 0;
  int64_t m = 0, n = 0;
  std::vector<std::pair<int, int64_t>> members;  // (param index, slice within a 3D parameter)
  int64_t wide_members = 0;                      // members [0, wide_members) are not tall
  OrthoConfig resolved;
  Buffer x, workspace;
  size_t workspace_bytes = 0;
  int cache = -1;  // its entries in BatchResources::caches (entry k = member k)
};

// A captured step (step_graph.cc).
struct StepGraph {
  std::vector<uint64_t> key;                  // of the last step issued eagerly or captured
  std::unique_ptr<BackendGraph> exec;         // captured under `key`
  OrthoStats ortho;                           // what the captured step added to stats.ortho
  std::vector<TransformCache::Ledger> cache;  // ... and to each cache class's ledger
  int failures = 0;                           // captures that failed
};

struct LocalStep {
  std::vector<ShapeClass> classes;  // built at the first step (Engine::Impl::build_classes)
  bool graph_mode = false;          // EngineOptions::graphs or DISTMUON_GRAPHS, read once
  StepGraph graph;
  static constexpr int kMaxCaptureFailures = 3;
  static bool graphs_enabled(const EngineOptions& options);
  // What a captured step depends on: the gradient and weight addresses, the classes' buffers and
  // resolved algorithms, nesterov, CacheMuon's gate options, the backend's capture epoch.
  std::vector<uint64_t> key(Backend& backend, const Registry& registry,
                            const std::vector<CacheClass>& caches,
                            std::span<const ParamData> data) const;
};

}  // namespace distmuon
