// Every CUDA backend operation against the float64 (Eigen) or CPU-backend reference on fresh
// random inputs, outputs poisoned with NaN beforehand; conditional blocks of captured graphs.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_handles.h"
#include "test_cuda_util.h"

namespace distmuon {
namespace {

using test::DeviceBatch;
using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::rel_err;

double tol_for(DType t) { return t == DType::kF64 ? 1e-12 : t == DType::kF32 ? 1e-5 : 1e-2; }

class CudaGemm : public ::testing::TestWithParam<std::tuple<DType, int, int>> {};

TEST_P(CudaGemm, DenseMatchesFloat64) {
  DM_SKIP_WITHOUT_CUDA();
  auto [dtype, ta, tb] = GetParam();
  CudaBackend& be = test::cuda_backend();
  const int64_t count = 3, m = 72, k = 136, n = 40;
  HostBatch a(dtype, count, ta ? k : m, ta ? m : k), b(dtype, count, tb ? n : k, tb ? k : n);
  HostBatch cin(dtype, count, m, n), c(dtype, count, m, n);
  std::vector<Mat> want;
  for (int64_t i = 0; i < count; ++i) {
    a.set(i, random_matrix(a.ref.rows, a.ref.cols));
    b.set(i, random_matrix(b.ref.rows, b.ref.cols));
    cin.set(i, random_matrix(m, n));
    Mat ra = a.get(i), rb = b.get(i);
    Mat opa = ta ? Mat(ra.transpose()) : ra, opb = tb ? Mat(rb.transpose()) : rb;
    want.push_back(0.75 * opa * opb - 0.5 * cin.get(i));
  }
  c.poison();
  DeviceBatch da(be, a), db(be, b), dcin(be, cin), dc(be, c);
  be.gemm(ta ? Op::kT : Op::kN, da.ref, tb ? Op::kT : Op::kN, db.ref, 0.75, -0.5, &dcin.ref, dc.ref);
  dc.download(be, c);
  for (int64_t i = 0; i < count; ++i) EXPECT_LT(rel_err(c.get(i), want[i]), tol_for(dtype)) << i;
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, CudaGemm,
                         ::testing::Combine(::testing::Values(DType::kF64, DType::kF32, DType::kBF16,
                                                              DType::kF16),
                                            ::testing::Values(0, 1), ::testing::Values(0, 1)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_T" : "_N") + (std::get<2>(info.param) ? "T" : "N");
                         });

// Symmetric products for every kernel variant: X X^T with and without beta Cin, and the
// product of two commuting symmetric matrices (N, N) as Gram NS issues it.
class CudaSym : public ::testing::TestWithParam<std::tuple<DType, SymKernel, int>> {};

TEST_P(CudaSym, LowerTriangleAndMirror) {
  DM_SKIP_WITHOUT_CUDA();
  auto [dtype, kernel, m] = GetParam();
  CudaBackend& be = test::cuda_backend();
  be.set_sym_kernel(kernel);
  const int64_t count = 3, k = 520;
  HostBatch x(dtype, count, m, k), cin(dtype, count, m, m), c(dtype, count, m, m);
  HostBatch r(dtype, count, m, m), z(dtype, count, m, m), c2(dtype, count, m, m);
  std::vector<Mat> want, want2;
  for (int64_t i = 0; i < count; ++i) {
    x.set(i, random_matrix(m, k, 1.0 / std::sqrt(double(k))));
    Mat s = random_matrix(m, m);
    cin.set(i, (s + s.transpose()).eval());
    Mat rx = x.get(i);
    want.push_back(1.5 * rx * rx.transpose() + 0.25 * cin.get(i));
    // Commuting symmetric pair: R = X X^T rounded, Z = 0.5 R + 0.1 R^2 rounded.
    Mat rr = rx * rx.transpose();
    r.set(i, (0.5 * (rr + rr.transpose())).eval());  // exactly symmetric, as the library's are
    Mat rq = r.get(i);
    Mat zz = 0.5 * rq + 0.1 * rq * rq;
    z.set(i, (0.5 * (zz + zz.transpose())).eval());
    want2.push_back(r.get(i) * z.get(i));
  }
  c.poison();
  c2.poison();
  DeviceBatch dx(be, x), dcin(be, cin), dc(be, c), dr(be, r), dz(be, z), dc2(be, c2);
  be.gemm_symmetric(Op::kN, dx.ref, Op::kT, dx.ref, 1.5, 0.25, &dcin.ref, dc.ref);
  be.gemm_symmetric(Op::kN, dr.ref, Op::kN, dz.ref, 1.0, 0.0, nullptr, dc2.ref);
  dc.download(be, c);
  dc2.download(be, c2);
  be.set_sym_kernel(SymKernel::kAuto);
  for (int64_t i = 0; i < count; ++i) {
    Mat got = c.get(i), got2 = c2.get(i);
    EXPECT_LT(rel_err(got, want[i]), tol_for(dtype)) << "X X^T, matrix " << i;
    EXPECT_EQ((got - got.transpose()).norm(), 0.0) << "not exactly symmetric";
    // R Z differs from Z R by rounding only; compare with the symmetrised exact product.
    Mat w2 = 0.5 * (want2[i] + want2[i].transpose());
    EXPECT_LT(rel_err(got2, w2), tol_for(dtype)) << "R Z, matrix " << i;
    EXPECT_EQ((got2 - got2.transpose()).norm(), 0.0) << "not exactly symmetric";
  }
}

// Rows longer than the matrix (ld > m): the epilogue's transposed store and the mirror of the
// diagonal blocks must follow ld, and leave the padding alone. m = 100 (not a multiple of 8)
// takes the element-wise mirror kernel, 520 the 16-byte one; each spans several diagonal blocks.
TEST(CudaSymPadded, MirrorFollowsTheLeadingDimension) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  const int64_t count = 2, k = 264;
  for (SymKernel kernel : {SymKernel::kTri128, SymKernel::kTri256x128, SymKernel::kTri128Cluster2,
                           SymKernel::kTri128Pingpong}) {
    for (int64_t m : {100, 520}) {
      SCOPED_TRACE(std::string(sym_kernel_name(kernel)) + ", m = " + std::to_string(m));
      const int64_t ld = (m + 7) / 8 * 8 + 8;
      be.set_sym_kernel(kernel);
      HostBatch x(DType::kBF16, count, m, k), out(DType::kBF16, count, m, ld);
      for (int64_t i = 0; i < count; ++i) x.set(i, random_matrix(m, k, 1.0 / std::sqrt(double(k))));
      out.poison();
      DeviceBatch dx(be, x), dout(be, out);
      BatchRef c = dout.ref;
      c.cols = m;  // m x m matrices in rows of ld elements
      be.gemm_symmetric(Op::kN, dx.ref, Op::kT, dx.ref, 1.0, 0.0, nullptr, c);
      dout.download(be, out);
      be.set_sym_kernel(SymKernel::kAuto);
      for (int64_t i = 0; i < count; ++i) {
        const Mat all = out.get(i), got = all.leftCols(m);
        const Mat rx = x.get(i);
        EXPECT_LT(rel_err(got, rx * rx.transpose()), tol_for(DType::kBF16)) << "matrix " << i;
        EXPECT_EQ((got - got.transpose()).norm(), 0.0) << "not exactly symmetric, matrix " << i;
        EXPECT_TRUE(all.rightCols(ld - m).array().isNaN().all()) << "padding written, matrix " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, CudaSym,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(SymKernel::kDenseMirror, SymKernel::kTri128,
                                         SymKernel::kTri256x128, SymKernel::kTri128Cluster2,
                                         SymKernel::kTri128Pingpong),
                       ::testing::Values(40, 256, 392, 776)),
    [](const auto& info) {
      std::string n = std::string(dtype_name(std::get<0>(info.param))) + "_" +
                      sym_kernel_name(std::get<1>(info.param)) + "_m" + std::to_string(std::get<2>(info.param));
      for (char& ch : n) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

TEST(CudaBackend, SymmetricFp32FallsBackToDense) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  HostBatch x(DType::kF32, 2, 100, 60), c(DType::kF32, 2, 100, 100);
  for (int i = 0; i < 2; ++i) x.set(i, random_matrix(100, 60));
  c.poison();
  DeviceBatch dx(be, x), dc(be, c);
  be.gemm_symmetric(Op::kN, dx.ref, Op::kT, dx.ref, 1.0, 0.0, nullptr, dc.ref);
  dc.download(be, c);
  for (int i = 0; i < 2; ++i) {
    Mat rx = x.get(i);
    EXPECT_LT(rel_err(c.get(i), rx * rx.transpose()), 1e-5);
  }
}

// lincomb, frob_norm and scale_copy against the CPU backend on the same bits.
TEST(CudaBackend, BatchedHelpersMatchCpu) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64}) {
    const int64_t count = 4, rows = 67, cols = 67;
    HostBatch a(t, count, rows, cols), b(t, count, rows, cols), out(t, count, rows, cols);
    HostBatch out_cpu(t, count, rows, cols);
    for (int i = 0; i < count; ++i) {
      a.set(i, random_matrix(rows, cols));
      b.set(i, random_matrix(rows, cols));
    }
    out.poison();
    DeviceBatch da(be, a), db(be, b), dout(be, out);
    be.lincomb(0.5, da.ref, -2.0, &db.ref, 3.0, dout.ref);
    dout.download(be, out);
    cpu.lincomb(0.5, a.ref, -2.0, &b.ref, 3.0, out_cpu.ref);
    for (int i = 0; i < count; ++i) EXPECT_LT(rel_err(out.get(i), out_cpu.get(i)), 1e-6) << dtype_name(t);
    // Norms.
    Buffer nd = be.alloc(sizeof(double) * count);
    be.frob_norm(da.ref, nd.as<double>());
    std::vector<double> ng(count), nc(count);
    be.copy_to_host(ng.data(), nd.data(), sizeof(double) * count);
    cpu.frob_norm(a.ref, nc.data());
    for (int i = 0; i < count; ++i) EXPECT_NEAR(ng[i], nc[i], 1e-5 * nc[i]);
    // Scaled transposed copy into another dtype.
    HostBatch tr(DType::kBF16, count, cols, rows), tr_cpu(DType::kBF16, count, cols, rows);
    tr.poison();
    DeviceBatch dtr(be, tr);
    ScaleSpec spec{nd.as<double>(), 1.01, 1e-7, 2.0};
    be.scale_copy(da.ref, true, spec, dtr.ref);
    dtr.download(be, tr);
    ScaleSpec spec_cpu{nc.data(), 1.01, 1e-7, 2.0};
    cpu.scale_copy(a.ref, true, spec_cpu, tr_cpu.ref);
    for (int i = 0; i < count; ++i) EXPECT_LT(rel_err(tr.get(i), tr_cpu.get(i)), 1e-2);
  }
}

// One call of many copies, the destinations' types interleaved (each copy converts on its own),
// lengths 0 to ~2000: the first 24 at 16-byte aligned ends with a tail (8k + 3 elements), the
// rest at random source offsets (the 8-, 4- and 2-byte paths), more than one launch's table.
// Each block equals the CPU backend's copy of the same list, and the NaN-poisoned gaps between
// and after the blocks stay untouched.
TEST(CudaBackend, CopyBlocksMatchCpu) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const std::vector<DType> types = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (DType st : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64}) {
    const int64_t n_src = 4096;
    HostBatch src(st, 1, 1, n_src);
    src.set(0, random_matrix(1, n_src));
    DeviceBatch dsrc(be, src);
    std::srand(7);
    const size_t n = 300;
    std::vector<int64_t> len(n), off(n), at(n);
    std::vector<int64_t> dst_size(types.size(), 0);
    for (size_t k = 0; k < n; ++k) {
      len[k] = k < 24 ? 8 * static_cast<int64_t>(k) + 3 : k % 17 == 0 ? 0 : std::rand() % 2000;
      off[k] = k < 24 ? 8 * static_cast<int64_t>(k) : std::rand() % (n_src - len[k] + 1);
      int64_t& end = dst_size[k % types.size()];
      at[k] = end;  // every block starts 16 elements aligned, a poisoned gap of >= 8 after it
      end = (end + len[k] + 8 + 15) / 16 * 16;
    }
    std::vector<HostBatch> out, want;
    std::vector<DeviceBatch> dout;
    for (size_t t = 0; t < types.size(); ++t) {
      out.emplace_back(types[t], 1, 1, dst_size[t]);
      want.emplace_back(types[t], 1, 1, dst_size[t]);
      out.back().poison();
      want.back().poison();
      dout.emplace_back(be, out.back());
    }
    std::vector<BlockCopy> on_gpu, on_cpu;
    const int64_t es = static_cast<int64_t>(dtype_size(st));
    for (size_t k = 0; k < n; ++k) {
      const size_t t = k % types.size();
      const int64_t ed = static_cast<int64_t>(dtype_size(types[t]));
      on_gpu.push_back({static_cast<const char*>(dsrc.buf.data()) + off[k] * es, st,
                        static_cast<char*>(dout[t].buf.data()) + at[k] * ed, types[t], len[k]});
      on_cpu.push_back({src.bytes.data() + off[k] * es, st, want[t].bytes.data() + at[k] * ed,
                        types[t], len[k]});
    }
    be.copy_blocks(on_gpu);
    cpu.copy_blocks(on_cpu);
    for (size_t t = 0; t < types.size(); ++t) dout[t].download(be, out[t]);
    std::vector<Mat> got, ref;
    for (size_t t = 0; t < types.size(); ++t) {
      got.push_back(out[t].get(0));
      ref.push_back(want[t].get(0));
    }
    for (size_t k = 0; k < n; ++k) {
      const size_t t = k % types.size();
      for (int64_t i = 0; i < len[k]; ++i)
        ASSERT_EQ(got[t](0, at[k] + i), ref[t](0, at[k] + i))
            << dtype_name(st) << " -> " << dtype_name(types[t]) << ", copy " << k << ", element " << i;
      const int64_t gap_end = k + types.size() < n ? at[k + types.size()] : dst_size[t];
      for (int64_t i = at[k] + len[k]; i < gap_end; ++i)
        ASSERT_TRUE(std::isnan(got[t](0, i))) << "copy " << k << " wrote past its end at " << i;
    }
  }
  const BlockCopy bad{nullptr, DType::kF32, nullptr, DType::kF32, -1};
  EXPECT_THROW(be.copy_blocks({&bad, 1}), Error);
}

TEST(CudaBackend, AdamWMatchesCpuAndCountsSkips) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const std::vector<int64_t> sizes = {1000, 4096, 7, 50000};
  std::vector<std::vector<float>> host(4 * sizes.size());
  std::vector<Buffer> dev;
  std::vector<AdamSlot> gs, cs;
  std::vector<AdamCoef> coef;
  std::mt19937_64& g = test::rng();
  std::normal_distribution<float> nd;
  for (size_t t = 0; t < sizes.size(); ++t) {
    for (int k = 0; k < 4; ++k) {
      auto& v = host[4 * t + k];
      v.resize(sizes[t]);
      for (float& x : v) x = k == 3 ? std::abs(nd(g)) : nd(g);
      if (t == 2 && k == 1) v[3] = NAN;  // a non-finite gradient: this tensor is skipped
      dev.push_back(be.alloc(v.size() * 4));
      be.copy_from_host(dev.back().data(), v.data(), v.size() * 4);
    }
    auto* d = &dev[dev.size() - 4];
    gs.push_back({d[0].data(), d[1].data(), d[2].data(), d[3].data(), DType::kF32, DType::kF32, sizes[t]});
    cs.push_back({host[4 * t].data(), host[4 * t + 1].data(), host[4 * t + 2].data(),
                  host[4 * t + 3].data(), DType::kF32, DType::kF32, sizes[t]});
    coef.push_back({1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3});
  }
  // The coefficients where each backend reads them: device memory, host memory.
  Buffer dcoef = be.alloc(sizeof(AdamCoef) * coef.size());
  be.upload_small(dcoef.data(), coef.data(), sizeof(AdamCoef) * coef.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    gs[t].coef = dcoef.as<AdamCoef>() + t;
    cs[t].coef = &coef[t];
  }
  Buffer st = be.alloc(sizeof(int32_t) * sizes.size());
  Buffer counter = be.alloc(sizeof(int64_t));
  be.fill_zero(counter.data(), sizeof(int64_t));
  be.adamw_check(gs, st.as<int32_t>());
  be.adamw_update(gs, st.as<int32_t>());
  be.count_status(st.as<int32_t>(), static_cast<int64_t>(sizes.size()), counter.as<int64_t>());
  std::vector<int32_t> st_cpu(sizes.size());
  cpu.adamw_check(cs, st_cpu.data());
  cpu.adamw_update(cs, st_cpu.data());
  int64_t skips = 0;
  be.copy_to_host(&skips, counter.data(), sizeof(int64_t));
  EXPECT_EQ(skips, 1);
  for (size_t t = 0; t < sizes.size(); ++t)
    for (int k : {0, 2, 3}) {
      std::vector<float> got(sizes[t]);
      be.copy_to_host(got.data(), dev[4 * t + k].data(), got.size() * 4);
      for (int64_t j = 0; j < sizes[t]; ++j)
        ASSERT_NEAR(got[j], host[4 * t + k][j], 1e-6f * (1 + std::abs(host[4 * t + k][j])))
            << "tensor " << t << " state " << k << " element " << j;
    }
}

}  // namespace
}  // namespace distmuon

namespace distmuon {
namespace {

// Backend::begin_if_selected inside the backend's own capture: the block runs on replay only
// when some flag selects it, decided on the device at each replay; blocks nest; outside the
// backend's own capture no block opens (the work always runs); a capture that throws inside an
// open block leaves the backend usable.
TEST(CudaGraphs, ConditionalBlockRunsOnlyWhenAFlagSelectsIt) {
  DM_SKIP_WITHOUT_CUDA();
  setenv("DISTMUON_GRAPH_CONDITIONALS", "1", 1);  // the default, unless the environment says 0
  CudaBackend& be = test::cuda_backend();
  const int64_t c = 3, m = 8, n = 16;
  HostBatch src(DType::kF32, c, m, n), dst(DType::kF32, c, m, n), inner(DType::kF32, c, m, n);
  for (int64_t i = 0; i < c; ++i) src.set(i, random_matrix(m, n));
  DeviceBatch dsrc(be, src), ddst(be, dst), dinner(be, inner);
  Buffer flags = be.alloc(c * sizeof(int32_t));
  auto set_flags = [&](std::vector<int32_t> f) {
    be.copy_from_host(flags.data(), f.data(), f.size() * sizeof(int32_t));
  };
  auto poison = [&] {
    DM_CHECK_CUDA(cudaMemsetAsync(ddst.ref.data, 0xff, ddst.ref.bytes(), be.stream()));
    DM_CHECK_CUDA(cudaMemsetAsync(dinner.ref.data, 0xff, dinner.ref.bytes(), be.stream()));
  };
  const BatchMask ones{flags.as<int32_t>(), 1}, twos{flags.as<int32_t>(), 2};
  EXPECT_FALSE(be.begin_if_selected(ones, c));  // eager: nothing to open

  int opened = 0;
  auto graph = be.capture([&] {
    if (be.begin_if_selected(ones, c)) ++opened;  // dst = src when some flag is 1
    be.scale_copy(dsrc.ref, false, {}, ddst.ref);
    if (be.begin_if_selected(twos, c)) ++opened;  // nested: inner = src when some flag is 2
    be.scale_copy(dsrc.ref, false, {}, dinner.ref);
    be.end_if_selected();
    be.end_if_selected();
  });
  ASSERT_TRUE(graph);
  EXPECT_EQ(opened, 2);
  struct Case {
    std::vector<int32_t> flags;
    bool outer, inner;
  };
  for (const Case& k : {Case{{0, 0, 0}, false, false}, Case{{0, 1, 0}, true, false},
                        Case{{0, 0, 2}, false, false}, Case{{2, 0, 1}, true, true},
                        Case{{0, 0, 0}, false, false}}) {
    SCOPED_TRACE(::testing::PrintToString(k.flags));
    set_flags(k.flags);
    poison();
    graph->replay();
    be.synchronize();
    ddst.download(be, dst);
    dinner.download(be, inner);
    for (int64_t i = 0; i < c; ++i) {
      EXPECT_EQ(dst.get(i).array().isNaN().all(), !k.outer) << i;
      EXPECT_EQ(inner.get(i).array().isNaN().all(), !k.inner) << i;
      if (k.outer) {
        EXPECT_EQ(dst.get(i), src.get(i)) << i;
      }
    }
  }

  {  // a caller's capture: no block opens, the work is recorded unconditionally
    bool in_caller = true;
    cuda::GraphExec exec = cuda::capture_graph(be.stream(), [&] {
      in_caller = be.begin_if_selected(ones, c);
      be.scale_copy(dsrc.ref, false, {}, ddst.ref);
    });
    EXPECT_FALSE(in_caller);
  }

  // An error inside an open block fails the capture, logged; the backend then works eagerly and
  // captures again.
  auto failed = be.capture([&] {
    EXPECT_TRUE(be.begin_if_selected(ones, c));
    be.scale_copy(dsrc.ref, false, {}, ddst.ref);
    DM_FAIL("test: an error inside the block");
  });
  EXPECT_FALSE(failed);
  set_flags({1, 1, 1});
  poison();
  be.scale_copy(dsrc.ref, false, {}, ddst.ref);
  be.synchronize();
  ddst.download(be, dst);
  EXPECT_EQ(dst.get(0), src.get(0));
  auto again = be.capture([&] {
    if (be.begin_if_selected(ones, c)) {
      be.scale_copy(dsrc.ref, false, {}, dinner.ref);
      be.end_if_selected();
    }
  });
  ASSERT_TRUE(again);
  poison();
  again->replay();
  be.synchronize();
  dinner.download(be, inner);
  EXPECT_EQ(inner.get(2), src.get(2));
}

// Backend::begin_if_some_selected: of its two bodies, the first runs on replay when some but not
// all flags select, the second when all do, neither when none does; decided at each replay, with
// more matrices than the condition kernel's threads. Outside the backend's capture it does not
// open. An error in the second body fails the capture cleanly.
TEST(CudaGraphs, TwoBodiesRunForSomeOrAllSelected) {
  DM_SKIP_WITHOUT_CUDA();
  setenv("DISTMUON_GRAPH_CONDITIONALS", "1", 1);  // the default, unless the environment says 0
  CudaBackend& be = test::cuda_backend();
  const int64_t c = 300, m = 2, n = 4;  // 300 flags: two rounds of the 256-thread kernel
  HostBatch src(DType::kF32, 1, m, n), some(DType::kF32, 1, m, n), all(DType::kF32, 1, m, n);
  src.set(0, random_matrix(m, n));
  DeviceBatch dsrc(be, src), dsome(be, some), dall(be, all);
  Buffer flags = be.alloc(c * sizeof(int32_t));
  const BatchMask ones{flags.as<int32_t>(), 1};
  EXPECT_FALSE(be.begin_if_some_selected(ones, c));  // eager: nothing to open
  int opened = 0;
  auto graph = be.capture([&] {
    if (!be.begin_if_some_selected(ones, c)) return;
    ++opened;
    be.scale_copy(dsrc.ref, false, {}, dsome.ref);
    be.else_if_all_selected();
    be.scale_copy(dsrc.ref, false, {}, dall.ref);
    be.end_if_selected();
  });
  ASSERT_TRUE(graph);
  EXPECT_EQ(opened, 1);
  struct Case {
    std::vector<int> selected;  // indices whose flag is 1 (-1: every one)
    bool some, all;
  };
  for (const Case& k : {Case{{}, false, false}, Case{{299}, true, false}, Case{{-1}, false, true},
                        Case{{0, 255, 256}, true, false}, Case{{}, false, false}}) {
    SCOPED_TRACE(::testing::PrintToString(k.selected));
    std::vector<int32_t> f(c, 0);
    for (int i : k.selected) {
      if (i < 0) std::fill(f.begin(), f.end(), 1);
      else f[i] = 1;
    }
    be.copy_from_host(flags.data(), f.data(), f.size() * sizeof(int32_t));
    DM_CHECK_CUDA(cudaMemsetAsync(dsome.ref.data, 0xff, dsome.ref.bytes(), be.stream()));
    DM_CHECK_CUDA(cudaMemsetAsync(dall.ref.data, 0xff, dall.ref.bytes(), be.stream()));
    graph->replay();
    be.synchronize();
    dsome.download(be, some);
    dall.download(be, all);
    EXPECT_EQ(some.get(0).array().isNaN().all(), !k.some);
    EXPECT_EQ(all.get(0).array().isNaN().all(), !k.all);
    if (k.some) {
      EXPECT_EQ(some.get(0), src.get(0));
    }
    if (k.all) {
      EXPECT_EQ(all.get(0), src.get(0));
    }
  }

  auto failed = be.capture([&] {
    EXPECT_TRUE(be.begin_if_some_selected(ones, c));
    be.else_if_all_selected();
    DM_FAIL("test: an error inside the second body");
  });
  EXPECT_FALSE(failed);
  auto again = be.capture([&] { be.scale_copy(dsrc.ref, false, {}, dall.ref); });
  EXPECT_TRUE(again);
}

}  // namespace
}  // namespace distmuon
