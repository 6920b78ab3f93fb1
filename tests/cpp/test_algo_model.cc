// `auto` on shapes nobody measured: the cost model (measure/algo_model.h) on an H200's tuner
// measurements, left out one shape at a time, and the engine's tune() / tuned_shapes() on a CPU
// backend that presents itself as a tuned one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "forwarding_backend.h"
#include "measure/algo_model.h"
#include "measure/store.h"
#include "measure/time_ortho.h"
#include "measure/tuner.h"
#include "recording_backend.h"
#include "test_files.h"

namespace distmuon::measure {
namespace {

// The tuner's measurements of the shape classes of gpt2-small, gpt2-large, pi0 and qwen2.5-7b
// (8 layers) on one H200 (the 2026-11-29 run: ns5-sym, Gram NS {2} and Gram NS {} per class,
// milliseconds of the batch; the 32 x 1024 ns5-sym result failed the numerical check, with an
// error of 2.1e-2 against a bar of 2e-2; the others' errors are those of that run's kind).
struct Measured {
  int64_t m, n, count;
  double sym_ms, gram2_ms, gram_ms;
  bool sym_accepted;
};
const std::vector<Measured> kH200 = {
    {768, 2304, 12, 0.741, 0.608, 0.679, true},
    {768, 768, 12, 0.434, 0.514, 0.572, true},
    {768, 3072, 24, 1.670, 1.183, 1.261, true},
    {1280, 3840, 36, 7.327, 5.383, 5.629, true},
    {1280, 1280, 36, 3.308, 3.949, 4.476, true},
    {1280, 5120, 72, 19.965, 12.636, 12.020, true},
    {2048, 2048, 36, 11.739, 13.580, 14.502, true},
    {256, 2048, 36, 0.514, 0.315, 0.384, true},
    {2048, 16384, 54, 101.764, 51.418, 41.076, true},
    {1024, 2048, 37, 2.966, 2.762, 3.024, true},
    {256, 1024, 36, 0.311, 0.286, 0.328, true},
    {1024, 4096, 54, 7.852, 5.098, 5.196, true},
    {1152, 1152, 108, 7.754, 9.521, 10.266, true},
    {1152, 4304, 54, 10.978, 7.203, 7.094, true},
    {1152, 2048, 1, 0.250, 0.263, 0.290, true},
    {32, 1024, 3, 0.158, 0.203, 0.225, false},
    {1024, 1024, 1, 0.173, 0.215, 0.235, true},
    {3584, 3584, 16, 25.614, 28.111, 29.534, true},
    {512, 3584, 16, 0.898, 0.582, 0.635, true},
    {3584, 18944, 24, 158.288, 89.652, 71.177, true},
};

AlgoChoice choice_of(const Measured& r) {
  AlgoChoice c;
  c.rows = r.m;
  c.cols = r.n;
  c.count = r.count;
  c.candidates = {{"ns5-sym", {}, DType::kBF16, r.sym_ms, r.sym_accepted ? 1e-2 : 2.1e-2,
                   r.sym_accepted},
                  {"gram-ns", {2}, DType::kF16, r.gram2_ms, 2e-3, true},
                  {"gram-ns", {}, DType::kF16, r.gram_ms, 4e-3, true}};
  return c;
}

OrthoConfig auto_bf16() {
  OrthoConfig c;
  c.iteration = Iteration::kAuto;
  c.work_dtype = DType::kBF16;
  return c;
}

double measured_ms(const Measured& r, const AlgoCandidate& k) {
  if (k.algorithm == "ns5-sym") return r.sym_ms;
  return k.restarts.empty() ? r.gram_ms : r.gram2_ms;
}

// Each class predicted from the other 19: the engine's pick (restart set {2}, as by default)
// runs within 3 % of the fastest measured candidate it could have taken, on every class.
// resolve()'s aspect-ratio heuristic loses 5 % on one of them (1152 x 2048, one matrix).
TEST(AlgoModel, PicksWithin3PercentOnEveryLeftOutH200Class) {
  const OrthoConfig base = auto_bf16();
  double worst = 1, worst_heuristic = 1;
  for (size_t i = 0; i < kH200.size(); ++i) {
    std::vector<AlgoChoice> others;
    for (size_t j = 0; j < kH200.size(); ++j)
      if (j != i) others.push_back(choice_of(kH200[j]));
    const Measured& r = kH200[i];
    const std::optional<AlgoChoice> p = predict_choice(others, r.m, r.n, r.count, base);
    ASSERT_TRUE(p);
    ASSERT_EQ(p->candidates.size(), 3u) << "every measured candidate gets a prediction";
    for (const AlgoCandidate& k : p->candidates) {
      EXPECT_GT(k.ms, 0.0);
      // Predictions within a factor of 1.5 of the measurement (the ranking is what counts).
      EXPECT_LT(std::abs(std::log(k.ms / measured_ms(r, k))), std::log(1.5))
          << r.m << "x" << r.n << " " << k.algorithm << " predicted " << k.ms;
    }
    const AlgoCandidate* pick = select_candidate(*p, false);
    ASSERT_NE(pick, nullptr);
    const double best = r.sym_accepted ? std::min(r.sym_ms, r.gram2_ms) : r.gram2_ms;
    const double ratio = measured_ms(r, *pick) / best;
    EXPECT_LE(ratio, 1.03) << r.m << "x" << r.n << "x" << r.count << ": picked "
                           << pick->algorithm;
    worst = std::max(worst, ratio);
    const double aspect = static_cast<double>(r.n) / static_cast<double>(r.m);
    const double heuristic = aspect >= 1.5 ? r.gram2_ms : r.sym_ms;
    worst_heuristic = std::max(worst_heuristic, heuristic / best);
  }
  EXPECT_GT(worst_heuristic, 1.05) << "the data no longer shows what the model is for";
  std::printf("[model] worst pick / fastest: %.3f (heuristic %.3f)\n", worst, worst_heuristic);
}

// The 42 shape classes of seven workloads on one H200 (2026-12-02, bench/auto_check.sh; the
// record: git show e79259d:bench/results/2026-12-02-h200-auto/auto_check-graph.json): the
// tuner's graph-replay measurements of the four candidates (ms, relative error, accepted), and
// ns5, ns5-sym and Gram NS {2} timed again independently (the truth a pick is judged by).
struct Cand {
  double ms, rel_err;
  bool accepted;
};
struct ClassRun {
  const char* workload;
  int64_t m, n, count;
  Cand ns5, sym, gram2, gram;
  double again[3];  // ns5, ns5-sym, Gram NS {2}
};
const std::vector<ClassRun> kH200Graph = {
    {"gpt2-small", 768, 2304, 12, {0.7436, 0.01, true}, {0.6706, 0.01, true}, {0.4996, 0.0015, true}, {0.5536, 0.0015, true}, {0.7427, 0.6714, 0.499}},
    {"gpt2-small", 768, 768, 12, {0.3678, 0.01, true}, {0.3537, 0.01, true}, {0.3996, 0.0051, true}, {0.4461, 0.0083, true}, {0.3707, 0.3536, 0.3995}},
    {"gpt2-small", 768, 3072, 24, {1.714, 0.01, true}, {1.575, 0.01, true}, {1.017, 0.0014, true}, {1.083, 0.0015, true}, {1.809, 1.672, 1.072}},
    {"gpt2-large", 1280, 3840, 36, {8.077, 0.0088, true}, {7.163, 0.0088, true}, {4.703, 0.0013, true}, {4.801, 0.0016, true}, {8.903, 7.327, 4.817}},
    {"gpt2-large", 1280, 1280, 36, {3.45, 0.0092, true}, {2.901, 0.0092, true}, {3.374, 0.0039, true}, {3.657, 0.008, true}, {3.979, 3.201, 3.413}},
    {"gpt2-large", 1280, 5120, 72, {22.35, 0.0085, true}, {19.39, 0.0085, true}, {11.48, 0.0013, true}, {10.66, 0.0014, true}, {22.88, 19.13, 11.94}},
    {"pi0", 2048, 2048, 36, {13.93, 0.0089, true}, {11.02, 0.0089, true}, {12.04, 0.0035, true}, {12.78, 0.01, true}, {14.44, 11.12, 12.25}},
    {"pi0", 256, 2048, 36, {0.42, 0.012, true}, {0.4509, 0.012, true}, {0.2743, 0.0015, true}, {0.3478, 0.0016, true}, {0.4182, 0.4503, 0.2585}},
    {"pi0", 2048, 16384, 54, {121, 0.0092, true}, {97.52, 0.0092, true}, {50.88, 0.0013, true}, {39.19, 0.0018, true}, {123.3, 99.37, 49.58}},
    {"pi0", 1024, 2048, 37, {3.087, 0.0095, true}, {2.828, 0.0095, true}, {2.441, 0.0015, true}, {2.584, 0.0018, true}, {3.361, 3.014, 2.471}},
    {"pi0", 256, 1024, 36, {0.2543, 0.012, true}, {0.2793, 0.012, true}, {0.2378, 0.0016, true}, {0.2783, 0.0016, true}, {0.2293, 0.2715, 0.2305}},
    {"pi0", 1024, 4096, 54, {8.777, 0.0091, true}, {7.669, 0.0091, true}, {4.409, 0.0013, true}, {4.543, 0.0014, true}, {9.436, 7.687, 4.622}},
    {"pi0", 1152, 1152, 108, {7.698, 0.0093, true}, {7.299, 0.0093, true}, {7.612, 0.0041, true}, {8.594, 0.0078, true}, {8.817, 7.263, 8.146}},
    {"pi0", 1152, 4304, 54, {10.84, 0.0088, true}, {10.44, 0.0088, true}, {6.174, 0.0013, true}, {6.077, 0.0015, true}, {12.5, 10.7, 6.486}},
    {"pi0", 1152, 2048, 1, {0.1753, 0.0096, true}, {0.2091, 0.0096, true}, {0.2224, 0.0017, true}, {0.242, 0.0019, true}, {0.1746, 0.2074, 0.2204}},
    {"pi0", 32, 1024, 3, {0.04874, 0.021, false}, {0.06278, 0.021, false}, {0.1025, 0.0038, true}, {0.1154, 0.0027, true}, {0.04861, 0.06346, 0.1025}},
    {"pi0", 1024, 1024, 1, {0.09907, 0.0095, true}, {0.1298, 0.0095, true}, {0.1641, 0.0044, true}, {0.1812, 0.0077, true}, {0.09952, 0.1304, 0.1642}},
    {"qwen2.5-7b:8", 3584, 3584, 16, {32.45, 0.0086, true}, {24.41, 0.0086, true}, {26.66, 0.0026, true}, {27.55, 0.016, true}, {33.45, 24.56, 27.48}},
    {"qwen2.5-7b:8", 512, 3584, 16, {0.7489, 0.014, true}, {0.8178, 0.014, true}, {0.4989, 0.0018, true}, {0.5488, 0.0019, true}, {0.6812, 0.747, 0.4518}},
    {"qwen2.5-7b:8", 3584, 18944, 24, {195.3, 0.0098, true}, {152.1, 0.0098, true}, {85.64, 0.0012, true}, {67.78, 0.0032, true}, {196.8, 153.8, 84.96}},
    {"deepseek-v2-lite:2", 2048, 3072, 2, {0.9862, 0.0084, true}, {0.9037, 0.0084, true}, {0.8704, 0.0019, true}, {0.9037, 0.0043, true}, {0.9897, 0.9263, 0.9051}},
    {"deepseek-v2-lite:2", 576, 2048, 2, {0.13, 0.011, true}, {0.1557, 0.011, true}, {0.1472, 0.0016, true}, {0.1638, 0.0016, true}, {0.1289, 0.1545, 0.1478}},
    {"deepseek-v2-lite:2", 512, 4096, 2, {0.1674, 0.014, true}, {0.1913, 0.014, true}, {0.1422, 0.0018, true}, {0.1588, 0.0019, true}, {0.1654, 0.1902, 0.1405}},
    {"deepseek-v2-lite:2", 2048, 2048, 2, {0.7393, 0.0089, true}, {0.6804, 0.0089, true}, {0.7863, 0.0035, true}, {0.8457, 0.01, true}, {0.7394, 0.678, 0.7844}},
    {"deepseek-v2-lite:2", 2048, 10944, 3, {4.188, 0.0094, true}, {3.936, 0.0094, true}, {2.224, 0.0014, true}, {1.991, 0.0019, true}, {4.615, 4.081, 2.228}},
    {"deepseek-v2-lite:2", 64, 2048, 2, {0.06506, 0.012, true}, {0.08986, 0.012, true}, {0.09994, 0.0018, true}, {0.09997, 0.0016, true}, {0.06032, 0.08326, 0.09267}},
    {"deepseek-v2-lite:2", 1408, 2048, 384, {71.34, 0.009, true}, {58.82, 0.009, true}, {54.97, 0.0021, true}, {58.23, 0.0032, true}, {71.67, 59.12, 55.59}},
    {"deepseek-v2-lite:2", 2048, 2816, 6, {2.668, 0.0084, true}, {2.202, 0.0084, true}, {2.202, 0.0021, true}, {2.289, 0.0054, true}, {2.952, 2.405, 2.268}},
    {"resnet18", 64, 147, 1, {0.07786, 0.014, true}, {0.116, 0.014, true}, {0.1012, 0.0024, true}, {0.1085, 0.0021, true}, {0.07786, 0.1068, 0.09402}},
    {"resnet18", 64, 576, 4, {0.05024, 0.013, true}, {0.07389, 0.013, true}, {0.08662, 0.0022, true}, {0.09578, 0.0018, true}, {0.04813, 0.07062, 0.0864}},
    {"resnet18", 128, 576, 1, {0.04957, 0.011, true}, {0.07222, 0.011, true}, {0.08931, 0.0015, true}, {0.09878, 0.0015, true}, {0.04938, 0.07197, 0.08922}},
    {"resnet18", 128, 1152, 3, {0.05837, 0.011, true}, {0.08067, 0.011, true}, {0.09136, 0.0014, true}, {0.09904, 0.0016, true}, {0.05843, 0.08096, 0.09133}},
    {"resnet18", 64, 128, 1, {0.04106, 0.013, true}, {0.06218, 0.013, true}, {0.08051, 0.0023, true}, {0.08976, 0.0019, true}, {0.04102, 0.06234, 0.08058}},
    {"resnet18", 256, 1152, 1, {0.06157, 0.012, true}, {0.0841, 0.012, true}, {0.09757, 0.0016, true}, {0.1057, 0.0017, true}, {0.06202, 0.08429, 0.09782}},
    {"resnet18", 256, 2304, 3, {0.09414, 0.011, true}, {0.1306, 0.011, true}, {0.1069, 0.0016, true}, {0.1196, 0.0016, true}, {0.09366, 0.13, 0.107}},
    {"resnet18", 128, 256, 1, {0.04378, 0.012, true}, {0.06563, 0.012, true}, {0.08499, 0.0016, true}, {0.09446, 0.0019, true}, {0.04378, 0.0655, 0.08496}},
    {"resnet18", 512, 2304, 1, {0.09722, 0.011, true}, {0.1208, 0.011, true}, {0.1184, 0.0017, true}, {0.1285, 0.0018, true}, {0.09702, 0.1208, 0.1184}},
    {"resnet18", 512, 4608, 3, {0.2248, 0.013, true}, {0.251, 0.013, true}, {0.1756, 0.0018, true}, {0.1948, 0.002, true}, {0.2252, 0.2512, 0.1759}},
    {"resnet18", 256, 512, 1, {0.05386, 0.011, true}, {0.07597, 0.011, true}, {0.09443, 0.0015, true}, {0.1036, 0.0017, true}, {0.05402, 0.0761, 0.09446}},
    {"llama3.2-1b", 2048, 2048, 32, {12.8, 0.0089, true}, {9.974, 0.0089, true}, {10.63, 0.0035, true}, {11.53, 0.01, true}, {13.16, 9.984, 10.94}},
    {"llama3.2-1b", 512, 2048, 32, {0.8773, 0.012, true}, {0.9086, 0.012, true}, {0.6129, 0.0017, true}, {0.6902, 0.0018, true}, {0.8144, 0.8467, 0.5947}},
    {"llama3.2-1b", 2048, 8192, 48, {57.12, 0.0096, true}, {47.03, 0.0096, true}, {29.89, 0.0014, true}, {25, 0.0019, true}, {59.02, 48.12, 28.84}},
};

// Each workload left out of the calibration (a user's new one under autotune="cached"): the
// model's pick runs within 3 % of the fastest algorithm that passes the check, on every class;
// resolve()'s heuristic loses up to 1.96x (resnet18, where dense ns5 wins). What the device
// check measured, replayed on the CPU. Its known limit: on pi0's 32 x 1024, where bf16 ns5 fails
// the check (2.1e-2), the model, having seen nothing narrower than 64, offers it.
TEST(AlgoModel, EveryWorkloadLeftOutPicksWithin3PercentOnH200GraphTimes) {
  const OrthoConfig base = auto_bf16();
  auto choice = [](const ClassRun& r) {
    AlgoChoice c;
    c.rows = r.m;
    c.cols = r.n;
    c.count = r.count;
    c.candidates = {{"ns5", {}, DType::kBF16, r.ns5.ms, r.ns5.rel_err, r.ns5.accepted},
                    {"ns5-sym", {}, DType::kBF16, r.sym.ms, r.sym.rel_err, r.sym.accepted},
                    {"gram-ns", {2}, DType::kF16, r.gram2.ms, r.gram2.rel_err, r.gram2.accepted},
                    {"gram-ns", {}, DType::kF16, r.gram.ms, r.gram.rel_err, r.gram.accepted}};
    return c;
  };
  double worst = 1, worst_heuristic = 1;
  int offered_rejected = 0;
  for (const ClassRun& q : kH200Graph) {
    std::vector<AlgoChoice> others;  // the classes of the other workloads, minus q's shapes
    for (const ClassRun& r : kH200Graph) {
      bool shared = std::string(r.workload) == q.workload;
      for (const ClassRun& o : kH200Graph)
        if (std::string(o.workload) == q.workload && o.m == r.m && o.n == r.n) shared = true;
      if (!shared) others.push_back(choice(r));
    }
    const std::optional<AlgoChoice> p = predict_choice(others, q.m, q.n, q.count, base);
    ASSERT_TRUE(p);
    const AlgoCandidate* pick = select_candidate(*p, false);
    ASSERT_NE(pick, nullptr);
    const double t[3] = {q.again[0], q.again[1], q.again[2]};
    const bool ok[3] = {q.ns5.accepted, q.sym.accepted, q.gram2.accepted};
    double best = INFINITY;
    for (int i = 0; i < 3; ++i)
      if (ok[i]) best = std::min(best, t[i]);
    const int k = pick->algorithm == "ns5" ? 0 : pick->algorithm == "ns5-sym" ? 1 : 2;
    offered_rejected += !ok[k];
    const double ratio = t[k] / best;
    EXPECT_LE(ratio, 1.03) << q.workload << " " << q.count << " x " << q.m << "x" << q.n
                           << ": picked " << pick->algorithm;
    worst = std::max(worst, ratio);
    const bool gram = static_cast<double>(q.n) / static_cast<double>(q.m) >= 1.5;
    worst_heuristic = std::max(worst_heuristic, t[gram ? 2 : 1] / best);
  }
  EXPECT_EQ(offered_rejected, 1) << "pi0's 32 x 1024 (see above); a fix changes this figure";
  EXPECT_GT(worst_heuristic, 1.9);
  std::printf("[model] H200 graph times, workload left out: worst %.3f (heuristic %.3f)\n", worst,
              worst_heuristic);
}

// A candidate is offered where its predicted error passes the check's bar: ns5-sym failed the
// check on 32 x 1024 (2.1e-2), so a prediction for that class (weighted 10x its neighbours)
// does not offer it; at 64 x 2048, between that shape and the passing ones, it does.
TEST(AlgoModel, AcceptanceFollowsThePredictedError) {
  std::vector<AlgoChoice> all;
  for (const Measured& r : kH200) all.push_back(choice_of(r));
  auto sym = [](const AlgoChoice& c) {
    for (const AlgoCandidate& k : c.candidates)
      if (k.algorithm == "ns5-sym") return k;
    ADD_FAILURE() << "no ns5-sym prediction";
    return AlgoCandidate{};
  };
  std::optional<AlgoChoice> p = predict_choice(all, 32, 1024, 3, auto_bf16());
  ASSERT_TRUE(p);
  EXPECT_GT(sym(*p).rel_err, kAcceptTolerance);
  EXPECT_FALSE(sym(*p).accepted);
  EXPECT_EQ(select_candidate(*p, false)->algorithm, "gram-ns");
  p = predict_choice(all, 64, 2048, 2, auto_bf16());
  ASSERT_TRUE(p);
  EXPECT_LT(sym(*p).rel_err, kAcceptTolerance);
  EXPECT_GT(sym(*p).rel_err, 1e-2);
  EXPECT_TRUE(sym(*p).accepted);
  // An exact entry dominates its neighbours: the prediction is close to its measurement.
  const std::optional<AlgoChoice> q = predict_choice(all, 3584, 18944, 24, auto_bf16());
  ASSERT_TRUE(q);
  for (const AlgoCandidate& k : q->candidates)
    if (k.algorithm == "gram-ns" && !k.restarts.empty()) {
      EXPECT_NEAR(k.ms / 89.652, 1.0, 0.15);
    }
}

// Nothing of this schedule measured: no prediction (the caller falls back to the heuristic).
TEST(AlgoModel, NoMeasurementsOfTheScheduleNoPrediction) {
  EXPECT_FALSE(predict_choice({}, 768, 3072, 24, auto_bf16()));
  AlgoChoice other = choice_of(kH200[0]);
  other.schedule = "polar-express:5";
  EXPECT_FALSE(predict_choice({other}, 768, 3072, 24, auto_bf16()));
  EXPECT_TRUE(predict_choice({choice_of(kH200[0])}, 768, 3072, 24, auto_bf16()));
  EXPECT_DOUBLE_EQ(shape_distance(768, 3072, 24, 768, 3072, 24), 0.0);
  EXPECT_DOUBLE_EQ(shape_distance(768, 3072, 24, 3072, 12288, 24), std::log(4.0));
}

// ---- the engine's tune() ------------------------------------------------------------------------

// The CPU backend, presenting itself as a tuned one so that the engine asks the tuner.
class TunedCpu : public test::ForwardingBackend {
 public:
  std::string tuning_fingerprint() const override { return "test cpu|tuned"; }
  void load_kernel_choices_json(const std::string&) override {}
};

ParamSpec muon_param(const std::string& name, int64_t rows, int64_t cols) {
  return {name, 0, {rows, cols}, DType::kF32};
}

TEST(EngineTune, MeasuresOnceStoresAndPredictsTheRest) {
  test::EnvGuard guard("DISTMUON_COST_CACHE");
  const std::string store = test::temp_path("test_algo_model", "store.json");
  std::remove(store.c_str());
  setenv("DISTMUON_COST_CACHE", store.c_str(), 1);
  test::EnvGuard autotune("DISTMUON_AUTOTUNE"), graphs("DISTMUON_GRAPHS");
  unsetenv("DISTMUON_AUTOTUNE");
  unsetenv("DISTMUON_GRAPHS");
  TunedCpu be;
  GroupOptions g;
  g.muon.ortho = auto_bf16();

  // Cached mode on an empty store: the heuristic everywhere, until tune() measures.
  EngineOptions cached;
  cached.autotune = AutoTune::kCached;
  Engine a(be, cached);
  a.add_group(g);
  a.add_param(muon_param("w0", 16, 48));
  a.add_param(muon_param("w1", 48, 16));
  a.add_param(muon_param("w2", 24, 24));
  EXPECT_TRUE(a.tuned_shapes().empty());
  a.setup();
  std::vector<TunedShape> r = a.tuned_shapes();
  ASSERT_EQ(r.size(), 2u);
  for (const TunedShape& t : r) EXPECT_EQ(t.source, "heuristic");
  r = a.tune();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].rows, 16);
  EXPECT_EQ(r[0].cols, 48);
  EXPECT_EQ(r[0].count, 2);
  for (const TunedShape& t : r) {
    EXPECT_EQ(t.source, "measured");
    EXPECT_GT(t.ms, 0.0);
    EXPECT_NE(t.config.iteration, Iteration::kAuto);
  }
  EXPECT_EQ(a.resolved_ortho(0).iteration, r[0].config.iteration);
  // A single-process engine with graphs (the default) keeps them under the graph-replay key.
  EXPECT_EQ(load_algo_choices(store, tuner_key(be.tuning_fingerprint(), true)).size(), 2u);
  EXPECT_TRUE(load_algo_choices(store, tuner_key(be.tuning_fingerprint())).empty());
  r = a.tune();  // measured already: nothing measured again
  for (const TunedShape& t : r) EXPECT_EQ(t.source, "stored");

  // The engine steps after tune() as before it.
  std::vector<float> w(3 * 16 * 48, 0.1f), gr(3 * 16 * 48, 0.01f);
  std::vector<ParamData> data = {{w.data(), gr.data(), DType::kF32, {}},
                                 {w.data() + 768, gr.data() + 768, DType::kF32, {}},
                                 {w.data() + 1536, gr.data() + 1536, DType::kF32, {}}};
  a.step(data);
  EXPECT_EQ(a.stats().steps, 1);

  // The next engine finds the stored shapes, and predicts a new one from them.
  Engine b(be, cached);
  b.add_group(g);
  b.add_param(muon_param("w0", 16, 48));
  b.add_param(muon_param("w1", 48, 16));
  b.add_param(muon_param("v", 20, 40));
  b.setup();
  r = b.tuned_shapes();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].source, "stored");
  EXPECT_EQ(r[1].source, "predicted");
  EXPECT_GT(r[1].ms, 0.0);
  EXPECT_EQ(load_algo_choices(store, tuner_key(be.tuning_fingerprint(), true)).size(), 2u)
      << "a prediction is not a measurement: never stored";
  // An engine issuing its steps (graphs off, as distributed engines do) measures for itself.
  EngineOptions eager = cached;
  eager.graphs = false;
  Engine d(be, eager);
  d.add_group(g);
  d.add_param(muon_param("w2", 24, 24));
  d.setup();
  EXPECT_EQ(d.tuned_shapes()[0].source, "heuristic") << "the eager key holds nothing yet";
  EXPECT_EQ(d.tune()[0].source, "measured");
  EXPECT_EQ(load_algo_choices(store, tuner_key(be.tuning_fingerprint())).size(), 1u);

  // Explicit algorithms are not the tuner's: no answer for them.
  Engine c(be, cached);
  GroupOptions fixed = g;
  fixed.muon.ortho.iteration = Iteration::kGram;
  c.add_group(fixed);
  c.add_param(muon_param("w0", 16, 48));
  EXPECT_TRUE(c.tune().empty());
  std::remove(store.c_str());
}

// Graph timing (what the tuner of a graph-replaying engine measures): the solve is captured once
// and the timed runs replay it; a backend whose capture fails is timed issuing each run.
TEST(MeasureTiming, GraphTimingReplaysOneCapturedSolve) {
  test::RecordingBackend be;
  OrthoConfig cfg;
  cfg.iteration = Iteration::kStandardDense;
  const OrthoInput in = make_ortho_input(be, 8, 24, 3, cfg, 7);
  EXPECT_GT(time_orthogonalizer(be, cfg, in.batch, {1, 3, true}), 0.0);
  EXPECT_EQ(be.captures, 1);
  EXPECT_EQ(be.replays, 3);
  EXPECT_GT(time_orthogonalizer(be, cfg, in.batch, {1, 3, false}), 0.0);
  EXPECT_EQ(be.captures, 1) << "issued runs capture nothing";
  be.fail_captures = true;
  EXPECT_GT(time_orthogonalizer(be, cfg, in.batch, {1, 3, true}), 0.0);
  EXPECT_EQ(be.captures, 2);
  EXPECT_EQ(be.replays, 3) << "a failed capture falls back to issued runs";
}

}  // namespace
}  // namespace distmuon::measure
