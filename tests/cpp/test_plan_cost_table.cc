// Cost tables: interpolation, the analytic model, the file format (round trip, corrupt and
// foreign files) and the measured path with its cache.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "distmuon/cost_table.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "distmuon/workload.h"
#include "test_files.h"

namespace distmuon {
namespace {

namespace fs = std::filesystem;
using test::EnvGuard;
using test::error_of;

std::string temp_path(const std::string& name) { return test::temp_path("test_plan", name); }

CostTable sample(const std::string& device, const std::string& version = DISTMUON_VERSION) {
  CostTable t;
  t.source = "measured";
  t.device = device;
  t.version = version;
  t.algorithm = "ns5";
  t.work_dtype = "f32";
  t.set(64, 128, {{1, 1.0}, {2, 1.5}, {4, 2.0}});
  t.set(32, 32, {{1, 0.25}});
  return t;
}

TEST(CostTable, InterpolatesBetweenPointsAndExtendsWithTheLastSlope) {
  CostTable t = sample("dev");
  EXPECT_DOUBLE_EQ(t.batch_seconds(64, 128, 1), 1.0);
  EXPECT_DOUBLE_EQ(t.batch_seconds(64, 128, 3), 1.75);
  EXPECT_DOUBLE_EQ(t.batch_seconds(64, 128, 4), 2.0);
  EXPECT_DOUBLE_EQ(t.batch_seconds(64, 128, 8), 3.0);  // slope 0.25 per matrix past k = 4
  EXPECT_DOUBLE_EQ(t.batch_seconds(128, 64, 2), 1.5);  // either orientation
  EXPECT_DOUBLE_EQ(t.batch_seconds(32, 32, 3), 0.75);  // one point: proportional
  EXPECT_NE(t.find(128, 64), nullptr);
  EXPECT_EQ(t.find(64, 64), nullptr);
  const std::string msg = error_of([&] { t.batch_seconds(16, 16, 1); });
  EXPECT_NE(msg.find("16x16"), std::string::npos) << msg;
}

// A part of a GPU f times slower multiplies each batch's work, not the launches every batch pays
// (the intercept of the shape's first two points): (1, 1.0), (2, 1.5) -> fixed 0.5, work 0.5 k.
TEST(CostTable, ScalingKeepsTheFixedCostOfABatch) {
  const CostTable t = sample("dev");
  const CostTable s = scale_costs(t, 3);
  EXPECT_DOUBLE_EQ(s.batch_seconds(64, 128, 1), 0.5 + 3 * 0.5);
  EXPECT_DOUBLE_EQ(s.batch_seconds(64, 128, 2), 0.5 + 3 * 1.0);
  EXPECT_DOUBLE_EQ(s.batch_seconds(64, 128, 4), 0.5 + 3 * 1.5);
  EXPECT_DOUBLE_EQ(s.batch_seconds(32, 32, 1), 0.75);  // one point: all of it scaled
  EXPECT_NE(s.device.find("x 3"), std::string::npos) << s.device;
  // A flat shape (launch-bound at every k) does not slow down; the identity changes nothing.
  CostTable flat = sample("dev");
  flat.set(16, 16, {{1, 0.2}, {2, 0.2}, {4, 0.19}});
  EXPECT_DOUBLE_EQ(scale_costs(flat, 2).batch_seconds(16, 16, 1), 0.2);
  EXPECT_DOUBLE_EQ(scale_costs(t, 1).batch_seconds(64, 128, 2), 1.5);
  EXPECT_THROW(scale_costs(t, 0), Error);
}

// On a part of 1/8 of the SMs, a batch that ran at the table's best rate slows by f, one at half
// that rate (half the whole GPU's SMs filled) by f / 2, and none by less than f / 8 or 1. The
// best rate is taken over points with at least 1 ms of work: a faster short one does not set it.
TEST(CostTable, APartOfTheGpuLosesLessOnBatchesThatLeftSmsIdle) {
  const OrthoConfig cfg = parse_algorithm("auto");
  const double big = ortho_flops(cfg, 1024, 4096), mid = ortho_flops(cfg, 512, 2048),
               tiny = ortho_flops(cfg, 64, 256), short_ = ortho_flops(cfg, 128, 512);
  CostTable t = CostTable::empty("measured", "dev", cfg);
  t.algorithm = "auto";
  // One point each (all of it work): 100 TFLOP/s over >= 1 ms, 50 and 1 TFLOP/s, and 400 TFLOP/s
  // over less than 1 ms.
  t.set(1024, 4096, {{4, 4 * big / 100e12}});
  t.set(512, 2048, {{4, 4 * mid / 50e12}});
  t.set(64, 256, {{4, 4 * tiny / 1e12}});
  t.set(128, 512, {{1, short_ / 400e12}});
  ASSERT_GE(t.batch_seconds(1024, 4096, 4), 1e-3);
  ASSERT_LT(t.batch_seconds(128, 512, 1), 1e-3);
  const double f = 9.6;
  const CostTable s = scale_costs(t, f, 8);
  EXPECT_NEAR(s.batch_seconds(1024, 4096, 4), f * t.batch_seconds(1024, 4096, 4), 1e-12);
  EXPECT_NEAR(s.batch_seconds(512, 2048, 4), f / 2 * t.batch_seconds(512, 2048, 4), 1e-12);
  EXPECT_NEAR(s.batch_seconds(64, 256, 4), f / 8 * t.batch_seconds(64, 256, 4), 1e-12);
  EXPECT_NEAR(s.batch_seconds(128, 512, 1), f * t.batch_seconds(128, 512, 1), 1e-15);
  EXPECT_NE(s.device.find("1/8"), std::string::npos) << s.device;
  // Without parts every batch slows by f alike; with f below the parts none speeds up.
  EXPECT_NEAR(scale_costs(t, f).batch_seconds(512, 2048, 4), f * t.batch_seconds(512, 2048, 4),
              1e-12);
  EXPECT_NEAR(scale_costs(t, 1, 8).batch_seconds(64, 256, 4), t.batch_seconds(64, 256, 4), 1e-15);
  EXPECT_THROW(scale_costs(t, f, -1), Error);
}

TEST(CostTable, RejectsBadPoints) {
  CostTable t;
  EXPECT_THROW(t.set(4, 4, {}), Error);
  EXPECT_THROW(t.set(4, 4, {{0, 1.0}}), Error);
  EXPECT_THROW(t.set(4, 4, {{1, -1.0}}), Error);
  EXPECT_THROW(t.set(4, 4, {{2, 1.0}, {2, 1.5}}), Error);
  EXPECT_THROW(t.set(0, 4, {{1, 1.0}}), Error);
}

TEST(CostTable, FileRoundTripKeepsEveryField) {
  const std::string path = temp_path("costs.json");
  write_cost_file(path, {sample("cpu A"), sample("gpu B", "0.0.1")});
  const std::vector<CostTable> back = read_cost_file(path);
  ASSERT_EQ(back.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const CostTable want = i == 0 ? sample("cpu A") : sample("gpu B", "0.0.1");
    EXPECT_EQ(back[i].source, want.source);
    EXPECT_EQ(back[i].device, want.device);
    EXPECT_EQ(back[i].version, want.version);
    EXPECT_EQ(back[i].algorithm, want.algorithm);
    EXPECT_EQ(back[i].work_dtype, want.work_dtype);
    ASSERT_EQ(back[i].shapes().size(), want.shapes().size());
    for (const auto& [key, sc] : want.shapes()) {
      const ShapeCost* got = back[i].find(key.first, key.second);
      ASSERT_NE(got, nullptr);
      ASSERT_EQ(got->points.size(), sc.points.size());
      for (size_t j = 0; j < sc.points.size(); ++j) {
        EXPECT_EQ(got->points[j].k, sc.points[j].k);
        EXPECT_DOUBLE_EQ(got->points[j].seconds, sc.points[j].seconds);
      }
    }
  }
  EXPECT_EQ(select_cost_table(back, "cpu A", path).device, "cpu A");
  // Several devices need a choice; a table from another version is refused, naming both.
  EXPECT_NE(error_of([&] { select_cost_table(back, "", path); }).find("--device"),
            std::string::npos);
  const std::string msg = error_of([&] { select_cost_table(back, "gpu B", path); });
  EXPECT_NE(msg.find("0.0.1"), std::string::npos) << msg;
  EXPECT_NE(msg.find(DISTMUON_VERSION), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { select_cost_table(back, "tpu", path); }).find("tpu"), std::string::npos);
}

TEST(CostTable, CorruptAndForeignFilesAreClearErrors) {
  const std::string path = temp_path("bad.json");
  test::write_text(path, "{\"format\": \"distmuon-cost-table\", \"tabl");
  std::string msg = error_of([&] { read_cost_file(path); });
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;

  test::write_text(path,
                   R"({"name": "gpt2-small", "muon": []})");  // a workload file, not a cost table
  msg = error_of([&] { read_cost_file(path); });
  EXPECT_NE(msg.find("not a distmuon cost table"), std::string::npos) << msg;

  test::write_text(path,
                   R"({"format": "distmuon-cost-table", "format_version": 99, "tables": []})");
  msg = error_of([&] { read_cost_file(path); });
  EXPECT_NE(msg.find("format version 99"), std::string::npos) << msg;

  test::write_text(path, R"({"format": "distmuon-cost-table", "format_version": 1, "tables": [
      {"source": "measured", "device": "x", "version": "1", "algorithm": "ns5",
       "work_dtype": "f32", "shapes": [{"m": 4, "n": 8, "points": [[1, -2.0]]}]}]})");
  msg = error_of([&] { read_cost_file(path); });
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("-2"), std::string::npos) << msg;

  test::write_text(path,
                   R"({"format": "distmuon-cost-table", "format_version": 1, "tables": [{}]})");
  EXPECT_NE(error_of([&] { read_cost_file(path); }).find("corrupt"), std::string::npos);
  EXPECT_THROW(read_cost_file(temp_path("missing.json")), Error);
}

TEST(CostTable, AnalyticModelAmortisesLaunchesOverTheBatch) {
  const OrthoConfig cfg = parse_algorithm("auto");
  AnalyticRates r;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{256, 1024}, {2048, 2048}, {4096, 1024}}) {
    const double one = analytic_batch_seconds(cfg, r, rows, cols, 1);
    const double eight = analytic_batch_seconds(cfg, r, rows, cols, 8);
    EXPECT_LT(eight, 8 * one);  // batching pays
    EXPECT_GT(eight, one);
    const int launches = ortho_launches(cfg, rows, cols);
    EXPECT_GT(launches, 5);
    const double per = std::max(ortho_flops(cfg, rows, cols) / r.flops_per_s,
                                ortho_bytes(cfg, rows, cols, 4) / r.bytes_per_s);  // f32 work
    EXPECT_NEAR(one, launches * r.launch_s + per, 1e-15);
  }
  // Both orientations of a shape share one entry holding points up to their summed count.
  std::vector<ShapeCount> shapes = {{3072, 768, 12}, {768, 3072, 12}, {768, 768, 12}};
  CostTable t = analytic_cost_table(shapes, cfg, r);
  ASSERT_EQ(t.shapes().size(), 2u);
  EXPECT_EQ(t.find(768, 3072)->points.back().k, 24);
  EXPECT_EQ(t.source, "analytic");
  EXPECT_EQ(t.version, DISTMUON_VERSION);
}

TEST(CostTable, MeasuredTableIsCachedAndReused) {
  auto be = make_backend("cpu");
  const std::string path = temp_path("cache.json");
  fs::remove(path);
  ProfileOptions po;
  po.ks = {1, 2, 4};
  po.reps = 1;
  po.warmup = 0;
  po.progress = false;
  const OrthoConfig cfg = parse_algorithm("ns5");
  // 16x40 and 40x16 batch together (5 matrices); 24x24 has one.
  std::vector<ShapeCount> shapes = {{16, 40, 3}, {40, 16, 2}, {24, 24, 1}};
  CachedCosts first = cached_cost_table(*be, shapes, cfg, po, path);
  EXPECT_EQ(first.shapes_measured, 2);
  EXPECT_EQ(first.shapes_reused, 0);
  ASSERT_TRUE(fs::exists(path));
  const ShapeCost* sc = first.table.find(16, 40);
  ASSERT_NE(sc, nullptr);
  ASSERT_EQ(sc->points.size(), 3u);  // k = 1, 2, 4
  EXPECT_EQ(first.table.find(24, 24)->points.size(), 1u);
  EXPECT_EQ(first.table.device, be->name());

  const std::string before = test::read_text(path);
  CachedCosts second = cached_cost_table(*be, shapes, cfg, po, path);
  EXPECT_EQ(second.shapes_measured, 0);
  EXPECT_EQ(second.shapes_reused, 2);
  EXPECT_EQ(test::read_text(path), before);  // nothing new: the file is not rewritten
  EXPECT_DOUBLE_EQ(second.table.batch_seconds(16, 40, 2), first.table.batch_seconds(16, 40, 2));

  po.ks = {1, 2, 4, 8};  // 8 is capped at the shape's 5 matrices: one new point
  CachedCosts third = cached_cost_table(*be, shapes, cfg, po, path);
  EXPECT_EQ(third.shapes_measured, 1);
  EXPECT_EQ(third.shapes_reused, 1);
  EXPECT_EQ(third.table.find(16, 40)->points.back().k, 5);

  // A corrupt cache is an error and is left alone for the user to look at.
  test::write_text(path, "garbage");
  EXPECT_THROW(cached_cost_table(*be, shapes, cfg, po, path), Error);
  EXPECT_EQ(test::read_text(path), "garbage");
}

}  // namespace
}  // namespace distmuon

// The cost profile and the autotuner keep their measurements where env::cache_file says: the
// knob, else the XDG cache directory, else the home directory's.
TEST(CostTable, MeasurementCachesShareOneLocationRule) {
  auto saved = [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
  };
  const std::string saved_xdg = saved("XDG_CACHE_HOME"), saved_home = saved("HOME");
  setenv("DISTMUON_COST_CACHE", "/tmp/explicit-costs.json", 1);
  EXPECT_EQ(distmuon::default_cost_cache_path(), "/tmp/explicit-costs.json");
  unsetenv("DISTMUON_COST_CACHE");
  setenv("XDG_CACHE_HOME", "/tmp/xdg", 1);
  EXPECT_EQ(distmuon::default_cost_cache_path(), "/tmp/xdg/distmuon/costs.json");
  EXPECT_EQ(distmuon::env::cache_file("DISTMUON_TUNE_CACHE", "tune.json"),
            "/tmp/xdg/distmuon/tune.json");
  unsetenv("XDG_CACHE_HOME");
  setenv("HOME", "/tmp/home", 1);
  EXPECT_EQ(distmuon::env::cache_file("DISTMUON_TUNE_CACHE", "tune.json"),
            "/tmp/home/.cache/distmuon/tune.json");
  setenv("HOME", saved_home.c_str(), 1);
  if (!saved_xdg.empty()) setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
}
