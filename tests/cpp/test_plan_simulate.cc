// The simulator: the collective formulas, and the predictions behaving as the modes must (owner
// modes do less per-rank work than gather-then-compute as D grows).
#include <gtest/gtest.h>

#include "distmuon/error.h"
#include "distmuon/simulate.h"
#include "distmuon/workload.h"

namespace distmuon {
namespace {

TEST(PlanSimulate, CollectiveFormulas) {
  CommModel cm;
  const double G = 1e9;
  EXPECT_EQ(ring_allgather_seconds(G, 1, cm, 8), 0.0);
  EXPECT_DOUBLE_EQ(ring_allgather_seconds(G, 8, cm, 8),
                   7 * cm.intra_latency_s + 7.0 / 8 * G / cm.intra_bytes_per_s);
  // Past one node the ring is paced by the NIC.
  EXPECT_DOUBLE_EQ(ring_allgather_seconds(G, 16, cm, 8),
                   15 * cm.inter_latency_s + 15.0 / 16 * G / cm.inter_bytes_per_s);
  EXPECT_DOUBLE_EQ(chain_seconds(G, 4, cm, 8), 3 * cm.intra_latency_s + G / cm.intra_bytes_per_s);
  EXPECT_DOUBLE_EQ(alltoall_seconds(G, 0.5 * G, 8, cm, 8),
                   7 * cm.intra_latency_s + G / cm.intra_bytes_per_s);
  // 64 ranks on 8-GPU nodes: 7 of 63 peers are on the node; the NIC part dominates.
  const double inter = G * 56.0 / 63 / cm.inter_bytes_per_s;
  EXPECT_DOUBLE_EQ(alltoall_seconds(G, G, 64, cm, 8), 63 * cm.inter_latency_s + inter);
  EXPECT_THROW(ring_allgather_seconds(G, 0, cm, 8), Error);
  EXPECT_FALSE(cm.describe().empty());
}

// The step as distmuon-bench times it: the FSDP2 emulation around gather, sharded and the AdamW
// baseline, the dedicated engine alone; the bandwidth terms beside it.
TEST(PlanSimulate, BenchStepAddsTheCollectivesAroundTheOptimizer) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(4));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  CommModel cm;
  double total = 0;
  for (const auto& m : mats) total += static_cast<double>(m.rows) * m.cols * cm.wire_elem_bytes;
  const auto pts = simulate(mats, costs, {1, 4}, 4, cm, "lpt");
  ASSERT_EQ(pts.size(), 2u);
  EXPECT_EQ(pts[0].fsdp_comm, 0);
  // At one rank NCCL still copies: every shard reduce and every gather is a local copy, issued
  // at local_collective_s each.
  const double copies = 2 * (2 * total) / cm.hbm_bytes_per_s;
  EXPECT_GE(pts[0].fsdp(), std::max(copies, 2.0 * mats.size() * cm.local_collective_s));
  EXPECT_LE(pts[0].fsdp(), copies + 2.0 * mats.size() * cm.local_collective_s);
  for (const SimPoint& p : pts) {
    SCOPED_TRACE(p.world);
    EXPECT_DOUBLE_EQ(p.gather_step(), p.gather() + p.fsdp());
    EXPECT_DOUBLE_EQ(p.sharded_step(), p.sharded() + p.fsdp());
    EXPECT_DOUBLE_EQ(p.dedicated_step(), p.dedicated());
    EXPECT_DOUBLE_EQ(p.adamw_step(), p.adamw_engine + p.fsdp());
    EXPECT_LT(p.adamw_step(), p.sharded_step());
    // The timeline never beats the work each of its parts does alone.
    EXPECT_GE(p.dedicated(), p.owner_step * (1 - 1e-12));
    EXPECT_GE(p.gather(), p.gather_compute + p.gather_elementwise - 1e-12);
  }
  const SimPoint& p = pts[1];
  EXPECT_DOUBLE_EQ(p.fsdp_comm, 2 * ring_allgather_seconds(total, 4, cm, 4));
  EXPECT_GE(p.dedicated_exchange, p.fsdp_comm);  // a chain forwards at least what a ring moves
  EXPECT_DOUBLE_EQ(p.adamw_update,
                   22 * total / cm.wire_elem_bytes / 4 / cm.adamw_pass_bytes_per_s());
  // The AdamW engine: the vote, then the update.
  EXPECT_NEAR(p.adamw_engine, cm.collective_latency_s + 6 * cm.intra_latency_s + p.adamw_update,
              1e-12);
}

// A workload of `count` tensors of one shape.
Workload uniform(int64_t count, std::vector<int64_t> shape) {
  Workload w;
  w.name = "uniform";
  w.muon.push_back({"w", std::move(shape), count});
  return w;
}

// A cost table where orthogonalizing costs (next to) nothing.
CostTable free_costs(const std::vector<PlanMatrix>& mats) {
  CostTable t = CostTable::empty("analytic", "free", parse_algorithm("auto"));
  for (const ShapeCount& s : shape_counts(mats)) {
    std::vector<CostPoint> pts;
    for (int64_t k = 1; k <= s.count; ++k) pts.push_back({k, 1e-15 * k});
    t.set(s.rows, s.cols, pts);
  }
  return t;
}

// A link where bytes and hops cost nothing: only the per-collective latency is left.
CommModel latency_only(double latency_s) {
  CommModel cm;
  cm.intra_bytes_per_s = cm.inter_bytes_per_s = 1e30;
  cm.intra_latency_s = cm.inter_latency_s = 0;
  cm.hbm_bytes_per_s = 1e30;
  cm.elementwise_bytes = 0;
  cm.collective_latency_s = latency_s;
  return cm;
}

// The FSDP2 emulation launches a layer's reduces as one group and its all-gathers as another
// (FSDP2 with fully_shard per block), however many tensors the layer holds.
TEST(PlanSimulate, FsdpLaunchesOneGroupPerLayerEachWay) {
  const double alpha = 100e-6;
  Workload w;
  w.name = "blocks";
  w.muon = {{"q", {64, 32}, 6}, {"k", {64, 32}, 6}, {"v", {32, 64}, 6}};
  const auto mats = plan_matrices(w);
  const SimPoint p =
      simulate(mats, free_costs(mats), {4}, 8, latency_only(alpha), "lpt", {}, sim_tensors(w))
          .at(0);
  EXPECT_EQ(p.fsdp_collectives, 18 * (4 + 1));  // a reduce per shard and an all-gather, per tensor
  EXPECT_EQ(p.fsdp_launches, 2 * 6);
  EXPECT_NEAR(p.fsdp(), 2 * 6 * alpha, 1e-12);
  // Without the tensors (one per matrix, each its own unit): a launch per tensor each way.
  const SimPoint q = simulate(mats, free_costs(mats), {4}, 8, latency_only(alpha), "lpt").at(0);
  EXPECT_EQ(q.fsdp_launches, 2 * 18);
}

// (a) Every launch costs its issuing host collective_latency_s, one after the other: twice the
// collectives add exactly N alpha (the dedicated mode launches a bucket's reduces, and its
// broadcasts, as one group each).
TEST(PlanSimulate, CollectiveLatencyIsPaidPerCollective) {
  const double alpha = 143e-6;
  const CommModel cm = latency_only(alpha);
  for (int64_t n : {8, 16}) {
    SCOPED_TRACE(n);
    const Workload w = uniform(n, {64, 32});
    const auto mats = plan_matrices(w);
    const auto pts = simulate(mats, free_costs(mats), {2}, 8, cm, "lpt", {}, sim_tensors(w));
    const SimPoint& p = pts.at(0);
    // FSDP2 emulation: a reduce per rank's shard and an all-gather per tensor, a launch per
    // layer each way (here one tensor per layer).
    EXPECT_EQ(p.fsdp_collectives, 3 * n);
    EXPECT_EQ(p.fsdp_launches, 2 * n);
    EXPECT_NEAR(p.fsdp(), 2 * n * alpha, 1e-12);
    // Dedicated: the vote, a reduce and a broadcast per matrix, launched per bucket; nothing
    // else to wait for.
    EXPECT_EQ(p.dedicated_collectives, 1 + 2 * n);
    EXPECT_EQ(p.dedicated_launches, 1 + 2 * p.buckets);
    EXPECT_NEAR(p.dedicated(), p.dedicated_launches * alpha, 1e-9);
  }
  const auto step = [&](int64_t n) {
    const Workload w = uniform(n, {64, 32});
    const auto mats = plan_matrices(w);
    return simulate(mats, free_costs(mats), {2}, 8, cm, "lpt", {}, sim_tensors(w)).at(0);
  };
  const SimPoint a = step(8), b = step(16);
  EXPECT_NEAR(b.fsdp() - a.fsdp(), (b.fsdp_launches - a.fsdp_launches) * alpha, 1e-12);
  EXPECT_NEAR(b.fsdp() - a.fsdp(), 16 * alpha, 1e-12);
  EXPECT_NEAR(b.adamw_step() - a.adamw_step(), 16 * alpha, 1e-12);
  EXPECT_NEAR(b.dedicated() - a.dedicated(), (b.dedicated_launches - a.dedicated_launches) * alpha,
              1e-9);
  // No latency: nothing is left.
  const Workload w = uniform(16, {64, 32});
  const auto mats = plan_matrices(w);
  const SimPoint z =
      simulate(mats, free_costs(mats), {2}, 8, latency_only(0), "lpt", {}, sim_tensors(w)).at(0);
  EXPECT_NEAR(z.fsdp() + z.dedicated(), 0, 1e-9);
}

// The host issues while the device moves what it issued before: collectives larger than the
// latency are paced by their bytes, smaller ones by the host.
TEST(PlanSimulate, CollectiveLatencyOverlapsTheTransfers) {
  const double alpha = 100e-6;
  const int64_t n = 10;
  const Workload w = uniform(n, {1024, 1024});  // 2 MiB of bf16 per tensor
  const auto mats = plan_matrices(w);
  for (const double beta : {1e9, 1e12}) {  // an all-gather of 2 MiB: ~1 ms, ~1 us
    SCOPED_TRACE(beta);
    CommModel cm = latency_only(alpha);
    cm.intra_bytes_per_s = beta;
    const SimPoint p =
        simulate(mats, free_costs(mats), {2}, 8, cm, "lpt", {}, sim_tensors(w)).at(0);
    const double t = 0.5 * 1024 * 1024 * 2 / beta;  // (D-1)/D of the tensor
    // The first is issued after alpha; then each starts when the later of the host and the
    // device is ready.
    EXPECT_NEAR(p.fsdp_all_gather, t > alpha ? alpha + n * t : n * alpha + t, 1e-12);
  }
}

// How many collectives each mode issues follows from the plan and the buckets: the FSDP2
// emulation per tensor (a reduce per non-empty shard, one all-gather), gather per bucket (a
// status all-reduce and the all-gather), sharded per bucket (two all-to-alls and a status
// all-reduce), dedicated per matrix (a reduce and a broadcast), plus the vote at D > 1.
TEST(PlanSimulate, CollectivesPerModeFollowThePlanAndTheBuckets) {
  // deepseek's experts are 3-D tensors: one tensor, 64 matrices each.
  const Workload w = load_workload("deepseek-v2-lite").first_layers(1);
  const auto mats = plan_matrices(w);
  const auto tensors = sim_tensors(w);
  int64_t held = 0;
  for (const SimTensor& t : tensors) held += t.matrices;
  ASSERT_EQ(held, static_cast<int64_t>(mats.size()));
  ASSERT_LT(tensors.size(), mats.size());
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  for (const int64_t bucket_mb : {int64_t{0}, int64_t{8}, int64_t{32}}) {
    CommModel cm;
    cm.bucket_bytes = bucket_mb << 20;
    const auto pts = simulate(mats, costs, {1, 2, 4}, 8, cm, "lpt", {}, tensors);
    for (const SimPoint& p : pts) {
      SCOPED_TRACE(::testing::Message() << "D " << p.world << ", " << bucket_mb << " MiB");
      const int64_t d = p.world, vote = d > 1 ? 1 : 0;
      // The buckets as the runtime cuts them (dist_layout.cc): one at one rank.
      int64_t buckets = 0, bytes = 0;
      for (const PlanMatrix& m : mats) {
        const int64_t mb = m.rows * m.cols * cm.wire_elem_bytes;
        if (buckets == 0 || (d > 1 && cm.bucket_bytes > 0 && bytes + mb > cm.bucket_bytes)) {
          ++buckets;
          bytes = 0;
        }
        bytes += mb;
      }
      EXPECT_EQ(p.buckets, buckets);
      int64_t shards = 0;
      for (const SimTensor& t : tensors) shards += std::min<int64_t>(d, t.dim0);
      EXPECT_EQ(p.fsdp_collectives, shards + static_cast<int64_t>(tensors.size()));
      EXPECT_EQ(p.gather_collectives, vote + 2 * buckets);
      EXPECT_EQ(p.sharded_collectives, vote + 3 * buckets);
      EXPECT_EQ(p.dedicated_collectives, vote + 2 * static_cast<int64_t>(mats.size()));
      EXPECT_EQ(p.adamw_collectives, vote);
    }
  }
}

// Buckets cut gather's batches (every run of a bucket, one shape, is one batched
// orthogonalization, paying the table's cost of its own batch size), not the owners': an owner
// runs each plan batch once, after its last bucket, unless batches_across_buckets is off (then
// once per bucket it spans, as the engine did before).
TEST(PlanSimulate, BucketsCutTheBatches) {
  const Workload w = load_workload("gpt2-large").first_layers(8);
  const auto mats = plan_matrices(w);
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  CommModel whole, small;
  whole.bucket_bytes = 0;
  small.bucket_bytes = 1;  // one matrix per bucket
  whole.collective_latency_s = small.collective_latency_s = 0;
  // Transfers free: only the batches' compute is compared (with transfers, cutting the batches
  // may pay: each runs as soon as its bucket lands, and a model's classes span its layers).
  small.intra_bytes_per_s = small.inter_bytes_per_s = 1e30;
  small.intra_latency_s = small.inter_latency_s = 0;
  CommModel cut = small;
  cut.batches_across_buckets = false;
  const SimPoint a = simulate(mats, costs, {2}, 8, whole, "lpt", {}, sim_tensors(w)).at(0);
  const SimPoint b = simulate(mats, costs, {2}, 8, small, "lpt", {}, sim_tensors(w)).at(0);
  const SimPoint c = simulate(mats, costs, {2}, 8, cut, "lpt", {}, sim_tensors(w)).at(0);
  EXPECT_EQ(a.buckets, 1);
  EXPECT_EQ(b.buckets, static_cast<int64_t>(mats.size()));
  // One bucket: gather batches each shape (3 wide shapes), an owner its plan's batches.
  EXPECT_EQ(a.gather_runs, 3);
  EXPECT_LE(a.owner_runs, 3);
  EXPECT_EQ(b.gather_runs, static_cast<int64_t>(mats.size()));
  EXPECT_EQ(b.owner_runs, a.owner_runs);
  EXPECT_GE(c.owner_runs, static_cast<int64_t>(mats.size()) / 2);
  // Batches of one pay the per-batch launches once per matrix. (The owner modes are compared
  // at equal buckets: one bucket would also leave no reduction to overlap with compute.)
  EXPECT_GT(b.gather(), a.gather());
  EXPECT_GT(c.dedicated(), b.dedicated());
  EXPECT_GT(c.sharded(), b.sharded());
  double singles = 0;
  for (const PlanMatrix& m : mats) singles += costs.batch_seconds(m.rows, m.cols, 1);
  EXPECT_GE(b.gather(), singles);
}

// A run whose engines planned on other costs than its steps take: the owners come from the
// planning table, the times (and the makespan) from the timing table.
TEST(PlanSimulate, OwnersCanBePlacedOnTheCostsTheRunPlannedWith) {
  const Workload w = load_workload("gpt2-large").first_layers(3);
  const auto mats = plan_matrices(w);
  const OrthoConfig cfg = parse_algorithm("auto");
  const CostTable timing = analytic_cost_table(shape_counts(mats), cfg, {});
  // The planning table believes the first shape nearly free.
  CostTable planning = timing;
  const auto& [key, first] = *timing.shapes().begin();
  std::vector<CostPoint> cheap = first.points;
  for (CostPoint& c : cheap) c.seconds *= 0.02;
  planning.set(key.first, key.second, cheap);
  Topology topo;
  topo.world_size = 2;
  topo.gpus_per_node = 8;
  const std::vector<int> planned = make_plan("lpt", mats, topo, planning).owner;
  ASSERT_NE(planned, make_plan("lpt", mats, topo, timing).owner) << "the tables must disagree";
  CommModel cm;
  const SimPoint own = simulate(mats, timing, {2}, 8, cm, "lpt", {}, sim_tensors(w)).at(0);
  const SimPoint p = simulate(mats, timing, {2}, 8, cm, "lpt", {}, sim_tensors(w), &planning).at(0);
  EXPECT_EQ(p.owner, planned);
  EXPECT_DOUBLE_EQ(p.makespan, plan_fixed(mats, topo, timing, planned).makespan);
  EXPECT_GE(p.makespan, own.makespan * 0.999);  // placed on the wrong costs: no better balanced
  EXPECT_DOUBLE_EQ(p.gather(), own.gather());   // gather has no owners
}

// A share of the compute (`field`) at each of `values` against `base`, on gpt2-large's first
// four layers: at one rank nothing changes; at `world` ranks the dedicated step grows with it,
// by at most every kernel at (1 - share) of its speed; a share of 1 is refused.
void expect_shares_slow_the_owners(double CommModel::*field, const CommModel& base, int world,
                                   std::initializer_list<double> values) {
  const Workload w = load_workload("gpt2-large").first_layers(4);
  const auto mats = plan_matrices(w);
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  const auto ref = simulate(mats, costs, {1, world}, 8, base, "lpt", {}, sim_tensors(w));
  double last = ref[1].dedicated();
  for (const double share : values) {
    CommModel cm = base;
    cm.*field = share;
    const auto pts = simulate(mats, costs, {1, world}, 8, cm, "lpt", {}, sim_tensors(w));
    SCOPED_TRACE(share);
    EXPECT_DOUBLE_EQ(pts[0].dedicated(), ref[0].dedicated());
    EXPECT_DOUBLE_EQ(pts[0].gather(), ref[0].gather());
    if (share > 0) {
      EXPECT_GT(pts[1].dedicated(), last);
    }
    EXPECT_LE(pts[1].dedicated(), ref[1].dedicated() / (1 - share) + 1e-12);
    last = pts[1].dedicated();
  }
  CommModel bad = base;
  bad.*field = 1;
  EXPECT_THROW(simulate(mats, costs, {2}, 8, bad, "lpt"), Error);
}

// (c) Where ranks share one GPU, collectives moving data slow the compute beside them: the
// owners' compute runs beside the reduces and broadcasts of other buckets.
TEST(PlanSimulate, CommunicationSharesTheComputeWhereRanksShareAGpu) {
  CommModel base;
  base.bucket_bytes = 8 << 20;
  // Each bucket's batches right after it lands, beside the next buckets' transfers (a plan batch
  // spanning the buckets would start after the last one, beside nothing).
  base.batches_across_buckets = false;
  expect_shares_slow_the_owners(&CommModel::comm_compute_share, base, 2, {0.0, 0.25, 0.5});
}

// An NCCL kernel waiting for its peers spins on its SMs: with a waiting share, the dedicated
// owners (whose peers join each broadcast only after their own compute) slow down further.
TEST(PlanSimulate, WaitingCollectivesTakeTheirShareToo) {
  CommModel base;
  base.bucket_bytes = 8 << 20;
  base.comm_compute_share = 0.5;
  expect_shares_slow_the_owners(&CommModel::comm_wait_share, base, 4, {0.25, 0.5});
}

// gpt2-large's first 4 layers on analytic costs, over links slow enough that the transfers show
// in the step: for the tests that give one kind of collective a rate of its own.
struct SlowLinks {
  Workload w = load_workload("gpt2-large").first_layers(4);
  std::vector<PlanMatrix> mats = plan_matrices(w);
  CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  CommModel base = [] {
    CommModel cm;
    cm.intra_bytes_per_s = 100e9;
    cm.collective_latency_s = 0;
    return cm;
  }();
};

// The dedicated mode's broadcasts and reduces run at their own rates where given; the other modes
// and the dedicated mode beyond a node do not see them, except the FSDP2 emulation's reduce of each
// dim-0 shard to its holder, a rooted reduce as well (its all-gathers keep the gathers' rate).
TEST(PlanSimulate, RootedCollectivesHaveRatesOfTheirOwn) {
  const SlowLinks s;
  const Workload& w = s.w;
  const auto& mats = s.mats;
  const CostTable& costs = s.costs;
  const CommModel& base = s.base;
  CommModel fast_bc = base, fast_red = base, bad = base;
  fast_bc.intra_broadcast_bytes_per_s = 400e9;
  fast_red.intra_root_reduce_bytes_per_s = 400e9;
  const auto ref = simulate(mats, costs, {2, 16}, 8, base, "lpt", {}, sim_tensors(w));
  for (const CommModel& cm : {fast_bc, fast_red}) {
    const auto pts = simulate(mats, costs, {2, 16}, 8, cm, "lpt", {}, sim_tensors(w));
    EXPECT_LT(pts[0].dedicated(), ref[0].dedicated());
    EXPECT_DOUBLE_EQ(pts[0].sharded(), ref[0].sharded());
    EXPECT_DOUBLE_EQ(pts[0].gather(), ref[0].gather());
    EXPECT_DOUBLE_EQ(pts[1].dedicated(), ref[1].dedicated());  // 16 ranks: two nodes, the NICs
    EXPECT_DOUBLE_EQ(pts[0].fsdp_all_gather, ref[0].fsdp_all_gather);
    EXPECT_DOUBLE_EQ(pts[1].fsdp_reduce_scatter, ref[1].fsdp_reduce_scatter);
  }
  auto fsdp_reduce = [&](const CommModel& cm) {
    return simulate(mats, costs, {2}, 8, cm, "lpt", {}, sim_tensors(w))[0].fsdp_reduce_scatter;
  };
  EXPECT_DOUBLE_EQ(fsdp_reduce(fast_bc), ref[0].fsdp_reduce_scatter);
  EXPECT_LT(fsdp_reduce(fast_red), ref[0].fsdp_reduce_scatter);
  bad.intra_broadcast_bytes_per_s = -1;
  EXPECT_THROW(simulate(mats, costs, {2}, 8, bad, "lpt"), Error);
}

// Likewise the sharded mode's all-to-alls: their own rate inside a node shortens the sharded step
// alone; 16 ranks on 8-GPU nodes stay on the NICs' rate.
TEST(PlanSimulate, AllToAllsHaveARateOfTheirOwn) {
  const double G = 1e9;
  CommModel cm;
  cm.intra_alltoall_bytes_per_s = 2 * cm.intra_bytes_per_s;
  EXPECT_DOUBLE_EQ(alltoall_seconds(G, 0.5 * G, 8, cm, 8),
                   7 * cm.intra_latency_s + G / cm.intra_alltoall_bytes_per_s);
  EXPECT_DOUBLE_EQ(alltoall_seconds(G, G, 64, cm, 8),
                   63 * cm.inter_latency_s + G * 56.0 / 63 / cm.inter_bytes_per_s);

  const SlowLinks s;
  const Workload& w = s.w;
  const auto& mats = s.mats;
  const CostTable& costs = s.costs;
  const CommModel& base = s.base;
  CommModel fast = base, bad = base;
  fast.intra_alltoall_bytes_per_s = 400e9;
  const auto ref = simulate(mats, costs, {2, 16}, 8, base, "lpt", {}, sim_tensors(w));
  const auto pts = simulate(mats, costs, {2, 16}, 8, fast, "lpt", {}, sim_tensors(w));
  EXPECT_LT(pts[0].sharded(), ref[0].sharded());
  EXPECT_LT(pts[0].sharded_comm, ref[0].sharded_comm);
  EXPECT_DOUBLE_EQ(pts[0].dedicated(), ref[0].dedicated());
  EXPECT_DOUBLE_EQ(pts[0].gather(), ref[0].gather());
  EXPECT_DOUBLE_EQ(pts[1].sharded(), ref[1].sharded());  // 16 ranks: two nodes, the NICs
  bad.intra_alltoall_bytes_per_s = -1;
  EXPECT_THROW(simulate(mats, costs, {2}, 8, bad, "lpt"), Error);
}

// The AdamW baseline's pass at its own measured rate: its update alone changes, by the ratio of
// the rates; the Muon modes stay.
TEST(PlanSimulate, AdamWPassHasARateOfItsOwn) {
  const SlowLinks s;
  CommModel slow = s.base, bad = s.base;
  slow.adamw_bytes_per_s = s.base.hbm_bytes_per_s / 2;
  const auto ref = simulate(s.mats, s.costs, {1, 4}, 8, s.base, "lpt", {}, sim_tensors(s.w));
  const auto pts = simulate(s.mats, s.costs, {1, 4}, 8, slow, "lpt", {}, sim_tensors(s.w));
  for (size_t i = 0; i < pts.size(); ++i) {
    SCOPED_TRACE(pts[i].world);
    const double ratio = s.base.adamw_pass_bytes_per_s() / slow.adamw_pass_bytes_per_s();
    EXPECT_NEAR(pts[i].adamw_update, ratio * ref[i].adamw_update, 1e-12 * pts[i].adamw_update);
    EXPECT_GT(pts[i].adamw_step(), ref[i].adamw_step());
    EXPECT_DOUBLE_EQ(pts[i].sharded_step(), ref[i].sharded_step());
    EXPECT_DOUBLE_EQ(pts[i].dedicated_step(), ref[i].dedicated_step());
    EXPECT_DOUBLE_EQ(pts[i].gather_step(), ref[i].gather_step());
  }
  bad.adamw_bytes_per_s = -1;
  EXPECT_THROW(simulate(s.mats, s.costs, {2}, 8, bad, "lpt"), Error);
  // Uncalibrated (0), the pass runs at the measured share of the copy rate, not at all of it.
  CommModel share = s.base;
  ASSERT_EQ(s.base.adamw_bytes_per_s, 0);
  share.adamw_bytes_per_s = CommModel::kAdamWShareOfCopy * s.base.hbm_bytes_per_s;
  const auto same = simulate(s.mats, s.costs, {1, 4}, 8, share, "lpt", {}, sim_tensors(s.w));
  for (size_t i = 0; i < same.size(); ++i)
    EXPECT_DOUBLE_EQ(same[i].adamw_update, ref[i].adamw_update);
}

// The sharded mode's all-to-alls in equal blocks (the engine's layout on NCCL windows): every
// pair moves its bucket's largest pair's bytes. With shards of unequal rows (1280 over 3 ranks:
// 427 / 427 / 426) the sharded step grows; with equal ones (over 4) the busiest owner received
// as much already (D - 1 times its largest pair), so it stays. No other mode moves.
TEST(PlanSimulate, EqualBlocksChargeTheLargestPairToEveryPair) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(2));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  const Workload w = load_workload("gpt2-large").first_layers(2);
  CommModel packed, equal;
  packed.intra_bytes_per_s = equal.intra_bytes_per_s = 20e9;  // slow enough to show the bytes
  equal.uniform_all_to_all = true;
  const auto a = simulate(mats, costs, {3, 4}, 8, packed, "lpt", {}, sim_tensors(w));
  const auto b = simulate(mats, costs, {3, 4}, 8, equal, "lpt", {}, sim_tensors(w));
  ASSERT_EQ(a.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].world);
    if (a[i].world == 3)
      EXPECT_GT(b[i].sharded_step(), a[i].sharded_step());
    else
      EXPECT_DOUBLE_EQ(b[i].sharded_step(), a[i].sharded_step());
    EXPECT_EQ(b[i].sharded_collectives, a[i].sharded_collectives);
    EXPECT_DOUBLE_EQ(b[i].gather_step(), a[i].gather_step());
    EXPECT_DOUBLE_EQ(b[i].dedicated_step(), a[i].dedicated_step());
    EXPECT_DOUBLE_EQ(b[i].adamw_step(), a[i].adamw_step());
  }
  EXPECT_NE(equal.describe().find("equal block"), std::string::npos);
}

// Owner modes divide the work: their compute shrinks as the world grows, and inside a node
// (collectives at a few microseconds of host time, a blocking launch) their steps beat gather's.
TEST(PlanSimulate, OwnerModesBeatGatherAsTheWorldGrows) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(8));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  const std::vector<int> worlds = {1, 2, 4, 8, 16, 32, 64, 128};
  PlanOptions opts;
  opts.time_limit_s = 2;
  CommModel cm;
  cm.collective_latency_s = 5e-6;
  for (const std::string solver : {"lpt", "milp"}) {
    const auto pts = simulate(mats, costs, worlds, 8, cm, solver, opts);
    ASSERT_EQ(pts.size(), worlds.size());
    SCOPED_TRACE(solver);
    // One rank: no traffic, and every mode computes everything (its staging copies and local
    // collectives apart).
    EXPECT_DOUBLE_EQ(pts[0].makespan, pts[0].gather_compute);
    for (const double mode : {pts[0].gather(), pts[0].sharded(), pts[0].dedicated()}) {
      EXPECT_GE(mode, pts[0].owner_step * (1 - 1e-12));
      EXPECT_LT(mode, 1.2 * pts[0].owner_step);
    }
    for (size_t i = 1; i < pts.size(); ++i) {
      const SimPoint& p = pts[i];
      SCOPED_TRACE(p.world);
      EXPECT_DOUBLE_EQ(p.gather_compute, pts[0].gather_compute);  // gather never divides work
      EXPECT_LE(p.makespan, pts[i - 1].makespan * (1 + 1e-12));   // owners never add work
      EXPECT_LT(p.makespan, p.gather_compute);
      EXPECT_GE(p.gather_comm, pts[i - 1].gather_comm);  // ring volume grows with D
      EXPECT_GE(p.dedicated_comm, 0.0);
      if (p.world <= 8) {
        EXPECT_LT(p.sharded(), p.gather());
        EXPECT_LT(p.sharded_step(), p.gather_step());
        EXPECT_LT(p.dedicated_step(), p.gather_step());
      }
    }
    // The owners' share of the compute keeps falling from 2 to 64 ranks.
    EXPECT_GT(pts[6].gather_compute / pts[6].owner_step, pts[1].gather_compute / pts[1].owner_step);
  }
}

// At the engine communicator's measured cost per collective the host issues more slowly than the
// device works through small matrices: a mode's engine step is at least its collectives times
// that cost (the dedicated mode's two per matrix: 65 for gpt2-large's 8 layers, 9.3 ms), counted
// per launch where collectives go as one group.
TEST(PlanSimulate, HostBoundStepsPayEveryCollective) {
  const Workload w = load_workload("gpt2-large").first_layers(8);
  const auto mats = plan_matrices(w);
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  const CommModel cm;  // the defaults: 143 us per collective
  CommModel cheap;
  cheap.collective_latency_s = 5e-6;
  const auto pts = simulate(mats, costs, {2, 8, 64}, 8, cm, "lpt", {}, sim_tensors(w));
  const auto ref = simulate(mats, costs, {2, 8, 64}, 8, cheap, "lpt", {}, sim_tensors(w));
  for (size_t i = 0; i < pts.size(); ++i) {
    const SimPoint& p = pts[i];
    SCOPED_TRACE(p.world);
    EXPECT_GE(p.dedicated(), p.dedicated_launches * cm.collective_latency_s);
    EXPECT_LT(p.dedicated_launches, p.dedicated_collectives);  // a bucket holds several
    EXPECT_GE(p.gather(), p.gather_collectives * cm.collective_latency_s);
    EXPECT_GE(p.sharded(), p.sharded_launches * cm.collective_latency_s);
    EXPECT_LT(p.sharded_launches, p.sharded_collectives);  // statuses ride with the rows back
    EXPECT_GE(p.fsdp(), p.fsdp_launches * cm.collective_latency_s);
    EXPECT_GT(p.dedicated(), ref[i].dedicated());
  }
}

// A collective that follows another in its group pays grouped_hop_share of its hops' latency:
// with free bytes and a free host, FSDP2's groups take their first collective's (D-1) alpha in
// full and each later one's at that share.
TEST(PlanSimulate, GroupedCollectivesShareTheirLatency) {
  const Workload w = load_workload("gpt2-large").first_layers(2);
  const auto mats = plan_matrices(w);
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  std::vector<SimPoint> by_share;
  for (double share : {0.0, 0.5, 1.0}) {
    SCOPED_TRACE(share);
    CommModel cm;
    cm.intra_bytes_per_s = 1e18;
    cm.collective_latency_s = 0;
    cm.intra_latency_s = 10e-6;
    cm.grouped_hop_share = share;
    const SimPoint p = simulate(mats, costs, {8}, 8, cm, "lpt", {}, sim_tensors(w))[0];
    ASSERT_LT(p.fsdp_launches, p.fsdp_collectives);  // groups of several
    const double hops = 7 * cm.intra_latency_s;
    EXPECT_NEAR(p.fsdp(), hops * (p.fsdp_launches + share * (p.fsdp_collectives - p.fsdp_launches)),
                1e-9);
    by_share.push_back(p);
  }
  // The engine's own groups too: the dedicated mode's reduces and broadcasts per bucket, the
  // sharded mode's rows back with their statuses.
  EXPECT_LT(by_share[0].dedicated_engine, by_share[1].dedicated_engine);
  EXPECT_LT(by_share[1].dedicated_engine, by_share[2].dedicated_engine);
  EXPECT_LT(by_share[0].sharded_engine, by_share[2].sharded_engine);
  CommModel bad;
  bad.grouped_hop_share = 1.5;
  EXPECT_THROW(simulate(mats, costs, {8}, 8, bad, "lpt"), Error);
}

TEST(PlanSimulate, ElementwisePassesScaleWithTheElementsEachRankOrthogonalizes) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(4));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  double elements = 0;
  for (const auto& m : mats) elements += static_cast<double>(m.rows) * m.cols;
  CommModel none, some;
  none.elementwise_bytes = 0;
  some.elementwise_bytes = 40;
  none.hbm_bytes_per_s = some.hbm_bytes_per_s = 4e12;
  const auto a = simulate(mats, costs, {1, 4}, 8, none, "lpt");
  const auto b = simulate(mats, costs, {1, 4}, 8, some, "lpt");
  const double all = elements * 40 / 4e12;
  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(a[i].world);
    EXPECT_DOUBLE_EQ(a[i].owner_step, a[i].makespan);  // left out: the compute alone
    EXPECT_EQ(a[i].gather_elementwise, 0.0);
    EXPECT_DOUBLE_EQ(b[i].gather_elementwise, all);  // gather prepares every matrix
    EXPECT_NEAR(b[i].gather() - a[i].gather(), all, 1e-12);
  }
  // One rank orthogonalizes everything in every mode; at four, an owner about a quarter.
  EXPECT_NEAR(b[0].dedicated() - a[0].dedicated(), all, 1e-12);
  EXPECT_NEAR(b[0].sharded() - a[0].sharded(), all, 1e-12);
  const double added = b[1].owner_step - b[1].makespan;
  EXPECT_GT(added, 0.2 * all);
  EXPECT_LT(added, 0.4 * all);
}

}  // namespace
}  // namespace distmuon
