// The CUDA backend's CacheMuon operations against the CPU backend and float64 references, with
// outputs poisoned beforehand: the gate case by case, the probe generator bit for bit, the
// masked copy, and masked products (selected matrices bit-exact against the same kernel
// unmasked, unselected ones untouched); then a whole cached orthogonalization captured in a
// CUDA graph, which fails if anything in it waits for the host. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "backend/cache_ref.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_handles.h"
#include "backend/cuda/launch/sym_gemm.h"
#include "distmuon/cache.h"
#include "test_cuda_util.h"

namespace distmuon {
namespace {

using test::DeviceBatch;
using test::HostBatch;
using test::Mat;
using test::random_matrix;
using test::rel_err;

bool bits_equal(const HostBatch& a, const HostBatch& b, int64_t i) {
  const size_t n = static_cast<size_t>(a.ref.rows * a.ref.cols) * dtype_size(a.ref.dtype);
  return std::memcmp(a.ref.matrix(i).data, b.ref.matrix(i).data, n) == 0;
}

template <typename T>
Buffer upload(Backend& be, const std::vector<T>& v) {
  Buffer b = be.alloc(std::max<size_t>(1, v.size()) * sizeof(T));
  be.copy_from_host(b.data(), v.data(), v.size() * sizeof(T));
  return b;
}
template <typename T>
std::vector<T> download(Backend& be, const Buffer& b, size_t n) {
  std::vector<T> v(n);
  be.copy_to_host(v.data(), b.data(), n * sizeof(T));
  return v;
}

TEST(CudaCache, GateEqualsCpuOnEveryCase) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const double key = 777;
  const int n = 300;
  std::vector<double> res(n);
  std::vector<float> age(n);
  std::vector<int32_t> st(n);
  std::vector<double> keys(n), stats(n * kCacheStatFields, 0.0);
  std::mt19937_64& g = test::rng();
  std::uniform_real_distribution<double> u(0.0, 6.0);
  for (int i = 0; i < n; ++i) {  // every branch: stale, empty, foreign key, NaN/Inf, skipped
    res[i] = i % 17 == 0 ? NAN : (i % 23 == 0 ? INFINITY : u(g));
    age[i] = static_cast<float>(i % 5);
    st[i] = i % 19 == 0 ? kStatusNonFinite : kStatusOk;
    keys[i] = i % 13 == 0 ? 0.0 : (i % 11 == 0 ? 5.0 : key);
    stats[i * kCacheStatFields + kCacheStatResMin] = INFINITY;
  }
  Buffer dres = upload(be, res), dage = upload(be, age), dst = upload(be, st);
  Buffer dkeys = upload(be, keys), dstats = upload(be, stats);
  Buffer ddec = be.alloc(n * sizeof(int32_t));
  std::vector<int32_t> dec(n, -1);
  CacheGateArgs h{n,          res.data(), 0.5, st.data(),  key,         keys.data(),
                  age.data(), 4,          2.0, dec.data(), stats.data()};
  CacheGateArgs d{n,
                  dres.as<double>(),
                  0.5,
                  dst.as<int32_t>(),
                  key,
                  dkeys.as<double>(),
                  dage.as<float>(),
                  4,
                  2.0,
                  ddec.as<int32_t>(),
                  dstats.as<double>()};
  cpu.cache_gate(h);
  be.cache_gate(d);
  EXPECT_EQ(download<int32_t>(be, ddec, n), dec);
  EXPECT_EQ(download<float>(be, dage, n), age);
  EXPECT_EQ(download<double>(be, dkeys, n), keys);
  const std::vector<double> gs = download<double>(be, dstats, stats.size());
  // The sum of squares may differ by a fused multiply-add; equality covers the +inf of minima
  // never updated.
  for (size_t k = 0; k < stats.size(); ++k) {
    if (gs[k] != stats[k]) {
      EXPECT_NEAR(gs[k], stats[k], 1e-12 * std::abs(stats[k])) << "stat " << k % kCacheStatFields;
    }
  }
}

// The per-batch gate (one block per call, votes ANDed by a barrier) against the CPU's
// cache_ref::gate_call, call by call: calls of 1 to 300 matrices (more than the block's 256
// threads, so that a thread votes for several), one whose matrices all pass but for skips (it
// hits), one where a single matrix past the 256th fails (all refresh), and random ones.
TEST(CudaCache, BatchGateEqualsCpuCallByCall) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const double key = 777;
  const int n = 700;
  std::vector<double> res(n), keys(n), stats(n * kCacheStatFields, 0.0);
  std::vector<float> age(n), misses(n);
  std::vector<int32_t> st(n);
  std::mt19937_64& g = test::rng();
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < n; ++i) {
    const bool passing = i >= 6 && i < 646;  // r = res / 2 <= 1.9 < gamma, usable, due
    res[i] = passing ? 3.8 * u(g) : (i % 17 == 0 ? NAN : (i % 23 == 0 ? INFINITY : 6 * u(g)));
    age[i] = static_cast<float>(i % 4);
    misses[i] = passing ? 0.0f : static_cast<float>(i % 6);
    st[i] = i % 37 == 0 ? kStatusNonFinite : kStatusOk;
    keys[i] = !passing && i % 13 == 0 ? 0.0 : (!passing && i % 11 == 0 ? 5.0 : key);
    stats[i * kCacheStatFields + kCacheStatResMin] = INFINITY;
  }
  res[336] = 5.0;  // r = 2.5: fails, 290th of its call
  Buffer dres = upload(be, res), dage = upload(be, age), dst = upload(be, st);
  Buffer dkeys = upload(be, keys), dstats = upload(be, stats), dmisses = upload(be, misses);
  Buffer ddec = be.alloc(n * sizeof(int32_t));
  std::vector<int32_t> dec(n, -1);
  const std::pair<int, int> calls[] = {{0, 1}, {1, 5}, {6, 40}, {46, 300}, {346, 300}, {646, 54}};
  // Gates matrices [first, first + count) of buffers res, st, ... (host or device) as one call.
  auto gate = [&](Backend& b, const double* r, const int32_t* s, double* k, float* a, int32_t* d,
                  double* t, float* m, int first, int count) {
    CacheGateArgs c;
    c.count = count;
    c.residual = r + first;
    c.residual_scale = 0.5;
    c.status = s + first;
    c.key = key;
    c.entry_key = k + first;
    c.age = a + first;
    c.max_age = 4;
    c.gamma = 2.0;
    c.decision = d + first;
    c.stats = t + static_cast<int64_t>(first) * kCacheStatFields;
    c.misses = m + first;
    c.backoff = 4;
    c.batch = true;
    b.cache_gate(c);
  };
  for (auto [first, count] : calls) {
    gate(cpu, res.data(), st.data(), keys.data(), age.data(), dec.data(), stats.data(),
         misses.data(), first, count);
    gate(be, dres.as<double>(), dst.as<int32_t>(), dkeys.as<double>(), dage.as<float>(),
         ddec.as<int32_t>(), dstats.as<double>(), dmisses.as<float>(), first, count);
  }
  for (int i = 346; i < 646; ++i) EXPECT_NE(dec[i], kCacheRefresh) << i;  // hit whole
  for (int i = 46; i < 346; ++i) EXPECT_NE(dec[i], kCacheHit) << i;       // refreshed whole
  EXPECT_EQ(download<int32_t>(be, ddec, n), dec);
  EXPECT_EQ(download<float>(be, dage, n), age);
  EXPECT_EQ(download<float>(be, dmisses, n), misses);
  EXPECT_EQ(download<double>(be, dkeys, n), keys);
  const std::vector<double> gs = download<double>(be, dstats, stats.size());
  for (size_t k = 0; k < stats.size(); ++k) {  // as GateEqualsCpuOnEveryCase
    if (gs[k] != stats[k]) {
      EXPECT_NEAR(gs[k], stats[k], 1e-12 * std::abs(stats[k])) << "stat " << k % kCacheStatFields;
    }
  }
}

TEST(CudaCache, NormalFillDrawsTheCpuSamples) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  for (DType t : {DType::kF64, DType::kF32, DType::kBF16, DType::kF16}) {
    HostBatch want(t, 3, 37, 53), got(t, 3, 37, 53);
    got.poison();
    DeviceBatch dg(be, got);
    cpu.fill_normal(want.ref, 99, 12345);
    be.fill_normal(dg.ref, 99, 12345);
    dg.download(be, got);
    for (int64_t i = 0; i < 3; ++i) {
      if (t == DType::kF64)  // device log/cos within an ulp or two of the host's
        EXPECT_LT(rel_err(got.get(i), want.get(i)), 1e-14);
      else
        EXPECT_TRUE(bits_equal(got, want, i)) << dtype_name(t) << " matrix " << i;
    }
  }
}

// The probes' keys and keyed streams: the device computes the CPU's fingerprints bit for bit
// (every storage size) and draws the CPU's samples from them.
TEST(CudaCache, FingerprintsAndKeyedFillEqualTheCpu) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  for (DType t : {DType::kF64, DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    HostBatch x(t, 5, 37, 53);
    for (int64_t i = 0; i < 5; ++i) x.set(i, random_matrix(37, 53));
    std::vector<uint64_t> want(5);
    cpu.fingerprint(x.ref, want.data());
    DeviceBatch dx(be, x);
    Buffer keys = be.alloc(5 * sizeof(uint64_t));
    be.fingerprint(dx.ref, keys.as<uint64_t>());
    EXPECT_EQ(download<uint64_t>(be, keys, 5), want);

    HostBatch wcpu(t, 5, 37, 8), wdev(t, 5, 37, 8);
    wdev.poison();
    DeviceBatch dw(be, wdev);
    cpu.fill_normal_keyed(wcpu.ref, 0x5eed, want.data());
    be.fill_normal_keyed(dw.ref, 0x5eed, keys.as<uint64_t>());
    dw.download(be, wdev);
    for (int64_t i = 0; i < 5; ++i) {
      if (t == DType::kF64)  // device log/cos within an ulp or two of the host's
        EXPECT_LT(rel_err(wdev.get(i), wcpu.get(i)), 1e-14);
      else
        EXPECT_TRUE(bits_equal(wdev, wcpu, i)) << "matrix " << i;
    }
  }
}

TEST(CudaCache, MaskedCopySelectsOnTheDevice) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  CpuBackend cpu;
  const std::vector<int32_t> flags = {1, 0, 1, 2, 1};
  Buffer df = upload(be, flags);
  const std::pair<DType, DType> pairs[] = {{DType::kF32, DType::kF16},
                                           {DType::kF16, DType::kF32},
                                           {DType::kBF16, DType::kBF16},
                                           {DType::kF64, DType::kF32}};
  for (auto [ts, td] : pairs)
    for (int64_t cols : {64, 30}) {  // vector and scalar paths
      HostBatch src(ts, 5, 24, cols), want(td, 5, 24, cols), got(td, 5, 24, cols);
      for (int64_t i = 0; i < 5; ++i) src.set(i, random_matrix(24, cols));
      want.poison();
      got.poison();
      DeviceBatch ds(be, src), dg(be, got);
      cpu.copy_masked(BatchMask{flags.data(), 1}, src.ref, want.ref);
      be.copy_masked(BatchMask{df.as<int32_t>(), 1}, ds.ref, dg.ref);
      dg.download(be, got);
      for (int64_t i = 0; i < 5; ++i) {
        if (flags[i] == 1)
          EXPECT_TRUE(bits_equal(got, want, i)) << dtype_name(ts) << "->" << dtype_name(td);
        else
          EXPECT_TRUE(got.get(i).array().isNaN().all()) << "unselected matrix " << i << " written";
      }
    }
}

// Masked symmetric products with every CUTLASS variant: X X^T with beta Cin and R Z (N, N).
class CudaMaskedSym : public ::testing::TestWithParam<std::tuple<DType, SymKernel, int>> {};

TEST_P(CudaMaskedSym, SelectedBitExactOthersUntouched) {
  DM_SKIP_WITHOUT_CUDA();
  auto [t, kernel, m] = GetParam();
  CudaBackend& be = test::cuda_backend();
  if (!be.has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  be.set_sym_kernel(kernel);
  const int64_t c = 6, k = 520;
  const std::vector<int32_t> flags = {1, 0, 0, 1, 3, 1};
  Buffer df = upload(be, flags);
  HostBatch x(t, c, m, k), cin(t, c, m, m), full(t, c, m, m), got(t, c, m, m);
  for (int64_t i = 0; i < c; ++i) {
    x.set(i, random_matrix(m, k, 1.0 / std::sqrt(double(k))));
    Mat s = random_matrix(m, m);
    cin.set(i, (s + s.transpose()).eval());
  }
  full.poison();
  got.poison();
  DeviceBatch dx(be, x), dcin(be, cin), dfull(be, full), dgot(be, got);
  const BatchMask mask{df.as<int32_t>(), 1};
  be.gemm_symmetric(Op::kN, dx.ref, Op::kT, dx.ref, 1.5, 0.25, &dcin.ref, dfull.ref);
  be.gemm_masked(mask, true, Op::kN, dx.ref, Op::kT, dx.ref, 1.5, 0.25, &dcin.ref, dgot.ref);
  dfull.download(be, full);
  dgot.download(be, got);
  for (int64_t i = 0; i < c; ++i) {
    SCOPED_TRACE("X X^T, matrix " + std::to_string(i));
    if (flags[i] == 1) {
      EXPECT_TRUE(bits_equal(got, full, i));
      Mat rx = x.get(i);
      EXPECT_LT(rel_err(got.get(i), 1.5 * rx * rx.transpose() + 0.25 * cin.get(i)), 1e-2);
    } else {
      EXPECT_TRUE(got.get(i).array().isNaN().all());
    }
  }
  // R Z with symmetric R and Z (op(B) = B), as Gram NS issues it; full is R, cin is Z.
  got.poison();
  DeviceBatch dgot2(be, got);
  HostBatch want2(t, c, m, m);
  DeviceBatch dwant2(be, want2);
  be.gemm_symmetric(Op::kN, dfull.ref, Op::kN, dcin.ref, 1.0, 0.0, nullptr, dwant2.ref);
  be.gemm_masked(mask, true, Op::kN, dfull.ref, Op::kN, dcin.ref, 1.0, 0.0, nullptr, dgot2.ref);
  dwant2.download(be, want2);
  dgot2.download(be, got);
  be.set_sym_kernel(SymKernel::kAuto);
  for (int64_t i = 0; i < c; ++i) {
    if (flags[i] == 1)
      EXPECT_TRUE(bits_equal(got, want2, i)) << "R Z, matrix " << i;
    else
      EXPECT_TRUE(got.get(i).array().isNaN().all()) << "R Z, unselected matrix " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, CudaMaskedSym,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(SymKernel::kTri128, SymKernel::kTri256x128,
                                         SymKernel::kTri128Cluster2, SymKernel::kTri128Pingpong),
                       ::testing::Values(256, 392, 776)),
    [](const auto& info) {
      std::string n = std::string(dtype_name(std::get<0>(info.param))) + "_" +
                      sym_kernel_name(std::get<1>(info.param)) + "_m" +
                      std::to_string(std::get<2>(info.param));
      for (char& ch : n)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// Masked dense products Q X (op(B) = B) and A B^T: against float64, bit-exact between masks,
// unselected matrices untouched, and an all-unselected mask writes nothing.
TEST(CudaCache, MaskedDenseProducts) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  if (!be.has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  const int64_t c = 5, m = 136, n = 400;
  const std::vector<int32_t> some = {0, 1, 1, 0, 1}, all(c, 1), none(c, 0);
  Buffer fs = upload(be, some), fa = upload(be, all), fn = upload(be, none);
  for (DType t : {DType::kBF16, DType::kF16})
    for (bool nt : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + (nt ? " A B^T" : " Q X"));
      HostBatch q(t, c, m, m), x(t, c, nt ? n : m, nt ? m : n), ref(t, c, m, n), got(t, c, m, n);
      for (int64_t i = 0; i < c; ++i) {
        q.set(i, random_matrix(m, m, 1.0 / std::sqrt(double(m))));
        x.set(i, random_matrix(x.ref.rows, x.ref.cols));
      }
      ref.poison();
      got.poison();
      DeviceBatch dq(be, q), dx(be, x), dref(be, ref), dgot(be, got);
      const Op ob = nt ? Op::kT : Op::kN;
      be.gemm_masked(BatchMask{fa.as<int32_t>(), 1}, false, Op::kN, dq.ref, ob, dx.ref, 1.0, 0.0,
                     nullptr, dref.ref);
      be.gemm_masked(BatchMask{fn.as<int32_t>(), 1}, false, Op::kN, dq.ref, ob, dx.ref, 1.0, 0.0,
                     nullptr, dgot.ref);
      dgot.download(be, got);
      for (int64_t i = 0; i < c; ++i) EXPECT_TRUE(got.get(i).array().isNaN().all());
      be.gemm_masked(BatchMask{fs.as<int32_t>(), 1}, false, Op::kN, dq.ref, ob, dx.ref, 1.0, 0.0,
                     nullptr, dgot.ref);
      dref.download(be, ref);
      dgot.download(be, got);
      for (int64_t i = 0; i < c; ++i) {
        Mat want = q.get(i) * (nt ? Mat(x.get(i).transpose()) : x.get(i));
        EXPECT_LT(rel_err(ref.get(i), want), 1e-2) << "matrix " << i;
        if (some[i])
          EXPECT_TRUE(bits_equal(got, ref, i)) << "matrix " << i;
        else
          EXPECT_TRUE(got.get(i).array().isNaN().all()) << "unselected matrix " << i;
      }
    }
}

// The dense kernel's two tile orders (row by row; column by column, the default where A is the
// smaller operand) compute every tile the same way: bit-identical outputs, on shapes of both
// sides (m < n and m > n) and with some matrices unselected; the 128 x 256 tiles in 2 x 1
// clusters against float64.
TEST(CudaCache, MaskedDenseTileOrdersAgreeBitForBit) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  if (!be.has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  int sms = 0;
  DM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t ws_bytes = size_t(16) << 20;
  Buffer ws = be.alloc(ws_bytes);
  const int64_t c = 3;
  const std::vector<int32_t> some = {1, 0, 1};
  Buffer flags = upload(be, some);
  for (auto [m, n] : {std::pair<int64_t, int64_t>{136, 520}, {520, 136}}) {
    SCOPED_TRACE(std::to_string(m) + " x " + std::to_string(n));
    HostBatch q(DType::kBF16, c, m, m), x(DType::kBF16, c, m, n);
    for (int64_t i = 0; i < c; ++i) {
      q.set(i, random_matrix(m, m, 1.0 / std::sqrt(double(m))));
      x.set(i, random_matrix(m, n));
    }
    DeviceBatch dq(be, q), dx(be, x);
    std::vector<HostBatch> outs;
    // Row order, column order, and the 128 x 256 tiles in 2 x 1 clusters.
    for (int variant = 0; variant < 3; ++variant) {
      HostBatch y(DType::kBF16, c, m, n);
      y.poison();
      DeviceBatch dy(be, y);
      cuda::SymGemmArgs g = cuda::make_sym_args(dq.ref, dx.ref, nullptr, dy.ref, m, 1.0, 0.0);
      g.lower = false;
      g.flags = flags.as<int32_t>();
      g.order = variant == 0 ? cuda::TileOrder::kRows : cuda::TileOrder::kColumns;
      g.tile = variant == 2 ? cuda::DenseTile::k128x256Cluster2 : cuda::DenseTile::k256x128;
      ASSERT_TRUE(cuda::run_dense_nn_sm90_bf16(g, sms, ws.data(), ws_bytes, be.stream()));
      dy.download(be, y);
      outs.push_back(std::move(y));
    }
    for (int64_t i = 0; i < c; ++i) {
      if (!some[i]) {
        for (const HostBatch& o : outs)
          EXPECT_TRUE(o.get(i).array().isNaN().all()) << "unselected matrix " << i;
        continue;
      }
      const Mat want = q.get(i) * x.get(i);
      EXPECT_LT(rel_err(outs[0].get(i), want), 1e-2) << "matrix " << i;
      EXPECT_TRUE(bits_equal(outs[0], outs[1], i)) << "matrix " << i;
      EXPECT_LT(rel_err(outs[2].get(i), want), 1e-2) << "128 x 256 tiles, matrix " << i;
    }
  }
}

// A product no device kernel covers (fp32) still honours the mask (host fallback), and the
// backend says that such products cannot be captured while half-precision ones can.
TEST(CudaCache, MaskedFp32FallsBackCorrectly) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  EXPECT_FALSE(be.masked_capturable(DType::kF32));
  EXPECT_FALSE(be.masked_capturable(DType::kF64));
  EXPECT_EQ(be.masked_capturable(DType::kBF16), be.has_sm90_kernels());
  EXPECT_EQ(be.masked_capturable(DType::kF16), be.has_sm90_kernels());
  const std::vector<int32_t> flags = {1, 0, 1};
  Buffer df = upload(be, flags);
  HostBatch a(DType::kF32, 3, 20, 36), got(DType::kF32, 3, 20, 20);
  for (int64_t i = 0; i < 3; ++i) a.set(i, random_matrix(20, 36));
  got.poison();
  DeviceBatch da(be, a), dg(be, got);
  be.gemm_masked(BatchMask{df.as<int32_t>(), 1}, true, Op::kN, da.ref, Op::kT, da.ref, 1.0, 0.0,
                 nullptr, dg.ref);
  dg.download(be, got);
  for (int64_t i = 0; i < 3; ++i) {
    if (flags[i]) {
      Mat ra = a.get(i);
      EXPECT_LT(rel_err(got.get(i), ra * ra.transpose()), 1e-5);
    } else {
      EXPECT_TRUE(got.get(i).array().isNaN().all());
    }
  }
}

// A whole CacheMuon call captured in a CUDA graph: the capture fails if any operation waits for
// the host or reads device memory back. Same input again: every matrix hits, and the accepted
// update Q X is the fresh one to half-precision rounding.
TEST(CudaCache, CachedRunIsGraphCapturableAndHitsOnTheSameInput) {
  DM_SKIP_WITHOUT_CUDA();
  CudaBackend& be = test::cuda_backend();
  if (!be.has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  const int64_t c = 4, m = 128, n = 384;
  OrthoConfig cfg;
  cfg.iteration = Iteration::kGram;
  cfg.work_dtype = DType::kBF16;
  const OrthoConfig r = resolve(cfg, m, n);
  const DType t = iteration_dtype(r);
  HostBatch x0(t, c, m, n), fresh(t, c, m, n), out(t, c, m, n);
  for (int64_t i = 0; i < c; ++i) {
    Mat u = random_matrix(m, n);
    x0.set(i, (u / u.norm()).eval());
  }
  DeviceBatch dx0(be, x0), dx(be, x0), dfresh(be, fresh), dout(be, out);
  Orthogonalizer ortho(be);
  {
    const size_t wb = Orthogonalizer::workspace_bytes(r, c, m, n);
    Buffer ws = be.alloc(wb);
    ortho.run(r, dx.ref, dfresh.ref, ws.data(), wb);
    dfresh.download(be, fresh);
  }
  for (CacheResidual res : {CacheResidual::kExact, CacheResidual::kProbe}) {
    SCOPED_TRACE(cache_residual_name(res));
    CacheOptions opt;
    opt.enabled = true;
    opt.gamma = 2.0;
    opt.residual = res;
    TransformCache cache(be, opt);
    cache.prepare(r, c, m, n);
    const size_t wb = Orthogonalizer::cached_workspace_bytes(r, opt, c, m, n);
    Buffer ws = be.alloc(wb);
    auto call = [&] {
      be.copy(dx.ref.data, dx0.ref.data, dx0.ref.bytes());
      ortho.run_cached(r, cache, 0, dx.ref, dout.ref, nullptr, ws.data(), wb);
    };
    call();  // empty entries: every matrix refreshes
    be.synchronize();
    cuda::GraphExec exec = cuda::capture_graph(be.stream(), call);
    DM_CHECK_CUDA(cudaMemsetAsync(dout.ref.data, 0xff, dout.ref.bytes(), be.stream()));  // NaN
    DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream()));
    DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream()));
    be.synchronize();
    const CacheStats st = cache.stats();
    EXPECT_EQ(st.refreshes, c);
    EXPECT_EQ(st.hits, 2 * c);
    dout.download(be, out);
    for (int64_t i = 0; i < c; ++i) EXPECT_LT(rel_err(out.get(i), fresh.get(i)), 1e-2) << i;
  }
}

}  // namespace
}  // namespace distmuon

namespace distmuon {
namespace {

// One call of a captured-against-eager run: which matrices see input B (else A), and the
// decisions expected (refreshes, hits, refreshes the back-off left untested).
struct DecisionCall {
  std::vector<bool> use_b;
  int64_t refreshes, hits, unchecked;
};

// Issues `calls` through two caches on 4 matrices of 128 x 384: one call captured once by the
// backend (its test and refresh paths are conditional blocks) and replayed, the other issued
// eagerly each time; both must decide as expected, and their outputs must be equal bit for bit
// (a skipped block was one with nothing to do). A replay where every matrix refreshes runs the
// refresh's second body, the plain solve's kernels: its output equals a plain solve of the same
// input bit for bit and the eager (masked) call's to rounding; the eager cache then takes the
// replayed one's transforms, so that later calls compare bit for bit again. Isotropic inputs
// (A) and ones with 16 strong directions (B) switch the decisions at gamma 1: a transform
// fitted to one leaves a residual of 3 (A's on B) to 18 (B's on A) on the other, and the same
// input again 0.3-0.4 (float64 model of the iteration).
void expect_replays_decide_as_eager_calls(int check_backoff,
                                          const std::vector<DecisionCall>& calls,
                                          CacheGate gate = CacheGate::kMatrix) {
  setenv("DISTMUON_GRAPH_CONDITIONALS", "1", 1);  // the default, unless the environment says 0
  CudaBackend& be = test::cuda_backend();
  const int64_t c = 4, m = 128, n = 384;
  OrthoConfig cfg;
  cfg.iteration = Iteration::kGram;
  cfg.work_dtype = DType::kBF16;
  const OrthoConfig r = resolve(cfg, m, n);
  const DType t = iteration_dtype(r);
  std::vector<Mat> a, b;
  for (int64_t i = 0; i < c; ++i) {
    Mat u = random_matrix(m, n);
    a.push_back((u / u.norm()).eval());
    Mat v = random_matrix(m, n);
    v.topRows(16) *= 10.0;  // 16 strong directions
    b.push_back((v / v.norm()).eval());
  }
  for (CacheResidual res : {CacheResidual::kExact, CacheResidual::kProbe}) {
    SCOPED_TRACE(cache_residual_name(res));
    CacheOptions opt;
    opt.enabled = true;
    opt.gamma = 1.0;
    opt.residual = res;
    opt.check_backoff = check_backoff;
    opt.gate = gate;
    HostBatch in(t, c, m, n), out(t, c, m, n), got(t, c, m, n), plain(t, c, m, n);
    DeviceBatch dsrc(be, in), dx(be, in), dout(be, out), dplain(be, plain);
    const size_t wb = Orthogonalizer::cached_workspace_bytes(r, opt, c, m, n);
    Buffer ws = be.alloc(wb);
    const size_t plain_wb = Orthogonalizer::workspace_bytes(r, c, m, n);
    Buffer plain_ws = be.alloc(plain_wb);
    Orthogonalizer ortho(be);
    TransformCache eager(be, opt), captured(be, opt);
    eager.prepare(r, c, m, n);
    captured.prepare(r, c, m, n);
    auto issue = [&](TransformCache& cache) {
      be.copy(dx.ref.data, dsrc.ref.data, dx.ref.bytes());
      ortho.run_cached(r, cache, 0, dx.ref, dout.ref, nullptr, ws.data(), wb);
    };
    const TransformCache::Ledger before = captured.ledger();
    auto graph = be.capture([&] { issue(captured); });
    ASSERT_TRUE(graph);
    const TransformCache::Ledger per_replay = captured.ledger() - before;  // as the engine does
    for (size_t k = 0; k < calls.size(); ++k) {
      SCOPED_TRACE("call " + std::to_string(k + 1));
      for (int64_t i = 0; i < c; ++i) in.set(i, calls[k].use_b[i] ? b[i] : a[i]);
      be.copy_from_host(dsrc.ref.data, in.bytes.data(), in.bytes.size());
      const CacheStats e0 = eager.stats(), g0 = captured.stats();
      issue(eager);
      be.synchronize();
      dout.download(be, out);
      DM_CHECK_CUDA(cudaMemsetAsync(dout.ref.data, 0xff, dout.ref.bytes(), be.stream()));  // NaN
      graph->replay();
      captured.add_replayed(per_replay);
      be.synchronize();
      dout.download(be, got);
      const CacheStats e1 = eager.stats(), g1 = captured.stats();
      for (const auto& [s0, s1] : {std::pair{&e0, &e1}, std::pair{&g0, &g1}}) {
        EXPECT_EQ(s1->refreshes - s0->refreshes, calls[k].refreshes);
        EXPECT_EQ(s1->hits - s0->hits, calls[k].hits);
        EXPECT_EQ(s1->unchecked_refreshes - s0->unchecked_refreshes, calls[k].unchecked);
      }
      EXPECT_DOUBLE_EQ(g1.flops - g0.flops, e1.flops - e0.flops);
      if (calls[k].refreshes < c) {
        for (int64_t i = 0; i < c; ++i) EXPECT_TRUE(bits_equal(out, got, i)) << i;
        continue;
      }
      be.copy(dx.ref.data, dsrc.ref.data, dx.ref.bytes());
      ortho.run(r, dx.ref, dplain.ref, plain_ws.data(), plain_wb);
      const TensorView from = captured.state("cache_q", 0, c, {c});
      const TensorView to = eager.state("cache_q", 0, c, {c});
      be.copy(to.data, from.data, static_cast<size_t>(from.numel()) * dtype_size(from.dtype));
      be.synchronize();
      dplain.download(be, plain);
      for (int64_t i = 0; i < c; ++i) {
        EXPECT_TRUE(bits_equal(plain, got, i)) << i;
        EXPECT_LT(rel_err(got.get(i), out.get(i)), 1e-2) << i;
      }
    }
  }
}

// Replayed under every kind of decision (all refresh, all hit, mixed), the refresh path skipped
// or not.
TEST(CudaCache, CapturedCallSkipsOnlyThePathsNoMatrixTakes) {
  DM_SKIP_WITHOUT_CUDA();
  if (!test::cuda_backend().has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  expect_replays_decide_as_eager_calls(0, {{{0, 0, 0, 0}, 4, 0, 0},    // empty entries
                                           {{0, 0, 0, 0}, 0, 4, 0},    // the same input
                                           {{1, 1, 0, 0}, 2, 2, 0},    // mixed
                                           {{1, 1, 0, 0}, 0, 4, 0},    // the same input
                                           {{0, 0, 1, 1}, 4, 0, 0}});  // every input switched
}

// With the check back-off (4), the test is a block too: replays where no matrix is due (call 5),
// where some are (call 10) and where all are equal the eager calls. Matrices whose input
// switches every call miss, and after three misses in a row they skip a test (misses counted
// before the call: 3 is between the tests at 2 and 4).
TEST(CudaCache, CapturedCallSkipsTheTestWhenNoMatrixIsDue) {
  DM_SKIP_WITHOUT_CUDA();
  if (!test::cuda_backend().has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  expect_replays_decide_as_eager_calls(4, {{{0, 0, 0, 0}, 4, 0, 0},    // 1: empty entries
                                           {{1, 1, 1, 1}, 4, 0, 0},    // 2: switched (1 miss)
                                           {{0, 0, 0, 0}, 4, 0, 0},    // 3: (2)
                                           {{1, 1, 1, 1}, 4, 0, 0},    // 4: (3)
                                           {{1, 1, 1, 1}, 4, 0, 4},    // 5: none due
                                           {{1, 1, 1, 1}, 0, 4, 0},    // 6: due again, fits
                                           {{0, 0, 1, 1}, 2, 2, 0},    // 7
                                           {{1, 1, 1, 1}, 2, 2, 0},    // 8
                                           {{0, 0, 1, 1}, 2, 2, 0},    // 9
                                           {{0, 0, 1, 1}, 2, 2, 2},    // 10: 0, 1 not due
                                           {{0, 0, 1, 1}, 0, 4, 0}});  // 11
}

// The per-batch gate inside a captured call: a call whose inputs switch for two matrices (mixed
// under the per-matrix gate) refreshes whole, so the replay runs the refresh's second body (the
// plain solve), and the refilled entries then hit whole; equal to the eager calls' decisions.
TEST(CudaCache, CapturedBatchGateCallsHitOrRefreshWhole) {
  DM_SKIP_WITHOUT_CUDA();
  if (!test::cuda_backend().has_sm90_kernels()) GTEST_SKIP() << "no sm90 kernels";
  expect_replays_decide_as_eager_calls(0,
                                       {{{0, 0, 0, 0}, 4, 0, 0},   // empty entries
                                        {{0, 0, 0, 0}, 0, 4, 0},   // the same input
                                        {{1, 1, 0, 0}, 4, 0, 0},   // two fail: all refresh
                                        {{1, 1, 0, 0}, 0, 4, 0},   // the same input
                                        {{0, 0, 1, 1}, 4, 0, 0}},  // every input switched
                                       CacheGate::kBatch);
}

}  // namespace
}  // namespace distmuon
