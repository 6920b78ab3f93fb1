// Sharded mode (unmodified FSDP2, dim-0 shards): an all-to-all inside the shard group moves each
// matrix's rows to its owner, the owner runs momentum + orthogonalization, and an all-to-all
// moves the update's rows back to the shards, where the weight update is applied. Only the
// owner keeps momentum. In HSDP the shards are identical across replicas: the owner's replica
// collects, the owner broadcasts the update to the other replicas (same shard position), and
// every replica distributes it inside its shard group.
//
// Stages of a bucket: 0 pack + all-to-all of gradient rows; 1 unpack, pass 1 and (with replicas)
// the statuses' agreement, then passes 2-3 and the orthogonalization of the owner batches whose last bucket
// this is, and the cross-replica broadcast of the buckets whose updates are then complete; 2
// all-to-all of update rows; 3 apply (stages 2-3 of a bucket follow the compute stage of the
// bucket that completes its updates, Bucket::ready). Only the apply reads the agreed statuses
// (the owner's batches read its own): without replicas their all-reduce is launched with the
// update rows' all-to-all, one launch instead of two (a launch costs the host about 0.1 ms on
// NCCL, and a step launches a few per bucket).
//
// Where the shard communicator gives windows (NCCL under DISTMUON_NCCL_CTA_POLICY=zero), the
// all-to-alls' buffers are windows and every pair exchanges one equal block (the bucket's
// largest): NCCL moves such all-to-alls with the copy engines, beside the owners' compute
// instead of on its SMs (choose_layout).
//
// A rank's own rows of the matrices it owns never enter the all-to-alls: they are copied from
// the gradient straight into the owner's stage, and applied straight from the update's stage
// (one copy each way instead of three; at one rank that is every row).
#include <algorithm>

#include "distmuon/env.h"
#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

class ShardedRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;

  void setup() override {
    const size_t n = dist_.mats.size();
    grad_stage_offset_.assign(n, -1);
    update_stage_offset_.assign(n, -1);
    choose_layout();
    bufs_.resize(dist_.buckets.size());
    for (size_t b = 0; b < dist_.buckets.size(); ++b) {
      const Bucket& bk = dist_.buckets[b];
      BucketBuffers& s = bufs_[b];
      // Stages hold whole matrices; the all-to-alls' buffers leave out this rank's own rows,
      // which go straight to and from the stages.
      int64_t g = 0, o = 0, send_g = 0, recv_g = 0, send_o = 0, recv_o = 0;
      for (int j : bk.mats) {
        const DistMatrix& m = dist_.mats[j];
        const int64_t mine = (m.hi[dist_.my_s] - m.lo[dist_.my_s]) * m.cols;
        if (m.owner == dist_.rank) {  // its gradient rows come here
          grad_stage_offset_[j] = g;
          g += m.numel();
          recv_g += m.numel() - mine;
        }
        if (m.owner_s == dist_.my_s) {  // its update is held at my position (every replica)
          update_stage_offset_[j] = o;
          o += m.numel();
          send_o += m.numel() - mine;
        } else {
          recv_o += mine;
          if (m.owner_r == dist_.my_r) send_g += mine;
        }
      }
      const DType w = dist_.mats[bk.mats[0]].wire;
      s.gstage = alloc(g, w);
      s.ostage = alloc(o, w);
      if (uniform_) {
        const auto [slot_g, slot_o] = uniform_blocks(bk);
        s.grad.block = slot_g;
        s.update.block = slot_o;
        send_g = recv_g = dist_.shard_size * slot_g;
        send_o = recv_o = dist_.shard_size * slot_o;
      }
      s.recv_g = wire(recv_g, w);
      s.send_o = wire(send_o, w);
      s.send_g = wire(send_g, w);
      s.recv_o = wire(recv_o, w);
    }
  }
  int num_stages() const override { return 4; }
  int compute_stage() const override { return 1; }

  void pass1(int b, StepContext& ctx) override {
    unpack(b);
    owned_norms(dist_.buckets[b], slot_of());
    (void)ctx;
  }

  void run_stage(int stage, int b, StepContext& ctx) override {
    switch (stage) {
      case 0:
        collect(b, ctx);
        break;
      case 1:
        compute(b, ctx);
        break;
      case 2:
        relay(b, ctx);
        break;
      case 3:
        apply(b, ctx);
        break;
    }
  }

 private:
  // Elements to and from each shard position in one all-to-all: packed (each position's
  // elements right after the previous one's), or in equal blocks of `block` elements at
  // q * block, which NCCL's own all-to-all takes (uniform_).
  struct AllToAllLayout {
    std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
    int64_t block = 0;
    void reset(int positions) {
      for (auto* v : {&send_counts, &send_displs, &recv_counts, &recv_displs})
        v->assign(positions, 0);
    }
  };

  // The all-to-alls' layout. Equal blocks cost the bytes by which a bucket's pairs differ, and
  // pay where the communicator moves equal blocks without SMs: on the windows it gives
  // (alloc_window: NCCL under DISTMUON_NCCL_CTA_POLICY=zero, its all-to-all on the copy
  // engines). DISTMUON_UNIFORM_ALL_TO_ALL=1/0 chooses them, or not, on any communicator.
  void choose_layout() {
    const std::string forced = env::get("DISTMUON_UNIFORM_ALL_TO_ALL");
    // Collective, as alloc_window is: every member gets a window or none.
    windows_ = (forced.empty() || env::get_bool("DISTMUON_UNIFORM_ALL_TO_ALL")) &&
               dist_.shard->alloc_window(256) != nullptr;
    uniform_ = forced.empty() ? windows_ : env::get_bool("DISTMUON_UNIFORM_ALL_TO_ALL");
  }
  // Equal blocks of a bucket: the most elements any position sends another in the gradient
  // rows' all-to-all, and in the update rows' (every member computes the same).
  std::pair<int64_t, int64_t> uniform_blocks(const Bucket& bk) const {
    const int S = dist_.shard_size;
    std::vector<int64_t> grad(static_cast<size_t>(S) * S, 0), update(grad);  // [from * S + to]
    for (int j : bk.mats) {
      const DistMatrix& m = dist_.mats[j];
      for (int q = 0; q < S; ++q) {
        if (q == m.owner_s) continue;
        if (m.owner_r == dist_.my_r) grad[static_cast<size_t>(q) * S + m.owner_s] += piece(m, q);
        update[static_cast<size_t>(m.owner_s) * S + q] += piece(m, q);
      }
    }
    return {*std::max_element(grad.begin(), grad.end()),
            *std::max_element(update.begin(), update.end())};
  }
  // An all-to-all's buffer: on a window of the shard communicator where it gives them.
  Buffer wire(int64_t elems, DType t) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(elems, 1)) * dtype_size(t);
    if (!windows_ || !uniform_) return backend_.alloc(bytes);
    std::shared_ptr<void> w = dist_.shard->alloc_window(bytes);
    if (!w) return backend_.alloc(bytes);
    return backend_.counted(w.get(), bytes, [w](void*) mutable { w.reset(); });
  }
  // Where position q's elements start, in a layout being filled up to `packed`.
  static int64_t start(const AllToAllLayout& l, int q, int64_t packed) {
    return l.block > 0 ? q * l.block : packed;
  }
  // How many elements position q's block holds, its elements ending at `end`.
  static int64_t extent(const AllToAllLayout& l, int q, int64_t end,
                        const std::vector<int64_t>& displs) {
    return l.block > 0 ? l.block : end - displs[q];
  }
  struct BucketBuffers {
    Buffer send_g, recv_g, gstage, ostage, send_o, recv_o;
    AllToAllLayout grad, update;  // the gradient rows' all-to-all and the update rows' one
    CommHandle collect, ret, status;
    std::vector<CommHandle> bcast;
  };

  Buffer alloc(int64_t elems, DType t) {
    return backend_.alloc(static_cast<size_t>(std::max<int64_t>(elems, 1)) * dtype_size(t));
  }
  int64_t piece(const DistMatrix& m, int q) const { return (m.hi[q] - m.lo[q]) * m.cols; }

  void collect(int b, StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    const int S = dist_.shard_size, me = dist_.my_s;
    s.grad.reset(S);
    if (bk.act.empty()) return;
    const DType w = dist_.mats[bk.mats[0]].wire;
    int64_t cur = 0;
    std::vector<BlockCopy> copies;
    for (int q = 0; q < S; ++q) {  // my rows of the matrices owned at position q of my replica
      cur = s.grad.send_displs[q] = start(s.grad, q, cur);
      for (int j : bk.act) {
        const DistMatrix& m = dist_.mats[j];
        if (m.owner_r != dist_.my_r || m.owner_s != q || piece(m, me) == 0) continue;
        const ParamData& d = ctx.data[m.param];
        // Mine: straight to the stage the owner batch reads.
        void* dst = q == me ? at(s.gstage.data(), grad_stage_offset_[j] + m.lo[me] * m.cols, w)
                            : at(s.send_g.data(), cur, w);
        copies.push_back({at(d.grad, local_offset(m, m.lo[me]), d.grad_dtype), d.grad_dtype, dst, w,
                          piece(m, me)});
        if (q != me) cur += piece(m, me);
      }
      s.grad.send_counts[q] = extent(s.grad, q, cur, s.grad.send_displs);
    }
    backend_.copy_blocks(copies);
    cur = 0;
    for (int q = 0; q < S; ++q) {  // every other position's rows of the matrices I own
      cur = s.grad.recv_displs[q] = start(s.grad, q, cur);
      for (int j : bk.act)
        if (q != me && dist_.mats[j].owner == dist_.rank) cur += piece(dist_.mats[j], q);
      s.grad.recv_counts[q] = extent(s.grad, q, cur, s.grad.recv_displs);
    }
    s.collect = dist_.shard->all_to_all_v(s.send_g.data(), s.grad.send_counts, s.grad.send_displs,
                                          s.recv_g.data(), s.grad.recv_counts, s.grad.recv_displs,
                                          comm_type(w));
  }

  void unpack(int b) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    dist_.wait_on_stream(s.collect);
    std::vector<BlockCopy> copies;
    for (int q = 0; q < dist_.shard_size; ++q) {
      if (q == dist_.my_s) continue;  // collect() staged my own rows
      int64_t cur = s.grad.recv_displs[q];
      for (int j : bk.act) {
        const DistMatrix& m = dist_.mats[j];
        if (m.owner != dist_.rank || piece(m, q) == 0) continue;
        copies.push_back({at(s.recv_g.data(), cur, m.wire), m.wire,
                          at(s.gstage.data(), grad_stage_offset_[j] + m.lo[q] * m.cols, m.wire),
                          m.wire, piece(m, q)});
        cur += piece(m, q);
      }
    }
    backend_.copy_blocks(copies);
  }

  // The owner's slot of matrix j: its gathered gradient in the bucket's staging buffer.
  SlotOf slot_of() {
    return [this](int j) {
      const DistMatrix& m = dist_.mats[j];
      MatRef g = MatRef::of(at(bufs_[m.bucket].gstage.data(), grad_stage_offset_[j], m.wire),
                            m.wire, m.rows, m.cols);
      // The owner holds no weight: pass 3 runs on the shards, so the weight slot is unused.
      const Param& p = registry_.params[m.param];
      return MuonSlot{g, MatRef::of(m.momentum.data(), p.state0_dtype, m.rows, m.cols), g,
                      record_.skips_of(p, m.slice)};
    };
  }

  void compute(int b, StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    if (!ctx.raise) {
      // Pass 1 of the runs this rank owns here (else the raise policy's pass1() ran it); the
      // shards apply the update, so they must learn whether the owner skipped the matrix.
      unpack(b);
      owned_norms(bk, slot_of());
      if (!statuses_with_updates()) agree_statuses(b);
    }
    // The owner batches whose last bucket this is: pass 2 and the orthogonalization, the update
    // written in the weight's orientation and the wire dtype for the matrix's shards.
    run_owner_batches(b, ctx, slot_of(), [&](int j, const BatchRef& x) {
      const DistMatrix& m = dist_.mats[j];
      backend_.scale_copy(x, m.tall(), ScaleSpec{},
                          BatchRef::packed(at(bufs_[m.bucket].ostage.data(),
                                              update_stage_offset_[j], m.wire),
                                           m.wire, 1, m.rows, m.cols));
    });
    if (!dist_.replica) return;
    // The buckets whose updates are now complete reach the other replicas while the next bucket
    // runs (one launch per bucket).
    for (int c : bk.ready_buckets) {
      BucketBuffers& sc = bufs_[c];
      dist_.replica->grouped([&] {
        for (int j : dist_.buckets[c].act) {
          const DistMatrix& m = dist_.mats[j];
          if (m.owner_s != dist_.my_s) continue;
          sc.bcast.push_back(
              dist_.replica->broadcast(at(sc.ostage.data(), update_stage_offset_[j], m.wire),
                                       m.numel(), comm_type(m.wire), m.owner_r));
        }
      });
    }
  }

  // Without replicas the world is the shard group: the statuses travel with the update rows.
  bool statuses_with_updates() const { return dist_.world == dist_.shard; }
  void agree_statuses(int b) {
    const Bucket& bk = dist_.buckets[b];
    if (bk.act.empty()) return;
    bufs_[b].status = dist_.world->all_reduce(status_at(bk, 0), status_at(bk, 0),
                                              static_cast<int64_t>(bk.act.size()),
                                              CommType::kI32, ReduceOp::kMax);
  }

  void relay(int b, StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    dist_.wait_on_stream(s.bcast);
    const int S = dist_.shard_size, me = dist_.my_s;
    s.update.reset(S);
    if (bk.act.empty()) return;
    const DType w = dist_.mats[bk.mats[0]].wire;
    int64_t cur = 0;
    std::vector<BlockCopy> copies;
    for (int q = 0; q < S; ++q) {  // rows of position q of the updates held at my position
      cur = s.update.send_displs[q] = start(s.update, q, cur);
      for (int j : bk.act) {
        const DistMatrix& m = dist_.mats[j];
        // Mine stay: apply() reads them from the stage.
        if (q == me || m.owner_s != me || piece(m, q) == 0) continue;
        copies.push_back({at(s.ostage.data(), update_stage_offset_[j] + m.lo[q] * m.cols, w), w,
                          at(s.send_o.data(), cur, w), w, piece(m, q)});
        cur += piece(m, q);
      }
      s.update.send_counts[q] = extent(s.update, q, cur, s.update.send_displs);
    }
    backend_.copy_blocks(copies);
    cur = 0;
    for (int q = 0; q < S; ++q) {  // my rows of the updates held at every other position q
      cur = s.update.recv_displs[q] = start(s.update, q, cur);
      for (int j : bk.act)
        if (q != me && dist_.mats[j].owner_s == q) cur += piece(dist_.mats[j], me);
      s.update.recv_counts[q] = extent(s.update, q, cur, s.update.recv_displs);
    }
    dist_.shard->grouped([&] {
      // The raise policy agreed on the statuses before the step changed anything.
      if (!ctx.raise && statuses_with_updates()) agree_statuses(b);
      s.ret = dist_.shard->all_to_all_v(s.send_o.data(), s.update.send_counts,
                                        s.update.send_displs, s.recv_o.data(),
                                        s.update.recv_counts, s.update.recv_displs, comm_type(w));
    });
  }

  void apply(int b, StepContext& ctx) {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    dist_.wait_on_stream(s.ret);
    dist_.wait_on_stream(s.status);
    const int me = dist_.my_s;
    // One update per matrix of which I hold rows, all in one grouped call (a launch per matrix
    // cost the host about as much as the rest of the step's issue on many small matrices).
    std::vector<MuonSlot> slots;
    slots.reserve(bk.act.size());  // each matrix has one owner: at most one slot each, no regrowth
    std::vector<MuonPassBatch> updates;
    for (int q = 0; q < dist_.shard_size; ++q) {
      int64_t cur = s.update.recv_displs[q];
      for (size_t k = 0; k < bk.act.size(); ++k) {
        const int j = bk.act[k];
        const DistMatrix& m = dist_.mats[j];
        if (m.owner_s != q || piece(m, me) == 0) continue;
        const int64_t rows = m.hi[me] - m.lo[me];
        MatRef wref = MatRef::of(at(ctx.data[m.param].param, local_offset(m, m.lo[me]), m.dtype),
                                 m.dtype, rows, m.cols);
        slots.push_back({wref, wref, wref, nullptr, ctx.coef + j});
        // Mine from the update's stage, the others' as the all-to-all delivered them.
        void* u = q == me ? at(s.ostage.data(), update_stage_offset_[j] + m.lo[me] * m.cols, m.wire)
                          : at(s.recv_o.data(), cur, m.wire);
        MuonPassBatch update;
        update.slots = {&slots.back(), 1};
        update.status = status_at(bk, static_cast<int>(k));
        update.x = BatchRef::packed(u, m.wire, 1, rows, m.cols);
        updates.push_back(update);
        if (q != me) cur += piece(m, me);
      }
    }
    backend_.muon_pass_grouped(MuonPass::kUpdate, updates);
  }

  bool windows_ = false, uniform_ = false;  // choose_layout()
  std::vector<BucketBuffers> bufs_;
  // Per matrix: element offset in gstage (matrices I own) and in ostage (matrices owned at my
  // shard position).
  std::vector<int64_t> grad_stage_offset_, update_stage_offset_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_sharded_runner(const RunnerContext& c) {
  return std::make_unique<ShardedRunner>(c);
}

}  // namespace distmuon
