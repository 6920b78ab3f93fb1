// The command line of distmuon-plan: its settings and their declaration (types, ranges and
// choices checked by CLI11 before any work; see cli.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "distmuon/simulate.h"
#include "distmuon/types.h"

namespace distmuon::plan_tool {

struct PlanArgs {
  std::string workload = "pi0";
  int64_t layers = 0;
  int world_size = 8, gpus_per_node = 8, replicate = 1;
  std::vector<std::string> solvers = {"milp", "lpt", "round-robin"};
  double time_limit = 4;
  int64_t max_nodes = 20000;
  double gap = 5e-4;
  std::string formulation = "auto";
  double comm_weight = 1e-3, memory_cap_gib = 0;
  int64_t max_batch = 0;
  bool no_spread = false, no_symmetry_breaking = false;
  int64_t state_bytes = 4;
  std::string costs, device;
  bool analytic = false, measure = false;
  std::string backend = "cpu", cache;
  std::vector<int64_t> profile_ks = {1, 2, 4, 8};
  int profile_reps = 3;
  std::string algo = "auto", work_dtype = "auto";
  double tflops = 759, hbm_tbs = 4.17, launch_us = 4;
  double costs_scale = 1;  // every cost times this (a device this many times slower)
  int costs_parts = 0;     // the device is a part of 1/costs_parts of the measured one's SMs
  bool owners = false, simulate = false;
  int sim_max_world = 1024;
  std::string sim_solver;
  double intra_gbs = 450, inter_gbs = 50, intra_us = 3, inter_us = 6;
  double intra_reduce_gbs = 0;       // 0: --intra-gbs
  double intra_broadcast_gbs = 0;    // 0: --intra-gbs
  double intra_root_reduce_gbs = 0;  // 0: --intra-reduce-gbs
  double intra_alltoall_gbs = 0;     // 0: --intra-gbs
  double adamw_tbs = 0;              // 0: --hbm-tbs
  double collective_latency_us = 143, local_collective_us = 10;
  double bucket_mb = static_cast<double>(kDefaultBucketBytes) / (1 << 20);
  double comm_compute_share = 0;
  double comm_wait_share = 0;
  double grouped_hop_share = CommModel{}.grouped_hop_share;
  bool batches_per_bucket = false;
  bool uniform_all_to_all = false;
  bool sim_plan_analytic = false;  // owners placed on the engine's analytic costs
  int64_t wire_bytes = 2;
  double elementwise_bytes = 44;
  std::string json;
};

// Declares every option on `app`, bound to `a`, and the checks that involve several options
// (run at the end of parsing, before any work).
void add_plan_options(CLI::App& app, PlanArgs& a);

}  // namespace distmuon::plan_tool
