// One runner per distributed mode. The driver (dist_step.cc) moves every bucket through the
// runner's stages: the stages before the compute stage for every bucket first (the gradients'
// way in), then, software-pipelined, in time slot t the compute stage of bucket t and the later
// stages of the buckets that bucket t's compute completes (Bucket::ready: an owner batch spanning
// buckets is computed in the compute stage of its last bucket, so the updates of the earlier
// ones are complete only then), one slot per stage. Each stage waits only for the handles the
// previous stage of the same bucket issued, and the owner's compute of a batch for every bucket
// holding a member.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "runtime/batch_resources.h"
#include "runtime/dist_state.h"
#include "runtime/muon_batch.h"
#include "runtime/registry.h"
#include "runtime/step_state.h"

namespace distmuon {

// What a runner's stages see: the registry (read-only), the distributed layout and
// communicators, the step's statuses and counters, and the batch resources -- not the engine.
struct RunnerContext {
  Backend& backend;
  const Registry& registry;
  DistState& dist;
  StepRecord& record;
  BatchResources& resources;
};

class ModeRunner {
 public:
  explicit ModeRunner(const RunnerContext& c)
      : backend_(c.backend),
        registry_(c.registry),
        dist_(c.dist),
        record_(c.record),
        resources_(c.resources) {}
  virtual ~ModeRunner() = default;

  virtual void setup() = 0;  // buffers, once the plan and the buckets exist
  virtual int num_stages() const = 0;
  // Stages before this one only move gradients and touch no state: with the raise policy the
  // driver runs them and pass1() for every bucket, checks the statuses of all ranks, and only
  // then runs the remaining stages.
  virtual int compute_stage() const = 0;
  virtual void run_stage(int stage, int b, StepContext& ctx) = 0;
  // Writes the non-finite statuses of bucket b into Impl::step_status (raise policy).
  virtual void pass1(int b, StepContext& ctx) = 0;
  // Whether DistOptions::defer_publish may leave this stage, after the last compute, to
  // finish_publish(): the stages that publish the weights; one that only issues a transfer the
  // caller's stream does not wait for gains nothing there and runs in the step.
  virtual bool deferrable(int /*stage*/) const { return true; }

 protected:
  // Every run of bucket b (matrices act[run.begin, run.end) of one owner -- gather: every rank --
  // plan batch, group and wide shape) is one MuonBatch, with its statuses and norms in the step's.
  MuonBatch run_batch(const Bucket& b, const Bucket::Run& run,
                      std::span<const MuonSlot> slots) const;
  // run_batches (muon_batch.h) over runs of bucket b, batches[k] made from *runs[k] by
  // run_batch, each run's scratch and CacheMuon binding from prepare_run; `seq` says the rest.
  void run_runs(const Bucket& b, std::span<const Bucket::Run* const> runs,
                std::span<const MuonBatch> batches, BatchSequence seq);
  // prepare_batch for a run (its matrices' cache entries go to `entries`; x: the run's shared
  // iteration buffer).
  BatchOrtho prepare_run(const Bucket& b, const Bucket::Run& run, const OrthoConfig& resolved,
                         std::vector<int64_t>* entries, BatchRef* x);
  // The slot of Muon matrix j (an index into DistState::mats) as the mode holds it; pass 3's
  // coefficients are set by the caller.
  using SlotOf = std::function<MuonSlot(int j)>;
  // Pass 1 (norms and statuses, into the step's entries of bucket b) on every run of bucket b
  // this rank owns: in the bucket's compute stage, or before it in the raise policy's pass1().
  void owned_norms(const Bucket& b, const SlotOf& slot_of);
  // What the owner does with member j's update x (one matrix, wide orientation) instead of pass 3.
  using MemberOutput = std::function<void(int j, const BatchRef& x)>;
  // The owner batches this rank completes in the compute stage of bucket t (Bucket::completes,
  // each after pass 1 of every run in it, per bucket): pass 2, the orthogonalization, the skips,
  // then pass 3 on the slots' weights with the step's coefficients (ctx.coef), or `output` per
  // member where it is set.
  void run_owner_batches(int t, const StepContext& ctx, const SlotOf& slot_of,
                         const MemberOutput& output = {});
  // The owner's part of bucket t's compute stage where nothing travels in between: pass 1 of its
  // runs (unless the raise policy ran it), then the owner batches it completes, updated in place.
  void step_owned(int t, const StepContext& ctx, const SlotOf& slot_of) {
    if (!ctx.raise) owned_norms(dist_.buckets[t], slot_of);
    run_owner_batches(t, ctx, slot_of);
  }
  int32_t* status_at(const Bucket& b, int pos) const {
    return record_.step_status.as<int32_t>() + b.status_offset + pos;
  }
  // Element `elems` of a buffer of dtype t.
  static char* at(const void* base, int64_t elems, DType t) {
    return const_cast<char*>(static_cast<const char*>(base)) +
           elems * static_cast<int64_t>(dtype_size(t));
  }
  // Where row `row` of matrix j starts in this rank's local shard of its parameter.
  int64_t local_offset(const DistMatrix& m, int64_t row) const {
    const Param& p = registry_.params[m.param];
    return m.slice * m.rows * m.cols + row * m.cols - p.spec.shard.row_begin * p.inner;
  }
  // Element offset of matrix j in its (unsharded) parameter.
  static int64_t full_offset(const DistMatrix& m) { return m.slice * m.rows * m.cols; }
  // Copies (converting dtype when needed) a rows x cols block.
  void copy_block(const void* src, DType src_t, void* dst, DType dst_t, int64_t rows,
                  int64_t cols) {
    distmuon::copy_block(backend_, src, src_t, dst, dst_t, rows, cols);
  }

  Backend& backend_;
  const Registry& registry_;
  DistState& dist_;
  StepRecord& record_;
  BatchResources& resources_;

 private:
  // An owner batch as a MuonBatch on `slots`; its norms and statuses are read in place when they
  // are one range of the step's entries, else gathered into gathered_* (device copies, issued
  // here, after pass 1 of every bucket it spans).
  MuonBatch owner_batch(const OwnerBatch& ob, std::span<const MuonSlot> slots);
  Buffer gathered_norms_, gathered_status_;  // one entry per Muon matrix, allocated on first use
};

// The distributed step's driver state (dist_step.cc): the mode's runner, and the publication a
// step left in flight (DistOptions::defer_publish) until finish_publish().
struct Pipeline {
  std::unique_ptr<ModeRunner> runner;
  bool publish_pending = false;
  std::vector<std::pair<int, int>> deferred;  // (stage, bucket) left for finish_publish()
  std::unique_ptr<StepContext> pending_ctx;   // the step they belong to
};

std::unique_ptr<ModeRunner> make_gather_runner(const RunnerContext& c);
std::unique_ptr<ModeRunner> make_sharded_runner(const RunnerContext& c);
std::unique_ptr<ModeRunner> make_replicated_runner(const RunnerContext& c);
std::unique_ptr<ModeRunner> make_dedicated_runner(const RunnerContext& c);

}  // namespace distmuon
