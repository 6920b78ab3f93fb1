// The distributed state of an Engine: the communicators and this rank's place among them, the
// plan, the Muon matrices with their owners and shard rows, the buckets, and the collectives a
// step left to check. Built by dist_setup() / build_matrices() and read by the runners.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distmuon/comm.h"
#include "distmuon/engine_types.h"
#include "distmuon/hsdp.h"
#include "distmuon/plan.h"

namespace distmuon {

// One Muon matrix in a distributed engine (a parameter, or one slice of a 3D parameter).
struct DistMatrix {
  int param = 0;
  int64_t slice = 0;
  int64_t rows = 0, cols = 0;
  int group = 0;
  DType dtype = DType::kF32;     // the parameter's
  DType wire = DType::kF32;      // dtype on the wire: the parameter's, or DistOptions::wire_dtype
  int owner = 0;                 // world rank
  int owner_r = 0, owner_s = 0;  // HSDP coordinates of the owner (replica, shard position)
  int bucket = 0;
  int batch =
      0;  // the plan's batch of its owner: matrices of one batch are orthogonalized together
  // Rows [lo[q], hi[q]) of the matrix are held by shard position q (sharded and gather).
  std::vector<int64_t> lo, hi;
  Buffer momentum;  // owner modes: on the owner only
  // CacheMuon: its entry in Engine::Impl::caches, where this rank orthogonalizes it (owner modes:
  // on the owner; gather: everywhere), else -1.
  int cache = -1;
  int64_t cache_entry = -1;
  bool tall() const { return rows > cols; }
  int64_t m() const { return std::min(rows, cols); }
  int64_t n() const { return std::max(rows, cols); }
  int64_t numel() const { return rows * cols; }
};

struct Bucket {
  std::vector<int> mats;      // matrices, sorted by (owner, group, shape) (gather: by group, shape)
  int64_t status_offset = 0;  // first entry of this bucket in StepRecord::step_status / step_norms
  // Per step: the matrices that have a gradient, in `mats` order, and their runs (maximal
  // segments of one owner, plan batch, group and wide shape m x n; gather ignores owners and
  // batches). Inside a run the wide matrices come first, then the tall ones.
  std::vector<int> act;
  struct Run {
    int begin = 0, end = 0;  // positions in act
    int tall_begin = 0;      // first tall matrix (end when there is none)
  };
  std::vector<Run> runs;
  // Per step, owner modes: the owner batches (DistState::owner_batches) whose last bucket is this
  // one -- the compute stage of this bucket orthogonalizes them -- and `ready`, the bucket whose
  // compute stage completes every update of this bucket (the last bucket of any owner batch with a
  // member here; this bucket itself in gather mode or where it has none): the stages after the
  // compute stage of this bucket follow that one's.
  std::vector<int> completes;
  int ready = 0;
  std::vector<int> ready_buckets;  // the buckets whose `ready` is this one, in order
};

// An owner's batch in one step (owner modes): the active matrices of one owner, plan batch, group
// and wide shape m x n, across buckets -- the runs of that key in every bucket, which
// prepare_buckets() gathers. The owner orthogonalizes it once, in the compute stage of its last
// bucket (after each bucket holding a member has landed), so a shape class that spans buckets is
// one batch as the planner costed it, not one per bucket. The transfers stay per bucket.
struct OwnerBatch {
  int owner = 0;
  int last = 0;                     // the last bucket holding a member
  std::vector<int> mats;            // wide members first (bucket by bucket), then tall ones
  std::vector<int64_t> status;      // per member: its entry in StepRecord::step_status / step_norms
  int64_t tall_begin = 0;           // first tall member (mats.size() when there is none)
  int64_t scratch = 0;              // its first entry in the runner's gathered norms and statuses
  // Whether `status` is one consecutive range (a batch inside one bucket): the batch then reads
  // the step's statuses and norms in place, else copies of them gathered after pass 1.
  bool contiguous() const {
    for (size_t k = 1; k < status.size(); ++k)
      if (status[k] != status[0] + static_cast<int64_t>(k)) return false;
    return true;
  }
};

// Modes where each rank holds dim-0 shards of the weights (and of the AdamW state).
inline bool is_sharded_mode(DistMode m) {
  return m == DistMode::kSharded || m == DistMode::kGather;
}

struct DistState {
  Communicator* world = nullptr;  // nullptr in a single process
  DistOptions options;
  // The world as replicate x shard (flat in replicated mode), and its groups (HsdpComms, split
  // at set-up; none with caller_transfers, where the caller moves the dedicated traffic).
  HsdpWorld hsdp;
  HsdpComms groups;
  Communicator* shard = nullptr;    // my shard group (the world when replicate == 1)
  Communicator* replica = nullptr;  // my replicate group (nullptr when replicate == 1)
  // hsdp's, for the runners: member, size, shard, my replica and shard position.
  int rank = 0, world_size = 1, shard_size = 1, my_r = 0, my_s = 0;
  Plan plan;
  std::vector<DistMatrix> mats;
  std::vector<Bucket> buckets;
  std::vector<OwnerBatch> owner_batches;  // per step (owner modes): every owner's, all ranks alike

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
  void wait_unchecked();  // host-waits `unchecked` (deadlines); on failure drops the rest
  // The communicators follow the stream the backend issues on (dist_step.cc says why).
  void bind_streams(void* stream);
  CommStats comm_stats() const;
};

// DISTMUON_PLAN_MEASURE=auto: whether rank 0 times the shape classes its store lacks before
// planning. On CUDA (on CPUs a large class takes seconds), unless ranks take turns on one GPU
// (NCCL's several ranks per GPU without MPS): rank 0 would keep a time-sliced cost as the
// device's. An MPS client (`mps_partition`) has SMs of its own, and the store keys a table by
// the SMs the process sees, so it times its partition, apart from the whole GPU's table.
bool plan_measure_by_default(DeviceKind kind, bool mps_partition, bool several_ranks_per_gpu);

}  // namespace distmuon
