// Internal state of the Engine shared by its files: the registry (engine.cc), the single-process
// step (local_step.cc), CacheMuon's entries (engine_cache.cc), the tuned algorithms
// (engine_tune.cc), the distributed set-up and plan (dist_setup.cc, dist_layout.cc), the step
// driver (dist_step.cc), AdamW (adamw_step.cc) and the prepared updates (dedicated_prepare.cc).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/engine.h"
#include "plan/runtime_plan.h"  // the start-up plan (dist_setup.cc)
#include "runtime/adamw_state.h"
#include "runtime/batch_resources.h"
#include "runtime/dist_state.h"
#include "runtime/local_step.h"
#include "runtime/mode_runner.h"
#include "runtime/muon_batch.h"
#include "runtime/registry.h"
#include "runtime/shape_tuning.h"
#include "runtime/step_state.h"

namespace distmuon {

// Dedicated mode with caller transfers: batches prepared since the last step (momentum and
// orthogonalization done, results in the arena x) whose updates step() applies.
struct PreparedUpdates {
  struct Batch {
    std::vector<int> mats;  // one owner batch, group and wide shape; wide matrices first
    int tall_begin = 0;     // first tall one (mats.size() when none)
    DType x_dtype = DType::kF32;
    size_t x_offset = 0;  // bytes into x
    int64_t slot = 0;     // first entry in norms / status
  };
  std::vector<Batch> batches;
  std::vector<char> is_prepared;  // per matrix
  Buffer x, norms, status;        // the arena: one slot per matrix this rank owns
  size_t x_used = 0;
  int64_t slots_used = 0;
  // Forgets the prepared batches (applied or discarded) and hands the arena out from the front.
  void reset();
};

// The engine's state, one base per concern -- the registry (Registry), the step's device
// statuses and counters (StepRecord), the distributed layout and communicators (DistState) --
// plus the single-process shape classes, CacheMuon's entries, the tuned algorithms, AdamW's
// staging and the prepared updates. The runners do not see it: they get a RunnerContext
// (mode_runner.h) with the parts their stages read, and the BatchResources it implements.
struct Engine::Impl {
  Backend& backend;
  EngineOptions options;
  Registry registry;  // groups and parameters as registered
  StepRecord record;  // the step's device statuses, norms, counters and hyperparameters
  DistState dist;     // communicators, plan, matrices, buckets (world == nullptr: one process)
  LocalStep local;    // the single-process shape classes and step graph (local_step.h)
  bool built = false;
  EngineStats stats;
  // The skips of every parameter's most-skipped matrix as this rank counted them (synchronises).
  std::vector<int64_t> local_skips();

  // ---- distributed (DistState::world == nullptr in a single process) ----
  std::unique_ptr<ModeRunner> runner;
  bool publish_pending = false;
  std::vector<std::pair<int, int>> deferred;  // (stage, bucket) left for finish_publish()
  std::unique_ptr<StepContext> pending_ctx;
  PreparedUpdates prepared;

  Impl(Backend& be, EngineOptions opt);
  ~Impl();
  void bind_streams();  // the communicators follow the backend's current stream

  // registry / single process (engine.cc, local_step.cc)
  int add_param(const ParamSpec& spec);
  void build_classes();
  // Uploads Param::step of every parameter and zeroes the Muon skip counters.
  void allocate_step_counts();
  // The step's hyperparameters in backend memory (step_scalars.cc): sized once the classes or
  // the distributed matrices are known, uploaded from the groups' options before every step
  // (and every dedicated prepare()).
  void allocate_scalars();
  void upload_scalars();
  void ensure_class_buffers(ShapeClass& c);
  // The single-process step: local_step drives it (the hyperparameters' upload, then the
  // step's graph or an eager issue, step_graph.cc); issue_local_step issues the device work
  // (local_step.cc); count_local_step does its host bookkeeping, which a replay repeats.
  void local_step(std::span<const ParamData> data);
  void issue_local_step(std::span<const ParamData> data);
  void count_local_step(std::span<const ParamData> data);
  void check_inputs(std::span<const ParamData> data) const;

  // Per-shape algorithms of `auto` (shape_tuning.h, engine_tune.cc).
  ShapeTuning tuning;
  // The Orthogonalizer, CacheMuon's entries and the owners' shared scratch
  // (batch_resources.h, engine_cache.cc).
  BatchResources resources;
  AdamWState adam;  // AdamW's step and its staging (adamw_state.h, adamw_step.cc)
  // tuning.tune() for these shapes with this engine's options (collective when distributed).
  void tune_shapes(const std::vector<TuneShape>& shapes);
  std::vector<TuneShape> class_shapes() const;  // the single-process classes as TuneShapes
  void tune_dist_shapes();  // tune_shapes over the distributed matrices (counts: all ranks')
  // Whether this engine's steps replay a captured graph: single process, graphs on, neither the
  // raise policy nor CacheMuon's shadow mode (both read the device on the host mid-step); the
  // tuner then times graph replays. local_step states it per class (step_graph.cc).
  bool steps_replay() const;

  // CacheMuon inside the engine (engine_cache.cc).
  // Gives every matrix this rank orthogonalizes its cache entry, in the order the runs use them.
  void assign_cache_entries();
  // The cache entries of matrix `slice` of Muon parameter i on this rank: (class, entry), or
  // (-1, -1) when this rank holds none. Single process: builds the classes.
  std::pair<int, int64_t> cache_entry_of(int i, int64_t slice);
  // Checkpoint views of the cache state (see Engine::state) and the state names of a Muon
  // parameter (momentum, plus the cache's when its shape uses one).
  TensorView cache_view(int i, int64_t slice, int64_t count, const std::string& name,
                        const std::vector<int64_t>& lead);
  std::vector<std::string> muon_state_names(int i) const;

  // distributed (dist_setup.cc, dist_layout.cc, dist_step.cc)
  void dist_setup();
  // Creates `mats` (pieces from shard_of(position, param) = (row_begin, row_count); nullptr:
  // unsharded), the buckets and their order.
  using ShardLookup = std::function<std::pair<int64_t, int64_t>(int position, size_t param)>;
  void build_matrices(const ShardLookup& shard_of);
  void allocate_state();
  void dist_step(std::span<const ParamData> data);
  void finish_publish();
  void vote(StepContext& ctx);
  void prepare_buckets(StepContext& ctx);
  // Raise policy: fails, naming every entry that is not ok on some rank, before anything changes.
  // muon_names: per Muon status entry, the matrix it belongs to this step ("" when none).
  void raise_if_nonfinite(const std::vector<std::string>& muon_names);
  // Dedicated mode with caller transfers (dedicated_prepare.cc).
  void prepare(std::span<const int> params, std::span<const ParamData> data);
  void apply_prepared(const StepContext& ctx);
  bool caller_transfers() const {
    return dist.world && dist.options.mode == DistMode::kDedicated && dist.options.caller_transfers;
  }
  std::string matrix_name(int j) const {
    return registry.slice_name(dist.mats[j].param, dist.mats[j].slice);
  }
  RunnerContext runner_context() { return {backend, registry, dist, record, resources}; }
};

// Helpers for small host-side exchanges through backend memory (dist_exchange.cc): the
// communicator may require device buffers.
std::vector<int64_t> host_all_gather(Communicator& comm, Backend& be,
                                     const std::vector<int64_t>& mine);
std::vector<char> host_all_gather_v(Communicator& comm, Backend& be, const std::string& mine,
                                    const std::vector<int64_t>& lengths);
void host_all_reduce(Communicator& comm, Backend& be, std::vector<int32_t>& values, ReduceOp op);
// Gathers every rank's `mine` (line-separated; `lengths` from a host_all_gather of the sizes)
// and describes, per rank that differs from rank 0, its first line that differs:
// "\n  rank 0 has `a` but rank q has `b`" (empty when all agree). Collective.
std::string text_differences(Communicator& comm, Backend& be, const std::string& mine,
                             const std::vector<int64_t>& lengths);

std::string join_shape(std::span<const int64_t> s);

}  // namespace distmuon
