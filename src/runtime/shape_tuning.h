// The per-shape algorithms of an Engine (engine_tune.cc): the one place the runtime resolves a
// group's config for a wide m x n shape (the tuned choice of `auto`, else resolve()), which
// classes run grouped products, and the tuner's answers. Filled once the classes (single
// process) or the matrices (distributed) are known; every path that orthogonalizes asks it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine_types.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"

namespace distmuon {

// A class of matrices of one group and one wide shape m x n, with how many there are
// (distributed: on all ranks).
struct TuneShape {
  int group;
  int64_t m, n, count;
};

struct ShapeTuning {
  ShapeTuning(Backend& backend, const std::vector<GroupOptions>& groups)
      : backend(backend), groups(groups) {}

  // The algorithm group `group` runs on a wide m x n shape: the tuned choice when tune() found
  // one for the group's current config, else resolve().
  OrthoConfig resolve_shape(int group, int64_t m, int64_t n) const;
  // OrthoConfig::grouped_products for a class (DISTMUON_GROUPED_PRODUCTS; auto: the backend
  // groups this work dtype natively, m <= kGroupedMaxRows and count m^2 n <= kGroupedMaxWork,
  // i.e. one of the class's products is a few microseconds of the device's time: launch-bound).
  // DISTMUON_GROUPED_PRODUCTS is read once, where the classes are set up (tune), so that a bad
  // value fails before any step and a step never sees it change; distributed, it is part of
  // what every rank must agree on (dist_setup.cc).
  bool grouped_products(int group, int64_t m, int64_t n, DType work) const;
  // What `auto` resolves a class to when it shares its launches (grouped Gram NS, untimed), or
  // nothing when the group is not `auto` or the class is not grouped.
  std::optional<OrthoConfig> grouped_auto(int group, int64_t m, int64_t n) const;
  static std::string grouped_products_setting();  // "auto", "off" or "all"; throws otherwise
  static constexpr int64_t kGroupedMaxRows = 512;
  static constexpr double kGroupedMaxWork = 1 << 30;
  // Asks the backend's tuner for the `auto` classes among `shapes` (EngineOptions::autotune,
  // the environment, force_measure); `replay`: the engine's steps replay a captured graph, so
  // the tuner times graph replays. Distributed (world not null), rank 0 asks and every rank
  // takes its answers (collective), so every rank runs the same algorithm.
  void tune(const std::vector<TuneShape>& shapes, const EngineOptions& options, bool replay,
            Communicator* world);

  Backend& backend;
  const std::vector<GroupOptions>& groups;  // the registry's
  std::string grouped_setting = "auto";
  std::map<std::tuple<int, int64_t, int64_t>, int64_t> shape_counts;  // (group, m, n): count
  std::map<std::string, OrthoConfig> tuned;  // key: tuned_key() (engine_tune.cc)
  std::vector<TunedShape> report;            // the last tune()'s answers, shape by shape
  // Set by Engine::tune() around its tuning: measure what the store lacks whatever the mode.
  bool force_measure = false;
};

}  // namespace distmuon
