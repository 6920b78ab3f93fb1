// What one CacheMuon call issues on the backend, observed through a counting test double: the
// cache stores Q in the work dtype unless told otherwise, so neither a hit nor a refresh
// converts it; no pass takes Q's own norm (the residual refuses a non-finite Q, checked here
// as well); a refresh's products write the new transform straight into the storage (no masked
// copy); and the restart segments are composed with one symmetric product, not a dense one.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "distmuon/cache.h"
#include "forwarding_backend.h"
#include "test_util.h"

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::random_matrix;

class CountingBackend final : public test::ForwardingBackend {
 public:
  int scale_copies = 0, norms = 0, masked_copies = 0, masked_sym = 0, masked_dense = 0;

  void reset() { scale_copies = norms = masked_copies = masked_sym = masked_dense = 0; }
  void frob_norm(const BatchRef& a, double* n) override {
    ++norms;
    cpu_.frob_norm(a, n);
  }
  void scale_copy(const BatchRef& s, bool t, const ScaleSpec& sc, const BatchRef& d) override {
    ++scale_copies;
    cpu_.scale_copy(s, t, sc, d);
  }
  void copy_masked(const BatchMask& m, const BatchRef& s, const BatchRef& d) override {
    ++masked_copies;
    cpu_.copy_masked(m, s, d);
  }
  void gemm_masked(const BatchMask& m, bool sym, Op oa, const BatchRef& a, Op ob, const BatchRef& b,
                   double al, double be, const BatchRef* ci, const BatchRef& c) override {
    ++(sym ? masked_sym : masked_dense);
    cpu_.gemm_masked(m, sym, oa, a, ob, b, al, be, ci, c);
  }
  void cache_gate(const CacheGateArgs& g) override { cpu_.cache_gate(g); }
  void fill_normal(const BatchRef& d, uint64_t seed, uint64_t counter) override {
    cpu_.fill_normal(d, seed, counter);
  }
  void fingerprint(const BatchRef& x, uint64_t* keys) override { cpu_.fingerprint(x, keys); }
  void fill_normal_keyed(const BatchRef& d, uint64_t seed, const uint64_t* keys) override {
    cpu_.fill_normal_keyed(d, seed, keys);
  }
};

// One shape class of 3 wide 12 x 40 matrices (Gram NS, 5 steps, restart before step 2).
struct Rig {
  CountingBackend be;
  Orthogonalizer ortho{be};
  OrthoConfig cfg;
  TransformCache cache;
  HostBatch x, out;
  Buffer ws;

  Rig(const CacheOptions& opt, DType work)
      : cache(be, opt), x(work, 3, 12, 40), out(work, 3, 12, 40) {
    cfg.iteration = Iteration::kGram;
    cfg.work_dtype = work;
    cfg.gram_work_dtype = work;
    cache.prepare(resolve(cfg, 12, 40), 3, 12, 40);
    ws = be.alloc(Orthogonalizer::cached_workspace_bytes(cfg, cache.options(), 3, 12, 40));
  }
  std::vector<Mat> step(const std::vector<Mat>& in) {
    for (int64_t i = 0; i < 3; ++i) x.set(i, in[i] / in[i].norm());
    out.poison();
    be.reset();
    ortho.run_cached(cfg, cache, 0, x.ref, out.ref, nullptr, ws.data(), ws.bytes());
    return {out.get(0), out.get(1), out.get(2)};
  }
};

std::vector<Mat> inputs() {
  return {random_matrix(12, 40), random_matrix(12, 40), random_matrix(12, 40)};
}

CacheOptions accept_all() {
  CacheOptions o;
  o.enabled = true;
  o.gamma = 1e9;
  return o;
}

TEST(CachePasses, StorageTakesTheWorkDtypeUnlessSet) {
  for (DType work : {DType::kF32, DType::kF16, DType::kBF16}) {
    Rig rig(accept_all(), work);
    EXPECT_EQ(rig.cache.state("cache_q", 0, 3, {3}).dtype, work) << dtype_name(work);
  }
  CacheOptions o = accept_all();
  o.dtype = DType::kF32;
  Rig f32(o, DType::kBF16);
  EXPECT_EQ(f32.cache.state("cache_q", 0, 3, {3}).dtype, DType::kF32);
}

TEST(CachePasses, NeitherRefreshNorHitConvertsCopiesOrNormsTheTransform) {
  for (CacheResidual mode : {CacheResidual::kExact, CacheResidual::kProbe}) {
    for (CacheLayout layout : {CacheLayout::kProduct, CacheLayout::kFactors}) {
      SCOPED_TRACE(std::string(cache_residual_name(mode)) + " " + cache_layout_name(layout));
      CacheOptions o = accept_all();
      o.residual = mode;
      o.layout = layout;
      Rig rig(o, DType::kF16);
      std::vector<Mat> u = inputs();
      for (int call = 0; call < 2; ++call) {  // 3 refreshes (empty entries), then 3 hits
        rig.step(u);
        EXPECT_EQ(rig.be.scale_copies, 0);
        EXPECT_EQ(rig.be.norms, 1);  // the residual's
        EXPECT_EQ(rig.be.masked_copies, 0);
        // Masked dense products: the restart's fold and the output of the solve, and D = Q X
        // (one per stored factor); the product layout composes its segments symmetrically.
        EXPECT_EQ(rig.be.masked_dense, layout == CacheLayout::kProduct ? 3 : 4);
      }
      CacheStats st = rig.cache.stats();
      EXPECT_EQ(st.refreshes, 3);
      EXPECT_EQ(st.hits, 3);
    }
  }
}

TEST(CachePasses, StorageSetApartConvertsOnceAndCopiesTheRefresh) {
  CacheOptions o = accept_all();
  o.dtype = DType::kF32;
  Rig rig(o, DType::kF16);
  rig.step(inputs());
  EXPECT_EQ(rig.be.scale_copies, 1);   // Q to the work dtype, for the residual and the hits
  EXPECT_EQ(rig.be.masked_copies, 1);  // the composed transform into f32 storage
  EXPECT_EQ(rig.be.norms, 1);
}

TEST(CachePasses, NonFiniteCachedTransformNeverHits) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (CacheResidual mode : {CacheResidual::kExact, CacheResidual::kProbe}) {
    SCOPED_TRACE(cache_residual_name(mode));
    CacheOptions o = accept_all();
    o.residual = mode;
    Rig rig(o, DType::kF32);
    std::vector<Mat> u = inputs();
    rig.step(u);  // fills the three entries
    float* q = static_cast<float*>(rig.cache.state("cache_q", 0, 3, {3}).data);
    q[12 * 12 + 5] = static_cast<float>(nan);      // entry 1
    q[2 * 12 * 12 + 7] = static_cast<float>(inf);  // entry 2
    std::vector<Mat> out = rig.step(u);
    CacheStats st = rig.cache.stats();
    EXPECT_EQ(st.hits, 1);
    EXPECT_EQ(st.refreshes, 5);
    EXPECT_EQ(st.forced_refreshes, 5);  // 3 empty, then the two non-finite entries
    EXPECT_EQ(st.residual.count, 1);    // their residuals enter no statistics
    for (const Mat& m : out) EXPECT_TRUE(m.allFinite());
    // The refresh rewrote both entries: the next call reuses all three.
    rig.step(u);
    EXPECT_EQ(rig.cache.stats().hits, 4);
  }
}

}  // namespace
}  // namespace distmuon
