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

// The step as distmuon-bench times it: FSDP2's reduce-scatter and all-gather (two rings) around
// gather and sharded, the dedicated mode's whole reduce and broadcast (two chains), and the AdamW
// baseline's update of a 1/D shard at 22 bytes per element.
TEST(PlanSimulate, BenchStepAddsTheCollectivesAroundTheOptimizer) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(4));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  CommModel cm;
  double total = 0;
  for (const auto& m : mats) total += static_cast<double>(m.rows) * m.cols * cm.wire_elem_bytes;
  const auto pts = simulate(mats, costs, {1, 4}, 4, cm, "lpt");
  ASSERT_EQ(pts.size(), 2u);
  EXPECT_EQ(pts[0].fsdp_comm, 0);
  EXPECT_DOUBLE_EQ(pts[0].gather_step(), pts[0].gather());
  const SimPoint& p = pts[1];
  EXPECT_DOUBLE_EQ(p.fsdp_comm, 2 * ring_allgather_seconds(total, 4, cm, 4));
  EXPECT_DOUBLE_EQ(p.gather_step(), p.gather() + p.fsdp_comm);
  EXPECT_DOUBLE_EQ(p.sharded_step(), p.sharded() + p.fsdp_comm);
  EXPECT_GE(p.dedicated_exchange, p.fsdp_comm);  // a chain forwards at least what a ring moves
  EXPECT_DOUBLE_EQ(p.dedicated_step(), p.owner_step + p.dedicated_exchange);
  EXPECT_DOUBLE_EQ(p.adamw_update, 22 * total / cm.wire_elem_bytes / 4 / cm.hbm_bytes_per_s);
  EXPECT_DOUBLE_EQ(p.adamw_step(), p.adamw_update + p.fsdp_comm);
  EXPECT_LT(p.adamw_step(), p.sharded_step());
}

TEST(PlanSimulate, OwnerModesBeatGatherAsTheWorldGrows) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(8));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  const std::vector<int> worlds = {1, 2, 4, 8, 16, 32, 64, 128};
  PlanOptions opts;
  opts.time_limit_s = 2;
  for (const std::string solver : {"lpt", "milp"}) {
    const auto pts = simulate(mats, costs, worlds, 8, CommModel{}, solver, opts);
    ASSERT_EQ(pts.size(), worlds.size());
    SCOPED_TRACE(solver);
    // One rank: no communication, and every mode computes everything.
    EXPECT_DOUBLE_EQ(pts[0].gather(), pts[0].sharded());
    EXPECT_DOUBLE_EQ(pts[0].gather(), pts[0].dedicated());
    EXPECT_DOUBLE_EQ(pts[0].makespan, pts[0].gather_compute);
    for (size_t i = 1; i < pts.size(); ++i) {
      const SimPoint& p = pts[i];
      SCOPED_TRACE(p.world);
      EXPECT_DOUBLE_EQ(p.gather_compute, pts[0].gather_compute);  // gather never divides work
      EXPECT_LE(p.makespan, pts[i - 1].makespan * (1 + 1e-12));   // owners never add work
      EXPECT_LT(p.makespan, p.gather_compute);
      EXPECT_GE(p.gather_comm, pts[i - 1].gather_comm);  // ring volume grows with D
      EXPECT_LT(p.sharded(), p.gather());
      EXPECT_LT(p.dedicated(), p.gather());
      EXPECT_GE(p.dedicated_comm, 0.0);
    }
    // The speed-up of the owner modes grows from 2 to 64 ranks.
    EXPECT_GT(pts[6].gather() / pts[6].dedicated(), pts[1].gather() / pts[1].dedicated());
    EXPECT_GT(pts[6].gather() / pts[6].sharded(), pts[1].gather() / pts[1].sharded());
  }
}

TEST(PlanSimulate, ElementwisePassesScaleWithTheElementsEachRankOrthogonalizes) {
  const auto mats = plan_matrices(load_workload("gpt2-large").first_layers(4));
  const CostTable costs = analytic_cost_table(shape_counts(mats), parse_algorithm("auto"), {});
  double elements = 0;
  for (const auto& m : mats) elements += static_cast<double>(m.rows) * m.cols;
  CommModel none, some;
  none.elementwise_bytes = 0;
  some.elementwise_bytes = 40;
  some.hbm_bytes_per_s = 4e12;
  const auto a = simulate(mats, costs, {1, 4}, 8, none, "lpt");
  const auto b = simulate(mats, costs, {1, 4}, 8, some, "lpt");
  const double all = elements * 40 / 4e12;
  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(a[i].world);
    EXPECT_DOUBLE_EQ(a[i].owner_step, a[i].makespan);  // left out: the compute alone
    EXPECT_EQ(a[i].gather_elementwise, 0.0);
    EXPECT_DOUBLE_EQ(b[i].gather_elementwise, all);  // gather prepares every matrix
    EXPECT_DOUBLE_EQ(b[i].gather() - a[i].gather(), all);
  }
  // One rank orthogonalizes everything in every mode; at four, an owner about a quarter.
  EXPECT_DOUBLE_EQ(b[0].dedicated() - a[0].dedicated(), all);
  EXPECT_DOUBLE_EQ(b[0].sharded(), b[0].gather());
  const double added = b[1].owner_step - b[1].makespan;
  EXPECT_GT(added, 0.2 * all);
  EXPECT_LT(added, 0.4 * all);
}

}  // namespace
}  // namespace distmuon
