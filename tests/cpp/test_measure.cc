// The measurement layer on the CPU: the store's file (round trip, sections kept, bad files,
// atomic write, the old tune cache taken over), the tuner's choice rules with a fake clock, and
// the timing both the tuner and the cost profile use.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include "backend/relative_error.h"
#include "distmuon/backend.h"
#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "measure/store.h"
#include "measure/time_ortho.h"
#include "measure/tuner.h"
#include "test_files.h"

namespace distmuon::measure {
namespace {

namespace fs = std::filesystem;
using test::EnvGuard;
using test::error_of;

std::string temp_path(const std::string& name) { return test::temp_path("test_measure", name); }
using nlohmann::json;

CostTable table_for(const std::string& device, double seconds) {
  CostTable t;
  t.source = "measured";
  t.device = device;
  t.version = DISTMUON_VERSION;
  t.algorithm = "gram-ns";
  t.work_dtype = "bf16";
  t.set(64, 256, {{1, seconds}, {4, 3 * seconds}});
  return t;
}

AlgoChoice choice_of(int64_t rows, int64_t cols, int64_t count, const std::string& algorithm) {
  AlgoChoice c;
  c.rows = rows;
  c.cols = cols;
  c.count = count;
  c.algorithm = algorithm;
  c.ms = 1.0;
  c.candidates = {{algorithm, {}, DType::kBF16, 1.0, 1e-3, true}};
  return c;
}

const std::string kKey = tuner_key("NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100");

// Every test runs without an old autotuner cache (the store would take one over) unless it
// makes one.
class Hermetic : public ::testing::Environment {
 public:
  void SetUp() override { setenv("DISTMUON_TUNE_CACHE", "/nonexistent/distmuon/tune.json", 1); }
};
const auto* const kHermetic = ::testing::AddGlobalTestEnvironment(new Hermetic);

// ---- the store -------------------------------------------------------------------------------

TEST(MeasureStore, RoundTripKeepsEverySection) {
  const std::string path = temp_path("store.json");
  EXPECT_TRUE(read_store(path).tables.empty()) << "a missing store is an empty one";
  save_tuning(path, kKey, {choice_of(18944, 3584, 16, "gram-ns")},
              R"([{"m": 3584, "k": 18944, "kernel": "tri256x128"}])");
  // The cost profile's writer keeps the tuner's section, and the tuner's keeps the tables.
  update_store(path, [](StoreContents& s) { s.tables.push_back(table_for("cpu A", 0.5)); });
  save_tuning(path, kKey, {choice_of(4096, 4096, 2, "ns5-sym")}, "[]");
  const StoreContents s = read_store(path);
  ASSERT_EQ(s.tables.size(), 1u);
  EXPECT_DOUBLE_EQ(s.tables[0].batch_seconds(64, 256, 4), 1.5);
  const std::vector<AlgoChoice> algo = load_algo_choices(path, kKey);
  ASSERT_EQ(algo.size(), 2u);
  EXPECT_EQ(algo[0].algorithm, "gram-ns");
  EXPECT_EQ(algo[1].algorithm, "ns5-sym");
  EXPECT_EQ(s.tuner[kKey]["sym"].size(), 1u) << "an empty kernel list keeps the stored one";
  // A second measurement of the same shape, batch size and schedule replaces the first.
  save_tuning(path, kKey, {choice_of(18944, 3584, 16, "ns5")}, "[]");
  EXPECT_EQ(load_algo_choices(path, kKey).size(), 2u);
  EXPECT_EQ(load_algo_choices(path, kKey)[1].algorithm, "ns5");
  // The store is a cost file: the planner's reader takes it as one.
  EXPECT_EQ(read_cost_file(path).size(), 1u);
  // Another device, and the same device under another tuner version, see nothing.
  EXPECT_TRUE(load_algo_choices(path, tuner_key("NVIDIA H100|driver 13000")).empty());
  EXPECT_TRUE(
      load_algo_choices(path, "NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100").empty());
}

TEST(MeasureStore, VersionMismatchAndCorruptFilesAreClearErrorsAndStayUntouched) {
  const std::string path = temp_path("store.json");
  const std::string newer =
      R"({"format": "distmuon-cost-table", "format_version": 99, "tables": []})";
  test::write_text(path, newer);
  EXPECT_NE(error_of([&] { read_store(path); }).find("format version 99"), std::string::npos);
  EXPECT_NE(error_of([&] {
              save_tuning(path, kKey, {choice_of(8, 8, 1, "ns5")}, "[]");
            }).find("format version 99"),
            std::string::npos);
  std::ifstream f(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), newer)
      << "a bad store was overwritten";

  test::write_text(path, "{ not json");
  EXPECT_NE(error_of([&] { read_store(path); }).find("corrupt"), std::string::npos);
  test::write_text(path, R"({"format": "distmuon-cost-table", "format_version": 1, "tables": [],)"
                         R"( "tuner": [1, 2]})");
  EXPECT_NE(error_of([&] { read_store(path); }).find("\"tuner\" is not an object"),
            std::string::npos);
  test::write_text(path, R"({"format": "distmuon-cost-table", "format_version": 1, "tables": [],)"
                         R"( "tuner": {")" +
                             kKey + R"(": {"algo": [{"rows": 8}]}}})");
  EXPECT_NE(error_of([&] { load_algo_choices(path, kKey); }).find("bad algorithm choice"),
            std::string::npos);
}

TEST(MeasureStore, WritesAtomically) {
  const std::string path = temp_path("sub/dir/store.json");  // parents are created
  write_store(path, StoreContents{{table_for("cpu A", 0.5)}, json::object()});
  EXPECT_EQ(read_store(path).tables.size(), 1u);
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    EXPECT_EQ(e.path().filename(), "store.json") << "a temporary file was left behind";
  // A store that cannot be written (its folder is a file): an error, the old file untouched.
  const std::string blocked = temp_path("blocked");
  test::write_text(blocked, "a file, not a folder");
  EXPECT_THROW(write_store(blocked + "/store.json", StoreContents{}), Error);
  const std::string target = temp_path("target.json");
  write_store(target, StoreContents{{table_for("cpu A", 0.5)}, json::object()});
  // The temporary file's name is taken by a folder: the write fails before the rename.
  fs::create_directories(target + ".tmp." + std::to_string(::getpid()));
  EXPECT_THROW(write_store(target, StoreContents{{table_for("cpu B", 0.5)}, json::object()}),
               Error);
  ASSERT_EQ(read_store(target).tables.size(), 1u);
  EXPECT_EQ(read_store(target).tables[0].device, "cpu A") << "a failed write changed the store";
}

// The autotuner cache of earlier versions is taken into the store once, with a log line; an
// unreadable one is ignored.
TEST(MeasureStore, TakesOverTheOldTuneCache) {
  EnvGuard guard("DISTMUON_TUNE_CACHE");
  const std::string store = temp_path("store.json"), old = temp_path("tune.json");
  setenv("DISTMUON_TUNE_CACHE", old.c_str(), 1);
  test::write_text(
      old, R"({")" + kKey +
               R"(": {"sym": [{"m": 64}], "algo": [{"rows": 512, "cols": 4608,)"
               R"( "count": 3, "algorithm": "ns5", "restarts": [], "work_dtype": "bf16",)"
               R"( "ms": 0.05, "rel_err": 0.004, "schedule": "jordan:5"}]},)"
               R"( "NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100": {"algo": []}})");
  ::testing::internal::CaptureStderr();
  const std::vector<AlgoChoice> algo = load_algo_choices(store, kKey);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("took the tuner's choices for"),
            std::string::npos);
  ASSERT_EQ(algo.size(), 1u);
  EXPECT_EQ(algo[0].algorithm, "ns5");
  ASSERT_EQ(algo[0].candidates.size(), 1u) << "an entry without candidates stands for itself";
  EXPECT_TRUE(algo[0].candidates[0].accepted);
  fs::remove(old);  // taken over: the store holds it now
  EXPECT_EQ(load_algo_choices(store, kKey).size(), 1u);
  EXPECT_EQ(tuner_section(store, kKey)["sym"].size(), 1u);

  const std::string store2 = temp_path("store2.json");
  test::write_text(old, "{ not json");
  EXPECT_TRUE(load_algo_choices(store2, kKey).empty());
  EXPECT_FALSE(fs::exists(store2)) << "nothing to take over, nothing written";
}

// ---- the tuner's choice ----------------------------------------------------------------------

// The candidates measured by a fake clock: ms and error per candidate name, and optionally the
// ms of each round (round_ms); `asked` records "name@round" in the order of the calls.
struct FakeClock {
  std::map<std::string, CandidateResult> results;
  std::map<std::string, std::vector<double>> round_ms;
  std::vector<std::string> asked;
  MeasureCandidate fn() {
    return [this](const OrthoConfig& cfg, int round) {
      std::string name = algorithm_name(cfg);
      if (cfg.iteration == Iteration::kGram) name += cfg.restarts.empty() ? "{}" : "{2}";
      asked.push_back(name + "@" + std::to_string(round));
      CandidateResult r = results.at(name);
      if (round_ms.count(name)) r.ms = round_ms.at(name).at(round);
      if (round > 0) r.rel_err = NAN;  // read in round 0 only
      return r;
    };
  }
};

// The four candidates at 3.0 / 2.0 / 1.5 / 1.0 ms: the restart-free Gram NS is the fastest and
// has error `restart_free_err`, the others pass the default tolerance.
FakeClock clock_with(double restart_free_err) {
  FakeClock clock;
  clock.results = {{"ns5", {3.0, 4e-3}},
                   {"ns5-sym", {2.0, 4e-3}},
                   {"gram-ns{2}", {1.5, 2e-3}},
                   {"gram-ns{}", {1.0, restart_free_err}}};
  return clock;
}

TuneOptions quiet() {
  TuneOptions opt;
  opt.verbose = false;
  return opt;
}

TEST(MeasureTuner, ChoosesTheFastestAcceptedCandidate) {
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  FakeClock clock = clock_with(5e-2);
  AlgoChoice c = choose_algorithm(18944, 3584, 16, base, quiet(), clock.fn());
  EXPECT_EQ(clock.asked,
            (std::vector<std::string>{"ns5@0", "ns5-sym@0", "gram-ns{2}@0", "gram-ns{}@0",
                                      "ns5@1", "ns5-sym@1", "gram-ns{2}@1", "gram-ns{}@1",
                                      "ns5@2", "ns5-sym@2", "gram-ns{2}@2", "gram-ns{}@2"}))
      << "the candidates take turns, round by round";
  EXPECT_EQ(c.algorithm, "gram-ns");  // restart-free Gram NS failed the check
  EXPECT_EQ(c.restarts, std::vector<int>{2});
  EXPECT_EQ(c.work_dtype, DType::kF16);
  EXPECT_EQ(c.schedule, "jordan:5");
  ASSERT_EQ(c.candidates.size(), 4u);
  EXPECT_FALSE(c.candidates[3].accepted);
  clock.results["gram-ns{2}"].rel_err = NAN;  // a NaN error is a rejection, not a pass
  EXPECT_EQ(choose_algorithm(18944, 3584, 16, base, quiet(), clock.fn()).algorithm, "ns5-sym");
  for (auto& [name, r] : clock.results) r.rel_err = 1.0;
  EXPECT_NE(error_of([&] {
              choose_algorithm(64, 64, 1, base, quiet(), clock.fn());
            }).find("no algorithm passed the numerical check for 64x64"),
            std::string::npos);
}

// A candidate's time is the median over the rounds: one slow round (the clock drifting while it
// ran) does not decide, and neither does one fast one.
TEST(MeasureTuner, KeepsTheMedianRound) {
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  FakeClock clock = clock_with(5e-2);
  clock.round_ms["gram-ns{2}"] = {1.5, 9.0, 1.6};  // its second round ran on a slow clock
  clock.round_ms["ns5-sym"] = {1.9, 1.0, 2.0};     // one round lucky
  TuneOptions opt = quiet();
  AlgoChoice c = choose_algorithm(18944, 3584, 16, base, opt, clock.fn());
  ASSERT_EQ(c.candidates.size(), 4u);
  EXPECT_DOUBLE_EQ(c.candidates[1].ms, 1.9);
  EXPECT_DOUBLE_EQ(c.candidates[2].ms, 1.6);
  EXPECT_EQ(c.algorithm, "gram-ns");
  EXPECT_DOUBLE_EQ(c.rel_err, 2e-3) << "the error of round 0";
  opt.rounds = 1;  // one round: its times as measured
  clock.asked.clear();
  EXPECT_EQ(choose_algorithm(18944, 3584, 16, base, opt, clock.fn()).algorithm, "gram-ns");
  EXPECT_EQ(clock.asked.size(), 4u);
  opt.rounds = 0;
  EXPECT_NE(error_of([&] { choose_algorithm(64, 64, 1, base, opt, clock.fn()); })
                .find("need rounds >= 1"),
            std::string::npos);
}

// The engine's `auto` takes the fastest accepted candidate whose Gram-NS restart set contains 2,
// unless restart-free Gram NS is allowed explicitly.
TEST(MeasureTuner, SelectionKeepsRestartTwoUnlessAllowed) {
  AlgoChoice c;
  c.rows = 18944;
  c.cols = 3584;
  c.count = 24;
  c.candidates = {{"ns5-sym", {}, DType::kBF16, 60.0, 1.1e-2, true},
                  {"gram-ns", {2}, DType::kF16, 50.0, 2.0e-3, true},
                  {"gram-ns", {}, DType::kF16, 44.0, 3.2e-3, true}};
  EXPECT_EQ(select_candidate(c, false)->ms, 50.0);
  EXPECT_EQ(select_candidate(c, true)->ms, 44.0);
  c.candidates[1].accepted = false;  // failed its check: standard NS is next
  EXPECT_EQ(select_candidate(c, false)->algorithm, "ns5-sym");
  c.candidates[0].accepted = false;
  EXPECT_EQ(select_candidate(c, false), nullptr);
  c.candidates = {{"gram-ns", {2, 4}, DType::kF16, 55.0, 2.0e-3, true}};
  EXPECT_EQ(select_candidate(c, false)->ms, 55.0);
  // Lookup: either orientation, same schedule, same batch size (others are the model's).
  AlgoChoice d = c;
  d.count = 8;
  std::vector<AlgoChoice> all = {c, d};
  EXPECT_EQ(find_choice(all, 3584, 18944, 8, "jordan:5")->count, 8);
  EXPECT_EQ(find_choice(all, 3584, 18944, 24, "jordan:5")->count, 24);
  EXPECT_EQ(find_choice(all, 3584, 18944, 10, "jordan:5"), nullptr);
  EXPECT_EQ(find_choice(all, 3584, 18944, 24, "you:5"), nullptr);
  EXPECT_EQ(find_choice(all, 3584, 14336, 24, "jordan:5"), nullptr);
}

// Dense ns5 is a candidate: where it is the fastest accepted one (small, launch-bound shapes),
// `auto` runs it, as the dense iteration.
TEST(MeasureTuner, DenseNs5IsACandidate) {
  AlgoChoice c;
  c.candidates = {{"ns5", {}, DType::kBF16, 0.050, 4.0e-3, true},
                  {"ns5-sym", {}, DType::kBF16, 0.061, 4.0e-3, true},
                  {"gram-ns", {2}, DType::kF16, 0.083, 2.0e-3, true}};
  const AlgoCandidate* pick = select_candidate(c, false);
  ASSERT_NE(pick, nullptr);
  EXPECT_EQ(pick->algorithm, "ns5");
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  EXPECT_EQ(config_of(*pick, base).iteration, Iteration::kStandardDense);
  EXPECT_EQ(config_of(*pick, base).steps, 5);
  EXPECT_EQ(kKey, "NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100|tuner 2");
}

// The engine's question: stored choices first, a measurement only when the policy allows it,
// and the measurement stored with the backend's kernel choices.
TEST(MeasureTuner, MeasuresOnlyWhatTheStoreLacksAndOnlyWhenAllowed) {
  const std::string path = temp_path("store.json");
  int measured = 0;
  auto measure = [&](int64_t m, int64_t n, int64_t count, const OrthoConfig& base) {
    ++measured;
    FakeClock clock = clock_with(3e-3);
    return choose_algorithm(m, n, count, base, quiet(), clock.fn());
  };
  AlgorithmTuner tuner(path, kKey, measure, [] { return std::string(R"([{"m": 1}])"); });
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  base.work_dtype = DType::kBF16;
  EXPECT_FALSE(tuner.config_for(base, 256, 1024, 4, {false, false})) << "measured unasked";
  EXPECT_EQ(measured, 0);
  std::optional<TunedConfig> cfg = tuner.config_for(base, 256, 1024, 4, {true, false});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(measured, 1);
  EXPECT_EQ(cfg->source, TuneSource::kMeasured);
  EXPECT_EQ(cfg->config.iteration, Iteration::kGram);
  EXPECT_EQ(cfg->config.restarts, std::vector<int>{2});
  EXPECT_EQ(cfg->config.gram_work_dtype, DType::kF16);
  // A restart-free policy picks among the stored candidates without measuring again.
  cfg = tuner.config_for(base, 256, 1024, 4, {true, true});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(cfg->source, TuneSource::kStored);
  EXPECT_TRUE(cfg->config.restarts.empty());
  EXPECT_EQ(measured, 1);
  // Another tuner on the same store (the next run) finds it, and the kernel choices beside it.
  AlgorithmTuner next(path, kKey, measure);
  EXPECT_TRUE(next.config_for(base, 256, 1024, 4, {false, false}));
  EXPECT_EQ(measured, 1);
  // Another batch size of the shape, or another shape: measured when allowed, else predicted by
  // the cost model from what is stored (and not stored itself).
  cfg = next.config_for(base, 256, 1024, 12, {false, false});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(cfg->source, TuneSource::kPredicted);
  EXPECT_EQ(measured, 1);
  EXPECT_FALSE(find_choice(load_algo_choices(path, kKey), 256, 1024, 12, "jordan:5"));
  cfg = next.config_for(base, 256, 1024, 12, {true, false});
  ASSERT_TRUE(cfg);
  EXPECT_EQ(cfg->source, TuneSource::kMeasured);
  EXPECT_EQ(measured, 2);
  EXPECT_EQ(tuner_section(path, kKey)["sym"], json::parse(R"([{"m": 1}])"));
  // Not the tuner's business: an explicit algorithm, an fp32 iteration, custom coefficients.
  OrthoConfig fixed = base;
  fixed.iteration = Iteration::kGram;
  EXPECT_FALSE(next.config_for(fixed, 256, 1024, 4, {true, false}));
  OrthoConfig f32 = base;
  f32.work_dtype = DType::kF32;
  EXPECT_FALSE(next.config_for(f32, 256, 1024, 4, {true, false}));
  EXPECT_EQ(measured, 2);
}

// A candidate that diverged has a NaN error (and may have an infinite time); JSON has neither,
// so the store keeps them as null and reads them back as NaN: the entry stays readable, the
// candidate rejected.
TEST(MeasureTuner, NonFiniteMeasurementsSurviveTheStore) {
  const std::string path = temp_path("nan.json");
  AlgoChoice c = choice_of(64, 256, 2, "ns5");
  c.candidates.push_back({"gram-ns", {2}, DType::kF16, INFINITY, NAN, false});
  save_tuning(path, kKey, {c}, "[]");
  const std::vector<AlgoChoice> back = load_algo_choices(path, kKey);
  ASSERT_EQ(back.size(), 1u);
  ASSERT_EQ(back[0].candidates.size(), 2u);
  EXPECT_TRUE(std::isnan(back[0].candidates[1].rel_err));
  EXPECT_FALSE(back[0].candidates[1].accepted);
  EXPECT_EQ(select_candidate(back[0], false)->algorithm, "ns5");
}

// ---- the shared timing -----------------------------------------------------------------------

// The CPU backend is not tuned: no tuner, no kernel choices, no store read.
TEST(MeasureTiming, CpuBackendIsNotTunedButTimesTheOrthogonalizer) {
  EnvGuard guard("DISTMUON_COST_CACHE");
  const std::string path = temp_path("store.json");
  test::write_text(path, "{ not json");
  setenv("DISTMUON_COST_CACHE", path.c_str(), 1);
  auto be = make_backend("cpu");
  EXPECT_FALSE(backend_tuner(*be));
  install_kernel_choices(*be);  // would throw or log on the corrupt store if it read it
  EXPECT_EQ(be->kernel_choices_json(), "[]");
  EXPECT_THROW(be->load_kernel_choices_json(R"([{"m": 1}])"), Error);

  OrthoConfig cfg;
  cfg.iteration = Iteration::kStandardDense;
  const OrthoInput in = make_ortho_input(*be, 8, 24, 3, cfg, 7);
  BatchRef out = BatchRef::packed(nullptr, DType::kF32, 2, 8, 24);
  Buffer ob = be->alloc(out.bytes());
  out.data = ob.data();
  const double ms = time_orthogonalizer(*be, cfg, in.batch, {1, 3}, &out);
  EXPECT_GT(ms, 0.0);
  // The outputs are (close to) orthogonal rows: the same iteration again agrees with them, and
  // they differ from the input.
  BatchRef again = out;
  Buffer ab = be->alloc(again.bytes());
  again.data = ab.data();
  EXPECT_EQ(time_orthogonalizer(*be, cfg, in.batch, {0, 0}, &again), 0.0);  // results alone
  EXPECT_EQ(relative_error(*be, again, out), 0.0);
  EXPECT_GT(relative_error(*be, in.batch.slice(0, 2), out), 0.1);
  EXPECT_THROW(time_orthogonalizer(*be, cfg, in.batch, {-1, 3}), Error);
}

}  // namespace
}  // namespace distmuon::measure
