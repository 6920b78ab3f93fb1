// The fused Muon passes, the orthogonalizer and whole engine steps on the GPU against the CPU
// reference and the float64 iteration; NaN/zero/tiny/huge inputs; CUDA-graph capture and replay
// of a whole step. Skips without a GPU.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_handles.h"
#include "distmuon/engine.h"
#include "test_cuda_util.h"

namespace distmuon {
namespace {

using test::DeviceBatch;
using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::rel_err;

struct Slots {
  std::vector<HostBatch> host;  // g, b, w per matrix
  std::vector<DeviceBatch> dev;
};

// Runs the three passes on both backends for `count` rows x cols matrices; `scale` multiplies
// the gradients (zero, tiny, huge), matrix 1's gradient gets a NaN when `nan`. Returns the
// statuses of pass 1 (the backends agree on them, and on the skips pass 2 counts).
std::vector<int32_t> check_passes(int64_t count, int64_t rows, int64_t cols, double scale,
                                  bool nan) {
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const bool tall = rows > cols;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  std::vector<HostBatch> hg, hb, hw;
  std::vector<DeviceBatch> dg, db, dw;
  std::vector<MuonSlot> gs, cs;
  std::vector<MuonUpdateCoef> coef;
  for (int64_t i = 0; i < count; ++i) {
    hg.emplace_back(DType::kF32, 1, rows, cols);
    hb.emplace_back(DType::kF32, 1, rows, cols);
    hw.emplace_back(DType::kF32, 1, rows, cols);
    Mat g = random_matrix(rows, cols, 1.0) * scale;
    if (nan && i == 1) g(rows / 2, cols / 3) = NAN;
    hg.back().set(0, g);
    hb.back().set(0, random_matrix(rows, cols, 0.5) * scale);
    hw.back().set(0, random_matrix(rows, cols, 0.02));
    coef.push_back({0.99f, 0.02f});
  }
  Buffer skips = be.alloc(sizeof(int64_t) * count);
  be.fill_zero(skips.data(), skips.bytes());
  std::vector<int64_t> cskips(count, 0);
  for (int64_t i = 0; i < count; ++i) {
    dg.emplace_back(be, hg[i]);
    db.emplace_back(be, hb[i]);
    dw.emplace_back(be, hw[i]);
    gs.push_back({dg[i].ref.matrix(0), db[i].ref.matrix(0), dw[i].ref.matrix(0),
                  skips.as<int64_t>() + i});
    cs.push_back({hg[i].ref.matrix(0), hb[i].ref.matrix(0), hw[i].ref.matrix(0), &cskips[i]});
  }
  // mu and pass 3's coefficients where each backend reads them: device memory, host memory.
  const float mu = 0.95f;
  Buffer dmu = be.alloc(sizeof(float)), dcoef = be.alloc(sizeof(MuonUpdateCoef) * count);
  be.upload_small(dmu.data(), &mu, sizeof(float));
  be.upload_small(dcoef.data(), coef.data(), sizeof(MuonUpdateCoef) * count);
  for (int64_t i = 0; i < count; ++i) {
    gs[i].coef = dcoef.as<MuonUpdateCoef>() + i;
    cs[i].coef = &coef[i];
  }
  Buffer norms = be.alloc(sizeof(double) * count), status = be.alloc(sizeof(int32_t) * count);
  std::vector<double> cn(count);
  std::vector<int32_t> cst(count);
  be.muon_momentum_norm(gs, dmu.as<float>(), true, norms.as<double>(), status.as<int32_t>());
  cpu.muon_momentum_norm(cs, &mu, true, cn.data(), cst.data());
  std::vector<double> gn(count);
  std::vector<int32_t> gst(count);
  be.copy_to_host(gn.data(), norms.data(), sizeof(double) * count);
  be.copy_to_host(gst.data(), status.data(), sizeof(int32_t) * count);
  for (int64_t i = 0; i < count; ++i) {
    EXPECT_EQ(gst[i], cst[i]) << "matrix " << i;
    if (cst[i] == 0) {
      EXPECT_NEAR(gn[i], cn[i], 1e-5 * cn[i] + 1e-30) << "matrix " << i;
    }
  }
  HostBatch x(DType::kBF16, count, m, n), xc(DType::kBF16, count, m, n);
  x.poison();
  DeviceBatch dx(be, x);
  be.muon_momentum_apply(gs, dmu.as<float>(), true, status.as<int32_t>(),
                         {norms.as<double>(), 1.0, 1e-7, 1.0}, tall, dx.ref);
  cpu.muon_momentum_apply(cs, &mu, true, cst.data(), {cn.data(), 1.0, 1e-7, 1.0}, tall, xc.ref);
  dx.download(be, x);
  for (int64_t i = 0; i < count; ++i) {
    Mat got = x.get(i);
    EXPECT_FALSE(got.hasNaN()) << "NaN in X of matrix " << i << " (scale " << scale << ")";
    if (cst[i] == 0 && xc.get(i).norm() > 0) {
      EXPECT_LT(rel_err(got, xc.get(i)), 1e-2) << i;
    }
    if (cst[i] != 0) {
      EXPECT_EQ(got.norm(), 0.0);
    }
    HostBatch bb(DType::kF32, 1, rows, cols);
    db[i].download(be, bb);
    EXPECT_LT(rel_err(bb.get(0), hb[i].get(0)), 1e-6) << "momentum of matrix " << i;
  }
  // Pass 3 reads the (bf16) X as O.
  be.muon_update(gs, status.as<int32_t>(), dx.ref, tall);
  cpu.muon_update(cs, cst.data(), xc.ref, tall);
  for (int64_t i = 0; i < count; ++i) {
    HostBatch ww(DType::kF32, 1, rows, cols);
    dw[i].download(be, ww);
    EXPECT_LT(rel_err(ww.get(0), hw[i].get(0)), 2e-3) << "weight of matrix " << i;
  }
  std::vector<int64_t> gskips(count);
  be.copy_to_host(gskips.data(), skips.data(), sizeof(int64_t) * count);
  for (int64_t i = 0; i < count; ++i) {
    EXPECT_EQ(gskips[i], cskips[i]) << "skips of matrix " << i;
    EXPECT_EQ(cskips[i], cst[i] != 0 ? 1 : 0) << "skips of matrix " << i;
  }
  return cst;
}

TEST(CudaMuon, PassesMatchCpuWide) { DM_SKIP_WITHOUT_CUDA(); check_passes(5, 96, 320, 1.0, false); }
TEST(CudaMuon, PassesMatchCpuTallWithNaN) { DM_SKIP_WITHOUT_CUDA(); check_passes(4, 330, 70, 1.0, true); }
TEST(CudaMuon, PassesTallVectorTiles) { DM_SKIP_WITHOUT_CUDA(); check_passes(3, 200, 72, 1.0, true); }
TEST(CudaMuon, PassesOddShape) { DM_SKIP_WITHOUT_CUDA(); check_passes(3, 37, 53, 1.0, true); }
TEST(CudaMuon, ZeroTinyHugeGiveNoNaN) {
  DM_SKIP_WITHOUT_CUDA();
  for (double s : {0.0, 1e-30, 1e30}) check_passes(2, 64, 256, s, false);
}
TEST(CudaMuon, ManySlotsSplitIntoLaunches) { DM_SKIP_WITHOUT_CUDA(); check_passes(90, 16, 48, 1.0, true); }

// Batches of several shapes, layouts and dtypes in one grouped call per pass
// (Backend::muon_pass_grouped): every matrix gets the bits its batch's own calls give it, through
// the flat, 32 x 32 and 64 x 64 transposing kernels, in launches of more than one table.
struct PassCase {
  int64_t count, rows, cols;
  DType grad;   // momentum and weights are fp32
  int64_t pad;  // extra columns per row (ld = cols + pad)
};

// One device copy of every case's operands (the same host data for every copy).
struct PassSet {
  std::vector<DeviceBatch> g, b, w, x;
  std::vector<std::vector<MuonSlot>> slots;
  std::vector<int64_t> offset;  // of each case's norms and statuses
  Buffer mu, coef, skips, norms, status;

  PassSet(Backend& be, const std::vector<PassCase>& cases, const std::vector<HostBatch>& hg,
          const std::vector<HostBatch>& hb, const std::vector<HostBatch>& hw) {
    int64_t total = 0;
    for (const PassCase& c : cases) offset.push_back(std::exchange(total, total + c.count));
    const float m = 0.9f;
    std::vector<MuonUpdateCoef> cf(total, MuonUpdateCoef{0.99f, 0.02f});
    mu = be.alloc(sizeof(float));
    coef = be.alloc(sizeof(MuonUpdateCoef) * total);
    skips = be.alloc(sizeof(int64_t) * total);
    norms = be.alloc(sizeof(double) * total);
    status = be.alloc(sizeof(int32_t) * total);
    be.upload_small(mu.data(), &m, sizeof(float));
    be.copy_from_host(coef.data(), cf.data(), coef.bytes());
    be.fill_zero(skips.data(), skips.bytes());
    for (size_t k = 0; k < cases.size(); ++k) {
      const PassCase& c = cases[k];
      g.emplace_back(be, hg[k]);
      b.emplace_back(be, hb[k]);
      w.emplace_back(be, hw[k]);
      HostBatch hx(DType::kBF16, c.count, std::min(c.rows, c.cols), std::max(c.rows, c.cols));
      hx.poison();
      x.emplace_back(be, hx);
      auto at = [&](const DeviceBatch& d, int64_t i) {
        MatRef r = d.ref.matrix(i);
        r.cols = c.cols;  // ld stays cols + pad
        return r;
      };
      slots.emplace_back();
      for (int64_t i = 0; i < c.count; ++i)
        slots.back().push_back({at(g[k], i), at(b[k], i), at(w[k], i),
                                skips.as<int64_t>() + offset[k] + i,
                                coef.as<MuonUpdateCoef>() + offset[k] + i});
    }
  }
  std::vector<MuonPassBatch> batches() {
    std::vector<MuonPassBatch> out;
    for (size_t k = 0; k < slots.size(); ++k) {
      MuonPassBatch p;
      p.slots = slots[k];
      p.mu = mu.as<float>();
      p.nesterov = true;
      p.norms = norms.as<double>() + offset[k];
      p.status = status.as<int32_t>() + offset[k];
      p.scale = {p.norms, 1.0, 1e-7, 1.0};
      p.transpose = slots[k][0].grad.rows > slots[k][0].grad.cols;
      p.x = x[k].ref;
      out.push_back(p);
    }
    return out;
  }
  std::vector<uint8_t> bytes(Backend& be) const {  // every output, concatenated
    std::vector<uint8_t> all;
    auto add = [&](const void* p, size_t n) {
      const size_t at = all.size();
      all.resize(at + n);
      be.copy_to_host(all.data() + at, p, n);
    };
    for (const Buffer* buf : {&skips, &norms, &status}) add(buf->data(), buf->bytes());
    for (const auto* v : {&b, &w, &x})
      for (const DeviceBatch& d : *v) add(d.buf.data(), d.buf.bytes());
    return all;
  }
};

TEST(CudaMuon, GroupedPassesGiveEveryBatchItsOwnBits) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  const std::vector<PassCase> cases = {{3, 96, 320, DType::kF32, 0},   // flat, vector path
                                       {2, 200, 72, DType::kF32, 0},   // tall, 64 x 64 tiles
                                       {2, 53, 37, DType::kBF16, 0},   // tall, 32 x 32 tiles
                                       {1, 33, 70, DType::kF32, 3},    // flat, scalar path
                                       {40, 16, 48, DType::kF32, 0}};  // past one table
  std::vector<HostBatch> hg, hb, hw;
  for (const PassCase& c : cases) {
    hg.emplace_back(c.grad, c.count, c.rows, c.cols + c.pad);
    hb.emplace_back(DType::kF32, c.count, c.rows, c.cols + c.pad);
    hw.emplace_back(DType::kF32, c.count, c.rows, c.cols + c.pad);
    for (int64_t i = 0; i < c.count; ++i) {
      Mat gm = random_matrix(c.rows, c.cols + c.pad, 1.0);
      if (c.grad == DType::kBF16 && i == 1) gm(c.rows / 2, c.cols / 3) = NAN;  // one skip
      hg.back().set(i, gm);
      hb.back().set(i, random_matrix(c.rows, c.cols + c.pad, 0.5));
      hw.back().set(i, random_matrix(c.rows, c.cols + c.pad, 0.02));
    }
  }
  PassSet grouped(be, cases, hg, hb, hw), alone(be, cases, hg, hb, hw);
  const std::vector<uint8_t> before = grouped.bytes(be);

  // A bad batch anywhere in the call: nothing is issued.
  std::vector<MuonPassBatch> bad = grouped.batches();
  bad.back().x.count = 1;
  EXPECT_THROW(be.muon_pass_grouped(MuonPass::kApply, bad), Error);
  EXPECT_TRUE(grouped.bytes(be) == before) << "a refused call changed something";

  for (MuonPass pass : {MuonPass::kNorm, MuonPass::kApply, MuonPass::kUpdate})
    be.muon_pass_grouped(pass, grouped.batches());
  for (MuonPass pass : {MuonPass::kNorm, MuonPass::kApply, MuonPass::kUpdate})
    for (const MuonPassBatch& p : alone.batches()) {
      if (pass == MuonPass::kNorm)
        be.muon_momentum_norm(p.slots, p.mu, p.nesterov, p.norms, p.status);
      else if (pass == MuonPass::kApply)
        be.muon_momentum_apply(p.slots, p.mu, p.nesterov, p.status, p.scale, p.transpose, p.x);
      else
        be.muon_update(p.slots, p.status, p.x, p.transpose);
    }
  const std::vector<uint8_t> got = grouped.bytes(be), want = alone.bytes(be);
  EXPECT_TRUE(got == want) << "the grouped passes differ from the batches' own calls";
  EXPECT_FALSE(got == before);
  std::vector<int64_t> skips(48);
  be.copy_to_host(skips.data(), grouped.skips.data(), skips.size() * sizeof(int64_t));
  int64_t skipped = 0;
  for (int64_t s : skips) skipped += s;
  EXPECT_EQ(skipped, 1);
}

// Gradients near float's largest value are finite: the Nesterov input (up to 1.95 x the
// gradient) and the norm (1e39 here) exceed float but not double. Both backends take every
// matrix (they used to skip them all as "non-finite"), in every pass-2 kernel variant.
TEST(CudaMuon, NearFloatMaxGradientsAreFinite) {
  DM_SKIP_WITHOUT_CUDA();
  for (auto [rows, cols] :
       {std::pair{64, 256}, std::pair{200, 72}, std::pair{330, 70}, std::pair{37, 53}}) {
    const std::vector<int32_t> st = check_passes(3, rows, cols, 1e37, false);
    for (int32_t s : st) EXPECT_EQ(s, kStatusOk) << rows << "x" << cols;
  }
}

// The orthogonalizer on the GPU against the float64 reference iteration.
struct OrthoCase {
  const char* algo;
  int64_t rows, cols, count;
  double tol;
};

class CudaOrtho : public ::testing::TestWithParam<OrthoCase> {};

TEST_P(CudaOrtho, MatchesFloat64Iteration) {
  DM_SKIP_WITHOUT_CUDA();
  const OrthoCase c = GetParam();
  CudaBackend& be = test::cuda_backend();
  OrthoConfig cfg = parse_algorithm(c.algo);
  cfg.work_dtype = DType::kBF16;
  HostBatch u(DType::kF32, c.count, c.rows, c.cols), out(DType::kF32, c.count, c.rows, c.cols);
  std::vector<Mat> want;
  for (int64_t i = 0; i < c.count; ++i) {
    u.set(i, random_matrix(c.rows, c.cols));
    want.push_back(test::reference_ns(u.get(i), cfg.coefficients, cfg.steps));
  }
  out.poison();
  DeviceBatch du(be, u), dout(be, out);
  Orthogonalizer(be).orthogonalize(cfg, du.ref, dout.ref);
  dout.download(be, out);
  for (int64_t i = 0; i < c.count; ++i) {
    const double e = rel_err(out.get(i), want[i]);
    std::printf("[measure] %s %lldx%lld: rel err %.3e vs float64 iteration\n", c.algo,
                (long long)c.rows, (long long)c.cols, e);
    EXPECT_LT(e, c.tol) << c.algo << " matrix " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Algorithms, CudaOrtho,
    ::testing::Values(OrthoCase{"ns5", 256, 768, 2, 2e-2}, OrthoCase{"ns5-sym", 256, 768, 2, 2e-2},
                      OrthoCase{"ns5-sym", 384, 384, 2, 2e-2}, OrthoCase{"gram-ns", 256, 1024, 2, 2e-2},
                      OrthoCase{"gram-ns", 1024, 256, 2, 2e-2},
                      OrthoCase{"gram-ns:polar-express-1.05", 384, 1536, 2, 2e-2},
                      OrthoCase{"ns5-sym:polar-express", 300, 520, 2, 2e-2}),
    [](const auto& info) {
      std::string n = std::string(info.param.algo) + "_" + std::to_string(info.param.rows) + "x" +
                      std::to_string(info.param.cols);
      for (char& ch : n) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// A small model: wide, tall and square matrices plus AdamW tensors.
struct Model {
  std::vector<std::vector<int64_t>> shapes = {{64, 192}, {192, 64}, {96, 96}, {64, 192}, {300}, {1024}};
  std::vector<Buffer> w, g;
  std::vector<std::vector<float>> w0;
  Model(Backend& be) {
    for (auto& s : shapes) {
      int64_t n = 1;
      for (int64_t d : s) n *= d;
      std::vector<float> wh(n), gh(n);
      std::normal_distribution<float> nd;
      for (float& v : wh) v = 0.02f * nd(test::rng());
      for (float& v : gh) v = nd(test::rng());
      w.push_back(be.alloc(n * 4));
      g.push_back(be.alloc(n * 4));
      be.copy_from_host(w.back().data(), wh.data(), n * 4);
      be.copy_from_host(g.back().data(), gh.data(), n * 4);
      w0.push_back(wh);
    }
  }
  void add_to(Engine& e, const char* algo) {
    GroupOptions gm;
    gm.muon.ortho = parse_algorithm(algo);
    gm.muon.ortho.work_dtype = DType::kBF16;
    gm.muon.weight_decay = 0.1f;
    e.add_group(gm);
    GroupOptions ga;
    ga.kind = ParamKind::kAdamW;
    e.add_group(ga);
    for (size_t i = 0; i < shapes.size(); ++i)
      e.add_param({"p" + std::to_string(i), shapes[i].size() == 2 ? 0 : 1, shapes[i], DType::kF32});
  }
  std::vector<ParamData> data() {
    std::vector<ParamData> d;
    for (size_t i = 0; i < shapes.size(); ++i) d.push_back({w[i].data(), g[i].data(), DType::kF32, {}});
    return d;
  }
  // The same weights and gradients as `o` (two engines then step from one state).
  void copy_from(Backend& be, const Model& o) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      be.copy(w[i].data(), o.w[i].data(), w0[i].size() * 4);
      be.copy(g[i].data(), o.g[i].data(), w0[i].size() * 4);
    }
  }
  std::vector<float> weights(Backend& be, size_t i) {
    std::vector<float> h(w0[i].size());
    be.copy_to_host(h.data(), w[i].data(), h.size() * 4);
    return h;
  }
};

// Eager steps and a captured-then-replayed step give bitwise identical weights.
TEST(CudaEngine, GraphReplayEqualsEagerStep) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  Model a(be);
  Model b(be);
  for (size_t i = 0; i < a.shapes.size(); ++i) {  // same initial state
    be.copy(b.w[i].data(), a.w[i].data(), a.w0[i].size() * 4);
    be.copy(b.g[i].data(), a.g[i].data(), a.w0[i].size() * 4);
  }
  Engine ea(be), eb(be);
  a.add_to(ea, "auto");
  b.add_to(eb, "auto");
  auto da = a.data(), db = b.data();
  ea.step(da);
  ea.step(da);
  ea.step(da);
  eb.step(db);  // first step allocates; the captured one must not
  be.synchronize();
  cuda::GraphExec exec = cuda::capture_graph(be.stream(), [&] { eb.step(db); });
  DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream()));
  DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream()));
  be.synchronize();
  // Every tensor bitwise equal: AdamW reads its step count on the device, so each replay
  // applies the next step's bias correction.
  for (size_t i = 0; i < a.shapes.size(); ++i) {
    auto wa = a.weights(be, i), wb = b.weights(be, i);
    EXPECT_NE(wa, a.w0[i]) << "parameter " << i << " was not updated";
    ASSERT_EQ(wa, wb) << "parameter " << i << " differs between eager and graph replay";
    if (a.shapes[i].size() == 1) {
      EXPECT_EQ(ea.param_step(static_cast<int>(i)), 3);
      EXPECT_EQ(eb.param_step(static_cast<int>(i)), 3);
    }
  }
}

// Two engines on one backend, one capturing its steps: `auto` by the heuristic (tuned, each
// would measure under its own key, graph-timed or issued, and could pick another algorithm).
EngineOptions with_graphs(bool on) {
  EngineOptions o;
  o.graphs = on;
  o.autotune = AutoTune::kOff;
  return o;
}

// Whole-step graphs (EngineOptions::graphs): an engine that captures its second step and
// replays the rest equals one that issues every step, bit for bit, while a schedule changes the
// learning rates, weight decays, momentum and AdamW's beta1 every step; with CacheMuon, the
// replayed gates decide as the issued ones and the counters agree.
TEST(CudaEngine, CapturedStepsFollowASchedule) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  for (const bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "gram-ns with CacheMuon" : "auto");
    Model a(be);
    Model b(be);
    b.copy_from(be, a);
    Engine ea(be, with_graphs(true)), eb(be, with_graphs(false));
    a.add_to(ea, cache ? "gram-ns" : "auto");
    b.add_to(eb, cache ? "gram-ns" : "auto");
    for (Engine* e : {&ea, &eb}) {
      e->group(0).muon.cache.enabled = cache;
      e->group(0).muon.cache.gamma = 50.0;  // the gradient is constant: hits after the first fill
    }
    auto da = a.data(), db = b.data();
    const int steps = 6;
    for (int s = 0; s < steps; ++s) {
      for (Engine* e : {&ea, &eb}) {
        e->group(0).muon.lr = 0.02f / (1 + s);
        e->group(0).muon.weight_decay = 0.05f * s;
        e->group(0).muon.momentum = 0.85f + 0.02f * s;
        e->group(1).adamw.lr = 1e-3f * (1 + s);
        e->group(1).adamw.beta1 = 0.9f - 0.01f * s;
      }
      ea.step(da);
      eb.step(db);
    }
    be.synchronize();
    for (size_t i = 0; i < a.shapes.size(); ++i) {
      auto wa = a.weights(be, i), wb = b.weights(be, i);
      EXPECT_NE(wa, a.w0[i]) << "parameter " << i << " was not updated";
      ASSERT_EQ(wa, wb) << "parameter " << i << " differs between replayed and eager steps";
    }
    const EngineStats sa = ea.stats(), sb = eb.stats();
    if (std::getenv("DISTMUON_GRAPHS") == nullptr) {
      EXPECT_EQ(sa.graph_captures, 1);
      EXPECT_EQ(sa.graph_replays, steps - 2);
      EXPECT_EQ(sb.graph_captures + sb.graph_replays, 0);
    }
    EXPECT_EQ(sa.ortho.flops, sb.ortho.flops);
    EXPECT_EQ(sa.cache.hits, sb.cache.hits);
    EXPECT_EQ(sa.cache.refreshes, sb.cache.refreshes);
    EXPECT_EQ(sa.cache.calls, sb.cache.calls);
    if (cache) {
      std::printf("[measure] CacheMuon under graphs: %lld hits, %lld refreshes in %d steps\n",
                  static_cast<long long>(sa.cache.hits), static_cast<long long>(sa.cache.refreshes),
                  steps);
      EXPECT_GT(sa.cache.hits, 0);
    }
    EXPECT_EQ(ea.param_step(4), steps);
  }
}

// A captured step holds the backend's workspace: after set_workspace (which frees the backend's
// own) the engine captures again rather than replaying into freed memory, and still equals an
// engine that issues every step.
TEST(CudaEngine, ANewWorkspaceCapturesAgain) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend be;  // its own: the test replaces its workspace
  Model a(be);
  Model b(be);
  b.copy_from(be, a);
  Engine ea(be, with_graphs(true)), eb(be, with_graphs(false));
  a.add_to(ea, "gram-ns");
  b.add_to(eb, "gram-ns");
  auto da = a.data(), db = b.data();
  Buffer mine = be.alloc(CudaBackend::recommended_workspace_bytes());
  const uint64_t epoch = be.capture_epoch();
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      be.set_workspace(mine.data(), mine.bytes());
      EXPECT_NE(be.capture_epoch(), epoch);
    }
    ea.step(da);
    eb.step(db);
  }
  be.synchronize();
  for (size_t i = 0; i < a.shapes.size(); ++i)
    ASSERT_EQ(a.weights(be, i), b.weights(be, i)) << "parameter " << i;
  if (std::getenv("DISTMUON_GRAPHS") == nullptr) {
    EXPECT_EQ(ea.stats().graph_captures, 2);  // steps 2 and 5
    EXPECT_EQ(ea.stats().graph_replays, 2);   // steps 3 and 6
  }
  be.set_workspace(nullptr, 0);  // before `mine` is released
}

// The GPU engine follows the CPU engine (fp32 reference iteration) within bf16 tolerance.
TEST(CudaEngine, StepsFollowCpuEngine) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  Model gm(be);
  Model cm(cpu);
  for (size_t i = 0; i < gm.shapes.size(); ++i) {
    std::vector<float> h(gm.w0[i].size());
    be.copy_to_host(h.data(), gm.g[i].data(), h.size() * 4);
    cpu.copy_from_host(cm.g[i].data(), h.data(), h.size() * 4);
    cpu.copy_from_host(cm.w[i].data(), gm.w0[i].data(), h.size() * 4);
  }
  Engine eg(be), ec(cpu);
  gm.add_to(eg, "auto");
  GroupOptions g0;
  g0.muon.ortho = parse_algorithm("ns5");
  g0.muon.weight_decay = 0.1f;
  ec.add_group(g0);
  GroupOptions g1;
  g1.kind = ParamKind::kAdamW;
  ec.add_group(g1);
  for (size_t i = 0; i < cm.shapes.size(); ++i)
    ec.add_param({"p" + std::to_string(i), cm.shapes[i].size() == 2 ? 0 : 1, cm.shapes[i], DType::kF32});
  auto dg = gm.data(), dc = cm.data();
  for (int s = 0; s < 2; ++s) {
    eg.step(dg);
    ec.step(dc);
  }
  for (size_t i = 0; i < gm.shapes.size(); ++i) {
    auto wg = gm.weights(be, i), wc = cm.weights(cpu, i);
    double num = 0, den = 0;
    for (size_t j = 0; j < wg.size(); ++j) {
      const double d0 = double(wg[j]) - gm.w0[i][j], d1 = double(wc[j]) - gm.w0[i][j];
      num += (d0 - d1) * (d0 - d1);
      den += d1 * d1;
    }
    EXPECT_LT(std::sqrt(num / den), 3e-2) << "update of parameter " << i;
  }
}

}  // namespace
}  // namespace distmuon
