// The Engine: registry of parameters and their optimizer state, the step pipeline
// (collect -> compute -> publish) and its statistics. In a single process it is the whole
// optimizer; distributed modes plug a Communicator and a Plan into the same pipeline.
//
// Distributed use (every rank runs the same calls in the same order):
//   Engine e(backend, world_comm, DistOptions{.mode = DistMode::kSharded});
//   e.add_group(...); e.add_param({name, group, full_shape, dtype, ShardSpec{begin, rows}});
//   e.setup();                  // optional: checks the registration across ranks now
//   e.step(local_buffers);      // collective
// Every mode produces the weights the single-process optimizer computes from the (mean)
// gradient, with momentum kept only by each matrix's owner (gather: by the shard holders).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine_types.h"  // EngineOptions, DistOptions, ParamSpec, ParamData, EngineStats
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"
#include "distmuon/plan.h"

namespace distmuon {

// The owners Engine::setup() plans for these Muon matrices on a world of topo.world_size ranks
// (HSDP: topo.replicate), with the options' planner and plan_costs (read here: call it on one
// rank and share the result), costing `ortho` with the rates of `device`; a measured table is
// looked up for `device_name` (Backend::name(); empty: a backend of `device` is made to ask).
// Layers are parsed from the matrix names as setup() does. For a front end that must know the
// owners before it registers anything (distmuon.torch.dedicate); pass the result as
// DistOptions::owners.
Plan plan_owners(std::vector<PlanMatrix> matrices, const Topology& topo, const DistOptions& dist,
                 const OrthoConfig& ortho, DeviceKind device, const std::string& device_name = "");

class Engine {
 public:
  // Single process: the whole optimizer.
  Engine(Backend& backend, EngineOptions options = {});
  // Distributed: `world` must outlive the engine and hold buffers where the backend does.
  Engine(Backend& backend, Communicator& world, const DistOptions& dist,
         EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Groups and parameters are registered before the first step.
  int add_group(const GroupOptions& options);
  GroupOptions& group(int index);  // hyperparameters may change between steps (schedulers)
  int num_groups() const;
  int add_param(const ParamSpec& spec);
  int num_params() const;
  const ParamSpec& param(int index) const;

  // Freezes the registration; in distributed modes checks it across ranks (names, shapes,
  // dtypes, groups, shards, plan hash; any difference throws the same error on every rank
  // before data moves), plans owners and allocates state. Collective. The first step() calls
  // it when the caller did not.
  void setup();
  // One optimizer step over every registered parameter; data[i] belongs to parameter i.
  // Collective in distributed modes.
  void step(std::span<const ParamData> data);
  // Completes a publication left in flight by DistOptions::defer_publish (no-op otherwise).
  void wait_published();
  // Dedicated mode with caller_transfers: the owner's momentum update and orthogonalization of
  // the matrices of `params` this rank owns (their gradients final: data[k] belongs to
  // params[k]) run now, on the backend's current stream, batched by plan batch and shape; the
  // next step() only applies their updates (with the learning rate and weight decay of that
  // step). Not collective. Momentum and CacheMuon options are read now. A matrix may be
  // prepared once per step; the raise policy is refused (state changes before every status of
  // the step is known).
  void prepare(std::span<const int> params, std::span<const ParamData> data);

  bool distributed() const;
  const DistOptions& dist_options() const;
  // The plan of the Muon matrices (distributed, after setup); nullptr in a single process.
  const Plan* plan() const;
  // World rank that orthogonalizes matrix `slice` of a Muon parameter (0 in a single process).
  int owner(int param, int64_t slice = 0) const;

  // Optimizer state of a parameter, in backend memory, shaped like the parameter (fp32 unless
  // the group asks for bf16 momentum). Names: "momentum_buffer" (Muon), "exp_avg",
  // "exp_avg_sq" (AdamW). The view stays valid for the engine's lifetime.
  // Distributed: AdamW state and gather-mode momentum are shaped like the local shard; in owner
  // modes the momentum exists on the owner only (data == nullptr elsewhere) and a 3D parameter
  // whose matrices have several owners is read per matrix with matrix_state().
  // With CacheMuon on a Gram-NS shape also "cache_q", "cache_age", "cache_key", "cache_misses" (see
  // TransformCache::state; leading shape [] for a matrix, [e] for a 3D parameter). Reading them
  // freezes the parameter list (as a first step does); they stay valid until the group's cache
  // dtype, layout or algorithm changes. Distributed: the entries live where the matrix is
  // orthogonalized, like momentum: on its owner (data == nullptr elsewhere), on every rank in
  // gather mode.
  TensorView state(int param, const std::string& name);
  // The state of matrix `slice` of a Muon parameter: "momentum_buffer" (rows x cols) or a cache
  // state as above with leading shape []; data == nullptr when this rank does not hold it.
  TensorView matrix_state(int param, int64_t slice, const std::string& name);
  std::vector<std::string> state_names(int param) const;
  // The orthogonalization a Muon parameter runs (its group's config with `auto` resolved for
  // its shape: tuned where the backend measured it, else the heuristic). Freezes the
  // registration (and tunes, per EngineOptions::autotune) as a first step does.
  OrthoConfig resolved_ortho(int param);
  // Measures every `auto` shape class that the measurement store lacks for this backend now,
  // whatever EngineOptions::autotune says (one line per shape on stderr), stores the results and
  // runs them from the next step on; returns every `auto` class's answer (measured, stored or the
  // heuristic). Freezes the registration as a first step does. Distributed: collective, in place
  // of setup() (the plan of owners and the buffers depend on the algorithms; an engine already
  // set up refuses). On an untuned backend (the CPU) every answer is the heuristic.
  std::vector<TunedShape> tune();
  // The answers of the last tuning (set-up or tune()); empty before set-up.
  std::vector<TunedShape> tuned_shapes() const;
  // Steps taken by this parameter: steps with a gradient, less those skipped for a non-finite
  // gradient (a 3D parameter: less the skips of its most-skipped matrix). Synchronises.
  // Distributed, a Muon matrix's skips are known where its momentum is kept (its owner; the
  // holders of its rows in gather mode): param_step() counts what this rank knows,
  // param_steps() gives every rank every parameter's count (collective).
  int64_t param_step(int param) const;
  std::vector<int64_t> param_steps();
  // Sets a parameter's count (a checkpoint's); its skips start again from zero.
  void set_param_step(int param, int64_t step);

  // Synchronises the backend to read device-side counters.
  EngineStats stats();
  // Matrices prepared since the last step() (their updates wait for it).
  int64_t prepared_matrices() const;
  // Forgets them: the next step() computes every matrix afresh. Their momentum and CacheMuon
  // entries have advanced already (for a step abandoned after prepare()).
  void discard_prepared();
  Backend& backend();

  struct Impl;  // opaque; public only so the runtime's internal files can name it

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace distmuon
