// The grouped product (Backend::gemm_grouped), the grouped linear combination
// (Backend::lincomb_grouped) and the grouped orthogonalization on the GPU: every problem of a
// mixed call against float64 on fresh random inputs, each matrix's bits independent of the rest
// of its call, and run_group against run() and the float64 iteration. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "test_cuda_util.h"

namespace distmuon {
namespace {

using test::DeviceBatch;
using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::rel_err;

bool same_bytes(const HostBatch& a, const HostBatch& b) { return a.bytes == b.bytes; }
// An empty host batch of h's dtype and shape (a copy of h would keep pointing at h's bytes).
HostBatch like(const HostBatch& h) {
  return HostBatch(h.ref.dtype, h.ref.count, h.ref.rows, h.ref.cols);
}

struct Case {
  DType dtype;
  Op op_a, op_b;
  int64_t count, m, n, k;
  bool source;   // beta * Cin
  bool in_place; // Cin is C
};

// Host operands and the float64 result of one problem.
struct HostProblem {
  Case c;
  HostBatch a, b, cin, out;
  std::vector<Mat> want;
  explicit HostProblem(const Case& cs)
      : c(cs),
        a(cs.dtype, cs.count, cs.op_a == Op::kN ? cs.m : cs.k, cs.op_a == Op::kN ? cs.k : cs.m),
        b(cs.dtype, cs.count, cs.op_b == Op::kN ? cs.k : cs.n, cs.op_b == Op::kN ? cs.n : cs.k),
        cin(cs.dtype, cs.count, cs.m, cs.n),
        out(cs.dtype, cs.count, cs.m, cs.n) {
    for (int64_t i = 0; i < cs.count; ++i) {
      a.set(i, random_matrix(a.ref.rows, a.ref.cols));
      b.set(i, random_matrix(b.ref.rows, b.ref.cols));
      cin.set(i, random_matrix(cs.m, cs.n));
      const Mat ra = a.get(i), rb = b.get(i);
      const Mat oa = cs.op_a == Op::kN ? ra : Mat(ra.transpose());
      const Mat ob = cs.op_b == Op::kN ? rb : Mat(rb.transpose());
      want.push_back(cs.source ? Mat(0.75 * oa * ob - 0.5 * cin.get(i)) : Mat(0.75 * oa * ob));
    }
  }
};

struct DeviceProblem {
  DeviceBatch a, b, cin, out;
  DeviceProblem(Backend& be, HostProblem& h)
      : a(be, h.a), b(be, h.b), cin(be, h.cin), out(be, h.c.in_place ? h.cin : h.out) {}
  GemmProblem problem(const Case& c) const {
    return {c.op_a, a.ref,  c.op_b, b.ref, 0.75, c.source ? -0.5 : 0.0,
            c.source ? (c.in_place ? out.ref : cin.ref) : BatchRef{}, out.ref};
  }
};

// Problems the kernel computes (bf16 and fp16, B as stored and transposed, leading dimensions
// that are not multiples of 8, a source, a source that is the output, several kernel tiles
// with ragged edges) and ones that go through gemm() one by one (A transposed, fp32).
const std::vector<Case> kCases = {
    {DType::kBF16, Op::kN, Op::kT, 3, 64, 64, 147, false, false},   // X X^T, unaligned rows
    {DType::kBF16, Op::kN, Op::kN, 2, 72, 136, 72, true, false},    // Q X with a source
    {DType::kBF16, Op::kN, Op::kN, 1, 130, 130, 130, true, true},   // in place
    {DType::kBF16, Op::kN, Op::kT, 2, 200, 200, 40, false, false},  // short k
    {DType::kF16, Op::kN, Op::kN, 2, 96, 256, 96, true, false},
    {DType::kF16, Op::kN, Op::kT, 1, 33, 33, 515, false, false},
    {DType::kBF16, Op::kT, Op::kN, 2, 48, 64, 80, false, false},    // gemm()
    {DType::kF32, Op::kN, Op::kT, 2, 40, 40, 100, true, false},     // gemm()
};

TEST(CudaGrouped, EveryProblemMatchesFloat64AndItsBitsAlone) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  EXPECT_TRUE(be.grouped_gemm_native(DType::kBF16));
  EXPECT_TRUE(be.grouped_gemm_native(DType::kF16));
  EXPECT_FALSE(be.grouped_gemm_native(DType::kF32));
  std::vector<HostProblem> host;
  for (const Case& c : kCases) host.emplace_back(c);
  std::vector<std::unique_ptr<DeviceProblem>> together, alone;
  std::vector<GemmProblem> call;
  for (HostProblem& h : host) {
    h.out.poison();
    together.push_back(std::make_unique<DeviceProblem>(be, h));
    alone.push_back(std::make_unique<DeviceProblem>(be, h));
    call.push_back(together.back()->problem(h.c));
  }
  be.gemm_grouped(call);
  for (size_t p = 0; p < host.size(); ++p) {
    const GemmProblem one = alone[p]->problem(host[p].c);
    be.gemm_grouped({&one, 1});
  }
  be.synchronize();
  for (size_t p = 0; p < host.size(); ++p) {
    SCOPED_TRACE("problem " + std::to_string(p));
    const Case& c = host[p].c;
    HostBatch got = like(host[p].out), got_alone = like(host[p].out);
    together[p]->out.download(be, got);
    alone[p]->out.download(be, got_alone);
    const double tol = c.dtype == DType::kF32 ? 1e-5 : 1e-2;
    for (int64_t i = 0; i < c.count; ++i)
      EXPECT_LT(rel_err(got.get(i), host[p].want[i]), tol) << "matrix " << i;
    EXPECT_TRUE(same_bytes(got, got_alone)) << "a matrix's bits depend on its call";
  }
}

// More problems than one launch's table takes (30, in two launches), half of them given a
// source with beta = 0 (which must be ignored): each matches float64 and its bits alone.
TEST(CudaGrouped, ManyProblemsSplitIntoLaunches) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  std::vector<HostProblem> host;
  for (int p = 0; p < 30; ++p)
    host.emplace_back(Case{DType::kBF16, Op::kN, Op::kN, 1 + p % 3, 8 + 5 * p, 16 + 3 * p,
                           24 + 7 * p, false, false});
  std::vector<std::unique_ptr<DeviceProblem>> together, alone;
  std::vector<GemmProblem> call;
  for (size_t p = 0; p < host.size(); ++p) {
    host[p].out.poison();
    together.push_back(std::make_unique<DeviceProblem>(be, host[p]));
    alone.push_back(std::make_unique<DeviceProblem>(be, host[p]));
    GemmProblem g = together.back()->problem(host[p].c);
    if (p % 2) g.c_in = together.back()->cin.ref;  // beta stays 0
    call.push_back(g);
  }
  be.gemm_grouped(call);
  for (size_t p = 0; p < host.size(); ++p) {
    const GemmProblem one = alone[p]->problem(host[p].c);
    be.gemm_grouped({&one, 1});
  }
  be.synchronize();
  for (size_t p = 0; p < host.size(); ++p) {
    SCOPED_TRACE("problem " + std::to_string(p));
    HostBatch got = like(host[p].out), got_alone = like(host[p].out);
    together[p]->out.download(be, got);
    alone[p]->out.download(be, got_alone);
    for (int64_t i = 0; i < host[p].c.count; ++i)
      EXPECT_LT(rel_err(got.get(i), host[p].want[i]), 1e-2) << "matrix " << i;
    EXPECT_TRUE(same_bytes(got, got_alone));
  }
}

// One problem of lincomb_grouped: out = alpha a + beta b + diag I, with a padded leading
// dimension where `pad` > 0 (the host batches hold cols + pad columns; the view takes cols).
struct LinCase {
  DType dtype;
  int64_t count, rows, cols, pad;
  double alpha, beta, diag;  // beta 0: no b
  bool in_place;             // out is a
};

struct LinProblem {
  LinCase c;
  HostBatch a, b, out;
  LinProblem(const LinCase& cs)
      : c(cs),
        a(cs.dtype, cs.count, cs.rows, cs.cols + cs.pad),
        b(cs.dtype, cs.count, cs.rows, cs.cols + cs.pad),
        out(cs.dtype, cs.count, cs.rows, cs.cols + cs.pad) {
    for (int64_t i = 0; i < cs.count; ++i) {
      a.set(i, random_matrix(cs.rows, cs.cols + cs.pad));
      b.set(i, random_matrix(cs.rows, cs.cols + cs.pad));
    }
    out.poison();
  }
  BatchRef view(const BatchRef& r) const {
    BatchRef v = r;
    v.cols = c.cols;
    return v;
  }
  // The float64 result of matrix i (its first `cols` columns).
  Mat want(int64_t i) const {
    Mat w = c.alpha * a.get(i).leftCols(c.cols);
    if (c.beta != 0) w += c.beta * b.get(i).leftCols(c.cols);
    for (int64_t d = 0; d < std::min(c.rows, c.cols); ++d) w(d, d) += c.diag;
    return w;
  }
};

struct LinDevice {
  DeviceBatch a, b, out;
  LinDevice(Backend& be, const LinProblem& h) : a(be, h.a), b(be, h.b), out(be, h.out) {}
  const DeviceBatch& result(const LinCase& c) const { return c.in_place ? a : out; }
  LincombProblem problem(const LinProblem& h) const {
    const LinCase& c = h.c;
    return {c.alpha, h.view(a.ref), c.beta, c.beta != 0 ? h.view(b.ref) : BatchRef{}, c.diag,
            h.view(result(c).ref)};
  }
};

// Problems of both kernels (vector: packed, 16-byte aligned; scalar: padded rows or an odd
// size), an identity term alone (Gram NS's Q = Z + a I), a result written over its input,
// fp64 (lincomb itself), and more matrices than one table holds (60 of 8 x 8): each equals its
// own lincomb() bit for bit and float64 to its dtype's rounding. A bad problem at the end of a
// call refuses the whole call before anything is written.
TEST(CudaGrouped, LincombGroupedEqualsLincombBitForBit) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  const std::vector<LinCase> cases = {
      {DType::kBF16, 3, 64, 64, 0, 1.0, 0.0, 1.875, false},   // Q = Z + a I
      {DType::kF16, 2, 96, 96, 0, 0.5, -1.25, 0.3, true},     // in place, with b
      {DType::kF32, 2, 33, 40, 8, 0.75, 2.0, 0.0, false},     // padded rows: scalar kernel
      {DType::kBF16, 1, 35, 35, 0, 1.0, 0.0, -3.25, false},   // odd size: scalar kernel
      {DType::kF64, 2, 16, 16, 0, 1.5, 0.25, 2.0, false},     // fp64: lincomb itself
      {DType::kBF16, 60, 8, 8, 0, 1.0, 0.0, 1.5, false},      // two tables
  };
  std::vector<LinProblem> host(cases.begin(), cases.end());
  std::vector<std::unique_ptr<LinDevice>> together, alone;
  std::vector<LincombProblem> call;
  for (const LinProblem& h : host) {
    together.push_back(std::make_unique<LinDevice>(be, h));
    alone.push_back(std::make_unique<LinDevice>(be, h));
    call.push_back(together.back()->problem(h));
  }
  // A call with a bad last problem (b of another shape) changes nothing.
  std::vector<LincombProblem> bad = call;
  LincombProblem wrong = call[0];
  wrong.b = host[3].view(together[3]->a.ref);
  wrong.beta = 1.0;
  bad.push_back(wrong);
  EXPECT_THROW(be.lincomb_grouped(bad), Error);
  be.synchronize();
  for (size_t p = 0; p < host.size(); ++p) {
    HostBatch untouched = like(host[p].out);
    together[p]->result(host[p].c).download(be, untouched);
    EXPECT_TRUE(same_bytes(untouched, host[p].c.in_place ? host[p].a : host[p].out)) << p;
  }

  be.lincomb_grouped(call);
  for (size_t p = 0; p < host.size(); ++p) {
    const LincombProblem one = alone[p]->problem(host[p]);
    be.lincomb(one.alpha, one.a, one.beta, one.b.data ? &one.b : nullptr, one.diag, one.out);
  }
  be.synchronize();
  for (size_t p = 0; p < host.size(); ++p) {
    SCOPED_TRACE("problem " + std::to_string(p));
    const LinCase& c = host[p].c;
    HostBatch got = like(host[p].out), got_alone = like(host[p].out);
    together[p]->result(c).download(be, got);
    alone[p]->result(c).download(be, got_alone);
    EXPECT_TRUE(same_bytes(got, got_alone)) << "differs from lincomb()";
    const double tol = c.dtype == DType::kF64 ? 1e-14 : c.dtype == DType::kF32 ? 1e-6 : 1e-2;
    for (int64_t i = 0; i < c.count; ++i)
      EXPECT_LT(rel_err(got.get(i).leftCols(c.cols), host[p].want(i)), tol) << "matrix " << i;
  }
}

// run_group over three shapes of one schedule against run() of each batch alone (bit for bit)
// and against the float64 iteration; ns5 and Gram NS (fp16 work) both.
TEST(CudaGrouped, RunGroupEqualsRunAloneAndTheFloat64Iteration) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  Orthogonalizer ortho(be);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 147}, {128, 576}, {256, 512}};
  for (const char* algo : {"ns5", "gram-ns"}) {
    SCOPED_TRACE(algo);
    OrthoConfig cfg = parse_algorithm(algo);
    cfg.work_dtype = DType::kBF16;
    cfg.grouped_products = true;
    std::vector<HostBatch> in;
    std::vector<std::unique_ptr<DeviceBatch>> grouped, alone;
    std::vector<Buffer> ws_group, ws_alone;
    std::vector<Orthogonalizer::GroupMember> members;
    for (const auto& [m, n] : shapes) {
      const OrthoConfig r = resolve(cfg, m, n);
      const int64_t count = 2;
      in.emplace_back(iteration_dtype(r), count, m, n);
      for (int64_t i = 0; i < count; ++i) {
        Mat u = random_matrix(m, n);
        in.back().set(i, (u / u.norm()).eval());
      }
      grouped.push_back(std::make_unique<DeviceBatch>(be, in.back()));
      alone.push_back(std::make_unique<DeviceBatch>(be, in.back()));
      const size_t wb = Orthogonalizer::workspace_bytes(r, count, m, n);
      ws_group.push_back(be.alloc(wb));
      ws_alone.push_back(be.alloc(wb));
      members.push_back({r, grouped.back()->ref, ws_group.back().data(), wb});
      ortho.run(r, alone.back()->ref, alone.back()->ref, ws_alone.back().data(), wb);
    }
    ortho.run_group(members);
    be.synchronize();
    for (size_t k = 0; k < shapes.size(); ++k) {
      SCOPED_TRACE(std::to_string(shapes[k].first) + "x" + std::to_string(shapes[k].second));
      HostBatch g = like(in[k]), a = like(in[k]);
      grouped[k]->download(be, g);
      alone[k]->download(be, a);
      EXPECT_TRUE(same_bytes(g, a));
      for (int64_t i = 0; i < g.ref.count; ++i) {
        const Mat want = test::reference_ns(in[k].get(i), cfg.coefficients, cfg.steps);
        const double e = rel_err(g.get(i), want);
        std::printf("[measure] grouped %s %lldx%lld: rel err %.3e vs float64 iteration\n", algo,
                    (long long)shapes[k].first, (long long)shapes[k].second, e);
        EXPECT_LT(e, 2e-2) << i;
      }
    }
  }
}

}  // namespace
}  // namespace distmuon
