// Whole-step graphs (EngineOptions::graphs) on a CPU backend that captures by recording
// (recording_backend.h): replays equal eager steps bit for bit while a scheduler changes every
// hyperparameter, CacheMuon steps replay with the same decisions and counters, a new buffer, a
// missing gradient, a new gamma or a new backend capture epoch captures again, failed captures fall back to eager steps, and
// the steps that need the host mid-step never capture.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/engine.h"
#include "recording_backend.h"
#include "test_util.h"

namespace distmuon {
namespace {

// Two Muon matrices of one class (a wide and a tall one), one of another, and two AdamW tensors.
struct Model {
  std::vector<std::vector<int64_t>> shapes = {{16, 48}, {48, 16}, {24, 24}, {48}, {16}};
  std::vector<std::vector<float>> w, g;
  Model() {
    for (size_t i = 0; i < shapes.size(); ++i) {
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      w.emplace_back(test::to_vec(test::random_matrix(1, n, 0.05)));
      g.emplace_back(n);
    }
  }
  void add_to(Engine& e) {
    GroupOptions m;
    m.kind = ParamKind::kMuon;
    m.muon.ortho.iteration = Iteration::kGram;
    GroupOptions a;
    a.kind = ParamKind::kAdamW;
    e.add_group(m);
    e.add_group(a);
    for (size_t i = 0; i < shapes.size(); ++i)
      e.add_param({"p" + std::to_string(i), i < 3 ? 0 : 1, shapes[i], DType::kF32});
  }
  // A new gradient for every parameter in the same buffers, the same for equal seeds.
  void new_grads(uint64_t seed) {
    for (size_t i = 0; i < g.size(); ++i) {
      test::rng().seed(seed * 31 + i);
      const std::vector<float> v =
          test::to_vec(test::random_matrix(1, static_cast<int64_t>(g[i].size()), 1.0));
      std::copy(v.begin(), v.end(), g[i].begin());
    }
  }
  std::vector<ParamData> data() {
    std::vector<ParamData> d;
    for (size_t i = 0; i < w.size(); ++i) d.push_back({w[i].data(), g[i].data(), DType::kF32, {}});
    return d;
  }
};

// A schedule that changes every hyperparameter a replay must pick up, every step.
void schedule(Engine& e, int step) {
  GroupOptions& m = e.group(0);
  m.muon.lr = 0.02f / (1 + step);
  m.muon.weight_decay = 0.1f * step;
  m.muon.momentum = 0.85f + 0.01f * step;
  GroupOptions& a = e.group(1);
  a.adamw.lr = 1e-3f * (1 + step);
  a.adamw.weight_decay = 0.01f * step;
  a.adamw.beta1 = 0.9f - 0.01f * step;
}

EngineOptions graphs(bool on, NonFinitePolicy p = NonFinitePolicy::kSkip) {
  EngineOptions o;
  o.graphs = on;
  o.nonfinite = p;
  return o;
}

// The same model stepped from the same weights by two engines: one that captures (on the
// recording backend) and one that issues every step (on the CPU backend).
struct GraphedAndEager {
  test::RecordingBackend rb;
  CpuBackend cb;
  Model a, b;
  Engine ea{rb, graphs(true)}, eb{cb, graphs(false)};
  GraphedAndEager() {
    b.w = a.w;
    a.add_to(ea);
    b.add_to(eb);
  }
  // The same change of options on both engines.
  template <typename F>
  void both(F&& change) {
    change(ea);
    change(eb);
  }
  // One step of both on the gradients of `seed`; `edit` may change their data first.
  void step(uint64_t seed,
            const std::function<void(std::vector<ParamData>&, std::vector<ParamData>&)>& edit = {}) {
    a.new_grads(seed);
    b.new_grads(seed);
    auto da = a.data(), db = b.data();
    if (edit) edit(da, db);
    ea.step(da);
    eb.step(db);
  }
  void expect_equal_weights() const {
    for (size_t i = 0; i < a.w.size(); ++i) ASSERT_EQ(a.w[i], b.w[i]) << "parameter " << i;
  }
};

void enable_cache(Engine& e, double gamma) {
  e.group(0).muon.cache.enabled = true;
  e.group(0).muon.cache.gamma = gamma;
}

TEST(StepGraph, ReplaysEqualEagerStepsUnderASchedule) {
  GraphedAndEager r;
  const int steps = 6;
  for (int s = 0; s < steps; ++s) {
    r.both([&](Engine& e) { schedule(e, s); });
    r.step(s);
  }
  r.expect_equal_weights();
  // Step 1 eager, step 2 captured (and run by one replay), steps 3.. replayed.
  EXPECT_EQ(r.rb.captures, 1);
  EXPECT_EQ(r.rb.replays, steps - 1);
  const EngineStats sa = r.ea.stats(), sb = r.eb.stats();
  EXPECT_EQ(sa.graph_captures, 1);
  EXPECT_EQ(sa.graph_replays, steps - 2);
  EXPECT_EQ(sb.graph_captures + sb.graph_replays, 0);
  EXPECT_EQ(sa.steps, steps);
  EXPECT_EQ(sa.ortho.flops, sb.ortho.flops);
  EXPECT_EQ(sa.ortho.calls, sb.ortho.calls);
  for (int i = 0; i < r.ea.num_params(); ++i) EXPECT_EQ(r.ea.param_step(i), steps);
}

TEST(StepGraph, NewBuffersOrAMissingGradientCaptureAgain) {
  GraphedAndEager r;
  std::vector<float> other(r.a.g[0].size());
  // Steps: same, same (capture), other buffer for p0 (eager), again (capture), p2 without a
  // gradient (eager), again (capture), again (replay).
  for (int s = 0; s < 7; ++s)
    r.step(s, [&](std::vector<ParamData>& da, std::vector<ParamData>& db) {
      if (s == 2 || s == 3) {
        other = r.a.g[0];
        da[0].grad = other.data();
      }
      if (s >= 4) da[2].grad = db[2].grad = nullptr;
    });
  r.expect_equal_weights();
  EXPECT_EQ(r.ea.stats().graph_captures, 3);
  EXPECT_EQ(r.ea.stats().graph_replays, 1);
  EXPECT_EQ(r.ea.param_step(2), 4);
  EXPECT_EQ(r.ea.param_step(0), 7);
}

// A graph holds the backend's workspace and kernel choices of its capture: when the backend's
// capture epoch moves (CUDA: set_workspace, a new kernel choice), the engine captures again.
TEST(StepGraph, ANewCaptureEpochCapturesAgain) {
  GraphedAndEager r;
  // Steps: eager, capture, replay, [epoch moves] eager, capture, replay.
  for (int s = 0; s < 6; ++s) {
    if (s == 3) r.rb.epoch += 1;
    r.step(s);
  }
  r.expect_equal_weights();
  EXPECT_EQ(r.ea.stats().graph_captures, 2);
  EXPECT_EQ(r.ea.stats().graph_replays, 2);
}

TEST(StepGraph, FailedCapturesFallBackToEagerStepsAndStop) {
  GraphedAndEager r;
  r.rb.fail_captures = true;
  for (int s = 0; s < 8; ++s) {
    r.both([&](Engine& e) { schedule(e, s); });
    r.step(s);
  }
  r.expect_equal_weights();
  EXPECT_EQ(r.rb.captures, 3);  // then no more attempts
  EXPECT_EQ(r.ea.stats().graph_captures, 0);
  EXPECT_EQ(r.ea.stats().ortho.flops, r.eb.stats().ortho.flops);  // a failed capture counts nothing
}

TEST(StepGraph, CacheMuonStepsReplayWithTheSameDecisionsAndCounters) {
  GraphedAndEager r;
  r.both([](Engine& e) { enable_cache(e, 5.0); });
  for (int s = 0; s < 8; ++s) {
    if (s == 6)  // a new gamma is a new graph: the gate takes it by value
      r.both([](Engine& e) { e.group(0).muon.cache.gamma = 0.5; });
    // Small changes between steps, so that entries are reused (hits) as well as refreshed.
    r.step(s < 4 ? 0 : s);
  }
  r.expect_equal_weights();
  const EngineStats sa = r.ea.stats(), sb = r.eb.stats();
  // Step 2 captured, 3-6 replayed, 7 (new gamma) eager, 8 captured again.
  EXPECT_EQ(sa.graph_captures, 2);
  EXPECT_EQ(sa.graph_replays, 4);
  EXPECT_GT(sb.cache.hits, 0);
  EXPECT_GT(sb.cache.refreshes, 0);
  EXPECT_EQ(sa.cache.hits, sb.cache.hits);
  EXPECT_EQ(sa.cache.refreshes, sb.cache.refreshes);
  EXPECT_EQ(sa.cache.calls, sb.cache.calls);
  EXPECT_EQ(sa.cache.matrices, sb.cache.matrices);
  EXPECT_EQ(sa.cache.flops, sb.cache.flops);
  EXPECT_EQ(sa.cache.fresh_flops, sb.cache.fresh_flops);
  EXPECT_EQ(sa.ortho.flops, sb.ortho.flops);
}

// Every option a captured step takes by value is in the key: changing one issues the next step
// eagerly and captures again, and the results stay those of eager steps.
TEST(StepGraph, OptionsTakenByValueCaptureAgain) {
  GraphedAndEager r;
  r.both([](Engine& e) { enable_cache(e, 5.0); });
  // Three steps per setting: eager (new key), captured, replayed.
  const std::vector<std::function<void(GroupOptions&)>> changes = {
      [](GroupOptions&) {},
      [](GroupOptions& g) { g.muon.nesterov = !g.muon.nesterov; },
      [](GroupOptions& g) { g.muon.ortho.steps = 6; },
      [](GroupOptions& g) { g.muon.ortho.coefficients = Coefficients::kPolarExpress; },
      [](GroupOptions& g) { g.muon.cache.probes = 4; },
      [](GroupOptions& g) { g.muon.cache.residual = CacheResidual::kExact; },
      [](GroupOptions& g) { g.muon.cache.max_staleness = 2; },
      [](GroupOptions& g) { g.muon.cache.seed = 7; },
      [](GroupOptions& g) { g.muon.cache.gate = CacheGate::kBatch; },
  };
  int step = 0;
  for (const auto& change : changes) {
    r.both([&](Engine& e) { change(e.group(0)); });
    for (int k = 0; k < 3; ++k) r.step(step++);
  }
  r.expect_equal_weights();
  const EngineStats sa = r.ea.stats(), sb = r.eb.stats();
  EXPECT_EQ(sa.graph_captures, static_cast<int64_t>(changes.size()));
  EXPECT_EQ(sa.graph_replays, static_cast<int64_t>(changes.size()));
  EXPECT_EQ(sa.cache.hits, sb.cache.hits);
  EXPECT_EQ(sa.cache.refreshes, sb.cache.refreshes);
}

// A backend that cannot capture (Backend::capture's default) is asked once; the engine then
// issues eagerly without counting failures (nor warning about them).
TEST(StepGraph, ABackendThatCannotCaptureIsAskedOnce) {
  struct Counting : test::ForwardingBackend {
    int asked = 0;
    std::unique_ptr<BackendGraph> capture(const std::function<void()>& issue) override {
      ++asked;
      return Backend::capture(issue);
    }
  } be;
  Model a;
  Engine e(be);  // default options: graphs on
  a.add_to(e);
  for (int s = 0; s < 6; ++s) {
    a.new_grads(s);
    auto d = a.data();
    e.step(d);
  }
  EXPECT_EQ(be.asked, 1);
  EXPECT_EQ(e.stats().graph_captures + e.stats().graph_replays, 0);
  EXPECT_EQ(e.stats().steps, 6);
}

TEST(StepGraph, StepsThatNeedTheHostNeverCapture) {
  for (int variant = 0; variant < 3; ++variant) {
    test::RecordingBackend rb;
    Model a;
    Engine e(rb, variant == 0 ? graphs(false)
                 : variant == 1 ? graphs(true, NonFinitePolicy::kRaise)
                                : graphs(true));
    a.add_to(e);
    if (variant == 2) {  // CacheMuon's shadow mode compares on the host
      enable_cache(e, 2.0);
      e.group(0).muon.cache.shadow = true;
    }
    for (int s = 0; s < 4; ++s) {
      a.new_grads(s);
      auto d = a.data();
      e.step(d);
    }
    EXPECT_EQ(rb.captures, 0) << "variant " << variant;
    EXPECT_EQ(e.stats().graph_captures + e.stats().graph_replays, 0) << "variant " << variant;
    EXPECT_EQ(e.stats().steps, 4);
  }
}

}  // namespace
}  // namespace distmuon
