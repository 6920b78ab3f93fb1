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

void ModeRunner::owned_norms(const Bucket& b, const SlotOf& slot_of) {
  for (const Bucket::Run& run : b.runs) {
    if (dist_.mats[b.act[run.begin]].owner != dist_.rank) continue;
    std::vector<MuonSlot> slots;
    for (int k = run.begin; k < run.end; ++k) slots.push_back(slot_of(b.act[k]));
    run_batch(b, run, slots).momentum_norm();
  }
}

MuonBatch ModeRunner::owner_batch(const OwnerBatch& ob, std::span<const MuonSlot> slots) {
  const DistMatrix& m0 = dist_.mats[ob.mats[0]];
  double* norms = record_.step_norms.as<double>();
  int32_t* status = record_.step_status.as<int32_t>();
  if (ob.contiguous()) {
    norms += ob.status[0];
    status += ob.status[0];
  } else {
    if (!gathered_norms_) {
      const size_t n = std::max<size_t>(dist_.mats.size(), 1);
      gathered_norms_ = backend_.alloc(n * sizeof(double));
      gathered_status_ = backend_.alloc(n * sizeof(int32_t));
    }
    double* gn = gathered_norms_.as<double>() + ob.scratch;
    int32_t* gs = gathered_status_.as<int32_t>() + ob.scratch;
    const size_t n = ob.status.size();
    for (size_t k0 = 0, k1; k0 < n; k0 = k1) {  // one copy per consecutive range of entries
      for (k1 = k0 + 1; k1 < n && ob.status[k1] == ob.status[k1 - 1] + 1;) ++k1;
      backend_.copy(gn + k0, norms + ob.status[k0], (k1 - k0) * sizeof(double));
      backend_.copy(gs + k0, status + ob.status[k0], (k1 - k0) * sizeof(int32_t));
    }
    norms = gn;
    status = gs;
  }
  return {backend_,
          registry_.groups[m0.group].muon,
          record_.scalars.mu(m0.group),
          resources_.resolve_shape(m0.group, m0.m(), m0.n()),
          static_cast<int64_t>(ob.mats.size()),
          ob.tall_begin,
          slots,
          norms,
          status};
}

void ModeRunner::run_owner_batches(int t, const StepContext& ctx, const SlotOf& slot_of,
                                   const MemberOutput& output) {
  std::vector<const OwnerBatch*> mine;
  for (int i : dist_.buckets[t].completes)
    if (dist_.owner_batches[i].owner == dist_.rank) mine.push_back(&dist_.owner_batches[i]);
  if (mine.empty()) return;
  std::vector<std::vector<MuonSlot>> slots(mine.size());
  std::vector<MuonBatch> batches;
  for (size_t r = 0; r < mine.size(); ++r) {
    for (int j : mine[r]->mats) {
      slots[r].push_back(slot_of(j));
      slots[r].back().coef = ctx.coef + j;
    }
    batches.push_back(owner_batch(*mine[r], slots[r]));
  }
  std::vector<std::vector<int64_t>> entries(mine.size());
  BatchSequence seq;
  seq.norms = false;  // pass 1 ran per bucket (owned_norms)
  // CacheMuon is decided here, on the device of the rank that orthogonalizes the batch; the
  // members share the group and shape, so their entries are of one cache class.
  seq.resources = [&](size_t k, BatchRef* x, BatchOrtho* how) {
    const DistMatrix& m0 = dist_.mats[mine[k]->mats[0]];
    for (int j : mine[k]->mats) entries[k].push_back(dist_.mats[j].cache_entry);
    *how = resources_.prepare_batch(batches[k].resolved, m0.cache, entries[k], batches[k].count,
                                    m0.m(), m0.n(), x);
  };
  seq.skip_counter = record_.skip_counter.as<int64_t>();
  if (output) {
    seq.output = BatchSequence::Output::kCustom;
    seq.custom_output = [&](size_t k, const BatchRef& x) {
      for (size_t r = 0; r < mine[k]->mats.size(); ++r)
        output(mine[k]->mats[r], x.slice(static_cast<int64_t>(r), 1));
    };
  }
  run_batches(backend_, batches, seq);
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

  void pass1(int b, StepContext& ctx) override { owned_norms(dist_.buckets[b], slot_of(ctx)); }

  void run_stage(int stage, int b, StepContext& ctx) override {
    if (stage == 1) {
      dist_.wait_on_stream(handles_[b]);
      return;
    }
    step_owned(b, ctx, slot_of(ctx));
    // The buckets whose updates are now complete broadcast them (one launch per bucket).
    for (int c : dist_.buckets[b].ready_buckets)
      dist_.world->grouped([&] {
        for (int j : dist_.buckets[c].act) {
          const DistMatrix& m = dist_.mats[j];
          void* w = at(ctx.data[m.param].param, full_offset(m), m.dtype);
          handles_[c].push_back(dist_.world->broadcast(w, m.numel(), comm_type(m.dtype), m.owner));
        }
      });
  }

 private:
  SlotOf slot_of(const StepContext& ctx) {
    return [this, &ctx](int j) {
      const DistMatrix& m = dist_.mats[j];
      const ParamData& d = ctx.data[m.param];
      const Param& p = registry_.params[m.param];
      return MuonSlot{
          MatRef::of(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, m.rows, m.cols),
          MatRef::of(m.momentum.data(), p.state0_dtype, m.rows, m.cols),
          MatRef::of(at(d.param, full_offset(m), m.dtype), m.dtype, m.rows, m.cols),
          record_.skips_of(p, m.slice)};
    };
  }
  std::vector<std::vector<CommHandle>> handles_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_replicated_runner(const RunnerContext& c) {
  return std::make_unique<ReplicatedRunner>(c);
}

}  // namespace distmuon
