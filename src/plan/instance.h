// The planner's internal view of a problem: identical matrices aggregated into shape classes,
// each with the best load of k of its matrices on one owner (batching included), and the
// conversion of per-owner counts back into a concrete, canonical Plan. Every solver (LPT, MILP)
// works on counts per (owner, class), never on individual matrices: that removes the symmetry
// between identical matrices, and realise() makes the result independent of the owner order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/plan.h"

namespace distmuon::plan_detail {

// Matrices that are interchangeable for the planner: same wide shape and state element size.
struct ShapeClass {
  int64_t m = 0, n = 0, elem_bytes = 4;
  std::vector<int> members;  // matrix indices in registration order
  // Indexed by k = 0..count: the cheapest way to run k members on one owner (split into batches
  // of at most max_batch), its first batch size, and the working memory of its largest batch.
  std::vector<double> load;  // seconds
  std::vector<int> first_batch;
  std::vector<double> work_bytes;
  double comm_bytes = 0;   // per matrix: what the owner receives (gradient) and sends (update)
  double state_bytes = 0;  // per matrix: momentum kept by the owner
  int count() const { return static_cast<int>(members.size()); }
  std::string shape() const;  // "m x n"
};

// counts[o][s]: how many matrices of class s owner o runs.
using Counts = std::vector<std::vector<int>>;

struct Instance {
  const std::vector<PlanMatrix>* matrices = nullptr;
  Topology topo;
  PlanOptions opts;
  std::vector<ShapeClass> classes;  // by decreasing single-matrix cost, then shape
  std::vector<int> class_of;        // per matrix

  int owners() const { return topo.world_size; }
  double load(const std::vector<int>& c) const;
  double comm(const std::vector<int>& c) const;
  double memory(const std::vector<int>& c) const;
  bool fits(const std::vector<int>& c) const;  // within the memory cap (always without one)
  double makespan(const Counts& counts) const;
  // max(everything batched per class / owners, the most expensive single matrix).
  double trivial_lower_bound() const;
};

// Validates the inputs (empty list, world size, shapes missing from the table, a matrix that
// exceeds the memory cap on its own) and builds the classes.
Instance build_instance(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                        const CostTable& costs, const PlanOptions& opts);

// Turns counts into a Plan: owners sorted canonically (so solutions that differ only by a
// permutation of owners give the same plan), placed on ranks so that each node carries a similar
// share of bytes, concrete matrices chosen to spread layers, batches split as the class says.
Plan realise(const Instance& inst, Counts counts, const std::string& solver);
// Fills batches, loads, bytes, imbalance, collisions and hash of a plan whose owners are set.
void finish(const Instance& inst, Plan& plan);

// LPT on counts (plan_lpt without realise). Throws naming the matrix that fits nowhere under the
// memory cap.
Counts lpt_counts(const Instance& inst);

}  // namespace distmuon::plan_detail
