// Planning: which rank owns (orthogonalizes) each Muon matrix, and how the matrices of one owner
// are batched. The planner is a pure function of (matrices, topology, costs): every rank computes
// the identical plan, and the runtime checks this with plan_hash() at start-up.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace distmuon {

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
};

struct Plan {
  std::string solver;                          // "milp", "lpt", "round-robin"
  std::vector<int> owner;                      // owner rank per matrix
  std::vector<std::vector<std::vector<int>>> batches;  // per owner: batches of same-shape matrices
  std::vector<double> owner_load;              // predicted seconds per owner
  double makespan = 0;                         // max owner load
  double solve_seconds = 0;
  uint64_t hash = 0;                           // plan_hash(*this)
};

// A hash of the assignment and batching (not of timings), identical on every rank that computed
// the same plan.
uint64_t plan_hash(const Plan& plan);

// Round-robin over matrices in registration order, one batch per shape per owner: the simplest
// valid plan (and the planner's baseline).
Plan plan_round_robin(const std::vector<PlanMatrix>& matrices, const Topology& topo);

}  // namespace distmuon
