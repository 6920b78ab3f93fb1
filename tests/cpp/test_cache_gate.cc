// The per-batch gate (CacheGate::kBatch): a gate call hits whole or refreshes whole. On the
// backend operation (CPU and the host fallback), case by case and against the per-matrix gate as
// the oracle over random calls; then through the orthogonalizer: one failing matrix refreshes the
// batch and refills every entry with the fresh solve's transform, skipped matrices do not block
// the others, matrices that agree decide as under the per-matrix gate, and the check back-off
// counts the batch's misses in step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "backend/cache_ref.h"
#include "backend/cpu/cpu_backend.h"
#include "distmuon/cache.h"
#include "forwarding_backend.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::drifted;
using test::random_matrix;

constexpr double kKey = 4321;
constexpr double kInf = std::numeric_limits<double>::infinity();

class FallbackBackend final : public test::ForwardingBackend {};

// The host buffers of one gate call; per matrix: scaled residual r (scale 1), status, key.
struct Gate {
  std::vector<double> res, keys, stats;
  std::vector<float> age, misses;
  std::vector<int32_t> status, dec;
  int32_t max_age = 0, backoff = 0;

  void add(double r, int32_t st = kStatusOk, double key = kKey, float a = 0, float miss = 0) {
    res.push_back(r);
    status.push_back(st);
    keys.push_back(key);
    age.push_back(a);
    misses.push_back(miss);
    dec.push_back(-1);
    stats.resize(stats.size() + kCacheStatFields, 0.0);
    stats[stats.size() - kCacheStatFields + kCacheStatResMin] = kInf;
  }
  int64_t count() const { return static_cast<int64_t>(res.size()); }
  const double* stat(int64_t i) const { return stats.data() + i * kCacheStatFields; }
  void run(Backend& be, bool batch, bool plan = false) {
    CacheGateArgs g{count(),      res.data(),    1.0,     status.data(), kKey,
                    keys.data(),  age.data(),    max_age, 2.0,           dec.data(),
                    stats.data(), misses.data(), backoff, plan,          batch};
    be.cache_gate(g);
  }
};

TEST(CacheGate, BatchGateIsAllOrNothingCaseByCase) {
  CpuBackend cpu;
  FallbackBackend fb;
  const float nan = std::nanf("");
  for (Backend* be : {static_cast<Backend*>(&cpu), static_cast<Backend*>(&fb)}) {
    SCOPED_TRACE(be->name());
    Gate pass;  // every matrix passes (gamma 2): hits, as under the per-matrix gate
    for (double r : {0.5, 1.0, 2.0}) pass.add(r, kStatusOk, kKey, 3, 5);
    Gate alone = pass;
    pass.run(*be, true);
    alone.run(*be, false);
    EXPECT_EQ(pass.dec, std::vector<int32_t>(3, kCacheHit));
    EXPECT_EQ(pass.dec, alone.dec);
    EXPECT_EQ(pass.age, alone.age);
    EXPECT_EQ(pass.misses, std::vector<float>(3, 0.0f));
    EXPECT_EQ(pass.stats, alone.stats);

    Gate one;  // matrix 1 fails: all three refresh, and 0 and 2 count a batch refresh and a miss
    for (double r : {1.0, 3.0, 0.5}) one.add(r, kStatusOk, kKey, 2, 1);
    one.run(*be, true);
    EXPECT_EQ(one.dec, std::vector<int32_t>(3, kCacheRefresh));
    EXPECT_EQ(one.age, std::vector<float>(3, 0.0f));
    EXPECT_EQ(one.keys, std::vector<double>(3, kKey));
    EXPECT_EQ(one.misses, std::vector<float>(3, 2.0f));
    for (int64_t i = 0; i < 3; ++i) {
      SCOPED_TRACE("matrix " + std::to_string(i));
      EXPECT_EQ(one.stat(i)[kCacheStatHits], 0);
      EXPECT_EQ(one.stat(i)[kCacheStatRefreshes], 1);
      EXPECT_EQ(one.stat(i)[kCacheStatBatch], i == 1 ? 0 : 1);
      EXPECT_EQ(one.stat(i)[kCacheStatForced], 0);
      EXPECT_EQ(one.stat(i)[kCacheStatChecks], 1);  // every tested residual is recorded
      EXPECT_EQ(one.stat(i)[kCacheStatResLast], one.res[i]);
    }

    Gate skip;  // a skipped matrix (non-finite input) takes no part: the others hit
    skip.add(1.0);
    skip.add(nan, kStatusNonFinite, 99, 7, 3);
    skip.add(0.5);
    skip.run(*be, true);
    EXPECT_EQ(skip.dec, (std::vector<int32_t>{kCacheHit, kCacheSkip, kCacheHit}));
    EXPECT_EQ(skip.keys[1], 99);  // untouched
    EXPECT_EQ(skip.age[1], 7);
    EXPECT_EQ(skip.misses[1], 3);
    EXPECT_EQ(skip.stat(1)[kCacheStatSkips], 1);

    Gate empty;  // an empty entry cannot hit, so it refreshes the batch (forced only itself)
    empty.add(1.0);
    empty.add(1.0, kStatusOk, 0.0);
    empty.add(1.0);
    empty.run(*be, true);
    EXPECT_EQ(empty.dec, std::vector<int32_t>(3, kCacheRefresh));
    EXPECT_EQ(empty.misses, (std::vector<float>{1, 0, 1}));
    EXPECT_EQ(empty.stat(1)[kCacheStatForced], 1);
    EXPECT_EQ(empty.stat(1)[kCacheStatBatch], 0);
    EXPECT_EQ(empty.stat(0)[kCacheStatBatch] + empty.stat(2)[kCacheStatBatch], 2);

    Gate none;  // every matrix skipped: nothing to decide
    none.add(1.0, kStatusNonFinite);
    none.add(5.0, kStatusNonFinite);
    none.run(*be, true);
    EXPECT_EQ(none.dec, std::vector<int32_t>(2, kCacheSkip));
  }
}

// Random calls (every branch: skips, empty and foreign entries, stale ones, NaN and infinite
// residuals, the back-off), each gated per batch and, on a copy, per matrix: the batch hits iff
// every matrix not skipped hits alone, and then equals the per-matrix call in everything; else
// every one of them refreshes and the only differences are the vetoed matrices' hit turned into
// a refresh counted in Batch, with a miss. Plan passes ignore the gate.
TEST(CacheGate, BatchGateFollowsThePerMatrixGateAsOracle) {
  CpuBackend cpu;
  FallbackBackend fb;
  std::mt19937_64& g = test::rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int whole_hits = 0, vetoed = 0;
  for (int call = 0; call < 400; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    Backend& be = call % 2 ? static_cast<Backend&>(fb) : cpu;
    Gate b;
    b.max_age = call % 3 == 0 ? 4 : 0;
    b.backoff = call % 5 == 0 ? 4 : 0;
    const int n = 1 + static_cast<int>(u(g) * 9);
    const double fail = u(g) < 0.5 ? 0.02 : 0.3;  // half the calls mostly pass
    for (int i = 0; i < n; ++i) {
      const double x = u(g);
      const double r = x < fail / 2 ? (x < fail / 4 ? NAN : 3.0) : 1.9 * u(g);
      const int32_t st = u(g) < 0.05 ? kStatusNonFinite : kStatusOk;
      const double key = u(g) < fail / 4 ? (u(g) < 0.5 ? 0.0 : 17.0) : kKey;
      b.add(r, st, key, static_cast<float>(static_cast<int>(u(g) * 5)),
            static_cast<float>(static_cast<int>(u(g) * 6)));
    }
    Gate m = b, plan_b = b, plan_m = b, before = b;
    b.run(be, true);
    m.run(be, false);
    plan_b.run(be, true, true);
    plan_m.run(be, false, true);
    EXPECT_EQ(plan_b.dec, plan_m.dec);
    EXPECT_EQ(plan_b.stats, before.stats);
    bool all = true;
    for (int i = 0; i < n; ++i) all = all && (m.dec[i] == kCacheHit || m.dec[i] == kCacheSkip);
    if (all) {
      whole_hits += 1;
      EXPECT_EQ(b.dec, m.dec);
      EXPECT_EQ(b.age, m.age);
      EXPECT_EQ(b.misses, m.misses);
      EXPECT_EQ(b.keys, m.keys);
      EXPECT_EQ(b.stats, m.stats);
      continue;
    }
    for (int i = 0; i < n; ++i) {
      SCOPED_TRACE("matrix " + std::to_string(i));
      if (m.dec[i] == kCacheSkip) {
        EXPECT_EQ(b.dec[i], kCacheSkip);
        EXPECT_EQ(b.age[i], before.age[i]);
        EXPECT_EQ(b.keys[i], before.keys[i]);
        EXPECT_EQ(b.misses[i], before.misses[i]);
        continue;
      }
      EXPECT_EQ(b.dec[i], kCacheRefresh);
      EXPECT_EQ(b.age[i], 0.0f);
      EXPECT_EQ(b.keys[i], kKey);
      const bool veto = m.dec[i] == kCacheHit;
      vetoed += veto;
      EXPECT_EQ(b.misses[i], veto ? cache_ref::one_more_miss(before.misses[i]) : m.misses[i]);
      for (int f = 0; f < kCacheStatFields; ++f) {
        double want = m.stat(i)[f];
        if (f == kCacheStatHits) want = 0;
        if (f == kCacheStatRefreshes) want = 1;
        if (f == kCacheStatBatch) want = veto ? 1 : 0;
        EXPECT_EQ(b.stat(i)[f], want) << "stat " << f;
      }
    }
  }
  EXPECT_GT(whole_hits, 40);  // both outcomes were exercised
  EXPECT_GT(vetoed, 40);
}

// Three wide 12 x 40 matrices through run_cached on the CPU backend, f32 work and storage.
struct Rig {
  CpuBackend be;
  Orthogonalizer ortho{be};
  OrthoConfig cfg;
  TransformCache cache;
  HostBatch x{DType::kF32, 3, 12, 40}, out{DType::kF32, 3, 12, 40};
  Buffer ws;

  explicit Rig(const CacheOptions& opt) : cache(be, opt) {
    cfg.iteration = Iteration::kGram;
    cfg.work_dtype = DType::kF32;
    cfg.gram_work_dtype = DType::kF32;
    cache.prepare(resolve(cfg, 12, 40), 3, 12, 40);
    ws = be.alloc(Orthogonalizer::cached_workspace_bytes(cfg, opt, 3, 12, 40));
  }
  void step(const std::vector<Mat>& in, const int32_t* status = nullptr) {
    for (int64_t i = 0; i < 3; ++i) x.set(i, in[i] / in[i].norm());
    out.poison();
    ortho.run_cached(cfg, cache, 0, x.ref, out.ref, status, ws.data(), ws.bytes());
  }
  // The fresh solve of the last input, as a plain orthogonalization computes it.
  HostBatch fresh() {
    HostBatch f(DType::kF32, 3, 12, 40);
    f.bytes = x.bytes;  // (a copied HostBatch would still point at x's bytes)
    Buffer w = be.alloc(Orthogonalizer::workspace_bytes(cfg, 3, 12, 40));
    ortho.run(cfg, f.ref, f.ref, w.data(), w.bytes());
    return f;
  }
  template <typename T>
  std::vector<T> state(const char* name) {
    const T* p = static_cast<const T*>(cache.state(name, 0, 3, {3}).data);
    return {p, p + 3};
  }
  std::vector<uint8_t> q() {  // the three entries' bytes
    TensorView v = cache.state("cache_q", 0, 3, {3});
    const uint8_t* p = static_cast<const uint8_t*>(v.data);
    return {p, p + v.numel() * static_cast<int64_t>(dtype_size(v.dtype))};
  }
};

CacheOptions options(CacheGate gate, double gamma = 0.5) {
  CacheOptions o;
  o.enabled = true;
  o.gamma = gamma;
  o.residual = CacheResidual::kExact;
  o.gate = gate;
  return o;
}

std::vector<Mat> inputs() {
  return {random_matrix(12, 40), random_matrix(12, 40), random_matrix(12, 40)};
}

bool same_bytes(const HostBatch& a, const HostBatch& b) { return a.bytes == b.bytes; }

// Matrices 0 and 1 drift slightly (they pass their tests, gamma 0.5), matrix 2 jumps: the
// per-matrix gate hits 0 and 1, the per-batch gate refreshes all three with the fresh solve's
// output and refills every entry with the fresh transform, so that the same input hits whole.
TEST(CacheGate, OneFailingMatrixRefreshesAndRefillsTheWholeBatch) {
  Rig batch(options(CacheGate::kBatch)), alone(options(CacheGate::kMatrix));
  Rig fresh(options(CacheGate::kMatrix, 0.0));  // gamma 0: refreshes every call
  const std::vector<Mat> u = inputs();
  std::vector<Mat> v = drifted(u, 0.005);
  v[2] = random_matrix(12, 40);
  for (Rig* r : {&batch, &alone, &fresh}) {
    r->step(u);
    r->step(v);
  }
  const CacheStats b = batch.cache.stats(), a = alone.cache.stats();
  EXPECT_EQ(a.hits, 2);
  EXPECT_EQ(b.hits, 0);
  EXPECT_EQ(b.refreshes, 6);
  EXPECT_EQ(b.batch_refreshes, 2);
  EXPECT_EQ(a.batch_refreshes, 0);
  EXPECT_EQ(b.forced_refreshes, 3);  // the empty entries of the first call only
  EXPECT_EQ(b.residual.count, 3);    // the tested residuals, recorded as the per-matrix gate does
  EXPECT_EQ(b.residual.mean, a.residual.mean);
  EXPECT_EQ(b.latest_hit_rate, 0.0);
  EXPECT_TRUE(same_bytes(batch.out, batch.fresh()));
  EXPECT_EQ(batch.q(), fresh.q());
  EXPECT_EQ(batch.state<float>("cache_age"), std::vector<float>(3, 0.0f));
  EXPECT_EQ(batch.state<float>("cache_misses"), std::vector<float>(3, 1.0f));
  EXPECT_EQ(alone.state<float>("cache_misses"), (std::vector<float>{0, 0, 1}));
  batch.step(v);  // the refilled entries fit the same input: the batch hits whole
  const CacheStats b2 = batch.cache.stats();
  EXPECT_EQ(b2.hits, 3);
  EXPECT_EQ(b2.latest_hit_rate, 1.0);
  EXPECT_EQ(batch.state<float>("cache_misses"), std::vector<float>(3, 0.0f));
}

// A matrix the step skips (non-finite input) leaves its entry untouched and does not hold back
// the others, which hit.
TEST(CacheGate, SkippedMatricesDoNotBlockTheBatch) {
  Rig batch(options(CacheGate::kBatch));
  const std::vector<Mat> u = inputs();
  batch.step(u);
  const std::vector<uint8_t> q0 = batch.q();
  std::vector<Mat> v = drifted(u, 0.005);
  v[1] = random_matrix(12, 40);  // would fail its test, but is skipped
  const int32_t status[3] = {kStatusOk, kStatusNonFinite, kStatusOk};
  batch.step(v, status);
  const CacheStats st = batch.cache.stats();
  EXPECT_EQ(st.hits, 2);
  EXPECT_EQ(st.skips, 1);
  EXPECT_EQ(st.batch_refreshes, 0);
  EXPECT_EQ(batch.state<float>("cache_age"), (std::vector<float>{1, 0, 1}));
  EXPECT_EQ(batch.state<double>("cache_key")[1], batch.cache.key());
  EXPECT_EQ(batch.q(), q0);  // hits and the skip write no entry
}

// Inputs with 4 strong directions: a transform fitted to isotropic inputs fails on them, and the
// other way round.
std::vector<Mat> strong() {
  std::vector<Mat> r = inputs();
  for (Mat& m : r) m.topRows(4) *= 10.0;
  return r;
}

// Calls whose matrices all agree (all fail, all pass) decide as under the per-matrix gate, bit
// for bit, with either residual.
TEST(CacheGate, EqualsThePerMatrixGateWhenMatricesAgree) {
  for (CacheResidual mode : {CacheResidual::kExact, CacheResidual::kProbe}) {
    SCOPED_TRACE(cache_residual_name(mode));
    CacheOptions ob = options(CacheGate::kBatch), om = options(CacheGate::kMatrix);
    ob.residual = om.residual = mode;
    Rig batch(ob), alone(om);
    std::vector<Mat> u = inputs();
    const std::vector<Mat> w = inputs();  // all empty, all pass, all fail twice, all pass
    const std::vector<std::vector<Mat>> calls = {u, drifted(u, 0.002), strong(), w,
                                                 drifted(w, 0.002)};
    for (size_t k = 0; k < calls.size(); ++k) {
      batch.step(calls[k]);
      alone.step(calls[k]);
      EXPECT_TRUE(same_bytes(batch.out, alone.out)) << "call " << k;
    }
    const CacheStats b = batch.cache.stats(), a = alone.cache.stats();
    EXPECT_EQ(a.hits, 6);  // calls 2 and 5
    EXPECT_EQ(b.hits, a.hits);
    EXPECT_EQ(b.refreshes, a.refreshes);
    EXPECT_EQ(b.batch_refreshes, 0);
    EXPECT_EQ(b.residual.mean, a.residual.mean);
    EXPECT_EQ(batch.q(), alone.q());
  }
}

// With the check back-off (4), a batch kept failing by one matrix counts every entry's misses
// in step, so the calls that leave the test out leave it out for the whole batch (call 5: no
// residual measured, three untested refreshes), which is what lets a captured call skip it.
TEST(CacheGate, BatchMissesMoveInStepUnderTheBackoff) {
  CacheOptions o = options(CacheGate::kBatch);
  o.check_backoff = 4;
  Rig batch(o);
  std::vector<Mat> u = inputs();
  const int tested[] = {0, 3, 3, 3, 0, 3};  // residuals measured per call (call 1: empty)
  const int untested[] = {0, 0, 0, 0, 3, 0};
  for (int k = 0; k < 6; ++k) {
    SCOPED_TRACE("call " + std::to_string(k + 1));
    const CacheStats before = batch.cache.stats();
    u = drifted(u, 0.002);
    u[2] = random_matrix(12, 40);  // fails every test
    batch.step(u);
    const CacheStats after = batch.cache.stats();
    EXPECT_EQ(after.residual.count - before.residual.count, tested[k]);
    EXPECT_EQ(after.unchecked_refreshes - before.unchecked_refreshes, untested[k]);
    EXPECT_EQ(after.refreshes - before.refreshes, 3);
    const std::vector<float> misses = batch.state<float>("cache_misses");
    EXPECT_EQ(misses, std::vector<float>(3, static_cast<float>(k)));
  }
}

}  // namespace
}  // namespace distmuon
