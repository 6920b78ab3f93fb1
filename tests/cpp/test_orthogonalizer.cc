// Every orthogonalization algorithm against the float64 reference of the same iteration, on
// fresh random wide, tall, square, one-row and zero inputs; Gram NS against standard NS; a
// converging schedule against the SVD polar factor; FLOP counts against docs/algorithms.md.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "test_util.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace distmuon {
namespace {

using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::reference_ns;
using test::rel_err;

// Runs the orthogonalizer on `inputs` (all the same shape) and returns its outputs (f64 read-back).
std::vector<Mat> run_ortho(const OrthoConfig& cfg, const std::vector<Mat>& inputs,
                           DType io_dtype = DType::kF64, OrthoStats* stats = nullptr) {
  CpuBackend be;
  Orthogonalizer ortho(be);
  const int64_t count = static_cast<int64_t>(inputs.size());
  HostBatch u(io_dtype, count, inputs[0].rows(), inputs[0].cols());
  HostBatch out(io_dtype, count, inputs[0].rows(), inputs[0].cols());
  for (int64_t i = 0; i < count; ++i) u.set(i, inputs[i]);
  out.poison();
  ortho.orthogonalize(cfg, u.ref, out.ref, stats);
  std::vector<Mat> r;
  for (int64_t i = 0; i < count; ++i) r.push_back(out.get(i));
  return r;
}

struct Shape {
  int64_t rows, cols;
  bool zero;
};

const Shape kShapes[] = {{24, 80, false}, {80, 24, false}, {40, 40, false},
                         {1, 64, false},  {64, 1, false},  {16, 48, true}};

const Iteration kIterations[] = {Iteration::kStandardDense, Iteration::kStandardSym,
                                 Iteration::kGram, Iteration::kAuto};
const Coefficients kCoeffs[] = {Coefficients::kJordan, Coefficients::kPolarExpress,
                                Coefficients::kPolarExpress105, Coefficients::kYou};

TEST(Orthogonalizer, EveryAlgorithmMatchesFloat64ReferenceOfTheSameIteration) {
  for (Iteration it : kIterations)
    for (Coefficients co : kCoeffs)
      for (const Shape& s : kShapes) {
        OrthoConfig cfg;
        cfg.iteration = it;
        cfg.coefficients = co;
        cfg.work_dtype = DType::kF64;
        std::vector<Mat> in;
        for (int i = 0; i < 3; ++i)
          in.push_back(s.zero ? Mat(Mat::Zero(s.rows, s.cols)) : random_matrix(s.rows, s.cols, 0.1 + i));
        std::vector<Mat> out = run_ortho(cfg, in);
        for (size_t i = 0; i < in.size(); ++i) {
          Mat want = reference_ns(in[i], co, cfg.steps);
          SCOPED_TRACE(iteration_name(it) + ":" + coefficients_name(co) + " " +
                       std::to_string(s.rows) + "x" + std::to_string(s.cols));
          ASSERT_FALSE(out[i].hasNaN());
          if (s.zero) {
            EXPECT_EQ(out[i].norm(), 0.0);  // a zero input gives a zero output, never NaN
          } else {
            EXPECT_LT(rel_err(out[i], want), 1e-10);
          }
        }
      }
}

TEST(Orthogonalizer, GramEqualsStandardInFloat64WithAndWithoutRestarts) {
  for (std::vector<int> restarts : {std::vector<int>{}, std::vector<int>{2}, std::vector<int>{1, 3}}) {
    for (Coefficients co : kCoeffs) {
      std::vector<Mat> in = {random_matrix(32, 96), random_matrix(96, 32), random_matrix(20, 200)};
      for (const Mat& u : in) {
        OrthoConfig g;
        g.iteration = Iteration::kGram;
        g.coefficients = co;
        g.restarts = restarts;
        g.work_dtype = DType::kF64;
        OrthoConfig s = g;
        s.iteration = Iteration::kStandardDense;
        Mat a = run_ortho(g, {u})[0], b = run_ortho(s, {u})[0];
        EXPECT_LT(rel_err(a, b), 1e-8) << coefficients_name(co) << " restarts " << restarts.size();
      }
    }
  }
}

TEST(Orthogonalizer, ConvergingScheduleApproachesSvdPolarFactor) {
  // Polar Express with ten steps converges for well-conditioned random inputs.
  OrthoConfig cfg;
  cfg.iteration = Iteration::kGram;
  cfg.coefficients = Coefficients::kPolarExpress;
  cfg.steps = 10;
  cfg.work_dtype = DType::kF64;
  for (auto [r, c] : {std::pair{48, 160}, std::pair{160, 48}}) {
    Mat u = random_matrix(r, c);
    Mat o = run_ortho(cfg, {u})[0];
    EXPECT_LT(rel_err(o, test::polar_factor(u)), 1e-3);
  }
  // Keller Jordan's quintic deliberately does not converge (singular values in ~[0.68, 1.15]).
  OrthoConfig jordan;
  jordan.work_dtype = DType::kF64;
  Mat u = random_matrix(48, 160);
  double e = rel_err(run_ortho(jordan, {u})[0], test::polar_factor(u));
  EXPECT_GT(e, 0.02);
  EXPECT_LT(e, 0.4);
}

TEST(Orthogonalizer, Float32AndHalfPrecisionStayCloseToReference) {
  struct Case {
    Iteration it;
    DType work;
    double tol;
  };
  // fp32 lands near 1e-5; bf16 standard NS and fp16 Gram NS (with the default restart) near 1e-2.
  for (Case k : {Case{Iteration::kStandardDense, DType::kF32, 2e-5}, Case{Iteration::kGram, DType::kF32, 2e-5},
                 Case{Iteration::kStandardSym, DType::kBF16, 3e-2}, Case{Iteration::kGram, DType::kF16, 3e-2}}) {
    OrthoConfig cfg;
    cfg.iteration = k.it;
    cfg.work_dtype = k.work;
    cfg.gram_work_dtype = k.work;
    for (auto [r, c] : {std::pair{64, 256}, std::pair{256, 64}, std::pair{96, 96}}) {
      Mat u = random_matrix(r, c);
      Mat o = run_ortho(cfg, {u}, DType::kF32)[0];
      EXPECT_LT(rel_err(o, reference_ns(u, cfg.coefficients, cfg.steps)), k.tol)
          << iteration_name(k.it) << " " << dtype_name(k.work) << " " << r << "x" << c;
    }
  }
}

TEST(Orthogonalizer, NoNaNOnTinyOrHugeInputs) {
  for (double scale : {1e-30, 1e-12, 1e12, 1e30}) {
    for (Iteration it : {Iteration::kStandardSym, Iteration::kGram}) {
      OrthoConfig cfg;
      cfg.iteration = it;
      Mat u = random_matrix(16, 48, scale);
      Mat o = run_ortho(cfg, {u}, DType::kF32)[0];
      ASSERT_FALSE(o.hasNaN()) << scale;
      // Same eps semantics as the reference (tiny inputs are not blown up to unit norm).
      Mat ref = reference_ns(u.cast<float>().cast<double>(), cfg.coefficients, cfg.steps);
      EXPECT_LT(rel_err(o, ref), 1e-4) << scale;
    }
  }
}

TEST(Orthogonalizer, FlopCountsMatchTheClosedForms) {
  // docs/algorithms.md section 4, in units of m^3 with alpha = n / m.
  const int64_t m = 512, n = 2048;
  const double a = double(n) / m, m3 = double(m) * m * m;
  OrthoConfig c;
  c.iteration = Iteration::kStandardDense;
  EXPECT_NEAR(ortho_flops(c, m, n) / m3, 2 * 5 * (2 * a + 1), 1e-9);
  c.iteration = Iteration::kStandardSym;
  EXPECT_NEAR(ortho_flops(c, m, n) / m3, 5 * (3 * a + 1), 0.05);  // one triangle counts m(m+1)k
  c.iteration = Iteration::kGram;
  EXPECT_NEAR(ortho_flops(c, m, n) / m3, 4 * 5 + 6 * a - 6, 0.05);
  EXPECT_EQ(ortho_flops(c, n, m), ortho_flops(c, m, n));  // tall = wide transposed
  // The run counts what it does.
  OrthoStats stats;
  OrthoConfig f64 = c;
  f64.work_dtype = DType::kF64;
  run_ortho(f64, {random_matrix(40, 100), random_matrix(40, 100)}, DType::kF64, &stats);
  EXPECT_DOUBLE_EQ(stats.flops, 2 * ortho_flops(c, 40, 100));
  EXPECT_EQ(stats.matrices, 2);
}

TEST(Orthogonalizer, SplittingABatchOverThreadsGivesTheSameBitsAndFlops) {
  // The CPU backend splits a batch over its OpenMP threads when BLAS runs on one thread (what
  // distmuon.torch sets): each thread iterates on whole matrices, so nothing may change.
  const int blas_threads = openblas_get_num_threads(), omp_threads = omp_get_max_threads();
  openblas_set_num_threads(1);
  for (Iteration it : {Iteration::kStandardSym, Iteration::kGram}) {
    OrthoConfig cfg;
    cfg.iteration = it;
    std::vector<Mat> in;
    for (int i = 0; i < 5; ++i) in.push_back(random_matrix(24, 80, 0.5 + i));
    omp_set_num_threads(1);
    EXPECT_EQ(CpuBackend().batch_parts(5), 1);
    OrthoStats one;
    std::vector<Mat> serial = run_ortho(cfg, in, DType::kF32, &one);
    omp_set_num_threads(3);
    EXPECT_EQ(CpuBackend().batch_parts(5), 3);
    OrthoStats three;
    std::vector<Mat> split = run_ortho(cfg, in, DType::kF32, &three);
    for (size_t i = 0; i < in.size(); ++i)
      EXPECT_EQ(serial[i], split[i]) << iteration_name(it) << " " << i;
    EXPECT_EQ(one.flops, three.flops);
    EXPECT_EQ(one.matrices, three.matrices);
  }
  openblas_set_num_threads(blas_threads);
  omp_set_num_threads(omp_threads);
}

// run_group iterates batches of three shapes as one: every matrix must get the bits run() gives
// its batch alone (on the CPU gemm_grouped is gemm per problem), with the same FLOPs; batches
// that do not iterate alike, and configs without grouped_products, are refused.
TEST(Orthogonalizer, GroupOfShapesGivesEachBatchTheBitsItGetsAlone) {
  CpuBackend be;
  Orthogonalizer ortho(be);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{24, 80}, {16, 16}, {40, 56}};
  for (Iteration it : {Iteration::kStandardSym, Iteration::kStandardDense, Iteration::kGram}) {
    SCOPED_TRACE(iteration_name(it));
    OrthoConfig cfg;
    cfg.iteration = it;
    cfg.grouped_products = true;
    std::vector<HostBatch> alone, grouped;
    std::vector<Buffer> ws;
    std::vector<Orthogonalizer::GroupMember> members;
    OrthoStats one, group;
    for (size_t k = 0; k < shapes.size(); ++k) {
      const auto [m, n] = shapes[k];
      const OrthoConfig r = resolve(cfg, m, n);
      const int64_t count = 2 + static_cast<int64_t>(k);
      alone.emplace_back(iteration_dtype(r), count, m, n);
      grouped.emplace_back(iteration_dtype(r), count, m, n);
      for (int64_t i = 0; i < count; ++i) {
        Mat u = random_matrix(m, n);
        alone.back().set(i, (u / u.norm()).eval());
      }
      grouped.back().bytes = alone.back().bytes;
      grouped.back().ref.data = grouped.back().bytes.data();
      const size_t wb = Orthogonalizer::workspace_bytes(r, count, m, n);
      ws.push_back(be.alloc(wb));
      ortho.run(r, alone.back().ref, alone.back().ref, ws.back().data(), wb, &one);
    }
    for (size_t k = 0; k < shapes.size(); ++k)
      members.push_back({resolve(cfg, shapes[k].first, shapes[k].second), grouped[k].ref,
                         ws[k].data(), ws[k].bytes()});
    ortho.run_group(members, &group);
    for (size_t k = 0; k < shapes.size(); ++k)
      EXPECT_EQ(alone[k].bytes, grouped[k].bytes) << shapes[k].first << "x" << shapes[k].second;
    EXPECT_EQ(group.flops, one.flops);
    EXPECT_EQ(group.matrices, one.matrices);
    EXPECT_EQ(group.calls, one.calls);
  }
  OrthoConfig gram;
  gram.iteration = Iteration::kGram;
  gram.grouped_products = true;
  OrthoConfig sym = gram;
  sym.iteration = Iteration::kStandardSym;
  EXPECT_FALSE(Orthogonalizer::same_schedule(resolve(gram, 8, 16), resolve(sym, 8, 16)));
  OrthoConfig six = gram;
  six.steps = 6;
  EXPECT_FALSE(Orthogonalizer::same_schedule(resolve(gram, 8, 16), resolve(six, 8, 16)));
  EXPECT_TRUE(Orthogonalizer::same_schedule(resolve(gram, 8, 16), resolve(gram, 4, 40)));
  HostBatch a(iteration_dtype(resolve(gram, 8, 16)), 1, 8, 16), b(DType::kF32, 1, 8, 16);
  Buffer w = be.alloc(1 << 20);
  const std::vector<Orthogonalizer::GroupMember> mixed = {
      {resolve(gram, 8, 16), a.ref, w.data(), w.bytes()},
      {resolve(sym, 8, 16), b.ref, w.data(), w.bytes()}};
  EXPECT_THROW(ortho.run_group(mixed), Error);
  HostBatch c(iteration_dtype(resolve(gram, 8, 16)), 1, 8, 16);
  const std::vector<Orthogonalizer::GroupMember> shared = {
      {resolve(gram, 8, 16), a.ref, w.data(), w.bytes()},
      {resolve(gram, 8, 16), c.ref, w.data(), w.bytes()}};
  try {
    ortho.run_group(shared);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("members 0 and 1 share memory"), std::string::npos)
        << e.what();
  }
  OrthoConfig plain = gram;
  plain.grouped_products = false;
  const std::vector<Orthogonalizer::GroupMember> ungrouped = {
      {resolve(plain, 8, 16), a.ref, w.data(), w.bytes()}};
  EXPECT_THROW(ortho.run_group(ungrouped), Error);
}

TEST(Orthogonalizer, AutoPicksGramOnlyForElongatedShapes) {
  EXPECT_EQ(choose_iteration(768, 768), Iteration::kStandardSym);
  EXPECT_EQ(choose_iteration(768, 1024), Iteration::kStandardSym);
  EXPECT_EQ(choose_iteration(768, 2304), Iteration::kGram);
  EXPECT_EQ(choose_iteration(3072, 768), Iteration::kGram);
}

TEST(Orthogonalizer, AlgorithmSpecsParseAndPrint) {
  OrthoConfig c = parse_algorithm("ns5");
  EXPECT_EQ(c.iteration, Iteration::kStandardDense);
  EXPECT_EQ(c.steps, 5);
  c = parse_algorithm("gram-ns:polar-express-1.05");
  EXPECT_EQ(c.iteration, Iteration::kGram);
  EXPECT_EQ(c.coefficients, Coefficients::kPolarExpress105);
  c = parse_algorithm("auto:you:6");
  EXPECT_EQ(c.steps, 6);
  EXPECT_EQ(algorithm_name(c), "auto:you:6");
  EXPECT_EQ(algorithm_name(parse_algorithm("ns7-sym")), "ns7-sym");
  EXPECT_THROW(parse_algorithm("svd"), Error);
  EXPECT_THROW(parse_algorithm("ns5:magic"), Error);
  EXPECT_THROW(parse_algorithm("gram-ns:jordan:0"), Error);
  // One range for the step count, named by every message that refuses one.
  EXPECT_EQ(parse_algorithm("ns5:jordan:" + std::to_string(kMaxOrthoSteps)).steps, kMaxOrthoSteps);
  for (const std::string bad : {"ns5:jordan:0", "ns5:jordan:500", "ns5:jordan:x"}) {
    try {
      parse_algorithm(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected 1 to 100)"), std::string::npos) << e.what();
    }
  }
}

TEST(Orthogonalizer, PolarExpressSafetyFactorsAreApplied) {
  auto pe = coefficient_schedule(Coefficients::kPolarExpress, 5);
  EXPECT_NEAR(pe[0].a, 8.28721201814563 / 1.01, 1e-12);
  EXPECT_NEAR(pe[0].c, 17.300387312530933 / std::pow(1.01, 5), 1e-12);
  EXPECT_NEAR(pe[4].a, 2.300652019954817, 1e-15);  // the last step has no safety factor
  auto dm = coefficient_schedule(Coefficients::kPolarExpress105, 7);
  EXPECT_NEAR(dm[0].a, 8.28721201814563 / 1.05, 1e-9);  // published rows = base / 1.05
  EXPECT_NEAR(dm[6].a, 1.8750014808534479, 1e-15);      // past the list: converged base rows
}

TEST(Orthogonalizer, CustomCoefficientsReproduceTheNamedSchedules) {
  // One custom row equal to Jordan's repeats on every step: bit-identical to kJordan.
  OrthoConfig jordan;
  jordan.iteration = Iteration::kGram;
  OrthoConfig custom = jordan;
  custom.coefficients = Coefficients::kCustom;
  custom.custom_coefficients = {{3.4445, -4.7750, 2.0315}};
  std::vector<Mat> in = {random_matrix(24, 80), random_matrix(80, 24)};
  std::vector<Mat> a = run_ortho(jordan, in), b = run_ortho(custom, in);
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(rel_err(b[i], a[i]), 0.0);
  // Per-step rows, the last repeating past the end.
  OrthoConfig pe = jordan;
  pe.coefficients = Coefficients::kPolarExpress105;
  pe.steps = 7;
  custom.steps = 7;
  custom.custom_coefficients = coefficient_schedule(Coefficients::kPolarExpress105, 6);
  auto sched = coefficient_schedule(custom);
  ASSERT_EQ(sched.size(), 7u);
  EXPECT_EQ(sched[6].a, sched[5].a);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(sched[i].b, coefficient_schedule(pe)[i].b) << i;
  EXPECT_EQ(coefficients_name(Coefficients::kCustom), "custom");
  EXPECT_THROW(coefficient_schedule(Coefficients::kCustom, 5), Error);
  custom.custom_coefficients.clear();
  EXPECT_THROW(coefficient_schedule(custom), Error);
  custom.custom_coefficients = {{1.0, std::nan(""), 0.0}};
  EXPECT_THROW(coefficient_schedule(custom), Error);
}

TEST(Orthogonalizer, RejectsWrongInputs) {
  CpuBackend be;
  Orthogonalizer o(be);
  HostBatch tall(DType::kF32, 1, 8, 4), out(DType::kF32, 1, 8, 4);
  OrthoConfig cfg;
  EXPECT_THROW(o.run(cfg, tall.ref, out.ref, nullptr, 0), Error);  // not wide
  HostBatch wide(DType::kBF16, 1, 4, 8), wout(DType::kBF16, 1, 4, 8);
  cfg.work_dtype = DType::kF32;
  EXPECT_THROW(o.run(cfg, wide.ref, wout.ref, nullptr, 0), Error);  // dtype differs from config
}

}  // namespace
}  // namespace distmuon
