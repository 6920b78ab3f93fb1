// The types shared by the Engine and the runtime behind it: policies and options of an engine
// (EngineOptions, DistOptions), what is registered and passed per step (ParamSpec, ShardSpec,
// ParamData), and what it reports (EngineStats, TunedShape). The runtime's parts
// (src/runtime) include this header, not engine.h, so that nothing below the Engine names it;
// distmuon/engine.h includes it, so users of the Engine see no difference.
#pragma once

#include <cstdint>
#include <span>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/comm.h"
#include "distmuon/optimizer.h"
#include "distmuon/ortho.h"
#include "distmuon/types.h"

namespace distmuon {

enum class NonFinitePolicy : int {
  kSkip = 0,   // skip the affected matrices/tensors, count them (no host synchronisation)
  kRaise = 1,  // throw before any state is touched (synchronises once per step)
};

// How Iteration::kAuto picks each shape's algorithm on a backend that is tuned (CUDA; see
// Backend::tuning_fingerprint).
enum class AutoTune : int {
  kOff = 0,     // the shape heuristic (resolve()), as on the CPU backend
  kCached = 1,  // the measurement store's choices for this device where it has them; for the
                // other shapes a cost model calibrated on the stored ones; with an empty store
                // the heuristic
  kOn = 2,      // kCached, measuring the shapes it lacks when the engine sets up (slow, once per
                // shape, batch size and device; progress on stderr)
};
// "off" | "cached" | "on"
AutoTune parse_autotune(const std::string& s);

// How `auto` was resolved for one shape class (Engine::tune, Engine::tuned_shapes).
struct TunedShape {
  int group = 0;
  int64_t rows = 0, cols = 0;  // wide: rows <= cols
  int64_t count = 0;           // matrices in the class (distributed: on all ranks)
  OrthoConfig config;          // resolved
  // "stored" / "measured" (the measurement store, earlier or now), "predicted" (the cost model
  // on the stored shapes), "heuristic" (resolve(): an untuned backend, an empty store, autotune
  // off, or a config the tuner does not cover), "grouped" (a class whose products share their
  // launches with other small classes: Gram NS for all of them, untimed; docs/design.md).
  std::string source;
  double ms = 0;  // the batch's measured or predicted milliseconds; 0 for the heuristic
};

struct EngineOptions {
  NonFinitePolicy nonfinite = NonFinitePolicy::kSkip;
  // DISTMUON_AUTOTUNE=off|cached|on overrides this when set.
  AutoTune autotune = AutoTune::kOn;
  // Let a tuned `auto` pick Gram NS without restarts where it measured fastest; by default only
  // restart sets containing 2 (the published choice) are taken: the tuner checks errors on random
  // inputs, whose spectra hide the half-precision drift a restart corrects on real momentum.
  // DISTMUON_AUTOTUNE_RESTART_FREE=1 overrides.
  bool allow_restart_free = false;
  // Whole-step graphs (single process, on backends that capture: CUDA): the second step in a row
  // that touches the same buffers with the same algorithms is captured, and later ones replay it
  // while that holds, so that a step costs one launch of host time. Hyperparameters (lr, weight
  // decay, momentum, AdamW's) are uploaded to the device before each replay, so a scheduler does
  // not invalidate the graph. Steps that need the host mid-step issue eagerly: the raise policy,
  // CacheMuon's shadow mode and distributed engines; inside the caller's own capture the step is
  // recorded there instead. DISTMUON_GRAPHS=0|1 overrides.
  bool graphs = true;
};

// Distributed modes (docs/design.md, "One step, distributed"); what each expects in ParamData.
enum class DistMode : int {
  // Dim-0 shards of reduced gradients and weights (FSDP2). Every rank all-gathers every
  // matrix, orthogonalizes all of them and keeps its rows: the naive baseline.
  kGather = 0,
  // Full reduced gradients identical on every rank, full weights (DDP, one GPU per replica).
  // Each matrix's owner computes; updated weights are broadcast from it.
  kReplicated = 1,
  // Dim-0 shards of reduced gradients and weights (FSDP2, uneven and empty shards allowed).
  // All-to-all moves the rows to each matrix's owner, the owner computes, all-to-all moves the
  // update's rows back. HSDP: shards are identical across replicas.
  kSharded = 2,
  // Full local (unreduced) gradients and full weights. Gradients are reduced to the owner (in
  // HSDP inside the shard group first, then across replicas), the owner steps, updated weights
  // are broadcast (across replicas first, then inside the shard group).
  kDedicated = 3,
};
// "gather" | "replicated" | "sharded" | "dedicated"
DistMode parse_dist_mode(const std::string& s);
const char* dist_mode_name(DistMode m);

struct DistOptions {
  DistMode mode = DistMode::kSharded;
  // HSDP replicate degree: world = replicate x shard, world rank = r * shard + s. Shards of
  // sharded/gather parameters are split over the shard group; owners span all ranks.
  // Replicated mode treats the world as flat.
  int replicate = 1;
  // Full-matrix bytes per bucket: every bucket's gradients are sent first, then each bucket's
  // results travel while the next one computes. <= 0: one bucket (also the case in a world of
  // one rank and with caller_transfers, where nothing moves).
  int64_t bucket_bytes = kDefaultBucketBytes;
  // Owner modes (sharded, dedicated, replicated): an owner orthogonalizes each plan batch (its
  // matrices of one shape class, as the planner costed them) as one batch, in the compute stage
  // of the last bucket holding a member, once every such bucket has landed (true); the buckets'
  // transfers stay per bucket. false: one batch per bucket the plan batch spans, each right after
  // its bucket lands (more batches, each paying a batch's fixed cost, but the compute of one
  // bucket overlaps the transfers of the next ones). Gather mode batches per bucket either way.
  bool batches_across_buckets = true;
  // Dedicated mode reduces local gradients: true divides the sum by the world size (the mean,
  // as DDP does); false keeps the sum.
  bool grad_mean = true;
  // Leave the publication (the stages after the last bucket's compute: HSDP's broadcast to the
  // other replicas and what follows it, the sharded mode's weight update, the final waits) in
  // flight when step() returns; wait_published() or the next step() completes it. Weights must
  // not be read before.
  bool defer_publish = false;
  // Ranks vote on which parameters have a gradient in each step (one small all-reduce), so that
  // a parameter is stepped on all ranks or on none, and that ranks step with the same options
  // (a digest of every group's). Disable only if the caller guarantees both.
  bool check_grad_presence = true;
  int gpus_per_node = 8;  // topology hint for the planner
  // Owner planner (distmuon/plan.h): "milp" (LPT for very large instances), "lpt" or
  // "round-robin". Layers, which the planner spreads over owners, are parsed from the parameter
  // names ("h.3.mlp.c_fc.weight" is layer 3 of "h").
  std::string planner = "milp";
  // Costs the planner balances. "auto": measured times from the store of `distmuon-plan
  // --measure` (DISTMUON_COST_CACHE) where it holds this device's (Backend::name()) table and
  // the shape, analytic costs for the other shapes (counted FLOPs and bytes, with an H200's
  // rates on CUDA and a CPU's on the CPU backend, scaled to the measured ones). "analytic": no
  // measurements. Else a cost file that must hold this device's table. Empty: the value of
  // DISTMUON_PLAN_COSTS (default auto). Rank 0's setting and files decide for every rank.
  std::string plan_costs;
  // Fixed owners instead of the planner: the world rank of every Muon matrix in registration
  // order (a 3D parameter: one per slice), e.g. from plan_owners() made before the engine
  // existed. Each owner orthogonalizes its matrices of one shape as one batch. Empty: planned.
  std::vector<int> owners;
  // Dedicated mode: the caller moves the data (distmuon.torch.dedicate: gradients reduced to the
  // owners during backward, weights broadcast during forward). ParamData::grad on a matrix's
  // owner is then its final, averaged gradient, step() only computes on the owners and moves
  // nothing, and other ranks' data for the matrix is ignored (null allowed). AdamW parameters
  // step with the caller's gradients as given. Enables prepare().
  bool caller_transfers = false;
  // Sharded and gather modes: the precision of what travels (gradient rows to their owners and
  // the updates back; gather's momentum rows) for parameters of a wider dtype, e.g. bf16 for f32
  // parameters, half the bytes and staging copies: every gradient and update is rounded to it
  // once (docs/distributed.md, "The wire's precision"). Parameters narrower than it keep their
  // own. Empty: each parameter's dtype. f16 is refused (its range flushes small gradients), and
  // so is any narrower wire in the other modes, which move weights.
  std::optional<DType> wire_dtype;
};

// The part of dim 0 this rank holds of a parameter (a Shard(0) local tensor): rows
// [row_begin, row_begin + row_count). row_count < 0: the whole parameter (not sharded). In
// sharded and gather modes every parameter is sharded and the shards of the ranks of one shard
// group tile dim 0 (empty shards allowed).
struct ShardSpec {
  int64_t row_begin = 0;
  int64_t row_count = -1;
  bool sharded() const { return row_count >= 0; }
};

struct ParamSpec {
  std::string name;
  int group = 0;               // index returned by Engine::add_group
  std::vector<int64_t> shape;  // full logical shape
  DType dtype = DType::kF32;   // parameter dtype (the gradient may differ)
  ShardSpec shard = {};        // distributed sharded/gather modes: the local rows of dim 0
};

// The buffers of one parameter for one step. grad == nullptr: the parameter has no gradient in
// this step and is left alone (as torch.optim does). In sharded and gather modes param and grad
// hold the local shard (row_count x the other dims, contiguous; null when the shard is empty).
struct ParamData {
  void* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  std::span<const int64_t> grad_shape;  // optional: checked against the parameter's shape
};

struct EngineStats {
  int64_t steps = 0;
  int64_t nonfinite_skips = 0;  // matrices/tensors skipped because of NaN/Inf gradients
  OrthoStats ortho;             // orthogonalization work done by this process (CacheMuon
                                // classes count what an ideal device does, see CacheStats)
  CacheStats cache;             // CacheMuon, summed over the shape classes that use it
  int64_t muon_matrices = 0;    // registered Muon matrices (3D params count once per slice)
  int64_t muon_params = 0;      // elements in Muon parameters
  int64_t adamw_params = 0;     // elements in AdamW parameters
  int64_t owned_matrices = 0;   // Muon matrices this rank orthogonalizes per step (all of them
                                // in a single process and in gather mode)
  CommStats comm;               // bytes moved by this rank during step(), all communicators
  // What the engine's backend holds: its buffers (momentum, stages, workspaces, communication
  // buffers) now and at the most since it was made (Backend::memory_use).
  MemoryUse memory;
  int64_t graph_captures = 0;   // steps captured into a graph (EngineOptions::graphs)
  int64_t graph_replays = 0;    // steps that replayed it (the captured step not counted)
  // Host milliseconds the last step() spent issuing its work: the whole call in one process; in
  // the distributed step, from after the ranks' vote (which waits for the slowest rank) to the
  // end-of-step wait for the collectives' completion (which follows the device, not the host's
  // own cost); under NonFinitePolicy::kRaise it includes the mid-step wait for the statuses.
  double issue_ms = 0;
};

}  // namespace distmuon
