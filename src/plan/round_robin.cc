// The baseline plan and the plan hash.
#include <chrono>
#include <map>
#include <tuple>

#include "common/fnv.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "distmuon/plan.h"
#include "instance.h"

namespace distmuon {

uint64_t plan_hash(const Plan& plan) {
  // FNV-1a over the owner list and the batch structure: stable across runs and machines.
  uint64_t h = kFnvOffset;
  auto mix = [&](uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = (v >> (8 * i)) & 0xff;  // little-endian on every host
    h = fnv1a(h, b, sizeof b);
  };
  mix(plan.owner.size());
  for (int o : plan.owner) mix(static_cast<uint64_t>(o));
  for (const auto& owner_batches : plan.batches) {
    mix(owner_batches.size());
    for (const auto& b : owner_batches) {
      mix(b.size());
      for (int m : b) mix(static_cast<uint64_t>(m));
    }
  }
  return h;
}

Plan plan_round_robin(const std::vector<PlanMatrix>& matrices, const Topology& topo) {
  DM_CHECK(topo.world_size >= 1, "world size must be >= 1 (got ", topo.world_size, ")");
  Plan p;
  p.solver = "round-robin";
  p.owner.resize(matrices.size());
  p.batches.assign(topo.world_size, {});
  p.owner_load.assign(topo.world_size, 0.0);
  std::vector<std::map<std::pair<int64_t, int64_t>, size_t>> batch_of(topo.world_size);
  for (size_t i = 0; i < matrices.size(); ++i) {
    const int o = static_cast<int>(i % topo.world_size);
    p.owner[i] = o;
    auto key = std::make_pair(matrices[i].rows, matrices[i].cols);
    auto it = batch_of[o].find(key);
    if (it == batch_of[o].end()) {
      it = batch_of[o].emplace(key, p.batches[o].size()).first;
      p.batches[o].emplace_back();
    }
    p.batches[o][it->second].push_back(static_cast<int>(i));
    // Load in FLOPs of the default algorithm until a cost table is given.
    p.owner_load[o] += ortho_flops(OrthoConfig{}, matrices[i].rows, matrices[i].cols);
  }
  for (double l : p.owner_load) p.makespan = std::max(p.makespan, l);
  p.hash = plan_hash(p);
  return p;
}

Plan plan_round_robin(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                      const CostTable& costs, const PlanOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  plan_detail::Instance inst = plan_detail::build_instance(matrices, topo, costs, opts);
  Plan p;
  p.solver = "round-robin";
  p.status = "heuristic";
  p.owner.resize(matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) p.owner[i] = static_cast<int>(i % topo.world_size);
  plan_detail::finish(inst, p);
  if (opts.memory_cap_bytes > 0) {
    for (int o = 0; o < topo.world_size; ++o) {
      DM_CHECK(p.owner_memory_bytes[o] <= opts.memory_cap_bytes, "planner: round-robin puts ",
               p.owner_memory_bytes[o] / (1 << 20), " MiB on owner ", o,
               ", over the memory cap of ", opts.memory_cap_bytes / (1 << 20),
               " MiB (use lpt or milp)");
    }
  }
  p.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

Plan plan_fixed(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                const CostTable& costs, const std::vector<int>& owners, const PlanOptions& opts) {
  DM_CHECK(owners.size() == matrices.size(), "fixed owners: ", owners.size(), " owners for ",
           matrices.size(), " matrices");
  for (size_t i = 0; i < owners.size(); ++i)
    DM_CHECK(owners[i] >= 0 && owners[i] < topo.world_size, "fixed owners: matrix '",
             matrices[i].name, "' has owner ", owners[i], " outside a world of ", topo.world_size);
  const auto t0 = std::chrono::steady_clock::now();
  plan_detail::Instance inst = plan_detail::build_instance(matrices, topo, costs, opts);
  Plan p;
  p.solver = "fixed";
  p.status = "given";
  p.owner = owners;
  plan_detail::finish(inst, p);
  p.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

}  // namespace distmuon
