// The runtime's owner plan under mpirun: layers parsed from parameter names, the planner the
// options name (MILP by default, never worse than round-robin or LPT on the same costs) on
// analytic costs, on a measured cost file or on rank 0's store when ranks hold different ones,
// and the engine following the plan's owners.
// That every mode still equals the single process whatever the plan is checked by
// test_dist_engine.cc.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <map>
#include <memory>
#include <tuple>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/cost_table.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "dist_rig.h"
#include "runtime/engine_impl.h"

namespace distmuon {
namespace {

using test::world;

TEST(MpiPlan, LayersAreParsedFromParameterNames) {
  std::map<std::string, int64_t> ids;
  const int64_t h3 = layer_of("transformer.h.3.mlp.c_fc.weight", ids);
  EXPECT_GE(h3, 0);
  EXPECT_EQ(layer_of("transformer.h.3.attn.c_attn.weight", ids), h3);
  EXPECT_NE(layer_of("transformer.h.4.attn.c_attn.weight", ids), h3);
  EXPECT_NE(layer_of("vision.layers.3.fc.weight", ids), h3);  // another stack's layer 3
  EXPECT_EQ(layer_of("blocks.12", ids), 3);                   // ids in first-seen order
  EXPECT_EQ(layer_of("lm_head.weight", ids), -1);
  EXPECT_EQ(layer_of("enc.b12.w", ids), -1);  // digits inside a component are not a layer index
}

// An engine, set up, over four layers of an MLP block: wide up, tall down (one 8 x 20 class
// with up) and square attention, named as the planner reads layers ("h.3.up" is layer 3).
std::unique_ptr<Engine> mlp_engine(Backend& be, Communicator& c, const DistOptions& opt) {
  auto e = std::make_unique<Engine>(be, c, opt);
  e->add_group(GroupOptions{});
  for (int l = 0; l < 4; ++l)
    for (auto [name, r, k] : {std::tuple{"up", 8, 20}, {"down", 20, 8}, {"attn", 8, 8}})
      e->add_param({"h." + std::to_string(l) + "." + name, 0, {r, k}, DType::kF32});
  e->setup();
  return e;
}

TEST(MpiPlan, OwnersComeFromThePlanner) {
  // Four layers of an MLP block (wide up, tall down, square attention): the MILP's plan on
  // analytic costs is never worse than round-robin's on the same costs, and the engine follows
  // it; every mode still equals the single process (EveryModeEqualsTheSingleProcessEngine).
  Communicator& c = world();
  std::vector<const Plan*> plans;
  std::vector<std::unique_ptr<Engine>> engines;
  CpuBackend be;
  for (const char* planner : {"milp", "lpt", "round-robin"}) {
    DistOptions opt;
    opt.mode = DistMode::kReplicated;
    opt.planner = planner;
    opt.plan_costs = "analytic";
    auto e = mlp_engine(be, c, opt);
    plans.push_back(e->plan());
    engines.push_back(std::move(e));
  }
  EXPECT_EQ(plans[0]->solver, "milp");
  EXPECT_EQ(plans[1]->solver, "lpt");
  EXPECT_EQ(plans[2]->solver, "round-robin");
  EXPECT_LE(plans[0]->makespan, plans[2]->makespan * (1 + 1e-12));
  EXPECT_LE(plans[0]->makespan, plans[1]->makespan * (1 + 1e-12));
  for (int i = 0; i < engines[0]->num_params(); ++i)
    EXPECT_EQ(engines[0]->owner(i), plans[0]->owner[i]) << engines[0]->param(i).name;

  // Measured costs from a file: here every launch costs a second, so no owner runs two
  // batches where it can be avoided, and up and down (one 8 x 20 class) batch together.
  const std::string path =
      ::testing::TempDir() + "distmuon_costs_rank" + std::to_string(c.rank()) + ".json";
  AnalyticRates slow_launch;
  slow_launch.launch_s = 1.0;
  CostTable table = analytic_cost_table({{8, 20, 8}, {8, 8, 4}}, OrthoConfig{}, slow_launch);
  table.device = be.name();
  write_cost_file(path, {table});
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = path;
  const auto e = mlp_engine(be, c, opt);
  for (int o = 0; o < c.size(); ++o)
    EXPECT_LE(e->plan()->batches[o].size(), c.size() > 1 ? 1u : 2u) << "owner " << o;
  if (c.size() <= 2) {  // the 8 x 20 class fits one owner: tall and wide in one batch
    for (int i = 0; i < e->num_params(); ++i) {
      if (i % 3 != 2) {
        EXPECT_EQ(e->owner(i), e->owner(0)) << e->param(i).name;
      }
    }
  }
  std::remove(path.c_str());
}

// The plan setup() makes from `measured` (every rank can compute it: no collective).
Plan plan_on(const CostTable* measured, int world_size) {
  std::vector<PlanMatrix> pm;
  for (int64_t l = 0; l < 4; ++l)
    for (auto [r, k] : {std::pair{8, 20}, {20, 8}, {8, 8}}) pm.push_back({"", r, k, l, 4});
  RuntimePlanSpec spec;
  spec.ortho = GroupOptions{}.muon.ortho;
  if (measured) spec.measured = *measured;
  return make_runtime_plan(pm, Topology{world_size, 8, 1}, spec);
}

class CostStore {  // this rank's DISTMUON_COST_CACHE for one test
 public:
  explicit CostStore(const std::string& path) : path_(path) {
    if (const char* v = std::getenv("DISTMUON_COST_CACHE")) saved_ = v;
    setenv("DISTMUON_COST_CACHE", path.c_str(), 1);
  }
  ~CostStore() {
    std::remove(path_.c_str());
    if (saved_.empty())
      unsetenv("DISTMUON_COST_CACHE");
    else
      setenv("DISTMUON_COST_CACHE", saved_.c_str(), 1);
  }

 private:
  std::string path_, saved_;
};

TEST(MpiPlan, RanksWithDifferentStoresPlanOnRankZerosTable) {
  // Every rank's store holds measurements of the 8 x 20 class, different on every rank (rank
  // 0's: a launch costs a second, so the class is batched on few owners; the others': no launch
  // cost and a rate that depends on the rank). Every rank plans on rank 0's table (with analytic
  // costs for the 8 x 8 matrices), and setup() does not fail the plan-hash check.
  Communicator& c = world();
  CpuBackend be;
  auto table_of = [&](int rank) {
    AnalyticRates rates;
    rates.launch_s = rank == 0 ? 1.0 : 0.0;
    rates.flops_per_s *= 1 + rank;
    CostTable t = analytic_cost_table({{8, 20, 8}}, GroupOptions{}.muon.ortho, rates);
    t.source = "measured";
    t.device = be.name();
    return t;
  };
  CostStore store(::testing::TempDir() + "distmuon_store_rank" + std::to_string(c.rank()) +
                  ".json");
  write_cost_file(std::getenv("DISTMUON_COST_CACHE"), {table_of(c.rank())});
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = "auto";
  const auto e = mlp_engine(be, c, opt);
  const CostTable rank0 = table_of(0), mine = table_of(c.rank());
  const Plan want = plan_on(&rank0, c.size());
  EXPECT_EQ(e->plan()->hash, want.hash);
  EXPECT_EQ(e->plan()->costs, want.costs);  // the scale of the analytic costs is rank 0's too
  EXPECT_NE(want.costs.find("measured costs for 1 of 2 shapes (" + be.name() + ")"),
            std::string::npos)
      << want.costs;
  if (c.rank() > 0) {  // this rank's own store would have costed (and at 2 ranks planned) otherwise
    EXPECT_NE(plan_on(&mine, c.size()).costs, want.costs);
    if (c.size() == 2) {
      EXPECT_NE(plan_on(&mine, c.size()).hash, want.hash);
    }
  }
}

class EnvSetting {  // an environment knob for one test
 public:
  EnvSetting(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) saved_ = v;
    setenv(name, value, 1);
  }
  ~EnvSetting() {
    if (saved_)
      setenv(name_, saved_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

std::string file_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(MpiPlan, AutoTimesTheShapesTheStoreLacksOnRankZeroOnly) {
  Communicator& c = world();
  CpuBackend be;
  const std::string path =
      ::testing::TempDir() + "distmuon_timed_store_rank" + std::to_string(c.rank()) + ".json";
  CostStore store(path);
  EnvSetting measure("DISTMUON_PLAN_MEASURE", "on");  // the default times on CUDA only
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = "auto";
  const auto first = mlp_engine(be, c, opt);
  EXPECT_NE(first->plan()->costs.find("measured costs for 2 of 2 shapes (" + be.name() + ")"),
            std::string::npos)
      << first->plan()->costs;
  if (c.rank() == 0) {
    const std::vector<CostTable> tables = read_cost_file(path);
    ASSERT_EQ(tables.size(), 1u);
    EXPECT_EQ(tables[0].device, be.name());
    ASSERT_EQ(tables[0].shapes().size(), 2u);
    for (const auto& [shape, sc] : tables[0].shapes()) {
      ASSERT_FALSE(sc.points.empty()) << shape.first << "x" << shape.second;
      for (const CostPoint& p : sc.points) EXPECT_GT(p.seconds, 0.0);
    }
  } else {
    EXPECT_FALSE(std::filesystem::exists(path)) << "only rank 0 times the shapes";
  }
  // The next engine finds everything in the store: nothing is timed again, the plan is the same.
  const std::string before = c.rank() == 0 ? file_text(path) : "";
  const auto second = mlp_engine(be, c, opt);
  EXPECT_EQ(second->plan()->hash, first->plan()->hash);
  if (c.rank() == 0) {
    EXPECT_EQ(file_text(path), before);
  }
}

TEST(MpiPlan, ABadPlanMeasureSettingIsASetUpErrorOnEveryRank) {
  Communicator& c = world();
  CpuBackend be;
  CostStore store(::testing::TempDir() + "distmuon_unused_store_rank" + std::to_string(c.rank()) +
                  ".json");
  EnvSetting measure("DISTMUON_PLAN_MEASURE", "sometimes");
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = "auto";
  try {
    (void)mlp_engine(be, c, opt);
    ADD_FAILURE() << "a bad DISTMUON_PLAN_MEASURE was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DISTMUON_PLAN_MEASURE is 'sometimes'"), std::string::npos)
        << e.what();
  }
}

// DISTMUON_PLAN_MEASURE=auto times at start-up on CUDA, also on an MPS partition (its own SMs,
// its own table), but not where NCCL's several ranks per GPU take turns without MPS, nor on CPUs.
TEST(MpiPlan, StartUpTimingByDefaultOnCudaUnlessRanksTakeTurnsOnTheGpu) {
  EXPECT_TRUE(plan_measure_by_default(DeviceKind::kCUDA, false, false));  // a GPU per rank
  EXPECT_TRUE(plan_measure_by_default(DeviceKind::kCUDA, true, true));    // MPS partitions
  EXPECT_TRUE(plan_measure_by_default(DeviceKind::kCUDA, true, false));
  EXPECT_FALSE(plan_measure_by_default(DeviceKind::kCUDA, false, true));  // time-sliced
  EXPECT_FALSE(plan_measure_by_default(DeviceKind::kCPU, false, false));
  EXPECT_FALSE(plan_measure_by_default(DeviceKind::kCPU, true, true));
}

TEST(MpiPlan, AutoWithAnEmptyStorePlansAsAnalytic) {
  Communicator& c = world();
  CpuBackend be;
  CostStore store(::testing::TempDir() + "distmuon_no_store_rank" + std::to_string(c.rank()) +
                  ".json");
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = "auto";
  const auto automatic = mlp_engine(be, c, opt);
  opt.plan_costs = "analytic";
  const auto analytic = mlp_engine(be, c, opt);
  EXPECT_EQ(automatic->plan()->hash, analytic->plan()->hash);
  EXPECT_EQ(automatic->plan()->hash, plan_on(nullptr, c.size()).hash);
  EXPECT_EQ(automatic->plan()->costs, "analytic costs for 2 shapes");
}

}  // namespace
}  // namespace distmuon
