// The single-process optimizer: the Muon update rule against hand-computed values, AdamW in the
// same optimizer, parameter groups, 3D/4D layouts, and bad input.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "distmuon/workload.h"
#include "null_backend.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::Mat;
using test::random_matrix;
using test::to_vec;

GroupOptions muon_group(float lr, float wd = 0.0f, bool nesterov = true) {
  GroupOptions g;
  g.kind = ParamKind::kMuon;
  g.muon.lr = lr;
  g.muon.weight_decay = wd;
  g.muon.nesterov = nesterov;
  g.muon.ortho.iteration = Iteration::kStandardDense;
  return g;
}

// The Jordan quintic on a 1 x n matrix acts on its single singular value s.
double ns_scalar(double s) {
  for (int i = 0; i < 5; ++i) s = 3.4445 * s - 4.7750 * s * s * s + 2.0315 * std::pow(s, 5);
  return s;
}

TEST(Engine, MuonUpdateRuleMatchesHandComputation) {
  CpuBackend be;
  Engine eng(be);
  const float lr = 0.1f, wd = 0.5f, mu = 0.95f;
  eng.add_group(muon_group(lr, wd));
  eng.add_param({"w", 0, {1, 4}, DType::kF32});
  std::vector<float> w = {1.0f, -1.0f, 0.5f, 2.0f};
  std::vector<float> g1 = {3.0f, 0.0f, 4.0f, 0.0f};  // |g1| = 5
  std::vector<float> w0 = w;
  ParamData d{w.data(), g1.data(), DType::kF32, {}};
  eng.step({&d, 1});
  // Step 1: B = g1, U = g1 + mu B = 1.95 g1, X = U / (|U| + 1e-7), O = ns(|X|) * g1 / 5.
  // Scale "original" for 1 x 4: sqrt(max(1, 1/4)) = 1.
  const double s1 = ns_scalar(1.95 * 5 / (1.95 * 5 + 1e-7));
  for (int j = 0; j < 4; ++j) {
    double want = w0[j] * (1 - lr * wd) - lr * s1 * g1[j] / 5.0;
    EXPECT_NEAR(w[j], want, 1e-5) << j;
  }
  TensorView mom = eng.state(0, "momentum_buffer");
  const float* b = static_cast<const float*>(mom.data);
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(b[j], g1[j]);

  // Step 2 with a different gradient: B = mu g1 + g2, U = g2 + mu B.
  std::vector<float> g2 = {0.0f, 1.0f, 0.0f, 0.0f};
  std::vector<float> w1 = w;
  d.grad = g2.data();
  eng.step({&d, 1});
  std::vector<double> bn(4), u(4);
  double un = 0;
  for (int j = 0; j < 4; ++j) {
    bn[j] = mu * g1[j] + g2[j];
    u[j] = g2[j] + mu * bn[j];
    un += u[j] * u[j];
  }
  un = std::sqrt(un);
  const double s2 = ns_scalar(un / (un + 1e-7));
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(b[j], bn[j], 1e-6);
    EXPECT_NEAR(w[j], w1[j] * (1 - lr * wd) - lr * s2 * u[j] / un, 1e-5);
  }
  EXPECT_EQ(eng.param_step(0), 2);
}

TEST(Engine, ScaleModesAndTallMatrices) {
  for (ScaleMode mode : {ScaleMode::kOriginal, ScaleMode::kMatchRmsAdamW, ScaleMode::kSpectral}) {
    for (auto [r, c] : {std::pair{12, 4}, std::pair{4, 12}}) {
      CpuBackend be;
      Engine eng(be);
      GroupOptions g = muon_group(0.01f);
      g.muon.scale = mode;
      g.muon.nesterov = false;
      g.muon.ortho.work_dtype = DType::kF64;
      eng.add_group(g);
      eng.add_param({"w", 0, {r, c}, DType::kF32});
      Mat gm = random_matrix(r, c);
      std::vector<float> w(r * c, 0.0f), grad = to_vec(gm);
      ParamData d{w.data(), grad.data(), DType::kF32, {}};
      eng.step({&d, 1});
      // Without Nesterov the first U is the gradient itself.
      Mat o = test::reference_ns(gm.cast<float>().cast<double>(), Coefficients::kJordan, 5);
      const double scale = shape_scale(mode, r, c);
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) EXPECT_NEAR(w[i * c + j], -0.01 * scale * o(i, j), 1e-6);
    }
  }
  EXPECT_DOUBLE_EQ(shape_scale(ScaleMode::kOriginal, 3072, 768), 2.0);
  EXPECT_DOUBLE_EQ(shape_scale(ScaleMode::kMatchRmsAdamW, 768, 3072), 0.2 * std::sqrt(3072.0));
  EXPECT_DOUBLE_EQ(shape_scale(ScaleMode::kSpectral, 768, 3072), 0.5);
}

TEST(Engine, BatchOf3DAndConvLayoutsEqualSeparateMatrices) {
  // A (3, 8, 20) parameter is three 8 x 20 matrices; a (6, 2, 3, 3) conv is one 6 x 18 matrix.
  CpuBackend be;
  Engine stacked(be), separate(be);
  for (Engine* e : {&stacked, &separate}) e->add_group(muon_group(0.05f));
  stacked.add_param({"experts", 0, {3, 8, 20}, DType::kF32});
  stacked.add_param({"conv", 0, {6, 2, 3, 3}, DType::kF32});
  for (int i = 0; i < 3; ++i)
    separate.add_param({"e" + std::to_string(i), 0, {8, 20}, DType::kF32});
  separate.add_param({"conv2d", 0, {6, 18}, DType::kF32});
  std::vector<float> we(3 * 160), ge = to_vec(random_matrix(1, 480)), wc(108),
                                  gc = to_vec(random_matrix(1, 108));
  std::vector<float> we2 = we, wc2 = wc;
  std::vector<ParamData> ds = {{we.data(), ge.data(), DType::kF32, {}},
                               {wc.data(), gc.data(), DType::kF32, {}}};
  std::vector<ParamData> dp;
  for (int i = 0; i < 3; ++i)
    dp.push_back({we2.data() + 160 * i, ge.data() + 160 * i, DType::kF32, {}});
  dp.push_back({wc2.data(), gc.data(), DType::kF32, {}});
  for (int s = 0; s < 2; ++s) {
    stacked.step(ds);
    separate.step(dp);
  }
  EXPECT_EQ(we, we2);
  EXPECT_EQ(wc, wc2);
}

TEST(Engine, TallAndWideOfOneShapeShareABatchAndEqualSeparateEngines) {
  // An MLP's up (8 x 20) and down (20 x 8) projections are one 8 x 20 class: one batch per step
  // in the wide orientation, with results bit-identical to engines that hold one orientation
  // each. Also through CacheMuon, with a parameter missing its gradient in one step (a gap in
  // the class's cache entries).
  for (bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "gram-ns + cache" : "ns5");
    GroupOptions g = muon_group(0.05f, 0.1f);
    if (cache) {
      g.muon.ortho = parse_algorithm("gram-ns");
      g.muon.cache.enabled = true;
      g.muon.cache.gamma = 1e9;
      g.muon.cache.max_staleness = 2;
    }
    CpuBackend be;
    Engine joint(be), wide(be), tall(be);
    for (Engine* e : {&joint, &wide, &tall}) e->add_group(g);
    const std::vector<std::pair<std::string, std::vector<int64_t>>> defs = {
        {"down", {20, 8}}, {"up", {8, 20}}, {"up2", {8, 20}}, {"down2", {20, 8}}};
    std::vector<std::vector<float>> wj(4, std::vector<float>(160, 0.25f)), ws = wj, grads;
    for (int i = 0; i < 4; ++i) {
      joint.add_param({defs[i].first, 0, defs[i].second, DType::kF32});
      (defs[i].second[0] > defs[i].second[1] ? tall : wide)
          .add_param({defs[i].first, 0, defs[i].second, DType::kF32});
      grads.push_back(to_vec(random_matrix(1, 160)));
    }
    for (int step = 0; step < 4; ++step) {
      std::vector<ParamData> dj, dw, dt;
      for (int i = 0; i < 4; ++i) {
        const bool has = !(step == 2 && defs[i].first == "up");
        ParamData a{wj[i].data(), has ? grads[i].data() : nullptr, DType::kF32, {}};
        ParamData b{ws[i].data(), a.grad, DType::kF32, {}};
        dj.push_back(a);
        (defs[i].second[0] > defs[i].second[1] ? dt : dw).push_back(b);
      }
      const int64_t before = joint.stats().ortho.calls;
      joint.step(dj);
      wide.step(dw);
      tall.step(dt);
      if (!cache) {
        EXPECT_EQ(joint.stats().ortho.calls - before, 1) << "one batch per step";
      }
      for (auto& gr : grads)  // a slowly drifting gradient, so that cached transforms stay close
        for (float& x : gr) x = 0.9f * x + 0.01f * (x > 0 ? 1.0f : -1.0f);
    }
    for (int i = 0; i < 4; ++i) EXPECT_EQ(wj[i], ws[i]) << defs[i].first;
    if (cache) {
      const CacheStats cj = joint.stats().cache;
      const CacheStats cw = wide.stats().cache, ct = tall.stats().cache;
      EXPECT_GT(cj.hits, 0);
      EXPECT_EQ(cj.hits, cw.hits + ct.hits);
      EXPECT_EQ(cj.refreshes, cw.refreshes + ct.refreshes);
      for (int i = 0; i < 4; ++i) {
        Engine& sep = defs[i].second[0] > defs[i].second[1] ? tall : wide;
        const int si = i == 0 || i == 1 ? 0 : 1;  // position in its separate engine
        for (const char* n : {"cache_q", "cache_age", "cache_key"}) {
          TensorView a = joint.state(i, n), b = sep.state(si, n);
          ASSERT_EQ(a.numel(), b.numel());
          EXPECT_EQ(0, std::memcmp(a.data, b.data, a.numel() * dtype_size(a.dtype)))
              << defs[i].first << " " << n;
        }
      }
    }
  }
}

TEST(Engine, AdamwGroupsAndMissingGradients) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  GroupOptions a;
  a.kind = ParamKind::kAdamW;
  a.adamw.lr = 0.1f;
  a.adamw.weight_decay = 0.0f;
  eng.add_group(a);
  eng.add_param({"w", 0, {4, 6}, DType::kF32});
  eng.add_param({"bias", 1, {6}, DType::kF32});
  eng.add_param({"unused", 0, {4, 6}, DType::kF32});
  std::vector<float> w(24, 1.0f), gw = to_vec(random_matrix(4, 6)), bias(6, 0.0f),
                                  gb = {1, -2, 3, -4, 5, -6};
  std::vector<float> unused(24, 7.0f);
  std::vector<ParamData> d = {{w.data(), gw.data(), DType::kF32, {}},
                              {bias.data(), gb.data(), DType::kF32, {}},
                              {unused.data(), nullptr, DType::kF32, {}}};
  eng.step(d);
  for (int j = 0; j < 6; ++j)
    EXPECT_NEAR(bias[j], -0.1 * (gb[j] > 0 ? 1 : -1), 1e-6);  // first Adam step
  for (float v : unused) EXPECT_EQ(v, 7.0f);                  // no gradient: untouched
  EXPECT_EQ(eng.param_step(2), 0);
  EXPECT_EQ(eng.param_step(1), 1);
  // Schedulers change the learning rate between steps.
  eng.group(1).adamw.lr = 0.0f;
  std::vector<float> before = bias;
  eng.step(d);
  EXPECT_EQ(bias, before);
}

// AdamW's step count lives in backend memory (a replayed CUDA graph advances it): a restored
// count sets the bias correction, and a skipped (non-finite) step does not count.
TEST(Engine, AdamwStepCountRestoresAndSkips) {
  CpuBackend be;
  Engine eng(be);
  GroupOptions a;
  a.kind = ParamKind::kAdamW;
  a.adamw.lr = 0.1f;
  a.adamw.weight_decay = 0.0f;
  eng.add_group(a);
  eng.add_param({"b", 0, {3}, DType::kF32});
  eng.set_param_step(0, 9);  // as a checkpoint restore does, before the first step
  std::vector<float> p(3, 0.0f), g = {1.0f, -1.0f, 2.0f};
  std::vector<ParamData> d = {{p.data(), g.data(), DType::kF32, {}}};
  eng.step(d);
  EXPECT_EQ(eng.param_step(0), 10);
  const double bc1 = 1 - std::pow(0.9, 10), bc2 = 1 - std::pow(0.999, 10);
  for (int j = 0; j < 3; ++j) {
    const double m = 0.1 * g[j], v = 0.001 * g[j] * g[j];
    EXPECT_NEAR(p[j], -0.1 * (m / bc1) / (std::sqrt(v) / std::sqrt(bc2) + 1e-8), 1e-6);
  }
  const std::vector<float> before = p;
  g[1] = std::nanf("");
  eng.step(d);
  EXPECT_EQ(p, before);
  EXPECT_EQ(eng.param_step(0), 10);
  eng.set_param_step(0, 3);
  EXPECT_EQ(eng.param_step(0), 3);
}

TEST(Engine, NonFiniteGradientIsSkippedAndCounted) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  eng.add_param({"good", 0, {4, 8}, DType::kF32});
  eng.add_param({"bad", 0, {4, 8}, DType::kF32});
  std::vector<float> w1(32, 1.0f), w2(32, 1.0f), g1 = to_vec(random_matrix(4, 8)), g2 = g1;
  g2[5] = std::numeric_limits<float>::infinity();
  std::vector<ParamData> d = {{w1.data(), g1.data(), DType::kF32, {}},
                              {w2.data(), g2.data(), DType::kF32, {}}};
  eng.step(d);
  EXPECT_NE(w1, std::vector<float>(32, 1.0f));
  EXPECT_EQ(w2, std::vector<float>(32, 1.0f));
  const float* mom = static_cast<const float*>(eng.state(1, "momentum_buffer").data);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(mom[i], 0.0f);
  EXPECT_EQ(eng.stats().nonfinite_skips, 1);
  // Skipped means no state changes at all: its step count stays (it used to advance).
  EXPECT_EQ(eng.param_step(0), 1);
  EXPECT_EQ(eng.param_step(1), 0);
  d[1].grad = g1.data();
  eng.step(d);
  EXPECT_EQ(eng.param_step(1), 1);
  EXPECT_EQ(eng.param_steps(), (std::vector<int64_t>{2, 1}));
  eng.set_param_step(1, 7);  // a checkpoint's count replaces it, skips included
  EXPECT_EQ(eng.param_step(1), 7);
}

TEST(Engine, StepCountOfABatchFollowsItsMostSkippedMatrix) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  eng.add_param({"experts", 0, {3, 4, 8}, DType::kF32});
  std::vector<float> w(96, 1.0f), g = to_vec(random_matrix(12, 8));
  ParamData d{w.data(), g.data(), DType::kF32, {}};
  eng.step({&d, 1});
  g[40] = std::numeric_limits<float>::quiet_NaN();  // expert 1 only
  eng.step({&d, 1});
  EXPECT_EQ(eng.param_step(0), 1);
  EXPECT_EQ(eng.stats().nonfinite_skips, 1);
}

// Gradients near float's largest value are finite, and the step follows the update rule
// computed in float64 (they used to be skipped as "non-finite": the Nesterov input reaches
// 1.95 x 3e38 and the norm 1e40, beyond float). A momentum that would overflow its dtype is a
// skip, and leaves everything as it was.
TEST(Engine, NearFloatMaxGradientsFollowTheFloat64Rule) {
  CpuBackend be;
  Engine eng(be);
  const float lr = 0.02f, wd = 0.1f, mu = 0.95f;
  GroupOptions g = muon_group(lr, wd);
  g.muon.ortho.work_dtype = DType::kF32;
  eng.add_group(g);
  const int64_t rows = 8, cols = 32;
  eng.add_param({"w", 0, {rows, cols}, DType::kF32});
  Mat r = random_matrix(rows, cols);
  const Mat grad = (r / r.cwiseAbs().maxCoeff() * 3e38).cast<float>().cast<double>();
  std::vector<float> w = to_vec(random_matrix(rows, cols, 0.02)), gv = to_vec(grad);
  const std::vector<float> w0 = w;
  ParamData d{w.data(), gv.data(), DType::kF32, {}};
  eng.step({&d, 1});
  // float64: B = G, U = G + mu B, O = NS5(U / (||U|| + eps)), W = W (1 - lr wd) - lr O.
  const Mat u = grad + mu * grad;
  const Mat o = test::reference_ns(u, Coefficients::kJordan, 5);
  Mat got(rows, cols), want(rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      got(i, j) = w[i * cols + j];
      want(i, j) = w0[i * cols + j] * (1.0 - double(lr) * wd) - double(lr) * o(i, j);
    }
  const double err = test::rel_err(got, want);
  std::printf("[measure] near-max gradient, one step: rel err %.2e vs the float64 rule\n", err);
  EXPECT_LT(err, 1e-5);
  EXPECT_EQ(eng.param_step(0), 1);
  EXPECT_EQ(eng.stats().nonfinite_skips, 0);
  // The same gradient again: B would be mu G + G = 5.9e38, beyond float. Skipped, unchanged.
  const std::vector<float> w1 = w;
  eng.step({&d, 1});
  EXPECT_EQ(w, w1);
  const float* mom = static_cast<const float*>(eng.state(0, "momentum_buffer").data);
  for (int64_t k = 0; k < rows * cols; ++k) ASSERT_EQ(mom[k], gv[k]);
  EXPECT_EQ(eng.param_step(0), 1);
  EXPECT_EQ(eng.stats().nonfinite_skips, 1);
}

TEST(Engine, RaisePolicyThrowsBeforeTouchingState) {
  CpuBackend be;
  Engine eng(be, EngineOptions{NonFinitePolicy::kRaise});
  eng.add_group(muon_group(0.02f));
  eng.add_param({"layer.weight", 0, {4, 8}, DType::kF32});
  eng.add_param({"other", 0, {4, 8}, DType::kF32});
  std::vector<float> w1(32, 1.0f), w2(32, 1.0f), g1 = to_vec(random_matrix(4, 8)), g2 = g1;
  g2[0] = std::nanf("");
  std::vector<ParamData> d = {{w1.data(), g1.data(), DType::kF32, {}},
                              {w2.data(), g2.data(), DType::kF32, {}}};
  try {
    eng.step(d);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'other'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(w1, std::vector<float>(32, 1.0f));  // not even the good matrix moved
  const float* mom = static_cast<const float*>(eng.state(0, "momentum_buffer").data);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(mom[i], 0.0f);
}

TEST(Engine, ZeroGradientGivesZeroUpdate) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  eng.add_param({"w", 0, {8, 8}, DType::kF32});
  std::vector<float> w(64, 0.25f), g(64, 0.0f);
  ParamData d{w.data(), g.data(), DType::kF32, {}};
  eng.step({&d, 1});
  for (float v : w) EXPECT_EQ(v, 0.25f);
}

// issue_ms is the host time of the last step's call in one process (it does not wait at its end).
TEST(Engine, IssueTimeIsTheLastStepsHostTime) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  eng.add_param({"w", 0, {64, 96}, DType::kF32});
  std::vector<float> w(64 * 96, 0.25f), g(64 * 96, 0.01f);
  ParamData d{w.data(), g.data(), DType::kF32, {}};
  EXPECT_EQ(eng.stats().issue_ms, 0.0);
  for (int i = 0; i < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    eng.step({&d, 1});
    const double wall =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GT(eng.stats().issue_ms, 0.0);
    EXPECT_LE(eng.stats().issue_ms, wall);
  }
}

TEST(Engine, ClearErrorsForBadParameters) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(muon_group(0.02f));
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              eng.add_param({"norm.weight", 0, {768}, DType::kF32});
            }).find("norm.weight"),
            std::string::npos);
  EXPECT_NE(message([&] {
              eng.add_param({"empty", 0, {0, 4}, DType::kF32});
            }).find("empty"),
            std::string::npos);
  EXPECT_THROW(eng.add_param({"w", 3, {4, 4}, DType::kF32}), Error);  // no such group
  // Sizes that leave int64 are refused before anything is allocated: the element count, and
  // the bytes of its state.
  EXPECT_NE(message([&] {
              eng.add_param({"huge", 0, {3037000500, 3037000500}, DType::kF32});
            }).find("'huge': shape [3037000500, 3037000500] has more elements than a 64-bit"),
            std::string::npos);
  EXPECT_NE(message([&] {
              eng.add_param({"wide", 0, {int64_t{1} << 31, int64_t{1} << 31}, DType::kF32});
            }).find("'wide' (bytes): 4611686018427387904 x 8 overflows"),
            std::string::npos);
  EXPECT_EQ(eng.num_params(), 0);
  eng.add_param({"proj", 0, {4, 6}, DType::kF32});
  std::vector<float> w(24), g(24);
  std::vector<int64_t> wrong = {6, 4};
  ParamData d{w.data(), g.data(), DType::kF32, wrong};
  std::string msg = message([&] { eng.step({&d, 1}); });
  EXPECT_NE(msg.find("'proj'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[6, 4]"), std::string::npos) << msg;
  GroupOptions bad = muon_group(0.02f);
  bad.muon.momentum = 1.5f;
  EXPECT_THROW(eng.add_group(bad), Error);
}

TEST(Engine, HalfPrecisionParametersAndGradients) {
  // bf16 weights and gradients work and follow the fp32 result within bf16 rounding.
  CpuBackend be;
  Engine e32(be), e16(be);
  for (Engine* e : {&e32, &e16}) e->add_group(muon_group(0.05f));
  e32.add_param({"w", 0, {16, 40}, DType::kF32});
  e16.add_param({"w", 0, {16, 40}, DType::kBF16});
  test::HostBatch w16(DType::kBF16, 1, 16, 40), g16(DType::kBF16, 1, 16, 40);
  Mat w0 = random_matrix(16, 40), g0 = random_matrix(16, 40);
  w16.set(0, w0);
  g16.set(0, g0);
  std::vector<float> w32 = to_vec(w16.get(0)), g32 = to_vec(g16.get(0));
  ParamData d32{w32.data(), g32.data(), DType::kF32, {}};
  ParamData d16{w16.ref.data, g16.ref.data, DType::kBF16, {}};
  e32.step({&d32, 1});
  e16.step({&d16, 1});
  Mat a = w16.get(0), b(16, 40);
  for (int i = 0; i < 640; ++i) b(i / 40, i % 40) = w32[i];
  EXPECT_LT(test::rel_err(a, b), 1e-2);
}

// A step issues a few operations per shape class, not per matrix: the operations of one step
// of a workload do not grow with its layers (every layer adds matrices to the same classes).
// Classes whose products run grouped share each launch of their orthogonalization
// (DISTMUON_GROUPED_PRODUCTS=all groups every class); every matrix must still get the bits its
// class gets in an engine of its own, through standard and Gram NS, a tall member, a missing
// gradient, and a class through CacheMuon (which runs alone). Without grouped products
// (symmetric products computed as one triangle) the results agree to rounding.
TEST(Engine, GroupedProductsGiveEveryClassTheBitsItGetsAlone) {
  CpuBackend be;
  GroupOptions g = muon_group(0.05f, 0.1f);
  g.muon.ortho = parse_algorithm("auto");
  GroupOptions cached = g;
  cached.muon.ortho = parse_algorithm("gram-ns");
  cached.muon.cache.enabled = true;
  cached.muon.cache.gamma = 1e9;
  const std::vector<std::pair<std::vector<int64_t>, int>> defs = {
      {{8, 20}, 0}, {{20, 8}, 0}, {{12, 12}, 0}, {{6, 30}, 0}, {{10, 40}, 0}, {{16, 16}, 0},
      {{10, 40}, 1}};
  const size_t n = defs.size();
  std::vector<std::unique_ptr<Engine>> engines;  // [0]: every parameter; [1 + i]: parameter i
  for (size_t e = 0; e < n + 2; ++e) {             // [n + 1]: all of them, not grouped
    engines.push_back(std::make_unique<Engine>(be));
    engines.back()->add_group(g);
    engines.back()->add_group(cached);
  }
  std::vector<std::vector<std::vector<float>>> w(n + 2);
  std::vector<std::vector<float>> grads;
  for (size_t i = 0; i < n; ++i) {
    const auto& [shape, group] = defs[i];
    const ParamSpec spec{"p" + std::to_string(i), group, shape, DType::kF32};
    engines[0]->add_param(spec);
    engines[1 + i]->add_param(spec);
    engines[n + 1]->add_param(spec);
    grads.push_back(to_vec(random_matrix(1, shape[0] * shape[1])));
  }
  for (auto& we : w) we.assign(n, {});
  for (size_t i = 0; i < n; ++i)
    for (auto& we : w) we[i].assign(grads[i].size(), 0.25f);
  for (int step = 0; step < 3; ++step) {
    auto data = [&](size_t e, size_t i) {
      const float* grad = step == 1 && i == 2 ? nullptr : grads[i].data();
      return ParamData{w[e][i].data(), grad, DType::kF32, {}};
    };
    setenv("DISTMUON_GROUPED_PRODUCTS", "all", 1);
    std::vector<ParamData> all;
    for (size_t i = 0; i < n; ++i) all.push_back(data(0, i));
    engines[0]->step(all);
    for (size_t i = 0; i < n; ++i) {
      const std::vector<ParamData> one = {data(1 + i, i)};
      engines[1 + i]->step(one);
    }
    setenv("DISTMUON_GROUPED_PRODUCTS", "off", 1);
    std::vector<ParamData> plain;
    for (size_t i = 0; i < n; ++i) plain.push_back(data(n + 1, i));
    engines[n + 1]->step(plain);
    for (auto& gr : grads)
      for (float& x : gr) x = 0.9f * x + 0.01f;
  }
  unsetenv("DISTMUON_GROUPED_PRODUCTS");
  OrthoStats alone;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(w[0][i], w[1 + i][i]) << "p" << i;
    double diff = 0;
    for (size_t k = 0; k < w[0][i].size(); ++k)
      diff = std::max(diff, std::abs(double{w[0][i][k]} - w[n + 1][i][k]));
    EXPECT_LT(diff, 1e-5) << "p" << i;
    alone += engines[1 + i]->stats().ortho;
  }
  EXPECT_EQ(engines[0]->stats().ortho.flops, alone.flops);
  EXPECT_EQ(engines[0]->stats().ortho.matrices, alone.matrices);
  EXPECT_GT(engines[0]->stats().cache.hits + engines[0]->stats().cache.refreshes, 0);
  // The knob is read where the classes are set up: a bad value fails the first step before
  // anything changed.
  setenv("DISTMUON_GROUPED_PRODUCTS", "sometimes", 1);
  Engine bad(be);
  bad.add_group(g);
  bad.add_param({"p", 0, {8, 20}, DType::kF32});
  std::vector<float> wb(160, 0.25f);
  const std::vector<ParamData> d = {{wb.data(), grads[0].data(), DType::kF32, {}}};
  try {
    bad.step(d);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DISTMUON_GROUPED_PRODUCTS=sometimes"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(wb, std::vector<float>(160, 0.25f));
  EXPECT_EQ(bad.stats().steps, 0);
  unsetenv("DISTMUON_GROUPED_PRODUCTS");
}

// ResNet-18's convolutions as matrices: 20 matrices in 11 small classes. Where the backend has a
// grouped kernel, the launch-bound classes share each product's launch, each identity term's
// (Gram NS) and every class shares each fused pass's, so a step issues far fewer operations
// than one launch per class and product (when written: ns5 212 against 47, Gram NS 256 against
// 46; 64 with an identity term per class).
TEST(Engine, SmallClassesShareTheirLaunchesWhereTheBackendGroups) {
  auto ops_per_step = [](const char* algo, bool native) {
    test::NullBackend be;
    be.grouped_native = native;
    Engine e(be);
    GroupOptions g;
    g.muon.ortho = parse_algorithm(algo);
    e.add_group(g);
    const Workload w = load_workload("resnet18");
    std::vector<Buffer> keep;
    std::vector<ParamData> data;
    for (const WorkloadEntry& en : w.muon)
      for (int64_t l = 0; l < en.count; ++l) {
        e.add_param({en.name + "." + std::to_string(l), 0, en.shape, DType::kF32});
        keep.push_back(be.alloc(4 * static_cast<size_t>(en.numel())));
        void* wt = keep.back().data();
        keep.push_back(be.alloc(4 * static_cast<size_t>(en.numel())));
        data.push_back({wt, keep.back().data(), DType::kF32, {}});
      }
    e.step(data);
    be.ops = 0;
    e.step(data);
    return be.ops;
  };
  for (const auto& [algo, fraction] : {std::pair{"ns5", 4}, std::pair{"gram-ns", 5}}) {
    const int64_t alone = ops_per_step(algo, false), grouped = ops_per_step(algo, true);
    std::printf("[measure] resnet18, %s: %lld operations per step, %lld with grouped launches\n",
                algo, static_cast<long long>(alone), static_cast<long long>(grouped));
    EXPECT_LT(grouped, alone / fraction) << algo;
  }
}

// `auto` resolves every class that shares its launches to Gram NS untimed (one schedule, so all
// of them share every launch), and the others as before.
TEST(Engine, AutoGivesGroupedClassesOneSchedule) {
  test::NullBackend be;
  be.grouped_native = true;
  Engine e(be);
  e.add_group(GroupOptions{});  // auto
  e.add_param({"small", 0, {64, 576}, DType::kF32});
  e.add_param({"square", 0, {128, 128}, DType::kF32});
  e.add_param({"large", 0, {1024, 4096}, DType::kF32});
  const std::vector<TunedShape> rows = e.tune();
  ASSERT_EQ(rows.size(), 3u);
  for (const TunedShape& r : rows) {
    SCOPED_TRACE(std::to_string(r.rows) + "x" + std::to_string(r.cols));
    const bool small = r.rows <= 128;
    EXPECT_EQ(r.source, small ? "grouped" : "heuristic");
    EXPECT_EQ(r.config.grouped_products, small);
    if (small) {
      EXPECT_EQ(r.config.iteration, Iteration::kGram);
    }
  }
  for (int i : {0, 1}) {
    EXPECT_TRUE(e.resolved_ortho(i).grouped_products) << i;
    EXPECT_EQ(e.resolved_ortho(i).iteration, Iteration::kGram) << i;
  }
  EXPECT_FALSE(e.resolved_ortho(2).grouped_products);
}

TEST(Engine, OperationsPerStepDoNotGrowWithTheMatrices) {
  auto ops_per_step = [](const std::string& workload, int64_t layers, const char* algo) {
    test::NullBackend be;
    Engine e(be);
    GroupOptions g;
    g.muon.ortho = parse_algorithm(algo);
    e.add_group(g);
    GroupOptions a;
    a.kind = ParamKind::kAdamW;
    e.add_group(a);
    const Workload w = load_workload(workload).first_layers(layers);
    // Weights and gradients are never read: untouched calloc'ed pages cost no memory.
    std::vector<Buffer> keep;
    std::vector<ParamData> data;
    auto add = [&](const WorkloadEntry& en, int group) {
      for (int64_t l = 0; l < en.count; ++l) {
        e.add_param({en.name + "." + std::to_string(l), group, en.shape, DType::kF32});
        keep.push_back(be.alloc(4 * static_cast<size_t>(en.numel())));
        void* wt = keep.back().data();
        keep.push_back(be.alloc(4 * static_cast<size_t>(en.numel())));
        data.push_back({wt, keep.back().data(), DType::kF32, {}});
      }
    };
    for (const WorkloadEntry& en : w.muon) add(en, 0);
    for (const WorkloadEntry& en : w.adamw) add(en, 1);
    e.step(data);
    be.ops = 0;
    const auto t0 = std::chrono::steady_clock::now();
    e.step(data);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[measure] %s, %lld layers, %s: the engine's host time %.3f ms\n",
                workload.c_str(), static_cast<long long>(layers), algo, ms);
    return be.ops;
  };
  for (const char* algo : {"ns5", "gram-ns"}) {
    const int64_t one = ops_per_step("gpt2-small", 1, algo);
    const int64_t all = ops_per_step("gpt2-small", 12, algo);
    std::printf("[measure] gpt2-small, %s: %lld operations per step at 1 layer, %lld at 12\n",
                algo, static_cast<long long>(one), static_cast<long long>(all));
    EXPECT_EQ(one, all) << algo;
    EXPECT_GT(one, 0);
  }
  // deepseek-v2-lite, 2 layers: 403 Muon matrices in 12 classes (384 of them MoE experts).
  const int64_t moe = ops_per_step("deepseek-v2-lite", 2, "gram-ns");
  std::printf("[measure] deepseek-v2-lite (2 layers), gram-ns: %lld operations per step\n",
              static_cast<long long>(moe));
  EXPECT_LT(moe, 403);
}

}  // namespace
}  // namespace distmuon
