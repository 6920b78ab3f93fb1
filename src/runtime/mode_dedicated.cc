// Dedicated mode (the DMuon runtime): every rank holds full weights and its local, unreduced
// gradients. Each matrix's gradient is reduced to its owner (HSDP: inside the shard group to the
// owner's shard position first, then across replicas to the owner), the owner steps its weights,
// and the updated weights are broadcast (HSDP: across replicas first, then inside each shard
// group). Only the owner keeps momentum.
//
// Stages of a bucket: 0 reduce in the shard group; 1 reduce across replicas; 2 owner step (pass
// 1 of the bucket's runs, then the owner batches whose last bucket this is) and, under HSDP, the
// broadcast across replicas of the buckets whose updates are then complete; 3 broadcast in the
// shard group (flat: to everyone), one slot after the compute stage of the bucket that completes
// its updates (Bucket::ready); 4 wait, for every bucket once the step is issued.
//
// Flat, a bucket's broadcast is issued one slot after the compute that completes it, as the
// sharded mode sends its updates: issued in the same slot, each peer's NCCL kernel would start
// as soon as the peer's own earlier work is done and then wait, resident on its SMs, for the
// owner, beside the peer's own next owner batch, whose persistent GEMMs lose those SMs to a
// second wave (DISTMUON_DEDICATED_EARLY_BROADCAST=1 issues it in the same slot, to measure this).
//
// With DistOptions::caller_transfers the caller has already reduced each gradient onto its owner
// and publishes the weights itself: only stage 2's owner step runs, on the caller's buffers.
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "runtime/mode_runner.h"

namespace distmuon {
namespace {

class DedicatedRunner final : public ModeRunner {
 public:
  using ModeRunner::ModeRunner;

  void setup() override {
    caller_ = dist_.options.caller_transfers;
    early_broadcast_ = env::get_bool("DISTMUON_DEDICATED_EARLY_BROADCAST");
    grad_stage_offset_.assign(dist_.mats.size(), -1);
    convert_offset_.assign(dist_.mats.size(), -1);
    bufs_.resize(dist_.buckets.size());
    for (size_t b = 0; b < dist_.buckets.size(); ++b) {
      const Bucket& bk = dist_.buckets[b];
      int64_t g = 0, c = 0;
      for (int j : bk.mats) {
        const DistMatrix& m = dist_.mats[j];
        if (m.owner_s == dist_.my_s) {  // reduced here (the owner, or the relay of its replica)
          grad_stage_offset_[j] = g;
          g += m.numel();
        }
        convert_offset_[j] = c;
        c += m.numel();
      }
      const DType w = dist_.mats[bk.mats[0]].wire;
      if (!caller_)
        bufs_[b].gstage =
            backend_.alloc(static_cast<size_t>(std::max<int64_t>(g, 1)) * dtype_size(w));
      convert_elems_.push_back(c);
    }
  }
  int num_stages() const override { return 5; }
  // Flat, stage 3 issues the last buckets' broadcasts, which nothing on this rank waits for
  // until stage 4: issued in the step, they overlap what the caller does before publishing.
  bool deferrable(int stage) const override { return dist_.replica != nullptr || stage != 3; }
  int compute_stage() const override { return 2; }

  void pass1(int b, StepContext& ctx) override {
    const Bucket& bk = dist_.buckets[b];
    if (!caller_) {
      dist_.wait_on_stream(bufs_[b].reduce_in_shard);
      dist_.wait_on_stream(bufs_[b].reduce_across_replicas);
      scale(bk);
    }
    owned_norms(bk, owned_slot(ctx));
  }

  void run_stage(int stage, int b, StepContext& ctx) override {
    const Bucket& bk = dist_.buckets[b];
    BucketBuffers& s = bufs_[b];
    if (caller_) {
      if (stage == 2) step_owned(b, ctx, owned_slot(ctx));
      return;
    }
    switch (stage) {
      // Each stage's collectives (one per matrix, to or from its owner) launch as one group:
      // one host launch per bucket and stage instead of one per matrix.
      case 0: {
        // The contributions (conversions, allocations) before the group: a rank failing inside
        // it would launch part of the group and leave the others waiting until the timeout.
        std::vector<const void*> src;
        for (int j : bk.act) src.push_back(source(b, j, ctx));
        dist_.shard->grouped([&] {
          for (size_t k = 0; k < bk.act.size(); ++k) {
            const int j = bk.act[k];
            const DistMatrix& m = dist_.mats[j];
            void* recv = m.owner_s == dist_.my_s ? gstage(j) : nullptr;
            s.reduce_in_shard.push_back(dist_.shard->reduce(src[k], recv, m.numel(),
                                                            comm_type(m.wire), ReduceOp::kSum,
                                                            m.owner_s));
          }
        });
        break;
      }
      case 1:
        // Flat, the compute stage waits for its own bucket's reduction, so that the first owner
        // batches run while later buckets still reduce. Under HSDP the replicas' reduction reads
        // what the shard group's wrote, ordered through the compute stream: it waits here.
        if (!dist_.replica) break;
        dist_.wait_on_stream(s.reduce_in_shard);
        dist_.replica->grouped([&] {
          for (int j : bk.act) {
            const DistMatrix& m = dist_.mats[j];
            if (m.owner_s != dist_.my_s) continue;
            s.reduce_across_replicas.push_back(dist_.replica->reduce(
                gstage(j), gstage(j), m.numel(), comm_type(m.wire), ReduceOp::kSum, m.owner_r));
          }
        });
        break;
      case 2:
        dist_.wait_on_stream(s.reduce_in_shard);
        dist_.wait_on_stream(s.reduce_across_replicas);
        if (!ctx.raise) scale(bk);
        step_owned(b, ctx, owned_slot(ctx));
        if (dist_.replica || early_broadcast_)
          for (int c : bk.ready_buckets) broadcast_first(c, ctx);  // weights now all updated
        break;
      case 3:
        if (!dist_.replica) {
          if (!early_broadcast_) broadcast_first(b, ctx);
          break;
        }
        dist_.wait_on_stream(s.broadcast_first);
        dist_.shard->grouped([&] {
          for (int j : bk.act) {
            const DistMatrix& m = dist_.mats[j];
            s.broadcast_in_shard.push_back(
                dist_.shard->broadcast(weight(j, ctx), m.numel(), comm_type(m.dtype), m.owner_s));
          }
        });
        break;
      case 4:
        dist_.wait_on_stream(s.broadcast_first);
        dist_.wait_on_stream(s.broadcast_in_shard);
        break;
    }
  }

 private:
  struct BucketBuffers {
    Buffer gstage, conv;
    // Per stage: 0 reduce in the shard group, 1 reduce across replicas; broadcast_first: across
    // replicas (stage 2; flat: to everyone, stage 3), broadcast_in_shard: in the shard group (3).
    std::vector<CommHandle> reduce_in_shard, reduce_across_replicas, broadcast_first,
        broadcast_in_shard;
  };

  // The broadcast of bucket c's updated weights across replicas (flat: to everyone), one group.
  void broadcast_first(int c, StepContext& ctx) {
    BucketBuffers& sc = bufs_[c];
    Communicator& first = dist_.replica ? *dist_.replica : *dist_.shard;
    first.grouped([&] {
      for (int j : dist_.buckets[c].act) {
        const DistMatrix& m = dist_.mats[j];
        void* w = weight(j, ctx);
        const CommType t = comm_type(m.dtype);
        if (!dist_.replica)
          sc.broadcast_first.push_back(first.broadcast(w, m.numel(), t, m.owner_s));
        else if (m.owner_s == dist_.my_s)
          sc.broadcast_first.push_back(first.broadcast(w, m.numel(), t, m.owner_r));
      }
    });
  }

  void* gstage(int j) {
    const DistMatrix& m = dist_.mats[j];
    return at(bufs_[m.bucket].gstage.data(), grad_stage_offset_[j], m.wire);
  }
  void* weight(int j, const StepContext& ctx) {
    const DistMatrix& m = dist_.mats[j];
    return at(ctx.data[m.param].param, full_offset(m), m.dtype);
  }
  // This rank's contribution: the caller's gradient when it already has the wire dtype, else a
  // converted copy, or zeros when this rank computed no gradient for the matrix.
  const void* source(int b, int j, const StepContext& ctx) {
    const DistMatrix& m = dist_.mats[j];
    const ParamData& d = ctx.data[m.param];
    if (ctx.has_local[m.param] && d.grad_dtype == m.wire) return at(d.grad, full_offset(m), m.wire);
    BucketBuffers& s = bufs_[b];
    if (!s.conv)
      s.conv = backend_.alloc(static_cast<size_t>(convert_elems_[b]) * dtype_size(m.wire));
    void* dst = at(s.conv.data(), convert_offset_[j], m.wire);
    if (ctx.has_local[m.param])
      copy_block(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, dst, m.wire, m.rows,
                 m.cols);
    else
      backend_.fill_zero(dst, static_cast<size_t>(m.numel()) * dtype_size(m.wire));
    return dst;
  }
  // The owner turns the sum of the local gradients into their mean (DDP semantics).
  void scale(const Bucket& bk) {
    if (!dist_.options.grad_mean || dist_.world_size == 1) return;
    for (int j : bk.act) {
      const DistMatrix& m = dist_.mats[j];
      if (m.owner != dist_.rank) continue;
      BatchRef g = BatchRef::packed(gstage(j), m.wire, 1, m.rows, m.cols);
      backend_.lincomb(1.0 / dist_.world_size, g, 0.0, nullptr, 0.0, g);
    }
  }
  MuonSlot slot(int j, const StepContext& ctx) {
    const DistMatrix& m = dist_.mats[j];
    return {MatRef::of(gstage(j), m.wire, m.rows, m.cols),
            MatRef::of(m.momentum.data(), registry_.params[m.param].state0_dtype, m.rows, m.cols),
            MatRef::of(weight(j, ctx), m.dtype, m.rows, m.cols),
            record_.skips_of(registry_.params[m.param], m.slice)};
  }

  // The caller's buffers: its (reduced) gradient and its weights, on the owner.
  MuonSlot caller_slot(int j, const StepContext& ctx) {
    const DistMatrix& m = dist_.mats[j];
    const ParamData& d = ctx.data[m.param];
    DM_CHECK(ctx.has_local[m.param], "matrix '", registry_.slice_name(m.param, m.slice),
             "' has a gradient on some rank but none on its owner, rank ", dist_.rank,
             ": with caller_transfers the caller reduces every gradient onto its owner");
    return {MatRef::of(at(d.grad, full_offset(m), d.grad_dtype), d.grad_dtype, m.rows, m.cols),
            MatRef::of(m.momentum.data(), registry_.params[m.param].state0_dtype, m.rows, m.cols),
            MatRef::of(at(d.param, full_offset(m), m.dtype), m.dtype, m.rows, m.cols),
            record_.skips_of(registry_.params[m.param], m.slice)};
  }
  // The owner's slot: the staged reduced gradient, or the caller's buffers.
  SlotOf owned_slot(const StepContext& ctx) {
    return [this, &ctx](int j) { return caller_ ? caller_slot(j, ctx) : slot(j, ctx); };
  }

  bool caller_ = false;
  bool early_broadcast_ = false;  // DISTMUON_DEDICATED_EARLY_BROADCAST (header)
  std::vector<BucketBuffers> bufs_;
  std::vector<int64_t> grad_stage_offset_, convert_offset_, convert_elems_;
};

}  // namespace

std::unique_ptr<ModeRunner> make_dedicated_runner(const RunnerContext& c) {
  return std::make_unique<DedicatedRunner>(c);
}

}  // namespace distmuon
