// Every CPU backend operation against a direct float64 computation (Eigen) on fresh random
// inputs, with outputs poisoned beforehand so that unwritten elements fail.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/muon_ref.h"
#include "common/half.h"
#include "distmuon/error.h"
#include "test_util.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::rel_err;

double tol_for(DType t) {
  switch (t) {
    case DType::kF64: return 1e-12;
    case DType::kF32: return 1e-5;
    default: return 1e-2;
  }
}

class GemmTest : public ::testing::TestWithParam<std::tuple<DType, int, int, bool>> {};

TEST_P(GemmTest, MatchesFloat64) {
  auto [dtype, ta, tb, symmetric] = GetParam();
  CpuBackend be;
  const int64_t count = 3, m = 37, k = 53;
  const int64_t n = symmetric ? m : 29;
  HostBatch a(dtype, count, ta ? k : m, ta ? m : k), b(dtype, count, tb ? n : k, tb ? k : n);
  HostBatch cin(dtype, count, m, n), c(dtype, count, m, n);
  std::vector<Mat> want;
  for (int64_t i = 0; i < count; ++i) {
    Mat ma = random_matrix(a.ref.rows, a.ref.cols);
    Mat mb = symmetric ? (ta != tb ? Mat(ma) : Mat(ma.transpose())) : random_matrix(b.ref.rows, b.ref.cols);
    Mat mc = random_matrix(m, n);
    if (symmetric) mc = (mc + mc.transpose()).eval();
    a.set(i, ma);
    b.set(i, mb);
    cin.set(i, mc);
    // Use the rounded operands, so that only the product's own rounding is measured.
    Mat ra = a.get(i), rb = b.get(i), rc = cin.get(i);
    Mat opa = ta ? Mat(ra.transpose()) : ra, opb = tb ? Mat(rb.transpose()) : rb;
    want.push_back(0.75 * opa * opb - 0.5 * rc);
  }
  c.poison();
  if (symmetric) {
    // symmetric only makes sense for X X^T-like products: op(B) = op(A)^T.
    be.gemm_symmetric(ta ? Op::kT : Op::kN, a.ref, tb ? Op::kT : Op::kN, b.ref, 0.75f, -0.5f, &cin.ref, c.ref);
  } else {
    be.gemm(ta ? Op::kT : Op::kN, a.ref, tb ? Op::kT : Op::kN, b.ref, 0.75f, -0.5f, &cin.ref, c.ref);
  }
  for (int64_t i = 0; i < count; ++i) {
    Mat got = c.get(i);
    EXPECT_LT(rel_err(got, want[i]), tol_for(dtype)) << "matrix " << i;
    if (symmetric) {
      EXPECT_EQ((got - got.transpose()).norm(), 0.0) << "not exactly symmetric";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllLayouts, GemmTest,
    ::testing::Combine(::testing::Values(DType::kF64, DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(0, 1), ::testing::Values(0, 1), ::testing::Values(false)));
// Symmetric products: X X^T (N, T) and X^T X (T, N).
INSTANTIATE_TEST_SUITE_P(
    Symmetric, GemmTest,
    ::testing::Values(std::make_tuple(DType::kF64, 0, 1, true), std::make_tuple(DType::kF32, 0, 1, true),
                      std::make_tuple(DType::kBF16, 0, 1, true), std::make_tuple(DType::kF16, 0, 1, true),
                      std::make_tuple(DType::kF32, 1, 0, true)));

TEST(CpuBackend, SymmetricProductOfCommutingMatrices) {
  CpuBackend be;
  const int64_t m = 300;  // more than one 128-row block
  Mat x = random_matrix(m, 2 * m);
  Mat r = x * x.transpose();
  Mat z = 0.3 * r + 0.1 * r * r;  // a polynomial in r: commutes with r
  HostBatch br(DType::kF64, 1, m, m), bz(DType::kF64, 1, m, m), out(DType::kF64, 1, m, m);
  br.set(0, r);
  bz.set(0, z);
  out.poison();
  be.gemm_symmetric(Op::kN, br.ref, Op::kN, bz.ref, 1.0f, 2.0f, &br.ref, out.ref);
  EXPECT_LT(rel_err(out.get(0), r * z + 2.0 * r), 1e-12);
}

// fp32 products of the sizes the backend's own AVX-512 kernel takes (cpu_small_gemm.h, where the
// CPU has it; OpenBLAS elsewhere): whole 8 x 32 tiles, edge tiles and panels, every layout, with
// and without a Cin (beta 0 must not read the poisoned C), and symmetric products of either kind
// (X X^T with a packed transposed panel, two commuting symmetric matrices), which write one
// triangle and mirror it.
TEST(CpuBackend, Fp32ProductsOfSmallModelSizes) {
  CpuBackend be;
  for (auto [m, n, k] : {std::array<int64_t, 3>{128, 128, 128}, {128, 384, 128},
                         {64, 96, 200}, {45, 70, 19}, {130, 33, 47}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (double beta : {0.0, -0.5}) {
          HostBatch a(DType::kF32, 1, ta ? k : m, ta ? m : k), b(DType::kF32, 1, tb ? n : k, tb ? k : n);
          HostBatch cin(DType::kF32, 1, m, n), c(DType::kF32, 1, m, n);
          a.set(0, random_matrix(a.ref.rows, a.ref.cols));
          b.set(0, random_matrix(b.ref.rows, b.ref.cols));
          cin.set(0, random_matrix(m, n));
          Mat ra = a.get(0), rb = b.get(0);
          Mat want = 0.75 * (ta ? Mat(ra.transpose()) : ra) * (tb ? Mat(rb.transpose()) : rb);
          if (beta != 0.0) want += beta * cin.get(0);
          c.poison();
          be.gemm(ta ? Op::kT : Op::kN, a.ref, tb ? Op::kT : Op::kN, b.ref, 0.75, beta,
                  beta != 0.0 ? &cin.ref : nullptr, c.ref);
          EXPECT_LT(rel_err(c.get(0), want), 1e-5)
              << m << "x" << n << "x" << k << " ta " << ta << " tb " << tb << " beta " << beta;
        }
  }
  for (auto [m, k] : {std::array<int64_t, 2>{128, 512}, {100, 37}, {40, 128}}) {
    Mat x = random_matrix(m, k);
    HostBatch bx(DType::kF32, 1, m, k), r(DType::kF32, 1, m, m), z(DType::kF32, 1, m, m),
        out(DType::kF32, 1, m, m);
    bx.set(0, x);
    r.poison();
    be.gemm_symmetric(Op::kN, bx.ref, Op::kT, bx.ref, 1.0, 0.0, nullptr, r.ref);
    Mat rx = bx.get(0), got_r = r.get(0);
    EXPECT_LT(rel_err(got_r, rx * rx.transpose()), 1e-5) << m << "x" << k;
    EXPECT_EQ((got_r - got_r.transpose()).norm(), 0.0) << "X X^T not exactly symmetric";
    Mat rr = got_r / got_r.norm();
    r.set(0, rr);
    z.set(0, Mat(0.3 * rr + 0.1 * rr * rr));
    Mat zr = z.get(0);
    zr = 0.5 * (zr + zr.transpose());
    z.set(0, zr);
    out.poison();
    be.gemm_symmetric(Op::kN, r.ref, Op::kN, z.ref, 1.5, 2.0, &r.ref, out.ref);
    Mat got = out.get(0);
    EXPECT_LT(rel_err(got, 1.5 * r.get(0) * zr + 2.0 * r.get(0)), 1e-5) << m;
    EXPECT_EQ((got - got.transpose()).norm(), 0.0) << "R Z not exactly symmetric";
    out.poison();
    be.gemm_symmetric(Op::kN, r.ref, Op::kN, r.ref, 1.0, 0.0, nullptr, out.ref);  // R R
    got = out.get(0);
    EXPECT_LT(rel_err(got, r.get(0) * r.get(0)), 1e-5) << m;
    EXPECT_EQ((got - got.transpose()).norm(), 0.0) << "R R not exactly symmetric";
  }
}

// memory_use counts the Buffers alive and the most held at once; a Buffer that outlives its
// backend still releases (and uncounts) safely.
TEST(CpuBackend, MemoryUseCountsLiveBuffersAndThePeak) {
  auto be = std::make_unique<CpuBackend>();
  EXPECT_EQ(be->memory_use().bytes, 0);
  Buffer a = be->alloc(1000), b = be->alloc(3000);
  EXPECT_EQ(be->memory_use().bytes, 4000);
  b.reset();
  EXPECT_EQ(be->memory_use().bytes, 1000);
  EXPECT_EQ(be->memory_use().peak_bytes, 4000);
  Buffer c = be->alloc(500), none = be->alloc(0);
  EXPECT_EQ(be->memory_use().bytes, 1500);
  EXPECT_EQ(be->memory_use().peak_bytes, 4000);
  be.reset();
  a.reset();
  c.reset();  // after the backend: no crash (the count is shared with the Buffer)
}

// A thread count that is not one is refused where the backend reads it (it used to mean the
// library default, silently).
TEST(CpuBackend, NegativeThreadCountIsRefused) {
  ::setenv("DISTMUON_NUM_THREADS", "-3", 1);
  std::string msg;
  try {
    CpuBackend be;
  } catch (const Error& e) {
    msg = e.what();
  }
  ::unsetenv("DISTMUON_NUM_THREADS");
  EXPECT_NE(msg.find("DISTMUON_NUM_THREADS=-3 is not a thread count"), std::string::npos) << msg;
}

// The PyTorch front passes torch's intra-op pool size before each step: that count, not the
// calling thread's OpenMP setting, splits a batch and sizes the loops' teams, on every thread;
// 0 gives the choice back to OpenMP, and a count out of range is refused without effect.
TEST(CpuBackend, ThreadCountSetForTheProcessSplitsBatches) {
  const int blas = openblas_get_num_threads(), omp = omp_get_max_threads();
  openblas_set_num_threads(1);
  omp_set_num_threads(1);
  set_cpu_threads(3);
  EXPECT_EQ(cpu_threads(), 3);
  EXPECT_EQ(CpuBackend().batch_parts(5), 3);
  EXPECT_EQ(CpuBackend().batch_parts(2), 2);
  std::atomic<int> team{0};
  cpu::for_each_matrix(6, [&](int64_t) { team = omp_get_num_threads(); });
  EXPECT_EQ(team.load(), 3);
  int other = 0;  // a thread with OpenMP's default setting
  std::thread([&] { other = cpu_threads(); }).join();
  EXPECT_EQ(other, 3);
  EXPECT_THROW(set_cpu_threads(-1), Error);
  EXPECT_THROW(set_cpu_threads(5000), Error);
  EXPECT_EQ(cpu_threads(), 3);
  set_cpu_threads(0);
  EXPECT_EQ(cpu_threads(), 1);
  EXPECT_EQ(CpuBackend().batch_parts(5), 1);
  openblas_set_num_threads(blas);
  omp_set_num_threads(omp);
}

// One grouped call per pass (all small matrices in one loop over the threads, a larger batch
// through its own call) gives every matrix the bits of its batch's own calls: wide and tall
// batches, a bf16 gradient with a non-finite entry (a skip), and a batch above
// cpu::kLoopElements per matrix. A bad batch anywhere refuses the call before any write.
struct PassSet {
  std::vector<HostBatch> g, b, w, x;
  std::vector<std::vector<MuonSlot>> slots;
  std::vector<MuonUpdateCoef> coef;
  std::vector<int64_t> skips, offset;
  std::vector<double> norms;
  std::vector<int32_t> status;
  float mu = 0.9f;

  // inputs[k][i]: matrix i of case k's gradient, momentum and weight.
  PassSet(const std::vector<std::tuple<int64_t, int64_t, int64_t, DType>>& cases,
          const std::vector<std::vector<std::array<Mat, 3>>>& inputs) {
    int64_t total = 0;
    for (const auto& c : cases) offset.push_back(std::exchange(total, total + std::get<0>(c)));
    coef.assign(total, MuonUpdateCoef{0.99f, 0.02f});
    skips.assign(total, 0);
    norms.assign(total, 0);
    status.assign(total, 0);
    for (size_t k = 0; k < cases.size(); ++k) {
      const auto [count, rows, cols, dt] = cases[k];
      g.emplace_back(dt, count, rows, cols);
      b.emplace_back(DType::kF32, count, rows, cols);
      w.emplace_back(DType::kF32, count, rows, cols);
      x.emplace_back(DType::kF32, count, std::min(rows, cols), std::max(rows, cols));
      x.back().poison();
      slots.emplace_back();
      for (int64_t i = 0; i < count; ++i) {
        g.back().set(i, inputs[k][i][0]);
        b.back().set(i, inputs[k][i][1]);
        w.back().set(i, inputs[k][i][2]);
        const int64_t at = offset[k] + i;
        slots.back().push_back({g.back().ref.matrix(i), b.back().ref.matrix(i),
                                w.back().ref.matrix(i), &skips[at], &coef[at]});
      }
    }
  }
  std::vector<MuonPassBatch> batches() {
    std::vector<MuonPassBatch> out;
    for (size_t k = 0; k < slots.size(); ++k) {
      MuonPassBatch p;
      p.slots = slots[k];
      p.mu = &mu;
      p.nesterov = true;
      p.norms = norms.data() + offset[k];
      p.status = status.data() + offset[k];
      p.scale = {p.norms, 1.0, 1e-7, 1.0};
      p.transpose = slots[k][0].grad.rows > slots[k][0].grad.cols;
      p.x = x[k].ref;
      out.push_back(p);
    }
    return out;
  }
  std::vector<uint8_t> bytes() const {  // every output, concatenated
    std::vector<uint8_t> all;
    auto add = [&](const void* p, size_t n) {
      all.insert(all.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    add(skips.data(), skips.size() * sizeof(int64_t));
    add(norms.data(), norms.size() * sizeof(double));
    add(status.data(), status.size() * sizeof(int32_t));
    for (const auto* v : {&b, &w, &x})
      for (const HostBatch& h : *v) add(h.bytes.data(), h.bytes.size());
    return all;
  }
};

// fp32 passes (the AVX-512 loops where the CPU has them) give the bits of the scalar formulas:
// B' = mu B + G and W = decay W - step O in float without fused multiply-adds, V in double
// (muon_ref::scaled_input), X = fl32(V f), written transposed for tall matrices; the norm's double
// sum may run in another order. Edge tiles (sizes not multiples of 16) and a skipped matrix.
TEST(CpuBackend, Fp32PassesGiveTheScalarFormulasBits) {
  const std::vector<std::tuple<int64_t, int64_t, int64_t, DType>> cases = {
      {2, 37, 70, DType::kF32}, {2, 70, 37, DType::kF32}, {2, 130, 48, DType::kF32}};
  std::vector<std::vector<std::array<Mat, 3>>> inputs;
  for (const auto& [count, rows, cols, dt] : cases) {
    inputs.emplace_back();
    for (int64_t i = 0; i < count; ++i) {
      Mat gm = random_matrix(rows, cols, 1.0);
      if (rows == 130 && i == 1) gm(100, 40) = INFINITY;  // a skip
      inputs.back().push_back({gm, random_matrix(rows, cols, 0.5), random_matrix(rows, cols, 0.02)});
    }
  }
  PassSet ps(cases, inputs);
  std::vector<std::vector<std::array<Mat, 3>>> stored;  // the inputs as fp32 holds them
  for (size_t k = 0; k < cases.size(); ++k) {
    stored.emplace_back();
    for (int64_t i = 0; i < std::get<0>(cases[k]); ++i)
      stored.back().push_back({ps.g[k].get(i), ps.b[k].get(i), ps.w[k].get(i)});
  }
  CpuBackend be;
  for (MuonPass pass : {MuonPass::kNorm, MuonPass::kApply, MuonPass::kUpdate})
    be.muon_pass_grouped(pass, ps.batches());
  const float mu = ps.mu;
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto [count, rows, cols, dt] = cases[k];
    for (int64_t i = 0; i < count; ++i) {
      const int64_t at = ps.offset[k] + i;
      const Mat &g = stored[k][i][0], &b = stored[k][i][1], &w = stored[k][i][2];
      double sum = 0;
      bool finite = true;
      Mat bn(rows, cols), v(rows, cols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float gv = static_cast<float>(g(r, c));
          const float bv = mu * static_cast<float>(b(r, c)) + gv;
          const float vv = muon_ref::scaled_input(gv, bv, mu, true);
          finite = finite && std::isfinite(gv) && std::isfinite(bv);
          sum += static_cast<double>(vv) * vv;
          bn(r, c) = bv;
          v(r, c) = vv;
        }
      ASSERT_EQ(ps.status[at], finite ? kStatusOk : kStatusNonFinite) << k << " " << i;
      if (!finite) {
        EXPECT_EQ(ps.b[k].get(i), b) << "a skipped matrix's momentum changed";
        continue;
      }
      const double norm = muon_ref::float_precision(std::sqrt(sum));
      EXPECT_NEAR(ps.norms[at], norm, norm * 0x1p-22) << k << " " << i;
      const double f = 1.0 / (ps.norms[at] + 1e-7);
      const bool tall = rows > cols;
      Mat x = ps.x[k].get(i), wn = ps.w[k].get(i), bb = ps.b[k].get(i);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(bb(r, c), bn(r, c)) << "momentum " << k << " " << i << " " << r << " " << c;
          const float xv = tall ? static_cast<float>(x(c, r)) : static_cast<float>(x(r, c));
          ASSERT_EQ(xv, static_cast<float>(v(r, c) * f)) << "X " << k << " " << i << " " << r << " " << c;
          const MuonUpdateCoef& q = ps.coef[at];
          const float want = q.decay * static_cast<float>(w(r, c)) - q.step * xv;
          ASSERT_EQ(static_cast<float>(wn(r, c)), want) << "W " << k << " " << i << " " << r << " " << c;
        }
    }
  }
}

TEST(CpuBackend, GroupedPassesGiveEveryBatchItsOwnBits) {
  const int blas = openblas_get_num_threads();
  openblas_set_num_threads(1);
  set_cpu_threads(3);
  const std::vector<std::tuple<int64_t, int64_t, int64_t, DType>> cases = {
      {3, 24, 80, DType::kF32},     // wide
      {2, 72, 40, DType::kF32},     // tall
      {3, 37, 21, DType::kBF16},    // tall, one skip
      {2, 160, 480, DType::kF32}};  // above kLoopElements per matrix: its own call
  ASSERT_GT(160 * 480, cpu::kLoopElements);
  std::vector<std::vector<std::array<Mat, 3>>> inputs;
  for (const auto& [count, rows, cols, dt] : cases) {
    inputs.emplace_back();
    for (int64_t i = 0; i < count; ++i) {
      Mat gm = random_matrix(rows, cols, 1.0);
      if (dt == DType::kBF16 && i == 1) gm(rows / 2, cols / 3) = NAN;  // one skip
      inputs.back().push_back(
          {gm, random_matrix(rows, cols, 0.5), random_matrix(rows, cols, 0.02)});
    }
  }
  CpuBackend be;
  PassSet grouped(cases, inputs), alone(cases, inputs);
  const std::vector<uint8_t> before = grouped.bytes();

  std::vector<MuonPassBatch> bad = grouped.batches();
  bad.back().x.count = 1;
  EXPECT_THROW(be.muon_pass_grouped(MuonPass::kApply, bad), Error);
  EXPECT_TRUE(grouped.bytes() == before) << "a refused call changed something";

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
  const std::vector<uint8_t> got = grouped.bytes();
  EXPECT_TRUE(got == alone.bytes()) << "the grouped passes differ from the batches' own calls";
  EXPECT_FALSE(got == before);
  EXPECT_EQ(grouped.skips[grouped.offset[2] + 1], 1);
  set_cpu_threads(0);
  openblas_set_num_threads(blas);
}

TEST(CpuBackend, GemmRejectsMismatchedShapes) {
  CpuBackend be;
  HostBatch a(DType::kF32, 1, 4, 5), b(DType::kF32, 1, 6, 3), c(DType::kF32, 1, 4, 3);
  EXPECT_THROW(be.gemm(Op::kN, a.ref, Op::kN, b.ref, 1, 0, nullptr, c.ref), Error);
}

TEST(CpuBackend, LincombNormAndScaleCopy) {
  CpuBackend be;
  Mat a = random_matrix(20, 20), b = random_matrix(20, 20);
  HostBatch ha(DType::kF32, 2, 20, 20), hb(DType::kF32, 2, 20, 20), out(DType::kF32, 2, 20, 20);
  for (int i = 0; i < 2; ++i) {
    ha.set(i, a * (i + 1));
    hb.set(i, b);
  }
  out.poison();
  be.lincomb(2.0f, ha.ref, -1.0f, &hb.ref, 0.5f, out.ref);
  Mat eye = Mat::Identity(20, 20);
  EXPECT_LT(rel_err(out.get(1), 2.0 * ha.get(1) - hb.get(1) + 0.5 * eye), 1e-6);

  double norms[2];
  be.frob_norm(ha.ref, norms);
  EXPECT_NEAR(norms[1], ha.get(1).norm(), 1e-4 * ha.get(1).norm());

  HostBatch t(DType::kBF16, 2, 20, 20);
  t.poison();
  be.scale_copy(ha.ref, true, ScaleSpec{norms, 1.0f, 1e-7f, 1.0f}, t.ref);
  Mat want = ha.get(1).transpose() / (norms[1] + 1e-7);
  EXPECT_LT(rel_err(t.get(1), want), 5e-3);
}

// The default copy_blocks: each block copied (same type, at any offset) or converted (as
// scale_copy rounds, checked against bfloat16 rounding too), empty blocks skipped, a negative
// length refused before anything is written.
TEST(CpuBackend, CopyBlocksCopiesOrConvertsEachBlock) {
  CpuBackend be;
  HostBatch src(DType::kF32, 1, 1, 300), same(DType::kF32, 1, 1, 100), conv(DType::kBF16, 1, 1, 200);
  src.set(0, random_matrix(1, 300));
  same.poison();
  conv.poison();
  const float* s = static_cast<const float*>(src.ref.data);
  const BlockCopy copies[] = {
      {s + 3, DType::kF32, same.ref.data, DType::kF32, 100},
      {s + 100, DType::kF32, conv.ref.data, DType::kBF16, 200},
      {s, DType::kF32, nullptr, DType::kF32, 0},
  };
  be.copy_blocks(copies);
  EXPECT_EQ(same.get(0), src.get(0).block(0, 3, 1, 100));
  HostBatch want(DType::kBF16, 1, 1, 200);
  be.scale_copy(BatchRef::packed(const_cast<float*>(s) + 100, DType::kF32, 1, 1, 200), false, {}, want.ref);
  EXPECT_EQ(conv.get(0), want.get(0));
  for (int64_t i = 0; i < 200; ++i)  // round to nearest even on bfloat16's 8 significant bits
    EXPECT_EQ(conv.get(0)(0, i), static_cast<double>(bf16_to_float(float_to_bf16(s[100 + i]))));
  // A bad copy after a good one: refused before the good one is written.
  HostBatch untouched(DType::kF32, 1, 1, 4);
  untouched.poison();
  const BlockCopy some_bad[] = {{s, DType::kF32, untouched.ref.data, DType::kF32, 4},
                                {s, DType::kF32, same.ref.data, DType::kF32, -1}};
  EXPECT_THROW(be.copy_blocks(some_bad), Error);
  EXPECT_TRUE(untouched.get(0).array().isNaN().all());
}

// The default lincomb_grouped: each problem as its own lincomb(), and a bad problem anywhere
// refuses the call before any output is written.
TEST(CpuBackend, LincombGroupedIsLincombPerProblemAndChecksFirst) {
  CpuBackend be;
  HostBatch a1(DType::kF32, 2, 12, 12), o1(DType::kF32, 2, 12, 12), w1(DType::kF32, 2, 12, 12);
  HostBatch a2(DType::kBF16, 1, 6, 9), b2(DType::kBF16, 1, 6, 9), o2(DType::kBF16, 1, 6, 9),
      w2(DType::kBF16, 1, 6, 9);
  for (int i = 0; i < 2; ++i) a1.set(i, random_matrix(12, 12));
  a2.set(0, random_matrix(6, 9));
  b2.set(0, random_matrix(6, 9));
  for (HostBatch* h : {&o1, &w1, &o2, &w2}) h->poison();
  std::vector<LincombProblem> call = {{1.0, a1.ref, 0.0, BatchRef{}, 1.875, o1.ref},
                                      {0.5, a2.ref, -2.0, b2.ref, 0.0, o2.ref}};
  std::vector<LincombProblem> bad = call;
  bad.push_back({1.0, a2.ref, 0.0, BatchRef{}, 1.0, o2.ref});  // identity term, not square
  EXPECT_THROW(be.lincomb_grouped(bad), Error);
  EXPECT_TRUE(std::isnan(o1.get(0)(0, 0)) && std::isnan(o2.get(0)(0, 0))) << "written anyway";
  be.lincomb_grouped(call);
  be.lincomb(1.0, a1.ref, 0.0, nullptr, 1.875, w1.ref);
  be.lincomb(0.5, a2.ref, -2.0, &b2.ref, 0.0, w2.ref);
  EXPECT_EQ(o1.bytes, w1.bytes);
  EXPECT_EQ(o2.bytes, w2.bytes);
  EXPECT_LT(rel_err(o1.get(1), a1.get(1) + 1.875 * Mat::Identity(12, 12)), 1e-6);
}

TEST(CpuBackend, FrobNormDoesNotOverflowOnHugeInputs) {
  CpuBackend be;
  HostBatch h(DType::kF32, 1, 8, 8);
  h.set(0, Mat::Constant(8, 8, 3e38));  // the squares overflow float, and so does the norm
  double norm;
  be.frob_norm(h.ref, &norm);
  EXPECT_NEAR(norm, 24e38, 1e33);
}

TEST(CpuBackend, AdamwMatchesClosedForm) {
  CpuBackend be;
  const int64_t n = 1000;
  std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::sin(0.1 * i);
    g[i] = std::cos(0.37 * i);
  }
  std::vector<float> p0 = p;
  AdamCoef k{0.01f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  AdamSlot s{p.data(), g.data(), m.data(), v.data(), DType::kF32, DType::kF32, n, nullptr, &k};
  int32_t status = -1;
  be.adamw_check({&s, 1}, &status);
  EXPECT_EQ(status, kStatusOk);
  be.adamw_update({&s, 1}, &status);
  for (int64_t i = 0; i < n; ++i) {
    // Step 1: bias-corrected m and v are g and g^2, so the step is lr * g / (|g| + eps).
    double want = p0[i] * (1 - 0.01 * 0.1) - 0.01 * g[i] / (std::abs(g[i]) + 1e-8);
    ASSERT_NEAR(p[i], want, 1e-6) << i;
    ASSERT_NEAR(m[i], 0.1 * g[i], 1e-7);
    ASSERT_NEAR(v[i], 0.05 * g[i] * g[i], 1e-7);
  }
  g[7] = std::nanf("");
  be.adamw_check({&s, 1}, &status);
  EXPECT_EQ(status, kStatusNonFinite);
  int64_t counter = 0;
  be.count_status(&status, 1, &counter);
  EXPECT_EQ(counter, 1);
}

}  // namespace
}  // namespace distmuon
