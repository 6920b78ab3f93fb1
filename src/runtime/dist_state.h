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
  DType wire = DType::kF32;      // dtype on the wire: the parameter's
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

}  // namespace distmuon
