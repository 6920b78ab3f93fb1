// The CacheMuon backend operations: the gate's contract case by case, masked products and
// copies (selected matrices bit-identical to the unmasked operation, the others untouched), the
// counter-based normal generator, and the host fallback of the Backend base class (what a new
// backend gets before it has kernels) against the CPU backend's own implementations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cache_ref.h"
#include "backend/cpu/cpu_backend.h"
#include "forwarding_backend.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::random_matrix;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The base class's defaults for the masked and cache operations over the CPU backend's
// required ones (the path a new device backend starts from).
class FallbackBackend final : public test::ForwardingBackend {
 public:
  std::string name() const override { return "fallback over " + cpu_.name(); }
};

struct GateCase {
  float residual, age;
  int32_t status;
  double entry_key;
  int32_t want;
  float want_age;
  bool counted;  // enters the residual statistics
  bool forced;
};

TEST(CacheOps, GateFollowsItsContractOnEveryCase) {
  const double key = 12345;
  const float nan = std::nanf(""), inf = INFINITY;
  // gamma 2, residual_scale 0.5, max_age 3
  const GateCase cases[] = {
      {2.0f, 0, kStatusOk, key, kCacheHit, 1, true, false},           // r = 1 <= 2
      {4.0f, 2, kStatusOk, key, kCacheHit, 3, true, false},           // r = 2: boundary
      {4.2f, 2, kStatusOk, key, kCacheRefresh, 0, true, false},       // r = 2.1 > gamma
      {1.0f, 3, kStatusOk, key, kCacheRefresh, 0, true, true},        // stale (age 3)
      {1.0f, 0, kStatusOk, 0, kCacheRefresh, 0, false, true},         // empty entry
      {1.0f, 0, kStatusOk, 99, kCacheRefresh, 0, false, true},        // other key
      {nan, 0, kStatusOk, key, kCacheRefresh, 0, false, true},        // non-finite residual
      {inf, 0, kStatusOk, key, kCacheRefresh, 0, false, true},        // (as from a non-finite Q)
      {1.0f, 1, kStatusNonFinite, key, kCacheSkip, 1, false, false},  // skipped step
  };
  const int n = static_cast<int>(std::size(cases));
  for (int variant = 0; variant < 2; ++variant) {
    CpuBackend cpu;
    FallbackBackend fb;
    Backend& be = variant == 0 ? static_cast<Backend&>(cpu) : fb;
    std::vector<double> res(n);
    std::vector<float> age(n);
    std::vector<int32_t> st(n), dec(n, -1);
    std::vector<double> keys(n), stats(n * kCacheStatFields, 0.0);
    for (int i = 0; i < n; ++i) {
      res[i] = cases[i].residual;
      age[i] = cases[i].age;
      st[i] = cases[i].status;
      keys[i] = cases[i].entry_key;
      stats[i * kCacheStatFields + kCacheStatResMin] = kInf;
    }
    CacheGateArgs g{n,          res.data(), 0.5, st.data(),  key,         keys.data(),
                    age.data(), 3,          2.0, dec.data(), stats.data()};
    be.cache_gate(g);
    for (int i = 0; i < n; ++i) {
      SCOPED_TRACE("case " + std::to_string(i) + (variant ? " (fallback)" : ""));
      const GateCase& k = cases[i];
      const double* s = stats.data() + i * kCacheStatFields;
      EXPECT_EQ(dec[i], k.want);
      EXPECT_EQ(age[i], k.want_age);
      EXPECT_EQ(keys[i], k.want == kCacheSkip ? k.entry_key : key);
      EXPECT_EQ(s[kCacheStatHits], k.want == kCacheHit ? 1 : 0);
      EXPECT_EQ(s[kCacheStatRefreshes], k.want == kCacheRefresh ? 1 : 0);
      EXPECT_EQ(s[kCacheStatSkips], k.want == kCacheSkip ? 1 : 0);
      EXPECT_EQ(s[kCacheStatForced], k.forced ? 1 : 0);
      EXPECT_EQ(s[kCacheStatChecks], k.counted ? 1 : 0);
      if (k.counted) {
        const double r = k.residual * 0.5;
        EXPECT_DOUBLE_EQ(s[kCacheStatResLast], r);
        EXPECT_EQ(s[kCacheStatHist + cache_ref::hist_bin(r)], 1);
      }
    }
  }
}

TEST(CacheOps, HistogramBinsAreQuarterDecades) {
  EXPECT_EQ(cache_ref::hist_bin(0.0), 0);
  EXPECT_EQ(cache_ref::hist_bin(9.9e-4), 0);
  EXPECT_EQ(cache_ref::hist_bin(1e-3), 1);
  EXPECT_EQ(cache_ref::hist_bin(1.0), 13);  // 1e-3 * 10^(12/4) = 1
  EXPECT_EQ(cache_ref::hist_bin(0.999), 12);
  EXPECT_EQ(cache_ref::hist_bin(999.0), kCacheHistBins - 2);
  EXPECT_EQ(cache_ref::hist_bin(1e3), kCacheHistBins - 1);
  EXPECT_EQ(cache_ref::hist_bin(std::nan("")), 0);
  EXPECT_NEAR(cache_ref::hist_lower_edge(13), 1.0, 1e-12);
}

TEST(CacheOps, MaskedProductsAndCopiesTouchOnlySelectedMatrices) {
  CpuBackend cpu;
  FallbackBackend fb;
  for (Backend* be : {static_cast<Backend*>(&cpu), static_cast<Backend*>(&fb)}) {
    for (DType t : {DType::kF32, DType::kF16}) {
      EXPECT_FALSE(be->masked_capturable(t));  // neither backend captures graphs
      const int64_t c = 4, m = 12, n = 30;
      HostBatch a(t, c, m, n), full(t, c, m, m), sym(t, c, m, m), masked(t, c, m, m);
      HostBatch msym(t, c, m, m), cp(DType::kF32, c, m, m);
      for (int64_t i = 0; i < c; ++i) a.set(i, random_matrix(m, n));
      be->gemm(Op::kN, a.ref, Op::kT, a.ref, 1.0, 0.0, nullptr, full.ref);
      be->gemm_symmetric(Op::kN, a.ref, Op::kT, a.ref, 1.0, 0.0, nullptr, sym.ref);
      masked.poison();
      msym.poison();
      cp.poison();
      const int32_t flags[c] = {1, 0, 1, 2};
      const BatchMask mask{flags, 1};
      be->gemm_masked(mask, false, Op::kN, a.ref, Op::kT, a.ref, 1.0, 0.0, nullptr, masked.ref);
      be->gemm_masked(mask, true, Op::kN, a.ref, Op::kT, a.ref, 1.0, 0.0, nullptr, msym.ref);
      be->copy_masked(BatchMask{flags, 0}, full.ref, cp.ref);
      for (int64_t i = 0; i < c; ++i) {
        SCOPED_TRACE(be->name() + " " + dtype_name(t) + " matrix " + std::to_string(i));
        const size_t bytes = static_cast<size_t>(m * m) * dtype_size(t);
        if (flags[i] == 1) {
          EXPECT_EQ(std::memcmp(masked.ref.matrix(i).data, full.ref.matrix(i).data, bytes), 0);
          EXPECT_EQ(std::memcmp(msym.ref.matrix(i).data, sym.ref.matrix(i).data, bytes), 0);
        } else {
          EXPECT_TRUE(masked.get(i).array().isNaN().all());
          EXPECT_TRUE(msym.get(i).array().isNaN().all());
        }
        if (flags[i] == 0)
          EXPECT_EQ(cp.get(i), full.get(i));  // f16 -> f32 is exact
        else
          EXPECT_TRUE(cp.get(i).array().isNaN().all());
      }
    }
  }
}

TEST(CacheOps, NormalGeneratorIsStandardDeterministicAndCounterAddressed) {
  CpuBackend cpu;
  FallbackBackend fb;
  HostBatch a(DType::kF64, 3, 50, 40), b(DType::kF64, 1, 50, 40), c(DType::kF64, 3, 50, 40);
  cpu.fill_normal(a.ref, 7, 1000);
  cpu.fill_normal(b.ref, 7, 1000 + 2 * 50 * 40);  // the third matrix of a, on its own
  fb.fill_normal(c.ref, 7, 1000);
  EXPECT_EQ(a.get(2), b.get(0));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.get(i), c.get(i));
  double sum = 0, sq = 0;
  for (int i = 0; i < 3; ++i) {
    Mat m = a.get(i);
    sum += m.sum();
    sq += m.squaredNorm();
  }
  const double n = 3 * 50 * 40, mean = sum / n, var = sq / n - mean * mean;
  EXPECT_LT(std::abs(mean), 0.05);  // 6000 samples: standard error 0.013
  EXPECT_NEAR(var, 1.0, 0.06);
  HostBatch d(DType::kF64, 1, 50, 40);
  cpu.fill_normal(d.ref, 8, 1000);  // another seed, another stream
  EXPECT_GT((d.get(0) - a.get(0)).norm(), 10.0);
}

// The probes' keys and streams: a matrix's fingerprint and draws depend on the matrix alone
// (not on its position in a batch), differ between matrices, see a change of one sampled
// element, and the host fallback computes the CPU's bits.
TEST(CacheOps, FingerprintKeysProbeStreamsByTheMatrixAlone) {
  CpuBackend cpu;
  FallbackBackend fb;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF64}) {
    SCOPED_TRACE(dtype_name(t));
    HostBatch x(t, 3, 12, 40), y(t, 2, 12, 40);
    for (int i = 0; i < 3; ++i) x.set(i, random_matrix(12, 40));
    y.set(0, x.get(2));  // x's third matrix, first in another batch
    y.set(1, x.get(0));
    std::vector<uint64_t> kx(3), ky(2), kf(3);
    cpu.fingerprint(x.ref, kx.data());
    cpu.fingerprint(y.ref, ky.data());
    fb.fingerprint(x.ref, kf.data());
    EXPECT_EQ(kf, kx);
    EXPECT_EQ(ky[0], kx[2]);
    EXPECT_EQ(ky[1], kx[0]);
    EXPECT_NE(kx[0], kx[1]);
    EXPECT_NE(kx[1], kx[2]);
    // The first element is always sampled: changing it changes the key.
    Mat changed = x.get(1);
    changed(0, 0) += 1.0;
    HostBatch z(t, 1, 12, 40);
    z.set(0, changed);
    uint64_t kz = 0;
    cpu.fingerprint(z.ref, &kz);
    EXPECT_NE(kz, kx[1]);

    HostBatch wx(DType::kF32, 3, 12, 8), wy(DType::kF32, 2, 12, 8), wf(DType::kF32, 3, 12, 8);
    cpu.fill_normal_keyed(wx.ref, 0x5eed, kx.data());
    cpu.fill_normal_keyed(wy.ref, 0x5eed, ky.data());
    fb.fill_normal_keyed(wf.ref, 0x5eed, kx.data());
    EXPECT_EQ(wy.get(0), wx.get(2));
    EXPECT_EQ(wy.get(1), wx.get(0));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(wf.get(i), wx.get(i));
    EXPECT_GT((wx.get(0) - wx.get(1)).norm(), 1.0);
    // Element (r, c) of a matrix with key k is normal_sample(seed ^ k, r * cols + c).
    const double want = cache_ref::normal_sample(0x5eed ^ kx[1], 3 * 8 + 5);
    EXPECT_EQ(wx.get(1)(3, 5), static_cast<double>(static_cast<float>(want)));
  }
}

}  // namespace
}  // namespace distmuon
