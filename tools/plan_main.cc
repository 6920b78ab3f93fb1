// distmuon-plan: owner assignment of a workload's Muon matrices for a world size, from analytic,
// measured or stored costs; compares solvers side by side and predicts the optimizer step time
// of the distributed modes from 1 to 1024 GPUs (--simulate).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli.h"
#include "distmuon/backend.h"
#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "distmuon/plan.h"
#include "distmuon/simulate.h"
#include "distmuon/workload.h"
#include "plan/runtime_plan.h"
#include "plan_options.h"

namespace distmuon::plan_tool {
namespace {

std::string hex(uint64_t h) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

CostTable load_costs(const PlanArgs& a, const std::vector<PlanMatrix>& mats, OrthoConfig& cfg) {
  const std::string& wd = a.work_dtype;
  if (!a.costs.empty()) {
    CostTable t = select_cost_table(read_cost_file(a.costs), a.device, a.costs);
    cfg = parse_algorithm(t.algorithm);
    cfg.work_dtype = parse_dtype(t.work_dtype);
    return t;
  }
  cfg = parse_algorithm(a.algo);
  if (a.measure) {
    auto be = make_backend(a.backend);
    cfg.work_dtype = parse_dtype(wd != "auto" ? wd : a.backend == "cuda" ? "bf16" : "f32");
    ProfileOptions po;
    po.ks = a.profile_ks;
    po.reps = a.profile_reps;
    std::fprintf(stderr, "distmuon-plan: costs of %s on %s\n", algorithm_name(cfg).c_str(),
                 be->name().c_str());
    CachedCosts c = cached_cost_table(*be, shape_counts(mats), cfg, po, a.cache);
    std::fprintf(stderr, "distmuon-plan: cost cache %s: %d shapes reused, %d measured\n",
                 c.path.c_str(), c.shapes_reused, c.shapes_measured);
    return c.table;
  }
  cfg.work_dtype = parse_dtype(wd == "auto" ? "bf16" : wd);
  AnalyticRates r;
  r.flops_per_s = a.tflops * 1e12;
  r.bytes_per_s = a.hbm_tbs * 1e12;
  r.launch_s = a.launch_us * 1e-6;
  return analytic_cost_table(shape_counts(mats), cfg, r);
}

nlohmann::json plan_json(const Plan& p) {
  double max_comm = 0;
  for (double b : p.owner_comm_bytes) max_comm = std::max(max_comm, b);
  return {{"solver", p.solver},
          {"makespan", p.makespan},
          {"imbalance", p.imbalance},
          {"solve_seconds", p.solve_seconds},
          {"owner_loads", p.owner_load},
          {"hash", hex(p.hash)},
          {"status", p.status},
          {"formulation", p.formulation},
          {"lower_bound", p.lower_bound},
          {"max_owner_comm_bytes", max_comm},
          {"layer_collisions", p.layer_collisions}};
}

int run(const PlanArgs& a) {
  Workload w = load_workload(a.workload);
  if (a.layers > 0) w = w.first_layers(a.layers);
  const std::vector<PlanMatrix> mats = plan_matrices(w, a.state_bytes);
  Topology topo;
  topo.world_size = a.world_size;
  topo.gpus_per_node = a.gpus_per_node;
  topo.replicate = a.replicate;
  topo.validate();
  const std::vector<std::string>& solvers = a.solvers;

  PlanOptions opts;
  const CostTable costs =
      scale_costs(load_costs(a, mats, opts.ortho), a.costs_scale, a.costs_parts);
  opts.time_limit_s = a.time_limit;
  opts.max_nodes = a.max_nodes;
  opts.relative_gap = a.gap;
  opts.comm_weight = a.comm_weight;
  opts.memory_cap_bytes = a.memory_cap_gib * 1024.0 * 1024.0 * 1024.0;
  opts.max_batch = a.max_batch;
  opts.spread_layers = !a.no_spread;
  opts.symmetry_breaking = !a.no_symmetry_breaking;
  opts.formulation = a.formulation;

  std::printf("%s: %zu Muon matrices, %zu shapes; world %d (%d node%s x %d GPUs, replicate %d)\n",
              w.name.c_str(), mats.size(), costs.shapes().size(), topo.world_size, topo.nodes(),
              topo.nodes() == 1 ? "" : "s", std::min(topo.world_size, topo.gpus_per_node),
              topo.replicate);
  std::printf("costs: %s\n\n", costs.describe().c_str());
  const int64_t owner_slots = topo.world_size;  // owner slots span every rank
  if (owner_slots > static_cast<int64_t>(mats.size())) {
    std::fflush(stdout);  // after the header in a shared log
    std::fprintf(stderr,
                 "distmuon-plan: warning: %lld owner slots for %zu matrices: at least %lld own "
                 "nothing (and the planners' work grows with the slots)\n",
                 static_cast<long long>(owner_slots), mats.size(),
                 static_cast<long long>(owner_slots - static_cast<int64_t>(mats.size())));
  }
  std::vector<Plan> plans;
  for (const std::string& s : solvers) plans.push_back(make_plan(s, mats, topo, costs, opts));
  std::printf("%-12s %12s %10s %10s %12s %9s %11s  %-16s %s\n", "solver", "makespan ms", "mean ms",
              "imbalance", "max comm MB", "solve s", "collisions", "hash", "status");
  for (const Plan& p : plans) {
    double mean = 0, comm = 0;
    for (double l : p.owner_load) mean += l / p.owner_load.size();
    for (double b : p.owner_comm_bytes) comm = std::max(comm, b);
    std::printf("%-12s %12.4f %10.4f %10.4f %12.1f %9.3f %11lld  %-16s %s%s%s\n", p.solver.c_str(),
                p.makespan * 1e3, mean * 1e3, p.imbalance, comm / 1e6, p.solve_seconds,
                static_cast<long long>(p.layer_collisions), hex(p.hash).c_str(), p.status.c_str(),
                p.formulation.empty() ? "" : ", ", p.formulation.c_str());
  }
  if (a.owners) {
    for (const Plan& p : plans) {
      std::printf("\n%s owner loads (ms):", p.solver.c_str());
      for (size_t o = 0; o < p.owner_load.size(); ++o)
        std::printf("%s%8.3f", o % 8 == 0 ? "\n " : " ", p.owner_load[o] * 1e3);
      std::printf("\n");
    }
  }

  nlohmann::json j;
  j["workload"] = w.name;
  j["matrices"] = mats.size();
  j["world_size"] = topo.world_size;
  j["gpus_per_node"] = topo.gpus_per_node;
  j["replicate"] = topo.replicate;
  j["costs"] = {{"source", costs.source},
                {"device", costs.device},
                {"version", costs.version},
                {"algorithm", costs.algorithm},
                {"work_dtype", costs.work_dtype}};
  j["solvers"] = nlohmann::json::array();
  for (const Plan& p : plans) j["solvers"].push_back(plan_json(p));

  if (a.simulate) {
    CommModel cm;
    cm.intra_bytes_per_s = a.intra_gbs * 1e9;
    cm.inter_bytes_per_s = a.inter_gbs * 1e9;
    cm.intra_latency_s = a.intra_us * 1e-6;
    cm.inter_latency_s = a.inter_us * 1e-6;
    cm.wire_elem_bytes = a.wire_bytes;
    cm.elementwise_bytes = a.elementwise_bytes;
    cm.hbm_bytes_per_s = a.hbm_tbs * 1e12;
    cm.intra_reduce_bytes_per_s = a.intra_reduce_gbs * 1e9;
    cm.intra_broadcast_bytes_per_s = a.intra_broadcast_gbs * 1e9;
    cm.intra_root_reduce_bytes_per_s = a.intra_root_reduce_gbs * 1e9;
    cm.intra_alltoall_bytes_per_s = a.intra_alltoall_gbs * 1e9;
    cm.adamw_bytes_per_s = a.adamw_tbs * 1e12;
    cm.collective_latency_s = a.collective_latency_us * 1e-6;
    cm.local_collective_s = a.local_collective_us * 1e-6;
    cm.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
    cm.comm_compute_share = a.comm_compute_share;
    cm.comm_wait_share = a.comm_wait_share;
    cm.grouped_hop_share = a.grouped_hop_share;
    cm.batches_across_buckets = !a.batches_per_bucket;
    cm.uniform_all_to_all = a.uniform_all_to_all;
    const std::string solver = a.sim_solver.empty() ? solvers.front() : a.sim_solver;
    std::vector<int> worlds;
    for (int d = 1; d <= a.sim_max_world; d *= 2) worlds.push_back(d);
    std::printf("\nsimulated optimizer step (%s plans, %d GPUs per node, costs: %s)\n%s\n\n",
                solver.c_str(), topo.gpus_per_node, costs.source.c_str(), cm.describe().c_str());
    // The costs an engine without a cost table plans with, on the costs' device kind.
    std::optional<CostTable> plan_costs;
    if (a.sim_plan_analytic) {
      const DeviceKind kind =
          costs.device.rfind("cpu", 0) == 0 ? DeviceKind::kCPU : DeviceKind::kCUDA;
      plan_costs =
          runtime_costs(shape_counts(mats), opts.ortho, runtime_rates(kind), nullptr).table;
    }
    const auto pts = simulate(mats, costs, worlds, topo.gpus_per_node, cm, solver, opts,
                              sim_tensors(w), plan_costs ? &*plan_costs : nullptr);
    std::printf("%6s %12s %9s %12s %11s %12s %12s %14s %10s %10s\n", "D", "makespan ms", "imbal.",
                "gather ms", "(comm ms)", "sharded ms", "(comm ms)", "dedicated ms", "x sharded",
                "x dedic.");
    j["simulate"] = {{"assumptions", cm.describe()},
                     {"solver", solver},
                     {"owners_placed_on", plan_costs ? "analytic costs" : "the costs above"},
                     {"points", {}}};
    for (const SimPoint& p : pts) {
      // Orthogonalization FLOPs per rank: every matrix (gather), or the busiest owner's.
      std::vector<double> owner_flops(p.world, 0.0);
      for (size_t i = 0; i < mats.size(); ++i)
        owner_flops[p.owner[i]] += ortho_flops(opts.ortho, mats[i].rows, mats[i].cols);
      double all_flops = 0;
      for (double f : owner_flops) all_flops += f;
      std::printf("%6d %12.3f %9.4f %12.3f %11.3f %12.3f %12.3f %14.3f %10.2f %10.2f\n", p.world,
                  p.makespan * 1e3, p.imbalance, p.gather() * 1e3, p.gather_comm * 1e3,
                  p.sharded() * 1e3, p.sharded_comm * 1e3, p.dedicated() * 1e3,
                  p.gather() / p.sharded(), p.gather() / p.dedicated());
      j["simulate"]["points"].push_back(
          {{"world", p.world},
           {"makespan", p.makespan},
           {"imbalance", p.imbalance},
           {"gather", p.gather()},
           {"gather_comm", p.gather_comm},
           {"gather_elementwise", p.gather_elementwise},
           {"owner_step", p.owner_step},
           {"sharded", p.sharded()},
           {"sharded_comm", p.sharded_comm},
           {"dedicated", p.dedicated()},
           {"dedicated_comm", p.dedicated_comm},
           {"fsdp_comm", p.fsdp_comm},
           {"dedicated_exchange", p.dedicated_exchange},
           {"adamw_update", p.adamw_update},
           {"gather_engine", p.gather_engine},
           {"sharded_engine", p.sharded_engine},
           {"dedicated_engine", p.dedicated_engine},
           {"adamw_engine", p.adamw_engine},
           {"fsdp_reduce_scatter", p.fsdp_reduce_scatter},
           {"fsdp_all_gather", p.fsdp_all_gather},
           {"buckets", p.buckets},
           {"owner_runs", p.owner_runs},
           {"gather_runs", p.gather_runs},
           {"collectives",
            {{"fsdp", p.fsdp_collectives},
             {"gather", p.gather_collectives},
             {"sharded", p.sharded_collectives},
             {"dedicated", p.dedicated_collectives},
             {"adamw", p.adamw_collectives}}},
           {"launches",
            {{"fsdp", p.fsdp_launches},
             {"sharded", p.sharded_launches},
             {"dedicated", p.dedicated_launches}}},
           {"gather_step", p.gather_step()},
           {"sharded_step", p.sharded_step()},
           {"dedicated_step", p.dedicated_step()},
           {"adamw_step", p.adamw_step()},
           {"speedup_sharded", p.gather() / p.sharded()},
           {"speedup_dedicated", p.gather() / p.dedicated()},
           {"gather_bytes", p.gather_bytes},
           {"replicated_bytes", p.replicated_bytes},
           {"sharded_bytes", p.sharded_bytes},
           {"dedicated_bytes", p.dedicated_bytes},
           {"gather_flops", all_flops},
           {"owner_flops_max", *std::max_element(owner_flops.begin(), owner_flops.end())}});
    }
  }
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    DM_CHECK(f.good(), "cannot write ", a.json);
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace distmuon::plan_tool

int main(int argc, char** argv) {
  using namespace distmuon;
  CLI::App app("Assigns Muon matrices to owner ranks and predicts step times.", "distmuon-plan");
  plan_tool::PlanArgs a;
  plan_tool::add_plan_options(app, a);
  return cli::run(app, argc, argv, [&] { return plan_tool::run(a); });
}
