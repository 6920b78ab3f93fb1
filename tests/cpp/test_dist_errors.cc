// Bad input across ranks: registrations that differ in shape, dtype, count or mode, shards that
// do not tile, a shard missing on one rank, planners that differ or do not exist, and gradients
// present on some ranks only. Each must
// raise the same clear error on every rank, naming the parameter, the ranks and the values,
// before any data moves, and never hang (ctest runs these with a 60 s communicator timeout).
#include <gtest/gtest.h>

#include <cstdlib>

#include <functional>

#include "dist_rig.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

using test::Mirror;
using test::world;

// Runs f on every rank and returns its error message ("" if none); checks that every rank got
// the same message.
std::string error_everywhere(const std::function<void()>& f) {
  std::string msg;
  try {
    f();
  } catch (const Error& e) {
    msg = e.what();
    // Drop the " [file.cc:line]" location: ranks may fail at different checks of one verdict.
    const size_t at = msg.rfind(" [");
    if (at != std::string::npos && msg.find(".cc:", at) != std::string::npos) msg.resize(at);
  }
  std::vector<int64_t> h = {static_cast<int64_t>(std::hash<std::string>{}(msg) >> 1)}, lo = h;
  test::host_world().all_reduce(h.data(), h.data(), 1, CommType::kI64, ReduceOp::kMax).wait();
  test::host_world().all_reduce(lo.data(), lo.data(), 1, CommType::kI64, ReduceOp::kMin).wait();
  EXPECT_EQ(h[0], lo[0]) << "ranks raised different errors; rank " << world().rank()
                         << " got: " << msg;
  return msg;
}

void expect_has(const std::string& msg, const std::vector<std::string>& parts) {
  EXPECT_FALSE(msg.empty()) << "expected an error";
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
}

struct Reg {
  std::string name = "w";
  std::vector<int64_t> shape = {8, 6};
  DType dtype = DType::kF32;
  bool extra = false;
  int64_t shard_shift = 0;  // moves this rank's shard of `name` (overlap / gap)
  bool no_shard = false;
  std::string planner = "milp";
};

// Registers two Muon matrices ("v" and `r.name`) plus an optional extra one, and runs setup().
void setup_with(DistMode mode, const Reg& r) {
  auto be = test::make_backend();
  DistOptions opt;
  opt.mode = mode;
  opt.planner = r.planner;
  Engine e(*be, world(), opt);
  e.add_group(GroupOptions{});
  const bool sharded = mode == DistMode::kSharded || mode == DistMode::kGather;
  auto shard_of = [&](int64_t dim0, int64_t shift = 0) {
    const int64_t cs = (dim0 + world().size() - 1) / world().size();
    const int64_t b = std::min<int64_t>(world().rank() * cs, dim0);
    return ShardSpec{b + shift, std::min<int64_t>(b + cs, dim0) - b};
  };
  ParamSpec v{"v", 0, {4, 4}, DType::kF32};
  ParamSpec w{r.name, 0, r.shape, r.dtype};
  if (sharded) {
    v.shard = shard_of(4);
    if (!r.no_shard) w.shard = shard_of(r.shape[0], r.shard_shift);
  }
  e.add_param(v);
  e.add_param(w);
  if (r.extra) e.add_param({"extra", 0, {3, 3}, DType::kF32, sharded ? shard_of(3) : ShardSpec{}});
  e.setup();
}

class MpiErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  }
  bool odd_one() const { return world().rank() == 1; }
};

TEST_F(MpiErrors, DifferentShapesNameTheParameterTheRanksAndTheShapes) {
  for (DistMode m : {DistMode::kSharded, DistMode::kDedicated, DistMode::kGather}) {
    Reg r;
    if (odd_one()) r.shape = {8, 7};
    std::string msg = error_everywhere([&] { setup_with(m, r); });
    expect_has(msg, {"'w'", "rank 0 has", "shape [8, 6]", "rank 1 has", "shape [8, 7]"});
  }
}

TEST_F(MpiErrors, DifferentDtypesAndCountsAndModes) {
  Reg r;
  if (odd_one()) r.dtype = DType::kBF16;
  expect_has(error_everywhere([&] { setup_with(DistMode::kReplicated, r); }),
             {"'w'", "dtype f32", "dtype bf16", "rank 1"});
  Reg x;
  x.extra = odd_one();
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, x); }),
             {"'extra'", "(nothing)", "rank 1"});
  expect_has(error_everywhere([&] {
               setup_with(odd_one() ? DistMode::kDedicated : DistMode::kReplicated, Reg{});
             }),
             {"mode replicated", "mode dedicated", "rank 1"});
}

TEST_F(MpiErrors, PlannersThatDifferOrDoNotExist) {
  Reg r;
  if (odd_one()) r.planner = "lpt";
  expect_has(error_everywhere([&] { setup_with(DistMode::kDedicated, r); }),
             {"planner milp", "planner lpt", "rank 1"});
  Reg bad;
  if (odd_one()) bad.planner = "greedy";
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, bad); }),
             {"rank 1: unknown planner 'greedy'"});
}

// Grouped products decide which kernel every rank runs for a class: ranks must agree on the
// knob, and a bad value fails the set-up everywhere, before any step.
TEST_F(MpiErrors, GroupedProductsSettingsThatDifferOrDoNotExist) {
  if (odd_one()) setenv("DISTMUON_GROUPED_PRODUCTS", "off", 1);
  expect_has(error_everywhere([&] { setup_with(DistMode::kDedicated, Reg{}); }),
             {"DISTMUON_GROUPED_PRODUCTS auto", "DISTMUON_GROUPED_PRODUCTS off", "rank 1"});
  if (odd_one()) setenv("DISTMUON_GROUPED_PRODUCTS", "sometimes", 1);
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, Reg{}); }),
             {"rank 1: DISTMUON_GROUPED_PRODUCTS=sometimes: expected auto, off or all"});
  unsetenv("DISTMUON_GROUPED_PRODUCTS");
}

TEST_F(MpiErrors, ACostFileRankZeroCannotReadFailsEverywhere) {
  // Rank 0 reads the plan costs for every rank: its missing cost file is an error on every rank
  // before any data moves, and nobody waits for rank 0 in a collective. (The other ranks' cost
  // settings are not read.)
  auto be = test::make_backend();
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.plan_costs = world().rank() == 0 ? "/nonexistent/costs.json" : "analytic";
  expect_has(error_everywhere([&] {
               Engine e(*be, world(), opt);
               e.add_group(GroupOptions{});
               e.add_param({"w", 0, {8, 6}, DType::kF32});
               e.setup();
             }),
             {"rank 0: plan costs '/nonexistent/costs.json' are neither auto, analytic nor a "
              "cost file"});
}

TEST_F(MpiErrors, ShardsThatDoNotTileDimZero) {
  Reg r;
  if (odd_one()) r.shard_shift = -1;  // overlaps rank 0's rows
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, r); }),
             {"'w'", "do not tile", "rank 1"});
}

TEST_F(MpiErrors, AShardMissingOnOneRankIsReportedByEveryRank) {
  Reg r;
  r.no_shard = odd_one();
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, r); }),
             {"rank 1: parameter 'w' has no shard"});
}

TEST_F(MpiErrors, AGradientOnSomeRanksOnlyNamesThem) {
  for (DistMode m : {DistMode::kReplicated, DistMode::kSharded}) {
    auto be = test::make_backend();
    DistOptions opt;
    opt.mode = m;
    Engine e(*be, world(), opt);
    e.add_group(GroupOptions{});
    const int p = world().size();
    ParamSpec spec{"w", 0, {2 * p, 3}, DType::kF32};
    int64_t rows = 2 * p;
    if (m == DistMode::kSharded) {
      spec.shard = {2 * world().rank(), 2};
      rows = 2;
    }
    e.add_param(spec);
    Mirror<float> w(*be, std::vector<float>(rows * 3, 1.0f)), g(*be, std::vector<float>(rows * 3, 0.5f));
    ParamData d{w.data(), odd_one() ? nullptr : g.data(), DType::kF32, {}};
    std::string msg = error_everywhere([&] { e.step({&d, 1}); });
    expect_has(msg, {"'w'", "not on ranks 1", "has one on ranks 0"});
    EXPECT_EQ(w.get(), std::vector<float>(rows * 3, 1.0f)) << "weights changed";
  }
}

// Each matrix takes its owner's options, so options that differ at a step (a learning-rate
// scheduler stepped on some ranks only) must stop the step on every rank, naming the option.
TEST_F(MpiErrors, StepOptionsThatDifferStopTheStepEverywhere) {
  for (DistMode m : {DistMode::kReplicated, DistMode::kSharded, DistMode::kGather}) {
    auto be = test::make_backend();
    DistOptions opt;
    opt.mode = m;
    Engine e(*be, world(), opt);
    e.add_group(GroupOptions{});
    GroupOptions adam;
    adam.kind = ParamKind::kAdamW;
    e.add_group(adam);
    const int p = world().size();
    ParamSpec w{"w", 0, {2 * p, 3}, DType::kF32}, b{"b", 1, {2 * p}, DType::kF32};
    int64_t rows = 2 * p;
    if (m != DistMode::kReplicated) {
      w.shard = b.shard = {2 * world().rank(), 2};
      rows = 2;
    }
    e.add_param(w);
    e.add_param(b);
    Mirror<float> wv(*be, std::vector<float>(rows * 3, 1.0f)),
        wg(*be, std::vector<float>(rows * 3, 0.5f));
    Mirror<float> bv(*be, std::vector<float>(rows, 1.0f)), bg(*be, std::vector<float>(rows, 0.5f));
    ParamData d[2] = {{wv.data(), wg.data(), DType::kF32, {}},
                      {bv.data(), bg.data(), DType::kF32, {}}};
    if (odd_one()) e.group(0).muon.lr = 0.05f;
    expect_has(error_everywhere([&] {
                 e.step({d, 2});
               }),
               {"different options", "rank 0 has `group 0 muon lr 0.02 momentum 0.95",
                "rank 1 has `group 0 muon lr 0.05 momentum 0.95"});
    EXPECT_EQ(wv.get(), std::vector<float>(rows * 3, 1.0f)) << "weights changed";
    EXPECT_EQ(bv.get(), std::vector<float>(rows, 1.0f)) << "weights changed";
    e.group(0).muon.lr = 0.02f;
    if (odd_one()) e.group(1).adamw.beta2 = 0.99f;
    expect_has(error_everywhere([&] { e.step({d, 2}); }), {"group 1 adamw", "betas 0.9 0.99 "});
    e.group(1).adamw.beta2 = 0.999f;
    if (odd_one()) e.group(0).muon.cache.enabled = true;
    expect_has(error_everywhere([&] { e.step({d, 2}); }), {"cache gamma 2 "});
    e.group(0).muon.cache.enabled = false;
    e.step({d, 2});  // agreeing again: the step runs
    EXPECT_NE(wv.get(), std::vector<float>(rows * 3, 1.0f));
  }
}

TEST_F(MpiErrors, ARegistrationErrorOnOneRankReachesEveryRank) {
  // Rank 1's shard lies outside dim 0: add_param cannot throw there alone, or the other ranks
  // would wait for it in set-up.
  Reg r;
  if (odd_one()) r.shard_shift = 100;
  expect_has(error_everywhere([&] { setup_with(DistMode::kSharded, r); }),
             {"rank 1: parameter 'w'", "outside dim 0"});
}

TEST_F(MpiErrors, BadStepInputsOnOneRankReachEveryRank) {
  auto be = test::make_backend();
  DistOptions opt;
  opt.mode = DistMode::kReplicated;
  Engine e(*be, world(), opt);
  e.add_group(GroupOptions{});
  e.add_param({"w", 0, {4, 6}, DType::kF32});
  Mirror<float> w(*be, std::vector<float>(24, 1.0f)), g(*be, std::vector<float>(24, 0.5f));
  std::vector<int64_t> good = {4, 6}, bad = {6, 4};
  ParamData d{w.data(), g.data(), DType::kF32, odd_one() ? bad : good};
  expect_has(error_everywhere([&] {
               e.step({&d, 1});
             }),
             {"rank 1: ", "'w' has shape [4, 6] but its gradient has shape [6, 4]"});
  EXPECT_EQ(w.get(), std::vector<float>(24, 1.0f));
  d.grad_shape = good;
  e.step({&d, 1});  // the engine is still usable
  EXPECT_NE(w.get(), std::vector<float>(24, 1.0f));
}

}  // namespace
}  // namespace distmuon
