// The costs of the engine's start-up plan: which measured table is used (the store, a file or
// none), and the table completed with scaled analytic costs for the shapes it lacks. That ranks
// with different stores agree on rank 0's table is test_dist_plan.cc's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <tuple>

#include "distmuon/cost_table.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "plan/runtime_plan.h"
#include "test_files.h"

namespace distmuon {
namespace {

namespace fs = std::filesystem;
using test::EnvGuard;
using test::error_of;

std::string temp_path(const std::string& name) {
  return test::temp_path("test_runtime_costs", name);
}

constexpr const char* kDevice = "test device";

// Four layers of an MLP block: wide up (8 x 20), tall down (20 x 8, one class with up) and
// square attention (8 x 8).
std::vector<PlanMatrix> mlp_layers() {
  std::vector<PlanMatrix> out;
  for (int64_t l = 0; l < 4; ++l)
    for (auto [name, r, c] : {std::tuple{"up", 8, 20}, {"down", 20, 8}, {"attn", 8, 8}})
      out.push_back({"h." + std::to_string(l) + "." + name, r, c, l, 4});
  return out;
}

// A measured table of this run's key for the 8 x 20 class only: `factor` times the analytic
// time at every point.
CostTable measured_up_down(const OrthoConfig& ortho, const AnalyticRates& rates, double factor) {
  CostTable t;
  t.source = "measured";
  t.device = kDevice;
  t.version = DISTMUON_VERSION;
  t.algorithm = algorithm_name(ortho);
  t.work_dtype = dtype_name(ortho.work_dtype);
  std::vector<CostPoint> pts;
  for (int64_t k : {1, 2, 4, 8})
    pts.push_back({k, factor * analytic_batch_seconds(ortho, rates, 8, 20, k)});
  t.set(8, 20, pts);
  return t;
}

TEST(RuntimeCosts, MeasuredShapesKeepTheirPointsAndTheRestIsScaledAnalytic) {
  const OrthoConfig ortho = parse_algorithm("auto");
  const AnalyticRates rates = runtime_rates(DeviceKind::kCPU);
  const std::vector<PlanMatrix> mats = mlp_layers();
  const CostTable measured = measured_up_down(ortho, rates, 3.0);
  const RuntimeCosts c = runtime_costs(shape_counts(mats), ortho, rates, &measured);
  EXPECT_EQ(c.shapes, 2);
  EXPECT_EQ(c.measured_shapes, 1);
  EXPECT_DOUBLE_EQ(c.analytic_scale, 3.0);
  EXPECT_EQ(c.table.source, "measured + analytic");
  EXPECT_EQ(c.table.device, kDevice);
  // Measured: exactly the measured points (interpolated between them as any table is).
  for (int64_t k : {1, 2, 4, 8})
    EXPECT_DOUBLE_EQ(c.table.batch_seconds(20, 8, k), measured.batch_seconds(8, 20, k));
  // Not measured: analytic, scaled to the measured.
  for (int64_t k = 1; k <= 4; ++k)
    EXPECT_DOUBLE_EQ(c.table.batch_seconds(8, 8, k),
                     3.0 * analytic_batch_seconds(ortho, rates, 8, 8, k));
  EXPECT_EQ(c.describe(), std::string("measured costs for 1 of 2 shapes (") + kDevice +
                              "), analytic for the rest (scaled by 3 to the measured)");

  // The plan on them: made, and says what it was costed on.
  RuntimePlanSpec spec;
  spec.ortho = ortho;
  spec.measured = measured;
  const Plan plan = make_runtime_plan(mats, Topology{3, 8, 1}, spec);
  EXPECT_EQ(plan.owner.size(), mats.size());
  EXPECT_EQ(plan.costs, c.describe());
  EXPECT_NEAR(plan.makespan, *std::max_element(plan.owner_load.begin(), plan.owner_load.end()),
              1e-15);
}

TEST(RuntimeCosts, TheScaleIsTheMedianRatioOverMeasuredPoints) {
  const OrthoConfig ortho = parse_algorithm("auto");
  const AnalyticRates rates = runtime_rates(DeviceKind::kCPU);
  CostTable measured = measured_up_down(ortho, rates, 1.0);
  measured.set(8, 20,
               {{1, 2 * analytic_batch_seconds(ortho, rates, 8, 20, 1)},
                {2, 4 * analytic_batch_seconds(ortho, rates, 8, 20, 2)},
                {3, 10 * analytic_batch_seconds(ortho, rates, 8, 20, 3)}});
  // A shape the workload does not have is not part of the scale.
  measured.set(64, 64, {{1, 1000.0}});
  const RuntimeCosts c = runtime_costs(shape_counts(mlp_layers()), ortho, rates, &measured);
  EXPECT_DOUBLE_EQ(c.analytic_scale, 4.0);
  EXPECT_EQ(c.table.find(64, 64), nullptr);
}

TEST(RuntimeCosts, WithoutMeasuredShapesTheCostsAreAnalytic) {
  const OrthoConfig ortho = parse_algorithm("auto");
  const AnalyticRates rates = runtime_rates(DeviceKind::kCPU);
  const std::vector<ShapeCount> shapes = shape_counts(mlp_layers());
  CostTable other;  // measured, but none of these shapes
  other.device = kDevice;
  other.set(64, 64, {{1, 1.0}});
  for (const CostTable* m : std::vector<const CostTable*>{nullptr, &other}) {
    const RuntimeCosts c = runtime_costs(shapes, ortho, rates, m);
    EXPECT_EQ(c.measured_shapes, 0);
    EXPECT_EQ(c.table.source, "analytic");
    EXPECT_DOUBLE_EQ(c.table.batch_seconds(8, 8, 3), analytic_batch_seconds(ortho, rates, 8, 8, 3));
    EXPECT_EQ(c.describe(), "analytic costs for 2 shapes");
  }
}

TEST(RuntimeCosts, TheSettingIsTheOptionElseTheKnob) {
  EnvGuard knob("DISTMUON_PLAN_COSTS"), store("DISTMUON_COST_CACHE");
  setenv("DISTMUON_COST_CACHE", "/tmp/the-store.json", 1);
  unsetenv("DISTMUON_PLAN_COSTS");
  EXPECT_EQ(plan_cost_source("").kind, PlanCostSource::Kind::kAuto);  // the default
  EXPECT_EQ(plan_cost_source("").path, "/tmp/the-store.json");
  setenv("DISTMUON_PLAN_COSTS", "analytic", 1);
  EXPECT_EQ(plan_cost_source("").kind, PlanCostSource::Kind::kAnalytic);
  EXPECT_EQ(plan_cost_source("auto").kind, PlanCostSource::Kind::kAuto);  // the option wins
  EXPECT_EQ(plan_cost_source("/x/costs.json").kind, PlanCostSource::Kind::kFile);
  EXPECT_EQ(plan_cost_source("/x/costs.json").path, "/x/costs.json");
  setenv("DISTMUON_PLAN_COSTS", "", 1);
  EXPECT_NE(error_of([] { plan_cost_source(""); }).find("auto, analytic or a cost file"),
            std::string::npos);
}

TEST(RuntimeCosts, AutoReadsTheStoreWhereItHoldsThisRunsTable) {
  const OrthoConfig ortho = parse_algorithm("auto");
  const AnalyticRates rates = runtime_rates(DeviceKind::kCPU);
  const std::string store = temp_path("costs.json");
  fs::remove(store);
  const PlanCostSource src{PlanCostSource::Kind::kAuto, store};
  auto device = [] { return std::string(kDevice); };

  MeasuredCosts m = read_measured_costs(src, device, ortho);  // no store yet
  EXPECT_FALSE(m.table);
  EXPECT_NE(m.note.find("no cost store at " + store), std::string::npos) << m.note;

  CostTable other_device = measured_up_down(ortho, rates, 2.0);
  other_device.device = "another device";
  CostTable other_algorithm = measured_up_down(parse_algorithm("ns5"), rates, 2.0);
  write_cost_file(store, {other_device, other_algorithm});
  m = read_measured_costs(src, device, ortho);
  EXPECT_FALSE(m.table);
  EXPECT_NE(m.note.find("no table for auto/f32 on 'test device'"), std::string::npos) << m.note;

  write_cost_file(store, {other_device, measured_up_down(ortho, rates, 2.0), other_algorithm});
  m = read_measured_costs(src, device, ortho);
  ASSERT_TRUE(m.table);
  EXPECT_EQ(m.table->device, kDevice);
  EXPECT_EQ(m.table->algorithm, "auto");
  EXPECT_DOUBLE_EQ(m.table->batch_seconds(8, 20, 2),
                   2.0 * analytic_batch_seconds(ortho, rates, 8, 20, 2));

  // A corrupt store is an error, not silently analytic.
  std::ofstream(store) << "{not json";
  EXPECT_NE(error_of([&] { read_measured_costs(src, device, ortho); }).find("corrupt"),
            std::string::npos);
  // Analytic never looks at a store or asks for the device.
  bool asked = false;
  m = read_measured_costs(
      {PlanCostSource::Kind::kAnalytic, ""}, [&] { return asked = true, std::string(kDevice); },
      ortho);
  EXPECT_FALSE(m.table);
  EXPECT_FALSE(asked);
}

TEST(RuntimeCosts, AFileMustHoldThisRunsTable) {
  const OrthoConfig ortho = parse_algorithm("auto");
  const AnalyticRates rates = runtime_rates(DeviceKind::kCPU);
  const std::string file = temp_path("costs.json");
  auto device = [] { return std::string(kDevice); };
  CostTable other_device = measured_up_down(ortho, rates, 2.0);
  other_device.device = "another device";
  write_cost_file(file, {other_device});
  const std::string msg = error_of([&] {
    read_measured_costs({PlanCostSource::Kind::kFile, file}, device, ortho);
  });
  EXPECT_NE(msg.find("no table for auto/f32 on 'test device'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'another device'"), std::string::npos) << msg;  // what it holds
  const std::string typo = error_of([&] {
    read_measured_costs({PlanCostSource::Kind::kFile, "analytics"}, device, ortho);
  });
  EXPECT_NE(typo.find("'analytics' are neither auto, analytic nor a cost file"), std::string::npos)
      << typo;
}

TEST(RuntimeCosts, AutoWithAnEmptyStorePlansAsAnalytic) {
  EnvGuard knob("DISTMUON_PLAN_COSTS"), store("DISTMUON_COST_CACHE");
  const std::string empty = temp_path("empty/costs.json");
  fs::remove_all(fs::path(empty).parent_path());
  setenv("DISTMUON_COST_CACHE", empty.c_str(), 1);
  const std::vector<PlanMatrix> mats = mlp_layers();
  const Topology topo{3, 8, 1};
  DistOptions dist;
  dist.plan_costs = "auto";
  const OrthoConfig ortho = parse_algorithm("auto");
  const Plan automatic = plan_owners(mats, topo, dist, ortho, DeviceKind::kCPU, kDevice);
  dist.plan_costs = "analytic";
  const Plan analytic = plan_owners(mats, topo, dist, ortho, DeviceKind::kCPU, kDevice);
  EXPECT_EQ(automatic.hash, analytic.hash);
  EXPECT_EQ(automatic.owner, analytic.owner);
  EXPECT_EQ(automatic.makespan, analytic.makespan);
  EXPECT_EQ(automatic.costs, "analytic costs for 2 shapes");

  // The same store with this run's table: the plan is costed on it.
  const CostTable table = measured_up_down(ortho, runtime_rates(DeviceKind::kCPU), 3.0);
  write_cost_file(empty, {table});
  dist.plan_costs = "";  // the knob, auto by default
  unsetenv("DISTMUON_PLAN_COSTS");
  const Plan measured = plan_owners(mats, topo, dist, ortho, DeviceKind::kCPU, kDevice);
  EXPECT_NE(measured.costs.find("measured costs for 1 of 2 shapes"), std::string::npos)
      << measured.costs;
  RuntimePlanSpec spec;
  spec.ortho = ortho;
  spec.measured = table;
  EXPECT_EQ(measured.hash, make_runtime_plan(mats, topo, spec).hash);
  // Every cost three times the analytic one: the same balance at three times the makespan.
  EXPECT_NEAR(measured.makespan, 3.0 * analytic.makespan, 1e-3 * analytic.makespan);
}

}  // namespace
}  // namespace distmuon
