// Gather mode, the naive gather-then-compute baseline: every rank updates the momentum of its
// rows, all-gathers every matrix's Nesterov input U inside the shard group, orthogonalizes every
// matrix itself and applies the rows of the update it holds. Kept for comparison and tests; it
// is what the owner modes are measured against.
//
// Stages of a bucket: 0 local pass 1, status agreement, local pass 2 into the send buffer and
// all-gather; 1 unpack, normalise, orthogonalize, apply.
#include <algorithm>

#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

class GatherRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;

  void setup() override {
    bufs_.resize(dist_.buckets.size());
    size_t largest = 1;  // bytes of the largest bucket's full matrices
    for (size_t b = 0; b < dist_.buckets.size(); ++b) {
      const Bucket& bk = dist_.buckets[b];
      int64_t all = 0, mine = 0;
      for (int j : bk.mats) {
        all += dist_.mats[j].numel();
        mine += piece(dist_.mats[j], dist_.my_s);
      }
      const DType w = dist_.mats[bk.mats[0]].wire;
      auto alloc = [&](int64_t n) {
        return backend_.alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(w));
      };
      bufs_[b].send = alloc(mine);
      bufs_[b].recv = alloc(all);
      largest = std::max(largest, static_cast<size_t>(all) * dtype_size(w));
    }
    // One stage for every bucket's full matrices: only the compute stage uses it, and the
    // buckets' compute stages run one after another on the compute stream. (One per bucket held
    // the whole model twice on every rank: eight gather ranks of a 0.5 B model sharing an 80 GB
    // GPU ran out of it.)
    ustage_ = backend_.alloc(largest);
  }
  int num_stages() const override { return 2; }
  int compute_stage() const override { return 1; }

  // Raise policy: stage 0 ran the local pass 1 already.
  void pass1(int, StepContext&) override {}

  void run_stage(int stage, int b, StepContext& ctx) override {
    if (stage == 0) {
      local_pass1(b, ctx);
      if (ctx.raise) return;  // the driver checks all statuses before anything changes
      const Bucket& bk = dist_.buckets[b];
      // Every holder must skip a matrix whose rows are non-finite anywhere.
      if (!bk.act.empty()) {
        CommHandle h = dist_.shard->all_reduce(status_at(bk, 0), status_at(bk, 0),
                                               static_cast<int64_t>(bk.act.size()), CommType::kI32,
                                               ReduceOp::kMax);
        dist_.wait_on_stream(h);
      }
      gather(b, ctx);
    } else {
      if (ctx.raise) gather(b, ctx);
      compute(b, ctx);
    }
  }

 private:
  struct BucketBuffers {
    Buffer send, recv;
    std::vector<int64_t> recv_counts, recv_displs;  // all-gather, per shard position
    CommHandle h;
  };

  int64_t piece(const DistMatrix& m, int q) const { return (m.hi[q] - m.lo[q]) * m.cols; }

  MuonSlot local_slot(const DistMatrix& m, const StepContext& ctx) {
    const ParamData& d = ctx.data[m.param];
    const Param& p = registry_.params[m.param];
    const int me = dist_.my_s;
    const int64_t rows = m.hi[me] - m.lo[me], off = local_offset(m, m.lo[me]);
    return {MatRef::of(at(d.grad, off, d.grad_dtype), d.grad_dtype, rows, m.cols),
            MatRef::of(at(p.state0.data(), off, p.state0_dtype), p.state0_dtype, rows, m.cols),
            MatRef::of(at(d.param, off, m.dtype), m.dtype, rows, m.cols),
            record_.skips_of(p, m.slice)};
  }

  // Statuses of my rows, one launch per segment of consecutive matrices of one group.
  void local_pass1(int b, const StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    size_t k = 0;
    while (k < bk.act.size()) {
      const DistMatrix& m0 = dist_.mats[bk.act[k]];
      if (piece(m0, dist_.my_s) == 0) {
        ++k;
        continue;
      }
      std::vector<MuonSlot> slots;
      size_t end = k;
      while (end < bk.act.size() && piece(dist_.mats[bk.act[end]], dist_.my_s) > 0 &&
             dist_.mats[bk.act[end]].group == m0.group)
        slots.push_back(local_slot(dist_.mats[bk.act[end++]], ctx));
      const int64_t first = bk.status_offset + static_cast<int64_t>(k);
      const int64_t count = static_cast<int64_t>(slots.size());
      // Rows of matrices of any shape: only pass 1 runs on this batch (no orthogonalization).
      const MuonBatch rows{backend_,
                           registry_.groups[m0.group].muon,
                           record_.scalars.mu(m0.group),
                           OrthoConfig{},
                           count,
                           count,
                           slots,
                           record_.step_norms.as<double>() + first,
                           record_.step_status.as<int32_t>() + first};
      rows.momentum_norm();
      k = end;
    }
  }

  // Pass 2 on my rows writes the rows of V (the passes' float form of U, backend/muon_ref.h)
  // into the send buffer, unnormalised; then all-gather.
  void gather(int b, const StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    const int S = dist_.shard_size;
    s.recv_counts.assign(S, 0), s.recv_displs.assign(S, 0);
    if (bk.act.empty()) return;
    const DType w = dist_.mats[bk.mats[0]].wire;
    int64_t cur = 0;
    for (size_t k = 0; k < bk.act.size(); ++k) {
      const DistMatrix& m = dist_.mats[bk.act[k]];
      if (piece(m, dist_.my_s) == 0) continue;
      MuonSlot slot = local_slot(m, ctx);
      const MuonOptions& opt = registry_.groups[m.group].muon;
      backend_.muon_momentum_apply(
          {&slot, 1}, record_.scalars.mu(m.group), opt.nesterov, status_at(bk, static_cast<int>(k)), ScaleSpec{},
          false, BatchRef::packed(at(s.send.data(), cur, w), w, 1, slot.grad.rows, m.cols));
      cur += piece(m, dist_.my_s);
    }
    int64_t total = 0;
    for (int q = 0; q < S; ++q) {
      s.recv_displs[q] = total;
      for (int j : bk.act) total += piece(dist_.mats[j], q);
      s.recv_counts[q] = total - s.recv_displs[q];
    }
    s.h = dist_.shard->all_gather_v(s.send.data(), cur, s.recv.data(), s.recv_counts, s.recv_displs,
                                    comm_type(w));
  }

  void compute(int b, const StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    dist_.wait_on_stream(s.h);
    if (bk.act.empty()) return;
    const DType w = dist_.mats[bk.mats[0]].wire;
    // Full matrices packed in act order, so that every run is one batch.
    std::vector<int64_t> matrix_offset(bk.act.size());
    int64_t cur = 0;
    for (size_t k = 0; k < bk.act.size(); ++k) {
      matrix_offset[k] = cur;
      cur += dist_.mats[bk.act[k]].numel();
    }
    std::vector<BlockCopy> copies;
    for (int q = 0; q < dist_.shard_size; ++q) {
      int64_t c = s.recv_displs[q];
      for (size_t k = 0; k < bk.act.size(); ++k) {
        const DistMatrix& m = dist_.mats[bk.act[k]];
        if (piece(m, q) == 0) continue;
        copies.push_back({at(s.recv.data(), c, w), w,
                          at(ustage_.data(), matrix_offset[k] + m.lo[q] * m.cols, w), w, piece(m, q)});
        c += piece(m, q);
      }
    }
    backend_.copy_blocks(copies);
    // V was staged by pass 2 on every holder: each run's batch only orthogonalizes (no slots).
    // CacheMuon: every rank holds every entry and sees the same input, so every rank takes the
    // same decisions without exchanging them.
    std::vector<const Bucket::Run*> runs;
    std::vector<MuonBatch> batches;
    for (const Bucket::Run& run : bk.runs) {
      runs.push_back(&run);
      batches.push_back(run_batch(bk, run, {}));
    }
    BatchSequence seq;
    seq.norms = false;  // stage 0 ran pass 1 on this rank's rows
    // V is staged in the weights' orientation: normalise each orientation's slice into X.
    seq.stage = [&](size_t r, const BatchRef& x) {
      const MuonBatch& batch = batches[r];
      const DistMatrix& m0 = dist_.mats[bk.act[runs[r]->begin]];
      batch.for_each_orientation([&](int64_t k0, int64_t len, bool tall) {
        const int64_t rows = tall ? m0.n() : m0.m(), cols = tall ? m0.m() : m0.n();
        BatchRef v = BatchRef::packed(at(ustage_.data(), matrix_offset[runs[r]->begin + k0], w), w,
                                      len, rows, cols);
        backend_.frob_norm(v, batch.norms + k0);
        backend_.scale_copy(v, tall, muon_input_scale(batch.norms + k0, batch.resolved),
                            x.slice(k0, len));
      });
    };
    // Each rank applies the rows of the update it holds; it counts the skips after them.
    seq.output = BatchSequence::Output::kCustom;
    seq.skips_after_output = true;
    seq.custom_output = [&](size_t r, const BatchRef& x) {
      const Bucket::Run& run = *runs[r];
      // The run's updates in one grouped call, not a launch per matrix.
      std::vector<MuonSlot> slots;
      slots.reserve(static_cast<size_t>(run.end - run.begin));  // no regrowth: the spans point in
      std::vector<MuonPassBatch> updates;
      for (int k = run.begin; k < run.end; ++k) {
        const DistMatrix& m = dist_.mats[bk.act[k]];
        if (piece(m, dist_.my_s) == 0) continue;
        const int64_t lo = m.lo[dist_.my_s], rows = m.hi[dist_.my_s] - lo;
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
        MuonSlot& slot = slots.emplace_back(local_slot(m, ctx));
        slot.grad = slot.momentum = slot.weight;
        slot.coef = ctx.coef + bk.act[k];
        MuonPassBatch update;
        update.slots = {&slot, 1};
        update.status = status_at(bk, k);
        update.transpose = m.tall();
        update.x = o;
        updates.push_back(update);
      }
      backend_.muon_pass_grouped(MuonPass::kUpdate, updates);
    };
    run_runs(bk, runs, batches, seq);
  }

  std::vector<BucketBuffers> bufs_;
  Buffer ustage_;  // the full matrices of the bucket being computed (compute())
};

}  // namespace

std::unique_ptr<ModeRunner> make_gather_runner(const RunnerContext& c) {
  return std::make_unique<GatherRunner>(c);
}

}  // namespace distmuon
