// Gather mode, the naive gather-then-compute baseline: every rank updates the momentum of its
// rows, all-gathers every matrix's Nesterov input U inside the shard group, orthogonalizes every
// matrix itself and applies the rows of the update it holds. Kept for comparison and tests; it
// is what the owner modes are measured against.
//
// Stages of a bucket: 0 local pass 1, status agreement, local pass 2 into the send buffer and
// all-gather; 1 unpack, normalise, orthogonalize, apply.
#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

class GatherRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;

  void setup() override {
    bufs_.resize(e_.buckets.size());
    for (size_t b = 0; b < e_.buckets.size(); ++b) {
      const Bucket& bk = e_.buckets[b];
      int64_t all = 0, mine = 0;
      for (int j : bk.mats) {
        all += e_.mats[j].numel();
        mine += piece(e_.mats[j], e_.my_s);
      }
      const DType w = e_.mats[bk.mats[0]].wire;
      auto alloc = [&](int64_t n) {
        return e_.backend.alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(w));
      };
      bufs_[b].send = alloc(mine);
      bufs_[b].recv = alloc(all);
      bufs_[b].ustage = alloc(all);
    }
  }
  int num_stages() const override { return 2; }
  int compute_stage() const override { return 1; }

  // Raise policy: stage 0 ran the local pass 1 already.
  void pass1(int, StepContext&) override {}

  void run_stage(int stage, int b, StepContext& ctx) override {
    if (stage == 0) {
      local_pass1(b, ctx);
      if (ctx.raise) return;  // the driver checks all statuses before anything changes
      const Bucket& bk = e_.buckets[b];
      // Every holder must skip a matrix whose rows are non-finite anywhere.
      if (!bk.act.empty()) {
        CommHandle h = e_.shard->all_reduce(status_at(bk, 0), status_at(bk, 0),
                                            static_cast<int64_t>(bk.act.size()), CommType::kI32,
                                            ReduceOp::kMax);
        e_.wait_on_stream(h);
      }
      gather(b, ctx);
    } else {
      if (ctx.raise) gather(b, ctx);
      compute(b, ctx);
    }
  }

 private:
  struct B {
    Buffer send, recv, ustage;
    std::vector<int64_t> rc, rd;
    CommHandle h;
  };

  int64_t piece(const DistMatrix& m, int q) const { return (m.hi[q] - m.lo[q]) * m.cols; }

  MuonSlot local_slot(const DistMatrix& m, const StepContext& ctx) {
    const ParamData& d = ctx.data[m.param];
    const Param& p = e_.params[m.param];
    const int me = e_.my_s;
    const int64_t rows = m.hi[me] - m.lo[me], off = local_offset(m, m.lo[me]);
    return {MatRef::of(at(d.grad, off, d.grad_dtype), d.grad_dtype, rows, m.cols),
            MatRef::of(at(p.state0.data(), off, p.state0_dtype), p.state0_dtype, rows, m.cols),
            MatRef::of(at(d.param, off, m.wire), m.wire, rows, m.cols), e_.skips_of(p, m.slice)};
  }

  // Statuses of my rows, one launch per segment of consecutive matrices of one group.
  void local_pass1(int b, const StepContext& ctx) {
    const Bucket& bk = e_.buckets[b];
    size_t k = 0;
    while (k < bk.act.size()) {
      const DistMatrix& m0 = e_.mats[bk.act[k]];
      if (piece(m0, e_.my_s) == 0) {
        ++k;
        continue;
      }
      std::vector<MuonSlot> slots;
      size_t end = k;
      while (end < bk.act.size() && piece(e_.mats[bk.act[end]], e_.my_s) > 0 &&
             e_.mats[bk.act[end]].group == m0.group)
        slots.push_back(local_slot(e_.mats[bk.act[end++]], ctx));
      const MuonOptions& opt = e_.groups[m0.group].muon;
      const int64_t pos = bk.status_offset + static_cast<int64_t>(k);
      e_.backend.muon_momentum_norm(slots, opt.momentum, opt.nesterov,
                                    e_.step_norms.as<double>() + pos,
                                    e_.step_status.as<int32_t>() + pos);
      k = end;
    }
  }

  // Pass 2 on my rows writes the rows of V (the passes' float form of U, backend/muon_ref.h)
  // into the send buffer, unnormalised; then all-gather.
  void gather(int b, const StepContext& ctx) {
    const Bucket& bk = e_.buckets[b];
    B& s = bufs_[b];
    const int S = e_.shard_size;
    s.rc.assign(S, 0), s.rd.assign(S, 0);
    if (bk.act.empty()) return;
    const DType w = e_.mats[bk.mats[0]].wire;
    int64_t cur = 0;
    for (size_t k = 0; k < bk.act.size(); ++k) {
      const DistMatrix& m = e_.mats[bk.act[k]];
      if (piece(m, e_.my_s) == 0) continue;
      MuonSlot slot = local_slot(m, ctx);
      const MuonOptions& opt = e_.groups[m.group].muon;
      e_.backend.muon_momentum_apply(
          {&slot, 1}, opt.momentum, opt.nesterov, status_at(bk, static_cast<int>(k)),
          ScaleSpec{}, false,
          BatchRef::packed(at(s.send.data(), cur, w), w, 1, slot.grad.rows, m.cols));
      cur += piece(m, e_.my_s);
    }
    int64_t total = 0;
    for (int q = 0; q < S; ++q) {
      s.rd[q] = total;
      for (int j : bk.act) total += piece(e_.mats[j], q);
      s.rc[q] = total - s.rd[q];
    }
    s.h = e_.shard->all_gather_v(s.send.data(), cur, s.recv.data(), s.rc, s.rd, comm_type(w));
  }

  void compute(int b, const StepContext& ctx) {
    const Bucket& bk = e_.buckets[b];
    B& s = bufs_[b];
    e_.wait_on_stream(s.h);
    if (bk.act.empty()) return;
    const DType w = e_.mats[bk.mats[0]].wire;
    // Full matrices packed in act order, so that every run is one batch.
    std::vector<int64_t> uofs(bk.act.size());
    int64_t cur = 0;
    for (size_t k = 0; k < bk.act.size(); ++k) {
      uofs[k] = cur;
      cur += e_.mats[bk.act[k]].numel();
    }
    for (int q = 0; q < e_.shard_size; ++q) {
      int64_t c = s.rd[q];
      for (size_t k = 0; k < bk.act.size(); ++k) {
        const DistMatrix& m = e_.mats[bk.act[k]];
        if (piece(m, q) == 0) continue;
        copy_block(at(s.recv.data(), c, w), w, at(s.ustage.data(), uofs[k] + m.lo[q] * m.cols, w),
                   w, m.hi[q] - m.lo[q], m.cols);
        c += piece(m, q);
      }
    }
    for (const Bucket::Run& run : bk.runs) {
      const DistMatrix& m0 = e_.mats[bk.act[run.begin]];
      const int64_t count = run.end - run.begin, pos = bk.status_offset + run.begin;
      double* norms = e_.step_norms.as<double>() + pos;
      OrthoConfig r = e_.resolve_shape(m0.group, m0.m(), m0.n());
      // CacheMuon: every rank holds every entry and sees the same input, so every rank takes
      // the same decisions without exchanging them.
      std::vector<int64_t> entries;
      const int cache = prepare_run(bk, run, r, &entries);
      BatchRef x = BatchRef::packed(e_.x.data(), iteration_dtype(r), count, m0.m(), m0.n());
      // V is staged in the weights' orientation: normalise each orientation's slice into X.
      for_each_orientation(run, [&](int k0, int len, bool tall) {
        const int64_t rows = tall ? m0.n() : m0.m(), cols = tall ? m0.m() : m0.n();
        BatchRef v =
            BatchRef::packed(at(s.ustage.data(), uofs[run.begin + k0], w), w, len, rows, cols);
        e_.backend.frob_norm(v, norms + k0);
        e_.backend.scale_copy(v, tall, muon_input_scale(norms + k0, r), x.slice(k0, len));
      });
      e_.orthogonalize(cache, r, x, entries, status_at(bk, run.begin), e_.workspace.data(),
                       e_.workspace_size);
      for (int k = run.begin; k < run.end; ++k) {
        const DistMatrix& m = e_.mats[bk.act[k]];
        if (piece(m, e_.my_s) == 0) continue;
        const int64_t lo = m.lo[e_.my_s], rows = m.hi[e_.my_s] - lo;
        MatRef xk = x.matrix(k - run.begin);
        // My rows of the update: rows of X (wide), or columns of X (tall, X = O^T).
        BatchRef o = m.tall() ? BatchRef{at(xk.data, lo, xk.dtype),
                                         xk.dtype,
                                         1,
                                         m.cols,
                                         rows,
                                         xk.ld,
                                         m.cols * xk.ld}
                              : BatchRef{at(xk.data, lo * xk.ld, xk.dtype),
                                         xk.dtype,
                                         1,
                                         rows,
                                         m.cols,
                                         xk.ld,
                                         rows * xk.ld};
        MuonSlot slot = local_slot(m, ctx);
        slot.grad = slot.momentum = slot.weight;
        MuonUpdateCoef coef = ctx.coef[bk.act[k]];
        e_.backend.muon_update({&slot, 1}, {&coef, 1}, status_at(bk, k), o, m.tall());
      }
      e_.backend.count_status(status_at(bk, run.begin), count, e_.skip_counter.as<int64_t>());
    }
  }

  std::vector<B> bufs_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_gather_runner(Engine::Impl& e) {
  return std::make_unique<GatherRunner>(e);
}

}  // namespace distmuon
