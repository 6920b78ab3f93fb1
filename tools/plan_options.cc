#include "plan_options.h"

#include <string>
#include <tuple>

#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "distmuon/simulate.h"

namespace distmuon::plan_tool {
namespace {

void check_plan_options(const CLI::App& app, const PlanArgs& a) {
  DM_CHECK(a.analytic + a.measure + !a.costs.empty() <= 1,
           "choose one of --costs FILE, --analytic and --measure");
  DM_CHECK(!a.solvers.empty(), "--solver needs at least one of milp, lpt, round-robin");
  DM_CHECK(!app.count("--device") || !a.costs.empty(), "--device selects a table of --costs");
  // Options of one mode given without it would be silently ignored.
  for (const char* o : {"--backend", "--cache", "--profile-ks", "--profile-reps"})
    DM_CHECK(!app.count(o) || a.measure, o, " applies to --measure");
  for (const char* o : {"--tflops", "--launch-us"})
    DM_CHECK(!app.count(o) || (!a.measure && a.costs.empty()), o,
             " applies to analytic costs (not with --costs or --measure)");
  for (const char* o :
       {"--sim-max-world", "--sim-solver", "--intra-gbs", "--inter-gbs", "--intra-us", "--inter-us",
        "--wire-bytes", "--elementwise-bytes", "--intra-reduce-gbs", "--intra-broadcast-gbs",
        "--intra-root-reduce-gbs", "--intra-alltoall-gbs", "--adamw-tbs", "--collective-latency-us",
        "--local-collective-us", "--bucket-mb", "--comm-compute-share", "--comm-wait-share",
        "--batches-per-bucket", "--uniform-all-to-all", "--grouped-hop-share",
        "--sim-plan-analytic"})
    DM_CHECK(!app.count(o) || a.simulate, o, " applies to --simulate");
  DM_CHECK(!a.sim_plan_analytic || a.measure || !a.costs.empty(),
           "--sim-plan-analytic places the owners on analytic costs and times the step with "
           "--costs or --measure: give one of them");
  // --measure keeps what it measured in the cost cache: a cache it cannot write would fail only
  // after the measurements.
  if (a.measure) {
    const std::string cache = a.cache.empty() ? default_cost_cache_path() : a.cache;
    const std::string why = cli::unwritable(cache, true);
    DM_CHECK(why.empty(), "the cost cache of --measure: ", why);
  }
  Topology topo;
  topo.world_size = a.world_size;
  topo.gpus_per_node = a.gpus_per_node;
  topo.replicate = a.replicate;
  topo.validate();
}

}  // namespace

void add_plan_options(CLI::App& app, PlanArgs& a) {
  app.option_defaults()->always_capture_default();
  const auto solver_names = CLI::IsMember({"milp", "lpt", "round-robin"});
  app.add_option("--workload", a.workload, cli::workload_help())->check(cli::kWorkload);
  app.add_option("--layers", a.layers, "keep only the first K of each repeated tensor (0: all)")
      ->check(cli::at_least(0, cli::kMaxRepeats));
  app.add_option("--world-size", a.world_size, "ranks (owner slots)")
      ->check(cli::at_least(1, cli::kMaxRanks));
  app.add_option("--gpus-per-node", a.gpus_per_node, "GPUs per node")
      ->check(cli::at_least(1, cli::kMaxRanks));
  app.add_option("--replicate", a.replicate,
                 "HSDP replicate degree (owner slots span replicate x shard)")
      ->check(cli::at_least(1, cli::kMaxRanks));
  app.add_option("--solver", a.solvers, "comma list of planners, compared side by side")
      ->delimiter(',')
      ->check(solver_names);
  app.add_option("--time-limit", a.time_limit,
                 "CPU seconds the MILP may take (a guard: node limits keep plans deterministic)")
      ->check(cli::above(0));
  app.add_option("--max-nodes", a.max_nodes, "branch-and-bound nodes CBC may explore")
      ->check(cli::at_least(1, 1e9));
  app.add_option("--gap", a.gap, "relative optimality gap at which CBC stops")
      ->check(cli::at_least(0));
  app.add_option("--formulation", a.formulation, "MILP formulation")
      ->check(CLI::IsMember({"auto", "patterns", "columns", "owners"}));
  app.add_option("--comm-weight", a.comm_weight,
                 "weight of the busiest owner's traffic time in the objective")
      ->check(cli::at_least(0));
  app.add_option("--memory-cap-gib", a.memory_cap_gib, "per-owner memory cap in GiB (0: none)")
      ->check(cli::at_least(0));
  app.add_option("--max-batch", a.max_batch, "largest batch an owner runs at once (0: no limit)")
      ->check(cli::at_least(0, 1 << 20));
  app.add_flag("--no-spread", a.no_spread, "do not spread the matrices of one layer over owners");
  app.add_flag("--no-symmetry-breaking", a.no_symmetry_breaking,
               "leave the owner ordering out of the MILP (to compare)");
  app.add_option("--state-bytes", a.state_bytes, "bytes per element of the momentum an owner keeps")
      ->check(CLI::Range(int64_t{1}, int64_t{16}));

  const std::string costs = "Costs (one source: --costs, --analytic (default) or --measure)";
  app.add_option("--costs", a.costs, "cost file (written by --measure on the target machine)")
      ->check(CLI::ExistingFile)
      ->group(costs);
  app.add_option("--device", a.device, "the device's table in --costs when it holds several")
      ->group(costs);
  app.add_flag("--analytic", a.analytic, "analytic costs from --tflops, --hbm-tbs, --launch-us")
      ->group(costs);
  app.add_option("--costs-scale", a.costs_scale,
                 "a device F times slower at the orthogonalization than the one that was measured "
                 "(a part of the GPU: its whole-GPU GEMM rate over the part's, from distmuon-bench "
                 "--calibrate): each batch's work times F, its fixed launch cost (the intercept of "
                 "its first two points) kept")
      ->check(cli::above(0, 1e6))
      ->group(costs);
  app.add_option("--costs-parts", a.costs_parts,
                 "with --costs-scale: the device is one of this many partitions of the measured "
                 "GPU's SMs (MPS ranks); a batch that filled only part of the whole GPU's SMs "
                 "(its rate below the table's best) loses less on a part (docs/distributed.md)")
      ->check(CLI::Range(0, 1024))
      ->group(costs);
  app.add_flag("--measure", a.measure, "measure costs on --backend, cached in --cache")
      ->group(costs);
  app.add_option("--backend", a.backend, "backend measured by --measure")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(costs);
  app.add_option("--cache", a.cache,
                 "cost cache (default: DISTMUON_COST_CACHE, else $XDG_CACHE_HOME or ~/.cache, "
                 "distmuon/costs.json)")
      ->group(costs);
  app.add_option("--profile-ks", a.profile_ks, "batch sizes timed per shape by --measure")
      ->delimiter(',')
      ->check(cli::at_least(1, 1 << 20))
      ->group(costs);
  app.add_option("--profile-reps", a.profile_reps, "timed repetitions per point (median kept)")
      ->check(cli::at_least(1, cli::kMaxRepeats))
      ->group(costs);
  app.add_option("--algo", a.algo, "algorithm costed")->check(cli::kAlgorithm)->group(costs);
  app.add_option("--work-dtype", a.work_dtype,
                 "iteration dtype (auto: bf16 for analytic/cuda, f32 on cpu)")
      ->check(cli::kDType | CLI::IsMember({"auto"}))
      ->group(costs);
  app.add_option("--tflops", a.tflops, "analytic: GEMM rate in TFLOP/s (H200 dense bf16, measured)")
      ->check(cli::above(0))
      ->group(costs);
  app.add_option("--hbm-tbs", a.hbm_tbs,
                 "analytic and simulate: memory bandwidth in TB/s (H200 copy, measured)")
      ->check(cli::above(0))
      ->group(costs);
  app.add_option("--launch-us", a.launch_us,
                 "analytic: fixed cost per kernel launch in microseconds")
      ->check(cli::at_least(0))
      ->group(costs);

  const std::string out = "Output";
  app.add_flag("--owners", a.owners, "print every owner's load")->group(out);
  app.add_flag("--simulate", a.simulate,
               "predict step times of gather / sharded / dedicated, D = 1..--sim-max-world")
      ->group(out);
  app.add_option("--json", a.json, "write the results as JSON to this path")
      ->check(cli::kWritableFile)
      ->group(out);

  const std::string sim = "Simulation (--simulate)";
  app.add_option("--sim-max-world", a.sim_max_world,
                 "largest world size simulated (powers of two from 1)")
      ->check(cli::at_least(1, cli::kMaxRanks))
      ->group(sim);
  app.add_option("--sim-solver", a.sim_solver,
                 "planner used by --simulate (default: the first of --solver)")
      ->check(solver_names)
      ->group(sim);
  app.add_option("--intra-gbs", a.intra_gbs, "intra-node bandwidth per GPU per direction, GB/s")
      ->check(cli::above(0))
      ->group(sim);
  app.add_option("--inter-gbs", a.inter_gbs, "inter-node bandwidth per GPU, GB/s")
      ->check(cli::above(0))
      ->group(sim);
  app.add_option("--intra-us", a.intra_us, "intra-node latency, microseconds")
      ->check(cli::at_least(0))
      ->group(sim);
  app.add_option("--inter-us", a.inter_us, "inter-node latency, microseconds")
      ->check(cli::at_least(0))
      ->group(sim);
  // Intra-node rates of particular collectives (0: the fallback their help names).
  for (auto [name, var, help] :
       {std::tuple{"--intra-reduce-gbs", &a.intra_reduce_gbs,
                   "intra-node bandwidth of reductions (reduce, reduce-scatter), GB/s (0: "
                   "--intra-gbs)"},
        std::tuple{"--intra-broadcast-gbs", &a.intra_broadcast_gbs,
                   "intra-node bus bandwidth of the dedicated mode's broadcasts, GB/s (0: "
                   "--intra-gbs)"},
        std::tuple{"--intra-root-reduce-gbs", &a.intra_root_reduce_gbs,
                   "intra-node bus bandwidth of the dedicated mode's reduces to one rank, GB/s "
                   "(0: --intra-reduce-gbs)"},
        std::tuple{"--intra-alltoall-gbs", &a.intra_alltoall_gbs,
                   "intra-node bus bandwidth of the sharded mode's all-to-alls (bytes a rank "
                   "sends to its peers over the time), GB/s (0: --intra-gbs)"}})
    app.add_option(name, *var, help)->check(cli::at_least(0))->group(sim);
  app.add_option("--adamw-tbs", a.adamw_tbs,
                 "rate of the AdamW baseline's fused pass, TB/s of the bytes the simulator counts "
                 "(distmuon-bench --calibrate's adamw_gbs; 0: " +
                     std::to_string(static_cast<int>(CommModel::kAdamWShareOfCopy * 100 + 0.5)) +
                     " % of --hbm-tbs, the share measured)")
      ->check(cli::at_least(0))
      ->group(sim);
  app.add_option("--collective-latency-us", a.collective_latency_us,
                 "host time per collective at D > 1, paid in program order (143: the engine's "
                 "non-blocking NCCL communicator, H100 with two MPS ranks; distmuon-bench "
                 "--calibrate's nccl_collective_us)")
      ->check(cli::at_least(0))
      ->group(sim);
  app.add_option("--local-collective-us", a.local_collective_us,
                 "host time per collective at one rank, where NCCL copies locally")
      ->check(cli::at_least(0))
      ->group(sim);
  app.add_option("--bucket-mb", a.bucket_mb,
                 "MiB of full matrices per bucket of the engine (DistOptions::bucket_bytes; "
                 "distmuon-bench --bucket-mb; 0: one bucket)")
      ->check(cli::at_least(0, 1 << 20))
      ->group(sim);
  app.add_flag("--batches-per-bucket", a.batches_per_bucket,
               "owner modes: one batch per run of a bucket, right after it lands (the engine "
               "with DistOptions::batches_across_buckets off; default: each plan batch once, "
               "after its last bucket)")
      ->group(sim);
  app.add_flag("--uniform-all-to-all", a.uniform_all_to_all,
               "sharded mode: every pair of an all-to-all moves one equal block, its bucket's "
               "largest (the engine's layout on NCCL windows, DISTMUON_NCCL_CTA_POLICY=zero)")
      ->group(sim);
  app.add_flag("--sim-plan-analytic", a.sim_plan_analytic,
               "place the owners on the analytic costs an engine without a cost table plans with "
               "(DISTMUON_PLAN_COSTS=analytic, the costs' device kind), time the step with "
               "--costs or --measure: what such a run does")
      ->group(sim);
  app.add_option("--comm-compute-share", a.comm_compute_share,
                 "ranks sharing one GPU: share of a rank's compute a collective takes while it "
                 "moves data (0: GPUs of their own)")
      ->check(CLI::Range(0.0, 0.95))
      ->group(sim);
  app.add_option("--grouped-hop-share", a.grouped_hop_share,
                 "share of its (D-1) hops' latency a collective pays after the first of its NCCL "
                 "group (the group's operations run side by side)")
      ->check(CLI::Range(0.0, 1.0))
      ->group(sim);
  app.add_option("--comm-wait-share", a.comm_wait_share,
                 "ranks sharing one GPU: share of a rank's compute its NCCL kernel takes while it "
                 "waits for its peers (0: nothing)")
      ->check(CLI::Range(0.0, 0.95))
      ->group(sim);
  app.add_option("--wire-bytes", a.wire_bytes, "bytes per element on the wire")
      ->check(CLI::Range(int64_t{1}, int64_t{16}))
      ->group(sim);
  app.add_option("--elementwise-bytes", a.elementwise_bytes,
                 "memory traffic of the elementwise passes per element orthogonalized (at "
                 "--hbm-tbs; 44: H200, f32 parameters; 0: left out)")
      ->check(cli::at_least(0))
      ->group(sim);
  app.callback([&app, &a] { check_plan_options(app, a); });
}

}  // namespace distmuon::plan_tool
