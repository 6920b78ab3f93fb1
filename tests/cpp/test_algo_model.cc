// `auto` on shapes nobody measured: the cost model (measure/algo_model.h) on an H200's tuner
// measurements, left out one shape at a time, and the engine's tune() / tuned_shapes() on a CPU
// backend that presents itself as a tuned one.
#include <gtest/gtest.h>

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

// A candidate is offered where its predicted error passes the check's bar: ns5-sym failed the
// check on 32 x 1024 (2.1e-2), so a prediction for that class (weighted 10x its neighbours)
// does not offer it; at 64 x 2048, between that shape and the passing ones, it does.
TEST(AlgoModel, AcceptanceFollowsThePredictedError) {
  std::vector<AlgoChoice> all;
  for (const Measured& r : kH200) all.push_back(choice_of(r));
  std::optional<AlgoChoice> p = predict_choice(all, 32, 1024, 3, auto_bf16());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->candidates[0].algorithm, "ns5-sym");
  EXPECT_GT(p->candidates[0].rel_err, 2e-2);
  EXPECT_FALSE(p->candidates[0].accepted);
  EXPECT_EQ(select_candidate(*p, false)->algorithm, "gram-ns");
  p = predict_choice(all, 64, 2048, 2, auto_bf16());
  ASSERT_TRUE(p);
  EXPECT_LT(p->candidates[0].rel_err, 2e-2);
  EXPECT_GT(p->candidates[0].rel_err, 1e-2);
  EXPECT_TRUE(p->candidates[0].accepted);
  // An exact entry dominates its neighbours: the prediction is close to its measurement.
  const std::optional<AlgoChoice> q = predict_choice(all, 3584, 18944, 24, auto_bf16());
  ASSERT_TRUE(q);
  EXPECT_NEAR(q->candidates[1].ms / 89.652, 1.0, 0.15);
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
