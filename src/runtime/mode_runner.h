// One runner per distributed mode. The driver (dist_step.cc) moves every bucket through the
// runner's stages, software-pipelined: in time slot t it runs stage 0 of bucket t (so the next
// bucket's gradients travel while the current one computes), then stage 1 of bucket t-1, and
// so on. Each stage waits only for the handles the previous stage of the same bucket issued.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "runtime/engine_impl.h"

namespace distmuon {

class ModeRunner {
 public:
  explicit ModeRunner(Engine::Impl& e) : e_(e) {}
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

 protected:
  // Every run of bucket b (matrices act[run.begin, run.end) of one owner -- gather: every rank --
  // plan batch, group and wide shape) is one MuonBatch, with its statuses and norms in the step's.
  MuonBatch run_batch(const Bucket& b, const Bucket::Run& run,
                      std::span<const MuonSlot> slots) const;
  // The owner's work on a run: pass 1 (norms and statuses) ...
  void owner_norms(const Bucket& b, const Bucket::Run& run, std::span<const MuonSlot> slots);
  // ... then pass 2, the orthogonalization and the update of the slots' weights ...
  void owner_update(const Bucket& b, const Bucket::Run& run, std::span<const MuonSlot> slots,
                    const StepContext& ctx);
  // ... or, instead of the update, the orthogonalized matrix j written to out(j), rows x cols in
  // the wire dtype (the shards apply it).
  void owner_orthogonalized(const Bucket& b, const Bucket::Run& run,
                            std::span<const MuonSlot> slots, const std::function<void*(int j)>& out);
  // Before a run is orthogonalized: grows the shared scratch for it (x: the run's iteration
  // buffer) and says how it is orthogonalized -- through CacheMuon where the run uses it on this
  // rank (its matrices' entries go to `entries`), else fresh.
  BatchOrtho prepare_run(const Bucket& b, const Bucket::Run& run, const OrthoConfig& resolved,
                         std::vector<int64_t>* entries, BatchRef* x);
  // Pass 2 and the orthogonalization of an owner's run: the run's iteration buffer.
  BatchRef owner_orthogonalize(const Bucket& b, const Bucket::Run& run, const MuonBatch& batch);
  int32_t* status_at(const Bucket& b, int pos) const {
    return e_.step_status.as<int32_t>() + b.status_offset + pos;
  }
  // Element `elems` of a buffer of dtype t.
  static char* at(const void* base, int64_t elems, DType t) {
    return const_cast<char*>(static_cast<const char*>(base)) +
           elems * static_cast<int64_t>(dtype_size(t));
  }
  // Where row `row` of matrix j starts in this rank's local shard of its parameter.
  int64_t local_offset(const DistMatrix& m, int64_t row) const {
    const Param& p = e_.params[m.param];
    return m.slice * m.rows * m.cols + row * m.cols - p.spec.shard.row_begin * p.inner;
  }
  // Element offset of matrix j in its (unsharded) parameter.
  static int64_t full_offset(const DistMatrix& m) { return m.slice * m.rows * m.cols; }
  // Copies (converting dtype when needed) a rows x cols block.
  void copy_block(const void* src, DType src_t, void* dst, DType dst_t, int64_t rows, int64_t cols);

  Engine::Impl& e_;
};

std::unique_ptr<ModeRunner> make_gather_runner(Engine::Impl& e);
std::unique_ptr<ModeRunner> make_sharded_runner(Engine::Impl& e);
std::unique_ptr<ModeRunner> make_replicated_runner(Engine::Impl& e);
std::unique_ptr<ModeRunner> make_dedicated_runner(Engine::Impl& e);

}  // namespace distmuon
