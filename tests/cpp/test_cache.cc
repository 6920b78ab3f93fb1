// CacheMuon in the orthogonalizer: the cached transform and the candidate/residual math against
// an independent float64 reference, the probe estimate against the exact residual, gamma = 0
// against fresh Gram NS bit for bit, the FLOP accounting, and invalidation on re-preparation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/cache.h"
#include "distmuon/error.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::drifted;
using test::random_matrix;
using test::rel_err;

Mat normalised(const Mat& m) { return m / m.norm(); }

// The total left transform of the quintic iteration, tracked in float64 through the standard
// formulation X <- (aI + bA + cA^2) X (mathematically the Gram-NS Q, restarts or not).
Mat reference_transform(const Mat& x0, Coefficients co, int steps) {
  Mat x = x0, q = Mat::Identity(x0.rows(), x0.rows());
  for (const QuinticCoef& k : coefficient_schedule(co, steps)) {
    Mat a = x * x.transpose();
    Mat p = k.a * Mat::Identity(a.rows(), a.rows()) + k.b * a + k.c * a * a;
    x = p * x;
    q = p * q;
  }
  return q;
}

// One shape class of wide m x n matrices driven through run_cached on the CPU backend.
struct Rig {
  CpuBackend be;
  Orthogonalizer ortho{be};
  OrthoConfig cfg;
  TransformCache cache;
  int64_t count, m, n;
  HostBatch x, out;
  Buffer ws;

  Rig(const CacheOptions& opt, int64_t c, int64_t rows, int64_t cols, DType work = DType::kF64)
      : cache(be, opt),
        count(c),
        m(rows),
        n(cols),
        x(work, c, rows, cols),
        out(work, c, rows, cols) {
    cfg.iteration = Iteration::kGram;
    cfg.work_dtype = work;
    cfg.gram_work_dtype = work;
    prepare();
  }
  void prepare() {
    cache.prepare(resolve(cfg, m, n), count, m, n);
    ws = be.alloc(Orthogonalizer::cached_workspace_bytes(cfg, cache.options(), count, m, n));
  }
  // Orthogonalizes `in` (normalised here) through the cache; returns the outputs.
  std::vector<Mat> step(const std::vector<Mat>& in, const int32_t* status = nullptr) {
    for (int64_t i = 0; i < count; ++i) x.set(i, normalised(in[i]));
    out.poison();
    ortho.run_cached(cfg, cache, 0, x.ref, out.ref, status, ws.data(), ws.bytes());
    std::vector<Mat> r;
    for (int64_t i = 0; i < count; ++i) r.push_back(out.get(i));
    return r;
  }
  Mat q(int64_t i) {  // the cached product transform of entry i (f64 or f32 storage)
    TensorView v = cache.state("cache_q", i, 1, {});
    HostBatch h(v.dtype, 1, m, m);
    std::memcpy(h.ref.data, v.data, static_cast<size_t>(m * m) * dtype_size(v.dtype));
    return h.get(0);
  }
};

double exact_residual(const Mat& q, const Mat& x) {
  Mat d = q * x;
  const int64_t m = x.rows();
  return (d * d.transpose() - Mat::Identity(m, m)).norm() / std::sqrt(double(m));
}

TEST(CacheMuon, TransformCandidateAndResidualMatchFloat64Reference) {
  for (CacheLayout layout : {CacheLayout::kProduct, CacheLayout::kFactors}) {
    CacheOptions opt;
    opt.enabled = true;
    opt.gamma = 1e9;  // accept every usable entry: this test checks the math, not the gate
    opt.residual = CacheResidual::kExact;  // against the float64 formula
    opt.dtype = DType::kF64;
    opt.layout = layout;
    opt.per_matrix_stats = true;
    Rig rig(opt, 3, 24, 80);
    std::vector<Mat> u0 = {random_matrix(24, 80), random_matrix(24, 80, 3.0),
                           random_matrix(24, 80)};
    std::vector<Mat> o0 = rig.step(u0);  // every entry empty: fresh solves fill the cache
    for (int64_t i = 0; i < 3; ++i) {
      Mat x0 = normalised(u0[i]);
      Mat want_q = reference_transform(x0, rig.cfg.coefficients, rig.cfg.steps);
      TensorView v = rig.cache.state("cache_q", i, 1, {});
      Mat q;
      if (layout == CacheLayout::kProduct) {
        q = rig.q(i);
      } else {  // two factors (restart before step 2): Q = Q1 Q0
        ASSERT_EQ(v.shape, (std::vector<int64_t>{2, 24, 24}));
        const double* p = static_cast<const double*>(v.data);
        Eigen::Map<const Mat> q0(p, 24, 24), q1(p + 24 * 24, 24, 24);
        q = q1 * q0;
      }
      EXPECT_LT(rel_err(q, want_q), 1e-9) << cache_layout_name(layout);
      EXPECT_LT(rel_err(q * x0, o0[i]), 1e-12);  // Q reproduces the fresh output it came from
    }
    std::vector<Mat> u1 = drifted(u0, 0.05);
    std::vector<Mat> o1 = rig.step(u1);
    CacheStats st = rig.cache.stats();
    EXPECT_EQ(st.hits, 3);
    for (int64_t i = 0; i < 3; ++i) {
      Mat x1 = normalised(u1[i]);
      Mat q = reference_transform(normalised(u0[i]), rig.cfg.coefficients, rig.cfg.steps);
      EXPECT_LT(rel_err(o1[i], q * x1), 1e-9);  // the candidate is D = Q X_t
      const double want = exact_residual(q, x1);
      EXPECT_NEAR(st.per_matrix[i].last_residual, want, 1e-6 * want) << cache_layout_name(layout);
    }
  }
}

TEST(CacheMuon, ProbeEstimateStaysWithinFactorOfExactResidual) {
  // k = 8 probes on 32 x 96 random inputs, from fresh-solve level (drift 0.02) to far-stale
  // (drift 1). The estimate of ||E||_F^2 has about k * (sum l^2)^2 / sum l^4 degrees of freedom
  // over E's eigenvalues l. Near the fresh level E's spectrum is flat (hundreds of degrees of
  // freedom): within a factor 1.5 (observed [0.81, 1.22] over 960 cases). A far-stale Q blows up
  // a few directions, fewer degrees of freedom: within a factor 2 (observed [0.63, 1.40]).
  for (double eps : {0.02, 0.2, 1.0}) {
    const double factor = eps < 0.5 ? 1.5 : 2.0;
    double lo = 1e9, hi = 0;
    CacheOptions opt;
    opt.enabled = true;
    opt.gamma = 1e9;
    opt.dtype = DType::kF64;
    opt.residual = CacheResidual::kProbe;
    opt.probes = 8;
    opt.per_matrix_stats = true;
    Rig rig(opt, 4, 32, 96);
    for (int trial = 0; trial < 6; ++trial) {
      rig.cache.invalidate();
      std::vector<Mat> u0 = {random_matrix(32, 96), random_matrix(32, 96), random_matrix(32, 96),
                             random_matrix(32, 96)};
      rig.step(u0);
      rig.cache.reset_stats();
      std::vector<Mat> u1 = drifted(u0, eps);
      rig.step(u1);
      CacheStats st = rig.cache.stats();
      for (int64_t i = 0; i < 4; ++i) {
        const double exact = exact_residual(rig.q(i), normalised(u1[i]));
        const double ratio = st.per_matrix[i].last_residual / exact;
        lo = std::min(lo, ratio);
        hi = std::max(hi, ratio);
        EXPECT_GT(ratio, 1 / factor) << "drift " << eps;
        EXPECT_LT(ratio, factor) << "drift " << eps;
      }
    }
    std::printf("drift %.2f: probe / exact residual over 24 cases in [%.3f, %.3f]\n", eps, lo, hi);
  }
}

// A matrix's probes depend on it alone: the same inputs called in other batches (as an owner
// mode splits them) and in another order give every matrix the same probe residual, bit for bit,
// so every distributed mode decides as one process.
TEST(CacheMuon, ProbeResidualsDoNotDependOnBatchesOrCallOrder) {
  CacheOptions opt;
  opt.enabled = true;
  opt.gamma = 1e9;
  opt.residual = CacheResidual::kProbe;
  opt.per_matrix_stats = true;
  const int64_t m = 12, n = 40;
  std::vector<Mat> u;
  for (int i = 0; i < 3; ++i) u.push_back(random_matrix(m, n));
  const std::vector<Mat> v = drifted(u, 0.05), w = drifted(u, 0.2);
  Rig whole(opt, 3, m, n), split(opt, 3, m, n);
  // split: matrix 2 alone first, then matrices 0 and 1, on every step.
  auto split_step = [&](const std::vector<Mat>& in) {
    for (int64_t i = 0; i < 3; ++i) split.x.set(i, normalised(in[i]));
    for (auto [first, count] : {std::pair<int64_t, int64_t>{2, 1}, {0, 2}})
      split.ortho.run_cached(split.cfg, split.cache, first, split.x.ref.slice(first, count),
                             split.out.ref.slice(first, count), nullptr, split.ws.data(),
                             split.ws.bytes());
  };
  for (const std::vector<Mat>& in : {u, v, w}) {
    whole.step(in);
    split_step(in);
  }
  const CacheStats a = whole.cache.stats(), b = split.cache.stats();
  ASSERT_EQ(a.per_matrix.size(), 3u);
  ASSERT_EQ(b.per_matrix.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_GT(a.per_matrix[i].last_residual, 0.0) << "matrix " << i;
    EXPECT_EQ(a.per_matrix[i].last_residual, b.per_matrix[i].last_residual) << "matrix " << i;
    EXPECT_EQ(a.per_matrix[i].mean_residual, b.per_matrix[i].mean_residual) << "matrix " << i;
  }
}

TEST(CacheMuon, GammaZeroReproducesFreshGramNsBitForBit) {
  for (DType work : {DType::kF32, DType::kF16}) {
    for (CacheResidual mode : {CacheResidual::kExact, CacheResidual::kProbe}) {
      CacheOptions opt;
      opt.enabled = true;
      opt.gamma = 0;
      opt.residual = mode;
      Rig rig(opt, 3, 20, 64, work);
      HostBatch plain(work, 3, 20, 64);
      Buffer ws = rig.be.alloc(Orthogonalizer::workspace_bytes(rig.cfg, 3, 20, 64));
      std::vector<Mat> u = {random_matrix(20, 64), random_matrix(20, 64), random_matrix(20, 64)};
      for (int s = 0; s < 4; ++s, u = drifted(u, 0.01)) {
        rig.step(u);
        for (int64_t i = 0; i < 3; ++i) plain.set(i, normalised(u[i]));
        rig.ortho.run(rig.cfg, plain.ref, plain.ref, ws.data(), ws.bytes());
        EXPECT_EQ(std::memcmp(plain.ref.data, rig.out.ref.data, plain.ref.bytes()), 0)
            << dtype_name(work) << " " << cache_residual_name(mode) << " step " << s;
      }
      EXPECT_EQ(rig.cache.stats().hits, 0);
    }
  }
}

// The check back-off: an entry whose test keeps failing is tested after 0, 1, 2, 4, 8, 12, ...
// misses in a row (interval doubling up to the back-off, here 4) and refreshes untested in
// between, with the fresh solve's output bit for bit; once its transform fits again, it is
// found at the next due test and the count starts over. Decisions per call, both residuals.
TEST(CacheMuon, CheckBackoffTestsAFailingEntryLessOften) {
  for (CacheResidual mode : {CacheResidual::kExact, CacheResidual::kProbe}) {
    SCOPED_TRACE(cache_residual_name(mode));
    CacheOptions opt;
    opt.enabled = true;
    opt.gamma = 0.0;  // every test fails
    opt.residual = mode;
    opt.check_backoff = 4;
    opt.dtype = DType::kF64;
    const int64_t m = 12, n = 40;
    Rig rig(opt, 1, m, n);
    HostBatch plain(DType::kF64, 1, m, n);
    Buffer ws = rig.be.alloc(Orthogonalizer::workspace_bytes(rig.cfg, 1, m, n));
    std::vector<Mat> u = {random_matrix(m, n)};
    // Call k (from 1) tested or not; the first finds the entry empty (a forced refresh).
    const std::vector<bool> tested = {0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1};
    double flops_of[2] = {-1, -1};  // FLOPs of an untested and of a tested call
    for (size_t k = 0; k < tested.size(); ++k) {
      SCOPED_TRACE("call " + std::to_string(k + 1));
      const CacheStats before = rig.cache.stats();
      std::vector<Mat> got = rig.step(u);
      const CacheStats after = rig.cache.stats();
      // The test is charged to the calls that ran it, and only to them.
      double& f = flops_of[tested[k] ? 1 : 0];
      if (f < 0) f = after.flops - before.flops;
      EXPECT_DOUBLE_EQ(after.flops - before.flops, f);
      EXPECT_EQ(after.residual.count - before.residual.count, tested[k] ? 1 : 0);
      EXPECT_EQ(after.refreshes - before.refreshes, 1);
      EXPECT_EQ(after.unchecked_refreshes - before.unchecked_refreshes, k > 0 && !tested[k]);
      plain.set(0, normalised(u[0]));
      rig.ortho.run(rig.cfg, plain.ref, plain.ref, ws.data(), ws.bytes());
      EXPECT_EQ(std::memcmp(plain.ref.data, rig.out.ref.data, plain.ref.bytes()), 0);
      u = drifted(u, 0.01);
    }
    EXPECT_GT(flops_of[1], flops_of[0]);
    // 13 misses in a row now: the next test is due at 16 (call 18). The transform fits again
    // (gamma large): calls 15 to 17 refresh untested, 18 hits, and so does every call after it.
    opt.gamma = 1e9;
    rig.cache.set_options(opt);
    for (int k = 15; k <= 19; ++k) {
      const CacheStats before = rig.cache.stats();
      rig.step(u);
      const CacheStats after = rig.cache.stats();
      EXPECT_EQ(after.hits - before.hits, k >= 18 ? 1 : 0) << "call " << k;
      u = drifted(u, 0.01);
    }
    TensorView misses = rig.cache.state("cache_misses", 0, 1, {});
    EXPECT_EQ(*static_cast<const float*>(misses.data), 0.0f);
  }
}

TEST(CacheMuon, FlopAccountingMatchesClosedForms) {
  const int64_t m = 16, n = 64;
  const double m3 = double(m) * m * m, syrk = double(m) * (m + 1) * n, mm = double(m) * (m + 1) * m;
  CacheOptions opt;
  opt.enabled = true;
  opt.gamma = 1e9;
  opt.residual = CacheResidual::kExact;  // first the exact residual's closed forms
  opt.dtype = DType::kF64;
  Rig rig(opt, 2, m, n);
  const double fresh = ortho_flops(rig.cfg, m, n);
  std::vector<Mat> u = {random_matrix(m, n), random_matrix(m, n)};
  rig.step(u);                 // 2 refreshes
  rig.step(drifted(u, 0.01));  // 2 hits
  CacheStats st = rig.cache.stats();
  ASSERT_EQ(st.hits, 2);
  ASSERT_EQ(st.refreshes, 2);
  // Every matrix: R (SYRK). Exact test, charged to the tested matrices only (the empty entries
  // of the first call are not): Q R (2m^3) + (QR) Q^T (one triangle). Hit: D = Q X. Refresh:
  // the fresh solve without its first SYRK plus one symmetric product (one triangle) to
  // multiply the two segments.
  const double test = 2 * m3 + mm, hit = 2.0 * m * m * n, refresh = fresh - syrk + mm;
  EXPECT_DOUBLE_EQ(st.flops, 4 * syrk + 2 * test + 2 * hit + 2 * refresh);
  EXPECT_DOUBLE_EQ(st.fresh_flops, 4 * fresh);

  opt.residual = CacheResidual::kProbe;  // probes: gate O(m n k); refreshes pay for R
  Rig probe(opt, 2, m, n);
  probe.step(u);
  probe.step(drifted(u, 0.01));
  st = probe.cache.stats();
  ASSERT_EQ(st.hits, 2);
  const double k = opt.probes, ptest = 2 * (2.0 * m * m * k) + 2 * (2.0 * m * n * k);
  EXPECT_DOUBLE_EQ(st.flops, 2 * ptest + 2 * hit + 2 * (refresh + syrk));
}

TEST(CacheMuon, ReprepareWithOtherAlgorithmOrShapeInvalidatesEntries) {
  CacheOptions opt;
  opt.enabled = true;
  opt.gamma = 1e9;
  opt.dtype = DType::kF64;
  Rig rig(opt, 2, 12, 40);
  std::vector<Mat> u = {random_matrix(12, 40), random_matrix(12, 40)};
  rig.step(u);
  rig.step(u);
  EXPECT_EQ(rig.cache.stats().hits, 2);
  const double key = rig.cache.key();
  rig.cfg.coefficients = Coefficients::kPolarExpress;  // algorithm change: same storage
  rig.prepare();
  EXPECT_NE(rig.cache.key(), key);
  rig.step(u);
  CacheStats st = rig.cache.stats();
  EXPECT_EQ(st.hits, 2);
  EXPECT_EQ(st.forced_refreshes, 4);  // 2 empty + 2 filled under the old key
  rig.cfg.restarts = {};              // restarts change the transform too
  rig.prepare();
  rig.step(u);
  EXPECT_EQ(rig.cache.stats().forced_refreshes, 6);
  // Running with a configuration the cache was not prepared for is an error, not a silent reuse.
  rig.cfg.steps = 6;
  EXPECT_THROW(rig.step(u), Error);
}

TEST(CacheMuon, NonFiniteInputRefreshesAndNeverHits) {
  CacheOptions opt;
  opt.enabled = true;
  opt.gamma = 1e9;
  Rig rig(opt, 2, 8, 24, DType::kF32);
  std::vector<Mat> u = {random_matrix(8, 24), random_matrix(8, 24)};
  rig.step(u);
  u[1](3, 5) = std::nan("");  // no status given: the orthogonalizer alone must not reuse
  std::vector<Mat> o = rig.step(u);
  CacheStats st = rig.cache.stats();
  EXPECT_EQ(st.hits, 1);
  EXPECT_EQ(st.refreshes, 3);
  EXPECT_FALSE(o[0].hasNaN());
}

}  // namespace
}  // namespace distmuon

namespace distmuon {
namespace {

// The latest-call summary and the shadow alignment: the share of hits of the last call (one
// entry refreshes because its input jumped), the mean of the last residuals against a float64
// reference, and cos(D, O) of the accepted update against the fresh one computed here.
TEST(CacheMuon, LatestCallSummaryAndShadowAlignment) {
  const int64_t m = 12, n = 40;
  CacheOptions opt;
  opt.enabled = true;
  opt.gamma = 0.5;
  opt.residual = CacheResidual::kExact;  // the summary against the exact float64 residual
  opt.shadow = true;
  opt.dtype = DType::kF64;
  Rig rig(opt, 3, m, n);
  std::vector<Mat> u = {random_matrix(m, n), random_matrix(m, n), random_matrix(m, n)};
  rig.step(u);  // 3 refreshes (empty entries)
  CacheStats st = rig.cache.stats();
  EXPECT_EQ(st.latest_entries, 3);
  EXPECT_EQ(st.latest_hit_rate, 0.0);
  EXPECT_EQ(st.latest_compared, 0);
  EXPECT_EQ(st.latest_alignment, 1.0);

  std::vector<Mat> q = {rig.q(0), rig.q(1), rig.q(2)};
  std::vector<Mat> v = drifted(u, 0.005);
  v[2] = random_matrix(m, n);  // far from its cached transform: refreshes
  std::vector<Mat> out = rig.step(v);
  st = rig.cache.stats();
  ASSERT_EQ(st.hits, 2);
  EXPECT_NEAR(st.latest_hit_rate, 2.0 / 3.0, 1e-12);
  double res = 0;
  for (int i = 0; i < 3; ++i) res += exact_residual(q[i], normalised(v[i]));
  EXPECT_NEAR(st.latest_mean_residual, res / 3, 1e-6 * res);

  // The fresh updates of the two accepted matrices, from a cache that never reuses.
  CacheOptions fresh_opt = opt;
  fresh_opt.gamma = 0;
  fresh_opt.shadow = false;
  Rig fresh(fresh_opt, 3, m, n);
  std::vector<Mat> o = fresh.step(v);
  double err = 0, cos = 0, cos_min = 1;
  for (int i = 0; i < 2; ++i) {
    err += (out[i] - o[i]).norm() / o[i].norm();
    const double c = (out[i].array() * o[i].array()).sum() / (out[i].norm() * o[i].norm());
    cos += c;
    cos_min = std::min(cos_min, c);
  }
  EXPECT_EQ(st.latest_compared, 2);
  EXPECT_NEAR(st.latest_update_error, err / 2, 1e-5);
  EXPECT_NEAR(st.latest_alignment, cos / 2, 1e-5);
  EXPECT_NEAR(st.alignment_mean, cos / 2, 1e-5);
  EXPECT_NEAR(st.alignment_min, cos_min, 1e-5);
  EXPECT_GT(st.alignment_min, 0.9);
  EXPECT_LT(st.alignment_min, 1.0);

  // Merging two classes weights each mean by what it averaged over.
  CacheStats a = st, b;
  b.latest_entries = 1;
  b.latest_hit_rate = 1.0;
  b.latest_with_residual = 1;
  b.latest_mean_residual = 0.0;
  b.latest_compared = 1;
  b.latest_update_error = 0.0;
  b.latest_alignment = 1.0;
  a.merge(b);
  EXPECT_NEAR(a.latest_hit_rate, (2.0 + 1.0) / 4, 1e-12);
  EXPECT_NEAR(a.latest_mean_residual, res / 4, 1e-6 * res);
  EXPECT_NEAR(a.latest_update_error, err / 3, 1e-5);
  EXPECT_NEAR(a.latest_alignment, (cos + 1) / 3, 1e-5);
}

}  // namespace
}  // namespace distmuon
