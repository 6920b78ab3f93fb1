// distmuon-plan: owner assignment of a workload's Muon matrices for a world size, from analytic,
// measured or stored costs; compares solvers side by side and predicts the optimizer step time
// of the distributed modes from 1 to 1024 GPUs (--simulate).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "distmuon/backend.h"
#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "distmuon/plan.h"
#include "distmuon/simulate.h"
#include "distmuon/workload.h"

namespace distmuon::plan_tool {
namespace {

std::string hex(uint64_t h) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void declare(cli::Args& a) {
  a.option("workload", "pi0", "built-in name (gpt2-small, gpt2-large, pi0, qwen2.5-7b) or JSON");
  a.option("layers", "0", "keep only the first K of each repeated tensor (0: all)");
  a.option("world-size", "8", "ranks (owner slots)");
  a.option("gpus-per-node", "8", "GPUs per node");
  a.option("replicate", "1", "HSDP replicate degree (owner slots span replicate x shard)");
  a.option("solver", "milp,lpt,round-robin", "comma list of milp | lpt | round-robin");
  a.option("time-limit", "4",
           "CPU seconds the MILP may take (a guard: node limits keep plans "
           "deterministic)");
  a.option("max-nodes", "20000", "branch-and-bound nodes CBC may explore");
  a.option("gap", "5e-4", "relative optimality gap at which CBC stops");
  a.option("formulation", "auto", "MILP formulation: auto | patterns | columns | owners");
  a.option("comm-weight", "1e-3", "weight of the busiest owner's traffic time in the objective");
  a.option("memory-cap-gib", "0", "per-owner memory cap in GiB (0: none)");
  a.option("max-batch", "0", "largest batch an owner runs at once (0: no limit)");
  a.option("no-spread", "0", "do not spread the matrices of one layer over owners", true);
  a.option("no-symmetry-breaking", "0", "leave the owner ordering out of the MILP (to compare)",
           true);
  a.option("state-bytes", "4", "bytes per element of the momentum an owner keeps");
  a.option("costs", "", "cost file (written by --measure on the target machine)");
  a.option("device", "", "the device's table in --costs when it holds several");
  a.option("analytic", "0", "analytic costs from --tflops, --hbm-tbs, --launch-us (default)", true);
  a.option("measure", "0", "measure costs on --backend, cached in --cache", true);
  a.option("backend", "cpu", "backend measured by --measure (cpu | cuda)");
  a.option("cache", "",
           "cost cache (default: DISTMUON_COST_CACHE or ~/.cache/distmuon/costs.json)");
  a.option("profile-ks", "1,2,4,8", "batch sizes timed per shape by --measure");
  a.option("profile-reps", "3", "timed repetitions per point (median kept)");
  a.option("algo", "auto", "algorithm costed (see distmuon-bench --help)");
  a.option("work-dtype", "auto", "iteration dtype (auto: bf16 for analytic/cuda, f32 on cpu)");
  a.option("tflops", "759", "analytic: GEMM rate in TFLOP/s (H200 dense bf16, measured)");
  a.option("hbm-tbs", "4.17", "analytic and simulate: memory bandwidth in TB/s (H200 copy, measured)");
  a.option("launch-us", "4", "analytic: fixed cost per kernel launch in microseconds");
  a.option("owners", "0", "print every owner's load", true);
  a.option("simulate", "0", "predict step times of gather / sharded / dedicated, D = 1..1024",
           true);
  a.option("sim-max-world", "1024", "largest world size simulated (powers of two from 1)");
  a.option("sim-solver", "", "planner used by --simulate (default: the first of --solver)");
  a.option("intra-gbs", "450", "simulate: intra-node bandwidth per GPU per direction, GB/s");
  a.option("inter-gbs", "50", "simulate: inter-node bandwidth per GPU, GB/s");
  a.option("intra-us", "3", "simulate: intra-node latency, microseconds");
  a.option("inter-us", "6", "simulate: inter-node latency, microseconds");
  a.option("wire-bytes", "2", "simulate: bytes per element on the wire");
  a.option("elementwise-bytes", "44",
           "simulate: memory traffic of the elementwise passes per element orthogonalized (at "
           "--hbm-tbs; 44: H200, f32 parameters; 0: left out)");
  a.option("json", "", "write the results as JSON to this path");
}

CostTable load_costs(const cli::Args& a, const std::vector<PlanMatrix>& mats, OrthoConfig& cfg) {
  const int sources = a.given("costs") + a.flag("analytic") + a.flag("measure");
  DM_CHECK(sources <= 1, "choose one of --costs FILE, --analytic and --measure");
  const std::string wd = a.str("work-dtype");
  if (a.given("costs")) {
    CostTable t =
        select_cost_table(read_cost_file(a.str("costs")), a.str("device"), a.str("costs"));
    cfg = parse_algorithm(t.algorithm);
    cfg.work_dtype = parse_dtype(t.work_dtype);
    return t;
  }
  if (a.flag("measure")) {
    auto be = make_backend(a.str("backend"));
    cfg.work_dtype = parse_dtype(wd != "auto" ? wd : a.str("backend") == "cuda" ? "bf16" : "f32");
    ProfileOptions po;
    po.ks.clear();
    for (double k : a.numbers("profile-ks")) po.ks.push_back(static_cast<int64_t>(k));
    po.reps = static_cast<int>(a.integer("profile-reps"));
    std::fprintf(stderr, "distmuon-plan: costs of %s on %s\n", algorithm_name(cfg).c_str(),
                 be->name().c_str());
    CachedCosts c = cached_cost_table(*be, shape_counts(mats), cfg, po, a.str("cache"));
    std::fprintf(stderr, "distmuon-plan: cost cache %s: %d shapes reused, %d measured\n",
                 c.path.c_str(), c.shapes_reused, c.shapes_measured);
    return c.table;
  }
  cfg.work_dtype = parse_dtype(wd == "auto" ? "bf16" : wd);
  AnalyticRates r;
  r.flops_per_s = a.number("tflops") * 1e12;
  r.bytes_per_s = a.number("hbm-tbs") * 1e12;
  r.launch_s = a.number("launch-us") * 1e-6;
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

int run(int argc, char** argv) {
  cli::Args a("distmuon-plan", "Assigns Muon matrices to owner ranks and predicts step times.");
  declare(a);
  if (!a.parse(argc, argv)) return 0;

  Workload w = load_workload(a.str("workload"));
  if (a.integer("layers") > 0) w = w.first_layers(a.integer("layers"));
  const std::vector<PlanMatrix> mats = plan_matrices(w, a.integer("state-bytes"));
  DM_CHECK(a.integer("world-size") >= 1, "--world-size must be >= 1 (got ", a.str("world-size"),
           ")");
  Topology topo;
  topo.world_size = static_cast<int>(a.integer("world-size"));
  topo.gpus_per_node = static_cast<int>(a.integer("gpus-per-node"));
  topo.replicate = static_cast<int>(a.integer("replicate"));
  topo.validate();

  const std::vector<std::string> solvers = a.list("solver");
  DM_CHECK(!solvers.empty(), "--solver needs at least one of milp, lpt, round-robin");
  for (const std::string& s : solvers)
    DM_CHECK(s == "milp" || s == "lpt" || s == "round-robin", "unknown solver '", s,
             "' in --solver (milp, lpt, round-robin)");

  PlanOptions opts;
  const CostTable costs = load_costs(a, mats, opts.ortho);
  opts.time_limit_s = a.number("time-limit");
  opts.max_nodes = a.integer("max-nodes");
  opts.relative_gap = a.number("gap");
  opts.comm_weight = a.number("comm-weight");
  opts.memory_cap_bytes = a.number("memory-cap-gib") * 1024.0 * 1024.0 * 1024.0;
  opts.max_batch = a.integer("max-batch");
  opts.spread_layers = !a.flag("no-spread");
  opts.symmetry_breaking = !a.flag("no-symmetry-breaking");
  opts.formulation = a.str("formulation");

  std::printf("%s: %zu Muon matrices, %zu shapes; world %d (%d node%s x %d GPUs, replicate %d)\n",
              w.name.c_str(), mats.size(), costs.shapes().size(), topo.world_size, topo.nodes(),
              topo.nodes() == 1 ? "" : "s", std::min(topo.world_size, topo.gpus_per_node),
              topo.replicate);
  std::printf("costs: %s\n\n", costs.describe().c_str());
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
  if (a.flag("owners")) {
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

  if (a.flag("simulate")) {
    CommModel cm;
    cm.intra_bytes_per_s = a.number("intra-gbs") * 1e9;
    cm.inter_bytes_per_s = a.number("inter-gbs") * 1e9;
    cm.intra_latency_s = a.number("intra-us") * 1e-6;
    cm.inter_latency_s = a.number("inter-us") * 1e-6;
    cm.wire_elem_bytes = a.integer("wire-bytes");
    cm.elementwise_bytes = a.number("elementwise-bytes");
    cm.hbm_bytes_per_s = a.number("hbm-tbs") * 1e12;
    const std::string solver = a.str("sim-solver").empty() ? solvers.front() : a.str("sim-solver");
    std::vector<int> worlds;
    for (int d = 1; d <= a.integer("sim-max-world"); d *= 2) worlds.push_back(d);
    std::printf("\nsimulated optimizer step (%s plans, %d GPUs per node, costs: %s)\n%s\n\n",
                solver.c_str(), topo.gpus_per_node, costs.source.c_str(), cm.describe().c_str());
    const auto pts = simulate(mats, costs, worlds, topo.gpus_per_node, cm, solver, opts);
    std::printf("%6s %12s %9s %12s %11s %12s %12s %14s %10s %10s\n", "D", "makespan ms", "imbal.",
                "gather ms", "(comm ms)", "sharded ms", "(comm ms)", "dedicated ms", "x sharded",
                "x dedic.");
    j["simulate"] = {{"assumptions", cm.describe()}, {"solver", solver}, {"points", {}}};
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
      j["simulate"]["points"].push_back({{"world", p.world},
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
                                         {"speedup_sharded", p.gather() / p.sharded()},
                                         {"speedup_dedicated", p.gather() / p.dedicated()},
                                         {"gather_bytes", p.gather_bytes},
                                         {"replicated_bytes", p.replicated_bytes},
                                         {"sharded_bytes", p.sharded_bytes},
                                         {"dedicated_bytes", p.dedicated_bytes},
                                         {"gather_flops", all_flops},
                                         {"owner_flops_max", *std::max_element(
                                             owner_flops.begin(), owner_flops.end())}});
    }
  }
  if (!a.str("json").empty()) {
    std::ofstream f(a.str("json"));
    DM_CHECK(f.good(), "cannot write ", a.str("json"));
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace distmuon::plan_tool

int main(int argc, char** argv) {
  try {
    return distmuon::plan_tool::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distmuon-plan: %s\n", e.what());
    return 1;
  }
}
