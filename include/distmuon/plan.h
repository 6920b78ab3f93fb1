// Planning: which rank owns (orthogonalizes) each Muon matrix, and how the matrices of one owner
// are batched. The planner is a pure function of (matrices, topology, costs): every rank computes
// the identical plan, and the runtime checks this with plan_hash() at start-up.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "distmuon/cost_table.h"
#include "distmuon/ortho.h"

namespace distmuon {

struct Workload;

// One Muon matrix as the planner sees it (in registration order).
struct PlanMatrix {
  std::string name;
  int64_t rows = 0, cols = 0;
  int64_t layer = -1;      // matrices of one layer are spread over owners when asked
  int64_t elem_bytes = 4;  // bytes per element of the state the owner keeps (momentum)
};

// World layout. In HSDP the world is replicate x shard; owner slots span all ranks.
struct Topology {
  int world_size = 1;
  int gpus_per_node = 8;
  int replicate = 1;  // HSDP replicate degree (world_size = replicate * shard)

  void validate() const;  // throws naming the bad value
  int shard() const { return world_size / replicate; }
  int nodes() const { return (world_size + gpus_per_node - 1) / gpus_per_node; }
  int node_of(int rank) const { return rank / gpus_per_node; }
  // The (replicate, shard) slot of an owner rank: rank = replicate_index * shard() + shard_index.
  std::pair<int, int> slot_of(int rank) const { return {rank / shard(), rank % shard()}; }
};

struct Plan {
  std::string solver;                                  // "milp", "lpt", "round-robin"
  std::vector<int> owner;                              // owner rank per matrix
  std::vector<std::vector<std::vector<int>>> batches;  // per owner: batches of same-shape matrices
  std::vector<double> owner_load;                      // predicted seconds per owner
  double makespan = 0;                                 // max owner load
  double solve_seconds = 0;
  uint64_t hash = 0;  // plan_hash(*this)

  // Added by the planner (not part of the hash).
  double imbalance = 0;                    // makespan / mean owner load (1 = perfect)
  std::vector<double> owner_comm_bytes;    // bytes of the matrices each owner receives and sends
  std::vector<double> owner_memory_bytes;  // state + largest batch's working memory per owner
  double lower_bound = 0;                  // proven lower bound on the makespan (MILP), else 0
  std::string status;       // "optimal", "time limit", "node limit", "heuristic", ...
  std::string formulation;  // how the MILP was posed: "patterns", "columns", "owners", or empty
  int64_t layer_collisions = 0;  // matrices sharing an owner with more of their layer than needed
  std::string costs;  // what the costs were (the engine's start-up plan), e.g. "analytic costs ..."
};

// A hash of the assignment and batching (not of timings), identical on every rank that computed
// the same plan.
uint64_t plan_hash(const Plan& plan);

// Round-robin over matrices in registration order, one batch per shape per owner: the simplest
// valid plan (and the planner's baseline). Loads in FLOPs of the default algorithm.
Plan plan_round_robin(const std::vector<PlanMatrix>& matrices, const Topology& topo);

// The matrices of a workload in model order (Workload::muon_tensors: layer by layer), named
// "<entry>.<index>", each with its tensor's layer. 3-D entries are stacks of matrices.
std::vector<PlanMatrix> plan_matrices(const Workload& workload, int64_t elem_bytes = 4);
// Distinct shapes (as given) with their counts, in first-seen order.
std::vector<ShapeCount> shape_counts(const std::vector<PlanMatrix>& matrices);

struct PlanOptions {
  double memory_cap_bytes = 0;  // per owner: state + working memory of its largest batch; 0: none
  bool spread_layers = true;    // matrices of one layer go to different owners where possible
  int64_t max_batch = 0;        // largest batch an owner runs at once (0: no limit)
  OrthoConfig ortho;            // the algorithm run (for workspace bytes)
  // Secondary objective: the busiest owner's bytes. The pattern models minimise it
  // lexicographically after the makespan whenever comm_weight > 0; the owner-indexed model adds
  // comm_weight * (max owner bytes / comm_bytes_per_s) seconds to the makespan. 0: ignored.
  double comm_weight = 1e-3;
  double comm_bytes_per_s = 50e9;
  int64_t comm_elem_bytes = 2;  // bytes per element on the wire (bf16 gradients and updates)
  // MILP limits. The node limits are deterministic; the time limit (CPU seconds of the planning
  // process, so that load on the machine does not change the plan) is a guard, and a plan
  // stopped by it may differ between machines (Plan::status then says "time limit").
  double time_limit_s = 4.0;
  int64_t max_nodes = 20000;
  double relative_gap = 5e-4;     // stop within this fraction of the best possible makespan
  int64_t pattern_limit = 20000;  // owner patterns enumerated before switching formulations
  int64_t max_binaries = 250000;  // larger owner-indexed models go straight to LPT
  bool symmetry_breaking = true;  // order owners by load in the owner-indexed model
  // "auto", or force one: "patterns" (all owner patterns enumerated), "columns" (patterns from
  // column generation), "owners" (owner-indexed). Forcing is for tests and comparisons.
  std::string formulation = "auto";
  int64_t seed = 7;  // CBC random seed (fixed: same inputs, same plan)
};

// Round-robin with loads from the cost table.
Plan plan_round_robin(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                      const CostTable& costs, const PlanOptions& opts = {});
// Longest processing time first: matrices by decreasing single cost, each to the owner whose
// load grows least (batching makes the marginal cost of a shape fall with the owner's count).
Plan plan_lpt(const std::vector<PlanMatrix>& matrices, const Topology& topo, const CostTable& costs,
              const PlanOptions& opts = {});
// Makespan-optimal assignment and batching as a MILP solved by COIN-OR CBC; returns the better
// of the MILP incumbent and LPT when the solver stops early or the instance is too large.
Plan plan_milp(const std::vector<PlanMatrix>& matrices, const Topology& topo,
               const CostTable& costs, const PlanOptions& opts = {});
// A plan whose owners were chosen elsewhere (planned earlier and passed along): batches, loads
// and hash from the cost table, exactly as the planners complete theirs. Throws when an owner is
// out of range or the counts differ.
Plan plan_fixed(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                const CostTable& costs, const std::vector<int>& owners,
                const PlanOptions& opts = {});
// Dispatches on "milp", "lpt" or "round-robin"; throws listing them for other names.
Plan make_plan(const std::string& solver, const std::vector<PlanMatrix>& matrices,
               const Topology& topo, const CostTable& costs, const PlanOptions& opts = {});

}  // namespace distmuon
