// CacheMuon through the Engine: gamma = 0 against the plain engine bit for bit, hits apply
// O = U Q^T to tall weights, the staleness limit, invalidation by configuration changes,
// non-finite gradients and transforms, and checkpoint export/import of the cache state.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::Mat;
using test::random_matrix;
using test::to_vec;

GroupOptions cached_group(double gamma, int staleness = 0) {
  GroupOptions g;
  g.muon.lr = 0.02f;
  g.muon.ortho.iteration = Iteration::kGram;
  g.muon.cache.enabled = true;
  g.muon.cache.gamma = gamma;
  g.muon.cache.max_staleness = staleness;
  g.muon.cache.per_matrix_stats = true;
  return g;
}

// Two parameters: a wide 2D matrix and a 3D stack of two tall ones, with drifting gradients.
struct Model {
  std::vector<float> w1, w2, g1, g2;
  Model() : w1(12 * 40, 0.1f), w2(2 * 36 * 10, -0.1f) {
    g1 = to_vec(random_matrix(12, 40));
    g2 = to_vec(random_matrix(1, 2 * 36 * 10));
  }
  void add_to(Engine& e, int group) {
    e.add_param({"wide", group, {12, 40}, DType::kF32});
    e.add_param({"experts", group, {2, 36, 10}, DType::kF32});
  }
  std::vector<ParamData> data() {
    return {{w1.data(), g1.data(), DType::kF32, {}}, {w2.data(), g2.data(), DType::kF32, {}}};
  }
  // In place: ParamData pointers taken before stay valid.
  void copy_gradients_from(const Model& o) {
    std::copy(o.g1.begin(), o.g1.end(), g1.begin());
    std::copy(o.g2.begin(), o.g2.end(), g2.begin());
  }
  void copy_weights_from(const Model& o) {
    std::copy(o.w1.begin(), o.w1.end(), w1.begin());
    std::copy(o.w2.begin(), o.w2.end(), w2.begin());
  }
  void drift(double eps) {
    for (auto* g : {&g1, &g2}) {
      Mat noise = random_matrix(1, static_cast<int64_t>(g->size()), eps);
      for (size_t i = 0; i < g->size(); ++i) (*g)[i] += static_cast<float>(noise(0, i));
    }
  }
};

TEST(CacheEngine, GammaZeroEqualsPlainEngineBitForBit) {
  CpuBackend be;
  Engine plain(be), cached(be);
  GroupOptions p = cached_group(0.0);
  p.muon.cache.enabled = false;
  plain.add_group(p);
  cached.add_group(cached_group(0.0));
  Model a, b;
  b = a;
  a.add_to(plain, 0);
  b.add_to(cached, 0);
  for (int s = 0; s < 4; ++s) {
    plain.step(a.data());
    cached.step(b.data());
    a.drift(0.02);
    b.copy_gradients_from(a);
  }
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.w2, b.w2);
  EngineStats st = cached.stats();
  EXPECT_EQ(st.cache.hits, 0);
  EXPECT_EQ(st.cache.refreshes, 12);  // 3 matrices x 4 steps
}

TEST(CacheEngine, HitAppliesCachedTransformFromTheRightToTallWeights) {
  CpuBackend be;
  Engine eng(be);
  GroupOptions g = cached_group(1e9);
  g.muon.nesterov = false;  // U is the momentum buffer itself
  g.muon.cache.dtype = DType::kF64;
  eng.add_group(g);
  eng.add_param({"tall", 0, {36, 10}, DType::kF32});
  std::vector<float> w(360, 0.0f), grad = to_vec(random_matrix(36, 10));
  ParamData d{w.data(), grad.data(), DType::kF32, {}};
  eng.step({&d, 1});
  TensorView q = eng.state(0, "cache_q");
  ASSERT_EQ(q.shape, (std::vector<int64_t>{10, 10}));
  Mat qm = Eigen::Map<const Mat>(static_cast<const double*>(q.data), 10, 10);
  const std::vector<float> g2 = to_vec(random_matrix(36, 10));
  std::copy(g2.begin(), g2.end(), grad.begin());  // d.grad keeps pointing at `grad`
  std::vector<float> w_before = w;
  eng.step({&d, 1});
  ASSERT_EQ(eng.stats().cache.hits, 1);
  const float* mom = static_cast<const float*>(eng.state(0, "momentum_buffer").data);
  Mat u(36, 10), dw(36, 10);
  for (int i = 0; i < 360; ++i) {
    u(i / 10, i % 10) = mom[i];
    dw(i / 10, i % 10) = w[i] - w_before[i];
  }
  u /= u.norm() + 1e-7;
  const double step = 0.02 * std::sqrt(36.0 / 10.0);  // lr * original scale
  EXPECT_LT(test::rel_err(dw, -step * u * qm.transpose()), 1e-5);
}

TEST(CacheEngine, StalenessLimitForcesRefreshes) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(cached_group(1e9, 3));
  Model m;
  m.add_to(eng, 0);
  for (int s = 0; s < 9; ++s) eng.step(m.data());
  // Refresh at steps 1, 5, 9: each entry serves 3 steps after its refresh, then must refresh.
  for (const CacheMatrixStats& pm : eng.stats().cache.per_matrix) {
    EXPECT_EQ(pm.refreshes, 3) << pm.name;
    EXPECT_EQ(pm.hits, 6) << pm.name;
    EXPECT_EQ(pm.forced, 3) << pm.name;  // one empty, two stale
    EXPECT_EQ(pm.age, 0) << pm.name;
  }
  EXPECT_EQ(eng.stats().cache.per_matrix.size(), 3u);
  EXPECT_EQ(eng.stats().cache.per_matrix[1].name, "experts[0]");
}

// Turning the cache off keeps its history in the statistics but no latest call (the latest
// hit rate used to keep its last value).
TEST(CacheEngine, TurnedOffTheCacheReportsNoLatestCall) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(cached_group(1e9));
  Model m;
  m.add_to(eng, 0);
  for (int s = 0; s < 3; ++s) eng.step(m.data());
  CacheStats on = eng.stats().cache;
  EXPECT_EQ(on.latest_entries, 3);
  EXPECT_EQ(on.latest_hit_rate, 1.0);
  eng.group(0).muon.cache.enabled = false;
  eng.step(m.data());
  CacheStats off = eng.stats().cache;
  EXPECT_EQ(off.latest_entries, 0);
  EXPECT_EQ(off.latest_hit_rate, 0.0);
  EXPECT_EQ(off.hits, on.hits);
  EXPECT_EQ(off.refreshes, on.refreshes);
}

TEST(CacheEngine, AlgorithmAndDtypeChangesInvalidateEntries) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(cached_group(1e9));
  Model m;
  m.add_to(eng, 0);
  auto counts = [&] {
    CacheStats st = eng.stats().cache;
    return std::pair{st.hits, st.forced_refreshes};
  };
  eng.step(m.data());
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{3, 3}));
  eng.group(0).muon.ortho.coefficients = Coefficients::kPolarExpress105;
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{3, 6}));
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{6, 6}));
  eng.group(0).muon.cache.dtype = DType::kBF16;  // cache precision
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{6, 9}));
  EXPECT_EQ(eng.state(0, "cache_q").dtype, DType::kBF16);
  eng.group(0).muon.ortho.work_dtype = DType::kF64;  // work dtype
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{6, 12}));
  eng.step(m.data());
  EXPECT_EQ(counts(), (std::pair<int64_t, int64_t>{9, 12}));
}

TEST(CacheEngine, NonFiniteGradientLeavesCacheStateUntouched) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(cached_group(1e9));
  Model m;
  m.add_to(eng, 0);
  eng.step(m.data());
  eng.step(m.data());
  // Entry of slice 0 of "experts" (each slice of a 3D parameter is a matrix of its own).
  auto snapshot = [&] {
    std::vector<uint8_t> bytes;
    for (const char* n : {"cache_q", "cache_age", "cache_key", "cache_misses"}) {
      TensorView v = eng.state(1, n);
      const auto* p = static_cast<const uint8_t*>(v.data);
      bytes.insert(bytes.end(), p, p + v.numel() / 2 * dtype_size(v.dtype));
    }
    return bytes;
  };
  std::vector<uint8_t> before = snapshot();
  std::vector<float> w2 = m.w2;
  m.g2[7] = std::numeric_limits<float>::infinity();  // slice 0
  eng.step(m.data());
  EXPECT_EQ(snapshot(), before);
  EXPECT_TRUE(std::equal(w2.begin(), w2.begin() + 360, m.w2.begin()));
  EXPECT_FALSE(std::equal(w2.begin() + 360, w2.end(), m.w2.begin() + 360));
  CacheStats st = eng.stats().cache;
  EXPECT_EQ(st.skips, 1);
  EXPECT_EQ(st.hits, 5);               // the wide matrix and slice 1 still hit
  EXPECT_EQ(st.per_matrix[1].age, 1);  // unchanged by the skipped step
  m.g2[7] = 0.5f;
  eng.step(m.data());
  st = eng.stats().cache;
  EXPECT_EQ(st.hits, 8);  // the untouched entry serves again
  EXPECT_EQ(st.per_matrix[1].age, 2);
}

TEST(CacheEngine, NonFiniteCachedTransformIsNeverReused) {
  CpuBackend be;
  Engine eng(be);
  eng.add_group(cached_group(1e9));
  Model m;
  m.add_to(eng, 0);
  eng.step(m.data());
  TensorView q = eng.state(0, "cache_q");
  static_cast<float*>(q.data)[5] = std::nanf("");  // e.g. a corrupted checkpoint
  eng.step(m.data());
  CacheStats st = eng.stats().cache;
  EXPECT_EQ(st.hits, 2);  // the two slices of "experts" only
  for (float v : m.w1) ASSERT_TRUE(std::isfinite(v));
  const float* qa = static_cast<const float*>(q.data);
  for (int64_t i = 0; i < q.numel(); ++i) ASSERT_TRUE(std::isfinite(qa[i]));  // refilled
}

TEST(CacheEngine, CacheStateRoundTripsThroughCheckpoints) {
  CpuBackend be;
  Engine a(be), b(be);
  a.add_group(cached_group(1e9));
  b.add_group(cached_group(1e9));
  Model ma;
  ma.add_to(a, 0);
  Model mb = ma;
  mb.add_to(b, 0);
  for (int s = 0; s < 3; ++s) {
    a.step(ma.data());
    ma.drift(0.05);
  }
  // Restore into b before its first step, as a PyTorch load_state_dict would.
  EXPECT_EQ(b.state_names(1),
            (std::vector<std::string>{"momentum_buffer", "cache_q", "cache_age", "cache_key",
                                      "cache_misses"}));
  for (int p = 0; p < 2; ++p)
    for (const std::string& n : a.state_names(p)) {
      TensorView src = a.state(p, n), dst = b.state(p, n);
      ASSERT_EQ(src.shape, dst.shape) << n;
      std::memcpy(dst.data, src.data, src.numel() * dtype_size(src.dtype));
    }
  EXPECT_EQ(b.state(1, "cache_q").shape, (std::vector<int64_t>{2, 10, 10}));
  EXPECT_EQ(b.state(1, "cache_age").shape, (std::vector<int64_t>{2}));
  mb.copy_weights_from(ma);
  mb.copy_gradients_from(ma);
  a.step(ma.data());
  b.step(mb.data());
  EXPECT_EQ(ma.w1, mb.w1);
  EXPECT_EQ(ma.w2, mb.w2);
  EXPECT_EQ(b.stats().cache.hits, 3);  // restored entries were reused, not refreshed
  // Without the cache (or on a non-Gram shape) there is no cache state, and asking names it.
  Engine c(be);
  GroupOptions off = cached_group(1e9);
  off.muon.cache.enabled = false;
  c.add_group(off);
  c.add_param({"plain", 0, {12, 40}, DType::kF32});
  EXPECT_EQ(c.state_names(0), std::vector<std::string>{"momentum_buffer"});
  try {
    c.state(0, "cache_q");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'plain'"), std::string::npos) << e.what();
  }
  // With the cache, a name it does not have is refused with the ones it has.
  try {
    b.state(0, "cache_bogus");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache_q, cache_age, cache_key, cache_misses"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace distmuon
