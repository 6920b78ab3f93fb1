// The distributed comparison of distmuon-bench: every mode timed in the same run, on the same
// ranks, from the same starting point to the same end point, so that the ratios are fair:
//
//   start: every rank holds its local, unreduced gradient of every tensor (what backward
//          leaves) and full weights;
//   end:   every rank holds the full updated weights (what the next forward needs).
//
// gather, sharded and adamw therefore include the FSDP2 gradient reduce-scatter before the
// optimizer and the weight all-gather after it, replicated the DDP all-reduce; dedicated reduces
// and broadcasts inside the engine. The engine's own share (time and bytes) is reported beside.
// "adamw" is the baseline a Muon step is measured against: fused AdamW on every tensor's FSDP2
// shard. The modes take turns step by step, so that a machine shared with other work slows them
// alike. Ranks are MPI processes (bench_dist.cc, bench_rank.h).
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_options.h"
#include "cli.h"
#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"

namespace distmuon::bench {

struct ModeResult {
  std::string mode, algo;
  cli::Summary step_ms, engine_ms;  // per step the slowest rank's, summarised over steps
  // How long Engine::step held the host (issuing kernels and collectives), slowest rank: the
  // share of engine_ms a captured graph could give back.
  cli::Summary host_ms;
  double bytes_max = 0, bytes_mean = 0, engine_bytes_max = 0;
  // Host launches of collectives per step, busiest rank: the engine's, and with the FSDP2/DDP
  // emulation's (CommStats::launches; the simulator's per-launch host cost counts these).
  double engine_launches_max = 0, launches_max = 0;
  double flops_max = 0, flops_mean = 0;
  int64_t owned_max = 0;
  std::string plan_costs;  // what the owners were placed on (Plan::costs), "" without a plan
};

class Comparison {
 public:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    bool muon = false;
    int64_t numel = 0, dim0 = 0, inner = 0;
    Buffer w, g;              // full weights and this rank's local gradient
    Buffer w_shard, g_shard;  // FSDP2 shards (gather, sharded and adamw modes)
  };
  // One mode's engine and what its steps accumulate.
  struct Run {
    std::string mode;  // a DistMode's name or "adamw"
    DistMode dist = DistMode::kSharded;
    std::string algo;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<Communicator> fsdp;  // the FSDP2 / DDP traffic around the optimizer
    std::vector<ParamData> data;
    std::vector<double> step_ms, engine_ms, host_ms;
    EngineStats s0;
    CommStats f0;
  };
  // Called by every rank right after the barrier that starts a step (begin) and once its device
  // finished the step (end): the cluster's profiler marks its window with it.
  using StepHook = std::function<void(const Run&, int64_t step, bool begin)>;

  // `comm` moves the data (NCCL or MPI), `host` (MPI) the ranks' barriers and figures.
  Comparison(const BenchOptions& o, Communicator& host, Communicator& comm, Backend& be);

  std::unique_ptr<Run> prepare(const std::string& mode, const std::string& algo);
  // One timed (or warm-up, i < warmup) step of one mode.
  void step(Run& run, int64_t i);
  // Collective over the ranks: the run's figures, reduced over them.
  ModeResult result(Run& run);
  void set_step_hook(StepHook hook) { hook_ = std::move(hook); }
  // Collective: throws unless every rank holds the same full weights, as every mode leaves them
  // (a digest of each tensor's bytes compared over the ranks) and they are finite.
  void check_weights_agree();

  const std::string& workload() const { return workload_; }
  int64_t matrices() const { return matrices_; }
  int64_t muon_params() const { return muon_params_; }
  int64_t adamw_params() const { return adamw_params_; }
  DType dtype() const { return dtype_; }
  // (name, rows, cols) of each Muon matrix, 3-D stacks expanded: what a planner places.
  std::vector<std::vector<int64_t>> muon_shapes() const;

 private:
  const BenchOptions& o_;
  Communicator& host_;
  Communicator& comm_;
  Backend& be_;
  std::string workload_;
  DType dtype_ = DType::kF32;
  std::vector<Tensor> tensors_;
  // FSDP2's units (fully_shard per layer, the rest in the root's): the tensors each of its
  // reduce-scatters and all-gathers moves at once (Workload::fsdp_units).
  std::vector<std::vector<int>> units_;
  int64_t matrices_ = 0, muon_params_ = 0, adamw_params_ = 0;
  StepHook hook_;
};

// Element-wise `op` of every rank's `v` (the same length on every rank), over a host
// communicator.
std::vector<double> over_ranks(Communicator& host, std::vector<double> v, ReduceOp op);

// The table rank 0 prints: one row per mode and algorithm, ratios against gather.
void print_comparison(const Comparison& cmp, const std::vector<ModeResult>& results, int world,
                      const std::string& device);
// The "runs" of the JSON record.
nlohmann::json comparison_runs_json(const std::vector<ModeResult>& results);

}  // namespace distmuon::bench
