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

// What one distributed step knows beyond the registry.
struct StepContext {
  std::vector<ParamData> data;       // a copy: deferred stages outlive the caller's array
  std::vector<char> active;          // per parameter: stepped on every rank in this step
  std::vector<char> has_local;       // per parameter: this rank passed a gradient
  std::vector<MuonUpdateCoef> coef;  // per Muon matrix (index into Impl::mats)
  bool raise = false;                // NonFinitePolicy::kRaise
};

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
  // The owner's work on one run of bucket b (matrices act[run.begin, run.end) with one owner,
  // group and shape). Pass 1: momentum norms and statuses into step_norms / step_status.
  void owner_pass1(const Bucket& b, const Bucket::Run& run, std::span<const MuonSlot> slots);
  // Pass 2, orthogonalization and either the weight update on the slots' weights (out ==
  // nullptr) or the orthogonalized matrices written to out(k), rows x cols in the wire dtype.
  void owner_rest(const Bucket& b, const Bucket::Run& run, std::span<const MuonSlot> slots,
                  const StepContext& ctx, const std::function<void*(int k)>* out);
  // Before a run is orthogonalized: grows the shared scratch for it and, where the run uses
  // CacheMuon on this rank, returns its cache class and fills the matrices' entries (else -1).
  int prepare_run(const Bucket& b, const Bucket::Run& run, const OrthoConfig& resolved,
                  std::vector<int64_t>* entries);
  // Calls f(k0, len, tall) for the wide and the tall part of a run (positions relative to
  // run.begin), skipping an empty part: the fused passes take one orientation per call.
  static void for_each_orientation(const Bucket::Run& run,
                                   const std::function<void(int k0, int len, bool tall)>& f);
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
