// Internal state of the Engine shared by its files: the registry (engine.cc), the single-process
// step (local_step.cc), CacheMuon's entries (engine_cache.cc), the distributed set-up and plan
// (dist_setup.cc), the distributed step driver (dist_step.cc) and one runner per mode
// (mode_*.cc).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/cache.h"
#include "distmuon/engine.h"
#include "runtime/muon_batch.h"

namespace distmuon {

struct Param {
  ParamSpec spec;
  int64_t numel = 0;        // of the full parameter
  int64_t dim0 = 0;         // full size of dim 0
  int64_t inner = 0;        // elements per dim-0 row
  int64_t local_rows = 0;   // dim-0 rows held by this rank (dim0 when not sharded)
  int64_t local_numel = 0;  // elements held by this rank
  MatrixLayout layout;      // Muon only
  Buffer state0;            // momentum (single process, gather) or exp_avg (AdamW)
  Buffer state1;            // exp_avg_sq (AdamW)
  DType state0_dtype = DType::kF32;
  int64_t step = 0;  // Muon: steps with a gradient (see Impl::matrix_skips); AdamW: step_counts
  int64_t first_matrix = 0;   // Muon: index of its first matrix among all Muon matrices
  std::vector<int> matrices;  // distributed Muon: indices into Impl::mats, one per slice
  int adam_index = -1;        // AdamW: position among the AdamW parameters
  int cls = -1;               // single process, Muon: its shape class
  int64_t first_member = 0;   // single process, Muon: its first slice's position in the class
};

// CacheMuon entries (distmuon/cache.h) of one group and one wide shape m x n: one entry per
// matrix this process orthogonalizes (single process: every member of a shape class; owner
// modes: the matrices this rank owns, kept beside their momentum; gather: every matrix, since
// every rank solves everything). The TransformCache allocates nothing until the cache is used.
struct CacheClass {
  int group = 0;
  int64_t m = 0, n = 0;
  std::vector<std::string> names;  // per entry ("param" or "param[slice]"), for statistics
  std::unique_ptr<TransformCache> cache;
  bool use = false;  // this step: the group enables the cache and m x n resolves to Gram NS
  int64_t count() const { return static_cast<int64_t>(names.size()); }
};

// Muon matrices of one group and one wide shape m x n (single process), tall and wide weights
// together: their orthogonalization runs as one batch in the wide orientation, and the fused
// momentum and update passes run once per orientation on the two slices of that batch (the wide
// members come first).
struct ShapeClass {
  int group = 0;
  int64_t m = 0, n = 0;
  std::vector<std::pair<int, int64_t>> members;  // (param index, slice within a 3D parameter)
  int64_t wide_members = 0;                      // members [0, wide_members) are not tall
  OrthoConfig resolved;
  Buffer x, workspace;
  size_t workspace_bytes = 0;
  int cache = -1;  // its entries in Impl::caches (entry k = member k)
};

// One Muon matrix in a distributed engine (a parameter, or one slice of a 3D parameter).
struct DistMatrix {
  int param = 0;
  int64_t slice = 0;
  int64_t rows = 0, cols = 0;
  int group = 0;
  DType wire = DType::kF32;      // dtype on the wire: the parameter's
  int owner = 0;                 // world rank
  int owner_r = 0, owner_s = 0;  // HSDP coordinates of the owner (replica, shard position)
  int bucket = 0;
  int batch =
      0;  // the plan's batch of its owner: matrices of one batch are orthogonalized together
  // Rows [lo[q], hi[q]) of the matrix are held by shard position q (sharded and gather).
  std::vector<int64_t> lo, hi;
  Buffer momentum;  // owner modes: on the owner only
  // CacheMuon: its entry in Impl::caches, where this rank orthogonalizes it (owner modes: on the
  // owner; gather: everywhere), else -1.
  int cache = -1;
  int64_t cache_entry = -1;
  bool tall() const { return rows > cols; }
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
  int64_t numel() const { return rows * cols; }
};

struct Bucket {
  std::vector<int> mats;      // matrices, sorted by (owner, group, shape) (gather: by group, shape)
  int64_t status_offset = 0;  // first entry of this bucket in Impl::step_status / step_norms
  // Per step: the matrices that have a gradient, in `mats` order, and their runs (maximal
  // segments of one owner, plan batch, group and wide shape m x n; gather ignores owners and
  // batches). Inside a run the wide matrices come first, then the tall ones.
  std::vector<int> act;
  struct Run {
    int begin = 0, end = 0;  // positions in act
    int tall_begin = 0;      // first tall matrix (end when there is none)
  };
  std::vector<Run> runs;
};

class ModeRunner;

// Modes where each rank holds dim-0 shards of the weights (and of the AdamW state).
inline bool is_sharded_mode(DistMode m) {
  return m == DistMode::kSharded || m == DistMode::kGather;
}

// What one step knows beyond the registry.
struct StepContext {
  std::vector<ParamData> data;       // a copy: deferred stages outlive the caller's array
  std::vector<char> active;          // per parameter: stepped on every rank in this step
  std::vector<char> has_local;       // per parameter: this rank passed a gradient
  std::vector<MuonUpdateCoef> coef;  // distributed: per Muon matrix (index into Impl::mats)
  bool raise = false;                // NonFinitePolicy::kRaise
};

struct Engine::Impl {
  Backend& backend;
  EngineOptions options;
  std::vector<GroupOptions> groups;
  std::vector<Param> params;
  std::vector<ShapeClass> classes;
  std::vector<CacheClass> caches;  // CacheMuon entries (single process and distributed)
  bool built = false;
  Orthogonalizer ortho;
  EngineStats stats;
  Buffer skip_counter;  // int64 on the device
  // AdamW step counts on the device, one int64 per parameter (only AdamW entries are used):
  // adamw_update reads and advances them, so a replayed CUDA graph keeps counting. Until it is
  // allocated (the first step or setup) Param::step holds the count.
  Buffer step_counts;
  // Muon: per matrix (Param::first_matrix + slice; distributed: its index in `mats`), the steps
  // pass 2 skipped it, counted on the device where its momentum is kept (its owner; the rank of
  // a single process; every holder of its rows in gather mode). A Muon parameter's step count is
  // Param::step minus the most skips of its matrices.
  Buffer matrix_skips;
  int64_t* skips_of(const Param& p, int64_t slice) {
    return matrix_skips.as<int64_t>() + p.first_matrix + slice;
  }
  // The skips of every parameter's most-skipped matrix as this rank counted them (synchronises).
  std::vector<int64_t> local_skips();

  // ---- distributed (world == nullptr in a single process) ----
  Communicator* world = nullptr;
  DistOptions dist;
  std::unique_ptr<Communicator> shard_owned, replica_owned;
  Communicator* shard = nullptr;    // my shard group (the world when replicate == 1)
  Communicator* replica = nullptr;  // my replicate group (nullptr when replicate == 1)
  int rank = 0, world_size = 1, shard_size = 1, my_r = 0, my_s = 0;
  Plan plan;
  std::vector<DistMatrix> mats;
  std::vector<Bucket> buckets;
  std::vector<int> adam_params;  // AdamW parameters in registration order
  int64_t n_status = 0;          // Muon matrices + AdamW parameters
  Buffer step_status;            // int32 per Muon matrix (bucket order) then per AdamW parameter
  Buffer step_norms;             // double per Muon matrix (bucket order)
  std::unique_ptr<ModeRunner> runner;
  // Scratch of the owner computation, grown on demand and shared by all buckets (buckets
  // compute one after another).
  Buffer x, workspace, norms_scratch;
  size_t x_bytes = 0, workspace_size = 0;
  bool publish_pending = false;
  std::vector<std::pair<int, int>> deferred;  // (stage, bucket) left for finish_publish()
  std::unique_ptr<StepContext> pending_ctx;
  // AdamW in dedicated mode: local gradients copied in the wire dtype and all-reduced.
  Buffer adam_stage, adam_dummy;
  std::vector<int64_t> adam_offset;  // bytes, per AdamW parameter
  std::vector<CommHandle> adam_handles;
  std::vector<AdamSlot> adam_slots;
  // Collectives the step ordered on the device (CommHandle::wait_on_stream) instead of waiting
  // on the host mid-step, which would drain the GPU's queue and expose every later launch;
  // their completion and deadline are checked once everything is issued (end of the step).
  std::vector<CommHandle> unchecked;
  void wait_on_stream(CommHandle& h) {
    h.wait_on_stream();
    if (h.pending()) unchecked.push_back(std::move(h));
  }
  void wait_on_stream(std::vector<CommHandle>& hs) {
    for (CommHandle& h : hs) wait_on_stream(h);
    hs.clear();
  }
  void wait_unchecked();      // host-waits `unchecked` (deadlines); on failure drops the rest
  void bind_streams();  // the communicators follow the backend's current stream
  // Dedicated mode with caller transfers: batches prepared since the last step (momentum and
  // orthogonalization done, results in prep_x) whose updates step() applies.
  struct PreparedBatch {
    std::vector<int> mats;  // one owner batch, group and wide shape; wide matrices first
    int tall_begin = 0;     // first tall one (mats.size() when none)
    DType x_dtype = DType::kF32;
    size_t x_offset = 0;  // bytes into prep_x
    int64_t slot = 0;     // first entry in prep_norms / prep_status
  };
  std::vector<PreparedBatch> prepared;
  std::vector<char> is_prepared;  // per matrix
  Buffer prep_x, prep_norms, prep_status;
  size_t prep_x_used = 0;
  int64_t prep_slots_used = 0;

  Impl(Backend& be, EngineOptions opt);
  ~Impl();

  // registry / single process (engine.cc, local_step.cc)
  int add_param(const ParamSpec& spec);
  std::vector<std::string> registration_errors;  // distributed: reported by setup() everywhere
  void build_classes();
  // Uploads Param::step of every parameter and zeroes the Muon skip counters.
  void allocate_step_counts();
  int64_t* step_count(int i) { return step_counts.as<int64_t>() + i; }
  void ensure_class_buffers(ShapeClass& c);
  void local_step(std::span<const ParamData> data);
  void check_inputs(std::span<const ParamData> data) const;
  // "param" or "param[slice]" (a 3D parameter's matrix).
  std::string slice_name(int param, int64_t slice) const;

  // Per-shape algorithms of `auto` (engine_tune.cc). resolve_shape is the one place the runtime
  // resolves a group's config for a wide m x n shape: the tuned choice when tune_shapes found
  // one for the group's current config, else resolve(). tune_shapes asks the backend for
  // (group, m, n, count) shapes; distributed, rank 0 asks and every rank takes its answers
  // (collective), so every rank runs the same algorithm.
  struct TuneShape {
    int group;
    int64_t m, n, count;
  };
  OrthoConfig resolve_shape(int group, int64_t m, int64_t n) const;
  void tune_shapes(const std::vector<TuneShape>& shapes);
  void tune_dist_shapes();  // tune_shapes over the distributed matrices (counts: all ranks')
  std::map<std::string, OrthoConfig> tuned;  // key: tuned_key()

  // CacheMuon (engine_cache.cc). The index of the cache class of (group, m, n), created on demand.
  int cache_class_of(int group, int64_t m, int64_t n);
  // Binds a cache class to its group's current options for the resolved config; returns whether
  // this step uses it and, if so, the workspace bytes run_cached needs for `count` matrices.
  bool prepare_cache(CacheClass& cc, const OrthoConfig& resolved, int64_t count,
                     size_t* workspace_bytes);
  // How a batch is orthogonalized: fresh, or through the cache class `cache` (-1: none, or
  // not used in this step) where matrix k uses entry entries[k].
  BatchOrtho batch_ortho(int cache, std::span<const int64_t> entries, void* workspace,
                         size_t workspace_bytes);
  // Gives every matrix this rank orthogonalizes its cache entry, in the order the runs use them.
  void assign_cache_entries();
  // The cache entries of matrix `slice` of Muon parameter i on this rank: (class, entry), or
  // (-1, -1) when this rank holds none. Single process: builds the classes.
  std::pair<int, int64_t> cache_entry_of(int i, int64_t slice);
  CacheStats cache_stats();
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
  void adam_begin(StepContext& ctx);
  void adam_check(StepContext& ctx);
  void adam_update();
  // Dedicated mode moving gradients itself: AdamW gradients are all-reduced in the wire dtype.
  bool reduces_adam_gradients() const {
    return world && dist.mode == DistMode::kDedicated && !dist.caller_transfers;
  }
  // The step's statuses and norms (n_status entries).
  void allocate_step_status();
  // Raise policy: fails, naming every entry that is not ok on some rank, before anything changes.
  // muon_names: per Muon status entry, the matrix it belongs to this step ("" when none).
  void raise_if_nonfinite(const std::vector<std::string>& muon_names);
  // Dedicated mode with caller transfers (dedicated_prepare.cc).
  void prepare(std::span<const int> params, std::span<const ParamData> data);
  void apply_prepared(const StepContext& ctx);
  bool caller_transfers() const {
    return world && dist.mode == DistMode::kDedicated && dist.caller_transfers;
  }
  // Grows the shared scratch for `count` matrices of a shape with a resolved config.
  void ensure_scratch(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n,
                      size_t workspace_bytes = 0);
  CommStats comm_stats() const;
  std::string matrix_name(int j) const;
};

// Helpers for small host-side exchanges through backend memory (dist_exchange.cc): the
// communicator may require device buffers.
std::vector<int64_t> host_all_gather(Communicator& comm, Backend& be,
                                     const std::vector<int64_t>& mine);
std::vector<char> host_all_gather_v(Communicator& comm, Backend& be, const std::string& mine,
                                    const std::vector<int64_t>& lengths);
void host_all_reduce(Communicator& comm, Backend& be, std::vector<int32_t>& values, ReduceOp op);

std::string join_shape(std::span<const int64_t> s);

// What the start-up plan is made from.
struct RuntimePlanSpec {
  std::string solver = "milp";           // milp | lpt | round-robin
  OrthoConfig ortho;                     // the algorithm costed
  DeviceKind device = DeviceKind::kCPU;  // picks the analytic rates
  std::string cost_file;                 // measured costs instead (distmuon-plan --measure)
  std::string device_name;               // whose table cost_file must hold (Backend::name())
  std::vector<int> owners;               // fixed owners (DistOptions::owners): only batched
};
// The plan call site: the solver on analytic (or measured) costs, with a CPU-time guard on the
// MILP and LPT for instances too large to solve at start-up.
Plan make_runtime_plan(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                       const RuntimePlanSpec& spec);
// The layer index parsed from a parameter name (see dist_setup.cc), -1 when it has none.
int64_t layer_of(const std::string& name, std::map<std::string, int64_t>& ids);

}  // namespace distmuon
