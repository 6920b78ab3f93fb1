// What the owner modes share: the owner's computation of one run (the same fused passes and
// batched orthogonalization as the single-process step, so results match it bit for bit), and
// the replicated mode, which needs nothing else.
#include <algorithm>

#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {

MuonBatch ModeRunner::run_batch(const Bucket& b, const Bucket::Run& run,
                                std::span<const MuonSlot> slots) const {
  const DistMatrix& m0 = dist_.mats[b.act[run.begin]];
  const int64_t first = b.status_offset + run.begin;
  return {backend_,
          registry_.groups[m0.group].muon,
          record_.scalars.mu(m0.group),
          resources_.resolve_shape(m0.group, m0.m(), m0.n()),
          run.end - run.begin,
          run.tall_begin - run.begin,
          slots,
          record_.step_norms.as<double>() + first,
          record_.step_status.as<int32_t>() + first};
}

void ModeRunner::owner_norms(const Bucket& b, const Bucket::Run& run,
                             std::span<const MuonSlot> slots) {
  run_batch(b, run, slots).momentum_norm();
}

void ModeRunner::owned_norms(const Bucket& b, const SlotsOf& slots_of) {
  for (const Bucket::Run& run : b.runs)
    if (dist_.mats[b.act[run.begin]].owner == dist_.rank) owner_norms(b, run, slots_of(run));
}

void ModeRunner::step_owned_runs(const Bucket& b, const StepContext& ctx, const SlotsOf& slots_of) {
  for (const Bucket::Run& run : b.runs) {
    if (dist_.mats[b.act[run.begin]].owner != dist_.rank) continue;
    // Pass 3's coefficients are in the slots from the start (pass 1 does not read them).
    std::vector<MuonSlot> slots = slots_of(run);
    for (int k = run.begin; k < run.end; ++k) slots[k - run.begin].coef = ctx.coef + b.act[k];
    const MuonBatch batch = run_batch(b, run, slots);
    const Bucket::Run* runs[] = {&run};
    BatchSequence seq;
    seq.norms = !ctx.raise;  // else the raise policy's pass1() ran it
    run_runs(b, runs, {&batch, 1}, seq);
  }
}

void ModeRunner::run_runs(const Bucket& b, std::span<const Bucket::Run* const> runs,
                          std::span<const MuonBatch> batches, BatchSequence seq) {
  std::vector<std::vector<int64_t>> entries(runs.size());
  // CacheMuon is decided here, on the device of the rank that orthogonalizes the run.
  seq.resources = [&](size_t k, BatchRef* x, BatchOrtho* how) {
    *how = prepare_run(b, *runs[k], batches[k].resolved, &entries[k], x);
  };
  seq.skip_counter = record_.skip_counter.as<int64_t>();
  run_batches(backend_, batches, seq);
}

BatchOrtho ModeRunner::prepare_run(const Bucket& b, const Bucket::Run& run,
                                   const OrthoConfig& resolved, std::vector<int64_t>* entries,
                                   BatchRef* x) {
  const DistMatrix& m0 = dist_.mats[b.act[run.begin]];
  // The matrices of a run share the group and shape, so their entries are of one cache class.
  entries->clear();
  for (int k = run.begin; k < run.end; ++k) entries->push_back(dist_.mats[b.act[k]].cache_entry);
  return resources_.prepare_batch(resolved, m0.cache, *entries, run.end - run.begin, m0.m(), m0.n(),
                                  x);
}

namespace {

// Replicated: gradients and weights are identical everywhere, so the owner steps on the
// caller's buffers and broadcasts the updated weights in place.
class ReplicatedRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;
  void setup() override { handles_.resize(dist_.buckets.size()); }
  int num_stages() const override { return 2; }
  int compute_stage() const override { return 0; }

  void pass1(int b, StepContext& ctx) override {
    const Bucket& bk = dist_.buckets[b];
    owned_norms(bk, [&](const Bucket::Run& run) { return slots(bk, run, ctx); });
  }

  void run_stage(int stage, int b, StepContext& ctx) override {
    Bucket& bk = dist_.buckets[b];
    if (stage == 1) {
      dist_.wait_on_stream(handles_[b]);
      return;
    }
    step_owned_runs(bk, ctx, [&](const Bucket::Run& run) { return slots(bk, run, ctx); });
    dist_.world->grouped([&] {  // one launch per bucket
      for (int j : bk.act) {
        const DistMatrix& m = dist_.mats[j];
        void* w = at(ctx.data[m.param].param, full_offset(m), m.wire);
        handles_[b].push_back(dist_.world->broadcast(w, m.numel(), comm_type(m.wire), m.owner));
      }
    });
  }

 private:
  std::vector<MuonSlot> slots(const Bucket& bk, const Bucket::Run& run, const StepContext& ctx) {
    std::vector<MuonSlot> out;
    for (int k = run.begin; k < run.end; ++k) {
      const DistMatrix& m = dist_.mats[bk.act[k]];
      const ParamData& d = ctx.data[m.param];
      const Param& p = registry_.params[m.param];
      out.push_back(
          {MatRef::of(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, m.rows, m.cols),
           MatRef::of(m.momentum.data(), p.state0_dtype, m.rows, m.cols),
           MatRef::of(at(d.param, full_offset(m), m.wire), m.wire, m.rows, m.cols),
           record_.skips_of(p, m.slice)});
    }
    return out;
  }
  std::vector<std::vector<CommHandle>> handles_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_replicated_runner(const RunnerContext& c) {
  return std::make_unique<ReplicatedRunner>(c);
}

}  // namespace distmuon
