// Internal state of the Engine shared by its files: the registry (engine.cc), the single-process
// step (local_step.cc), the distributed set-up (dist_setup.cc), the distributed step driver
// (dist_step.cc) and one runner per mode (mode_*.cc).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/engine.h"

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
  int64_t step = 0;
  std::vector<int> matrices;  // distributed Muon: indices into Impl::mats, one per slice
  int adam_index = -1;        // AdamW: position among the AdamW parameters
};

// Muon matrices of one group and one shape (single process): their momentum passes run as one
// launch list and their orthogonalization as one batch.
struct ShapeClass {
  int group = 0;
  int64_t rows = 0, cols = 0;
  std::vector<std::pair<int, int64_t>> members;  // (param index, slice within a 3D parameter)
  OrthoConfig resolved;
  Buffer x, workspace, norms, status;
  size_t workspace_bytes = 0;

  bool tall() const { return rows > cols; }
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
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
  bool tall() const { return rows > cols; }
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
  int64_t numel() const { return rows * cols; }
};

struct Bucket {
  std::vector<int> mats;      // matrices, sorted by (owner, group, shape) (gather: by group, shape)
  int64_t status_offset = 0;  // first entry of this bucket in Impl::step_status / step_norms
  // Per step: the matrices that have a gradient, in `mats` order, and their runs (maximal
  // segments of one owner, group and shape; gather ignores owners).
  std::vector<int> act;
  struct Run {
    int begin = 0, end = 0;  // positions in act
  };
  std::vector<Run> runs;
};

class ModeRunner;
struct StepContext;

struct Engine::Impl {
  Backend& backend;
  EngineOptions options;
  std::vector<GroupOptions> groups;
  std::vector<Param> params;
  std::vector<ShapeClass> classes;
  bool built = false;
  Orthogonalizer ortho;
  EngineStats stats;
  Buffer skip_counter;  // int64 on the device
  Buffer adam_status;

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
  Buffer step_norms;             // float per Muon matrix (bucket order)
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

  Impl(Backend& be, EngineOptions opt);
  ~Impl();

  // registry / single process (engine.cc, local_step.cc)
  int add_param(const ParamSpec& spec);
  std::vector<std::string> registration_errors;  // distributed: reported by setup() everywhere
  void build_classes();
  void ensure_class_buffers(ShapeClass& c);
  void local_step(std::span<const ParamData> data);
  void check_inputs(std::span<const ParamData> data) const;
  void raise_if_nonfinite(const std::vector<std::vector<int>>& slot_params,
                          const std::vector<int>& adam_params);

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
  void adam_update(StepContext& ctx);
  void raise_check();
  // Grows the shared scratch for `count` matrices of a shape with a resolved config.
  void ensure_scratch(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n);
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

// The plan call site: one function, so that the planner can replace the baseline here.
Plan make_runtime_plan(const std::vector<PlanMatrix>& matrices, const Topology& topo);

}  // namespace distmuon
