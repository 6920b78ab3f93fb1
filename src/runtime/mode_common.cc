// What the owner modes share: the owner's computation of one run (the same fused passes and
// batched orthogonalization as the single-process step, so results match it bit for bit), and
// the replicated mode, which needs nothing else.
#include <algorithm>

#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {

void Engine::Impl::ensure_scratch(const OrthoConfig& resolved, int64_t count, int64_t m, int64_t n,
                                  size_t workspace_bytes) {
  const size_t xb = static_cast<size_t>(count * m * n) * dtype_size(iteration_dtype(resolved));
  if (xb > x_bytes) {
    x = backend.alloc(xb);
    x_bytes = xb;
  }
  const size_t wb =
      std::max(workspace_bytes, Orthogonalizer::workspace_bytes(resolved, count, m, n));
  if (wb > workspace_size) {
    workspace = backend.alloc(wb);
    workspace_size = wb;
  }
}

void ModeRunner::copy_block(const void* src, DType src_t, void* dst, DType dst_t, int64_t rows,
                            int64_t cols) {
  if (rows * cols == 0) return;
  if (src_t == dst_t) {
    e_.backend.copy(dst, src, static_cast<size_t>(rows * cols) * dtype_size(src_t));
    return;
  }
  e_.backend.scale_copy(BatchRef::packed(const_cast<void*>(src), src_t, 1, rows, cols), false,
                        ScaleSpec{}, BatchRef::packed(dst, dst_t, 1, rows, cols));
}

void ModeRunner::owner_pass1(const Bucket& b, const Bucket::Run& run,
                             std::span<const MuonSlot> slots) {
  const DistMatrix& m0 = e_.mats[b.act[run.begin]];
  const MuonOptions& opt = e_.groups[m0.group].muon;
  const int64_t pos = b.status_offset + run.begin;
  e_.backend.muon_momentum_norm(slots, opt.momentum, opt.nesterov, e_.step_norms.as<double>() + pos,
                                e_.step_status.as<int32_t>() + pos);
}

void ModeRunner::for_each_orientation(const Bucket::Run& run,
                                      const std::function<void(int k0, int len, bool tall)>& f) {
  if (run.tall_begin > run.begin) f(0, run.tall_begin - run.begin, false);
  if (run.end > run.tall_begin) f(run.tall_begin - run.begin, run.end - run.tall_begin, true);
}

int ModeRunner::prepare_run(const Bucket& b, const Bucket::Run& run, const OrthoConfig& resolved,
                            std::vector<int64_t>* entries) {
  const DistMatrix& m0 = e_.mats[b.act[run.begin]];
  const int64_t count = run.end - run.begin;
  size_t cached_ws = 0;
  // The matrices of a run share the group and shape, so their entries are of one cache class.
  const bool cached =
      m0.cache >= 0 && e_.prepare_cache(e_.caches[m0.cache], resolved, count, &cached_ws);
  entries->clear();
  if (cached)
    for (int k = run.begin; k < run.end; ++k) entries->push_back(e_.mats[b.act[k]].cache_entry);
  e_.ensure_scratch(resolved, count, m0.m(), m0.n(), cached_ws);
  return cached ? m0.cache : -1;
}

void ModeRunner::owner_rest(const Bucket& b, const Bucket::Run& run,
                            std::span<const MuonSlot> slots, const StepContext& ctx,
                            const std::function<void*(int k)>* out) {
  const DistMatrix& m0 = e_.mats[b.act[run.begin]];
  const MuonOptions& opt = e_.groups[m0.group].muon;
  const int64_t count = run.end - run.begin;
  const int64_t pos = b.status_offset + run.begin;
  const int32_t* status = e_.step_status.as<int32_t>() + pos;
  OrthoConfig r = e_.resolve_shape(m0.group, m0.m(), m0.n());
  std::vector<int64_t> entries;
  const int cache = prepare_run(b, run, r, &entries);  // decided here, on the owner's device
  BatchRef x = BatchRef::packed(e_.x.data(), iteration_dtype(r), count, m0.m(), m0.n());
  // One orthogonalization batch in the wide orientation; the fused passes once per orientation.
  for_each_orientation(run, [&](int k0, int len, bool tall) {
    e_.backend.muon_momentum_apply(slots.subspan(k0, len), opt.momentum, opt.nesterov, status + k0,
                                   muon_input_scale(e_.step_norms.as<double>() + pos + k0, r),
                                   tall, x.slice(k0, len));
  });
  e_.orthogonalize(cache, r, x, entries, status, e_.workspace.data(), e_.workspace_size);
  if (!out) {
    std::vector<MuonUpdateCoef> coefs;
    for (int k = run.begin; k < run.end; ++k) coefs.push_back(ctx.coef[b.act[k]]);
    const std::span<const MuonUpdateCoef> all(coefs);
    for_each_orientation(run, [&](int k0, int len, bool tall) {
      e_.backend.muon_update(slots.subspan(k0, len), all.subspan(k0, len), status + k0,
                             x.slice(k0, len), tall);
    });
  } else {
    // The update in the weight's orientation and the wire dtype, for the matrix's shards.
    for (int k = 0; k < count; ++k) {
      const DistMatrix& m = e_.mats[b.act[run.begin + k]];
      e_.backend.scale_copy(x.slice(k, 1), m.tall(), ScaleSpec{},
                            BatchRef::packed((*out)(k), m.wire, 1, m.rows, m.cols));
    }
  }
  e_.backend.count_status(status, count, e_.skip_counter.as<int64_t>());
}

namespace {

// Replicated: gradients and weights are identical everywhere, so the owner steps on the
// caller's buffers and broadcasts the updated weights in place.
class ReplicatedRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;
  void setup() override { handles_.resize(e_.buckets.size()); }
  int num_stages() const override { return 2; }
  int compute_stage() const override { return 0; }

  void pass1(int b, StepContext& ctx) override {
    const Bucket& bk = e_.buckets[b];
    for (const Bucket::Run& run : bk.runs)
      if (e_.mats[bk.act[run.begin]].owner == e_.rank) owner_pass1(bk, run, slots(bk, run, ctx));
  }

  void run_stage(int stage, int b, StepContext& ctx) override {
    Bucket& bk = e_.buckets[b];
    if (stage == 1) {
      e_.wait_on_stream(handles_[b]);
      return;
    }
    for (const Bucket::Run& run : bk.runs) {
      if (e_.mats[bk.act[run.begin]].owner != e_.rank) continue;
      std::vector<MuonSlot> s = slots(bk, run, ctx);
      if (!ctx.raise) owner_pass1(bk, run, s);
      owner_rest(bk, run, s, ctx, nullptr);
    }
    for (int j : bk.act) {
      const DistMatrix& m = e_.mats[j];
      void* w = at(ctx.data[m.param].param, full_offset(m), m.wire);
      handles_[b].push_back(e_.world->broadcast(w, m.numel(), comm_type(m.wire), m.owner));
    }
  }

 private:
  std::vector<MuonSlot> slots(const Bucket& bk, const Bucket::Run& run, const StepContext& ctx) {
    std::vector<MuonSlot> out;
    for (int k = run.begin; k < run.end; ++k) {
      const DistMatrix& m = e_.mats[bk.act[k]];
      const ParamData& d = ctx.data[m.param];
      const Param& p = e_.params[m.param];
      out.push_back(
          {MatRef::of(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, m.rows, m.cols),
           MatRef::of(m.momentum.data(), p.state0_dtype, m.rows, m.cols),
           MatRef::of(at(d.param, full_offset(m), m.wire), m.wire, m.rows, m.cols),
           e_.skips_of(p, m.slice)});
    }
    return out;
  }
  std::vector<std::vector<CommHandle>> handles_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_replicated_runner(Engine::Impl& e) {
  return std::make_unique<ReplicatedRunner>(e);
}

}  // namespace distmuon
