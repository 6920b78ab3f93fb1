// The Engine's private state (Engine::Impl): the parts it is made of, each in its own header
// with the methods that own its data, and the few methods that need several parts at once --
// registration (engine.cc), the single-process step (local_step.cc, step_graph.cc), CacheMuon's
// views (engine_cache.cc), the distributed set-up, layout and step (dist_setup.cc,
// dist_layout.cc, dist_step.cc) and the prepared updates (dedicated_prepare.cc).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/engine.h"
#include "plan/runtime_plan.h"  // the start-up plan (dist_setup.cc)
#include "runtime/adamw_state.h"
#include "runtime/batch_resources.h"
#include "runtime/dist_exchange.h"
#include "runtime/dist_state.h"
#include "runtime/local_step.h"
#include "runtime/mode_runner.h"
#include "runtime/muon_batch.h"
#include "runtime/prepared_updates.h"
#include "runtime/registry.h"
#include "runtime/shape_tuning.h"
#include "runtime/step_state.h"

namespace distmuon {

// The engine's state as parts (docs/design.md, "The runtime's parts"). Each part holds its own
// data and the methods that work on it; a part that needs another's data names it in its
// constructor (ShapeTuning, BatchResources, AdamWState) or takes it per call. The runners do
// not see the engine: they get a RunnerContext (mode_runner.h) with the parts their stages read.
// Members are declared in the order they depend on each other, so that they are destroyed
// before what they refer to (the pipeline's runner first).
struct Engine::Impl {
  Backend& backend;
  EngineOptions options;
  EngineStats stats;
  bool built = false;  // setup() has run: the registration is frozen

  Registry registry;         // groups and parameters as registered (registry.h)
  StepRecord record;         // the step's statuses, norms, counters, scalars (step_state.h)
  DistState dist;            // communicators, plan, matrices, buckets; world null: one process
  ShapeTuning tuning;        // the algorithm of every shape (shape_tuning.h)
  BatchResources resources;  // Orthogonalizer, CacheMuon, owners' scratch (batch_resources.h)
  AdamWState adam;           // AdamW's step and its staging (adamw_state.h)
  LocalStep local;           // the single-process shape classes and step graph (local_step.h)
  PreparedUpdates prepared;  // the dedicated mode's prepare() (prepared_updates.h)
  Pipeline pipeline;         // the mode's runner and a deferred publication (mode_runner.h)

  Impl(Backend& be, EngineOptions opt);
  ~Impl();

  // Registration and inputs (engine.cc).
  int add_param(const ParamSpec& spec);
  void check_inputs(std::span<const ParamData> data) const;
  // record.upload_scalars() from the groups' current options: before every step (and every
  // dedicated prepare()).
  void upload_scalars() { record.upload_scalars(backend, registry, dist); }

  // The single-process step: local_step drives it (the hyperparameters' upload, then the
  // step's graph or an eager issue, step_graph.cc); issue_local_step issues the device work
  // (local_step.cc); count_local_step does its host bookkeeping, which a replay repeats.
  void build_classes();
  void ensure_class_buffers(ShapeClass& c);
  void local_step(std::span<const ParamData> data);
  void issue_local_step(std::span<const ParamData> data);
  void count_local_step(std::span<const ParamData> data);
  // Whether this engine's steps replay a captured graph: single process, graphs on, neither the
  // raise policy nor CacheMuon's shadow mode (both read the device on the host mid-step); the
  // tuner then times graph replays. local_step states it per class (step_graph.cc).
  bool steps_replay() const;

  // tuning.tune() for these shapes with this engine's options (engine_tune.cc; collective when
  // distributed).
  void tune_shapes(const std::vector<TuneShape>& shapes);
  std::vector<TuneShape> class_shapes() const;  // the single-process classes as TuneShapes
  void tune_dist_shapes();  // tune_shapes over the distributed matrices (counts: all ranks')

  // CacheMuon's entries seen from the registry (engine_cache.cc).
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

  // Distributed (dist_setup.cc, dist_layout.cc, dist_step.cc).
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
  void build_owner_batches();  // prepare_buckets(): DistState::owner_batches, Bucket::ready
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

std::string join_shape(std::span<const int64_t> s);

}  // namespace distmuon
