// Batched products of the CPU backend on OpenBLAS. Operands whose storage type differs from the
// arithmetic type (bf16/fp16, or mixed) are widened into scratch, multiplied in fp32 (fp64 when
// any operand is fp64) and rounded once into C, which is what the GPU's tensor cores do.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "backend/backend_checks.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_dtype.h"
#include "backend/cpu/cpu_small_gemm.h"

extern "C" int openblas_get_num_threads(void);

namespace distmuon {

namespace {
// set_cpu_threads' count; 0: none set. One value for the process, as torch's pool size is.
std::atomic<int> g_threads{0};
}  // namespace

void set_cpu_threads(int threads) {
  DM_CHECK(threads >= 0 && threads <= 4096, "set_cpu_threads(", threads,
           "): not a thread count (1 to 4096, or 0 for OpenMP's setting)");
  g_threads.store(threads, std::memory_order_relaxed);
}

int cpu_threads() { return cpu::threads(); }

int cpu::threads() {
  const int set = g_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : omp_get_max_threads();
}

int64_t cpu::matrix_threads(int64_t n) {
  if (n < 2 || omp_in_parallel() || openblas_get_num_threads() > 1) return 1;
  return std::min<int64_t>(n, threads());
}

void cpu::for_each_matrix(int64_t n, const std::function<void(int64_t)>& f) {
  const int64_t threads = matrix_threads(n);
  if (threads < 2) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

int64_t CpuBackend::batch_parts(int64_t count) const { return cpu::matrix_threads(count); }

void CpuBackend::run_parts(int64_t parts, const std::function<void(int64_t)>& f) {
  cpu::for_each_matrix(parts, f);
}

namespace {

using cpu::compute_t;
using cpu::dispatch;

// A matrix as a pointer to arithmetic type T: the original storage when it already is T, or a
// widened dense copy.
template <typename T>
struct Staged {
  std::vector<T> copy;
  const T* ptr = nullptr;
  int64_t ld = 0;

  Staged(const MatRef& m) {
    if (m.dtype == (std::is_same_v<T, double> ? DType::kF64 : DType::kF32)) {
      ptr = static_cast<const T*>(m.data);
      ld = m.ld;
      return;
    }
    copy.resize(static_cast<size_t>(m.rows * m.cols));
    dispatch(m.dtype, [&](auto tag) {
      using S = decltype(tag);
      const S* src = static_cast<const S*>(m.data);
      for (int64_t i = 0; i < m.rows; ++i)
        for (int64_t j = 0; j < m.cols; ++j) copy[i * m.cols + j] = cpu::to_float(src[i * m.ld + j]);
    });
    ptr = copy.data();
    ld = m.cols;
  }
};

void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
               const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
               int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void blas_syrk(bool trans, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               float beta, float* c, int64_t ldc) {
  cblas_ssyrk(CblasRowMajor, CblasLower, trans ? CblasTrans : CblasNoTrans, n, k, alpha, a, lda,
              beta, c, ldc);
}
void blas_syrk(bool trans, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
               double beta, double* c, int64_t ldc) {
  cblas_dsyrk(CblasRowMajor, CblasLower, trans ? CblasTrans : CblasNoTrans, n, k, alpha, a, lda,
              beta, c, ldc);
}

// The upper triangle of an n x n matrix from its lower one, in 32 x 32 tiles so that the rows
// read and the columns written both stay within a few cache lines.
template <typename S>
void mirror_lower(S* a, int64_t n, int64_t ld) {
  if constexpr (std::is_same_v<S, float>) {
    if (cpu::avx512_available()) return cpu::simd::mirror_lower(a, n, ld);
  }
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < n; r0 += kTile)
    for (int64_t j0 = r0; j0 < n; j0 += kTile)
      for (int64_t j = j0; j < std::min(n, j0 + kTile); ++j)
        for (int64_t r = r0; r < std::min(j, r0 + kTile); ++r) a[r * ld + j] = a[j * ld + r];
}

// Whether an fp32 product of this size runs on the backend's AVX-512 kernel (cpu_small_gemm.h).
template <typename T>
bool own_kernel(int64_t m, int64_t n, int64_t k) {
  return std::is_same_v<T, float> && cpu::small_gemm_available() && cpu::small_gemm_fits(m, n, k);
}

// Rows [r0, r1) x cols [0, ncols) of C = alpha op(A) op(B) + beta Cin, into the m x n T scratch.
template <typename T>
void product_block(bool ta, bool tb, const Staged<T>& a, const Staged<T>& b, int64_t k, T alpha,
                   T beta, int64_t r0, int64_t r1, int64_t ncols, T* c, int64_t ldc) {
  if (r1 <= r0 || ncols == 0) return;
  // Row r of op(A) starts at a + r*lda (as stored) or a + r (transposed storage).
  const T* a_rows = ta ? a.ptr + r0 : a.ptr + r0 * a.ld;
  if (k == 0) {
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t j = 0; j < ncols; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : c[i * ldc + j] * beta;
    return;
  }
  blas_gemm(ta, tb, r1 - r0, ncols, k, alpha, a_rows, a.ld, b.ptr, b.ld, beta, c + r0 * ldc, ldc);
}

// Matrices the mask does not select are skipped entirely (the flags live in host memory here).
template <typename T>
void run_products(bool symmetric, Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                  double alpha, double beta, const BatchRef* c_in, const BatchRef& c, GemmDims d,
                  const BatchMask* mask = nullptr) {
  const bool ta = op_a == Op::kT, tb = op_b == Op::kT;
  constexpr DType kArith = std::is_same_v<T, double> ? DType::kF64 : DType::kF32;
  cpu::for_each_matrix(c.count, [&](int64_t i) {
    if (mask && mask->flags[i] != mask->value) return;
    Staged<T> sa(a.matrix(i)), sb(b.matrix(i));
    MatRef out = c.matrix(i);
    // Multiply straight into C when it holds the arithmetic type and is not an input; else into
    // scratch, rounded once into C.
    const bool direct = out.dtype == kArith && out.data != sa.ptr && out.data != sb.ptr;
    std::vector<T> scratch(direct ? 0 : static_cast<size_t>(d.m * d.n));
    T* acc = direct ? static_cast<T*>(out.data) : scratch.data();
    const int64_t ld = direct ? out.ld : d.n;
    // The own kernel reads Cin where it lies; BLAS needs it in C first.
    const bool kernel = d.k > 0 && own_kernel<T>(d.m, d.n, d.k);
    T eff_beta = 0;
    std::optional<Staged<T>> sc;
    if (c_in && beta != 0.0) {
      sc.emplace(c_in->matrix(i));
      if (!kernel && sc->ptr != acc)
        for (int64_t r = 0; r < d.m; ++r)
          std::copy(sc->ptr + r * sc->ld, sc->ptr + r * sc->ld + d.n, acc + r * ld);
      eff_beta = static_cast<T>(beta);
    }
    if (kernel) {
      // Symmetric: the tiles of the lower triangle, whatever the operands (X X^T, or two
      // commuting symmetric matrices).
      if constexpr (std::is_same_v<T, float>)
        cpu::small_sgemm(ta, tb, d.m, d.n, d.k, static_cast<T>(alpha), sa.ptr, sa.ld, sb.ptr,
                         sb.ld, eff_beta, sc ? sc->ptr : acc, sc ? sc->ld : ld, acc, ld,
                         symmetric);
    } else if (!symmetric) {
      product_block<T>(ta, tb, sa, sb, d.k, static_cast<T>(alpha), eff_beta, 0, d.m, d.n, acc, ld);
    } else if (a.matrix(i).data == b.matrix(i).data && ta != tb && d.k > 0) {
      // X X^T or X^T X of one operand: BLAS's rank-k update computes the lower triangle.
      blas_syrk(ta, d.m, d.k, static_cast<T>(alpha), sa.ptr, sa.ld, eff_beta, acc, ld);
    } else {
      // Lower triangle in row blocks: block [r0, r1) needs columns [0, r1) only, which halves the
      // work; the upper triangle is then mirrored so the result is exactly symmetric.
      constexpr int64_t kBlock = 128;
      for (int64_t r0 = 0; r0 < d.m; r0 += kBlock) {
        int64_t r1 = std::min(d.m, r0 + kBlock);
        product_block<T>(ta, tb, sa, sb, d.k, static_cast<T>(alpha), eff_beta, r0, r1, r1, acc, ld);
      }
    }
    dispatch(out.dtype, [&](auto tag) {
      using S = decltype(tag);
      S* dst = static_cast<S*>(out.data);
      if (!direct)
        for (int64_t r = 0; r < d.m; ++r) {
          int64_t cols = symmetric ? r + 1 : d.n;
          for (int64_t j = 0; j < cols; ++j)
            dst[r * out.ld + j] = cpu::from_float<S>(acc[r * ld + j]);
        }
      if (symmetric) mirror_lower(dst, d.m, out.ld);
    });
  });
}

bool any_f64(const BatchRef& a, const BatchRef& b, const BatchRef* c_in, const BatchRef& c) {
  return a.dtype == DType::kF64 || b.dtype == DType::kF64 || c.dtype == DType::kF64 ||
         (c_in && c_in->dtype == DType::kF64);
}

}  // namespace

void CpuBackend::gemm(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                      double beta, const BatchRef* c_in, const BatchRef& c) {
  GemmDims d = check_gemm("gemm", op_a, a, op_b, b, c_in, c);
  if (any_f64(a, b, c_in, c))
    run_products<double>(false, op_a, a, op_b, b, alpha, beta, c_in, c, d);
  else
    run_products<float>(false, op_a, a, op_b, b, alpha, beta, c_in, c, d);
}

void CpuBackend::gemm_symmetric(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                                double alpha, double beta, const BatchRef* c_in,
                                const BatchRef& c) {
  GemmDims d = check_gemm("gemm_symmetric", op_a, a, op_b, b, c_in, c);
  DM_CHECK(d.m == d.n, "gemm_symmetric: the product is ", d.m, "x", d.n, ", not square");
  if (any_f64(a, b, c_in, c))
    run_products<double>(true, op_a, a, op_b, b, alpha, beta, c_in, c, d);
  else
    run_products<float>(true, op_a, a, op_b, b, alpha, beta, c_in, c, d);
}

void CpuBackend::gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a,
                             Op op_b, const BatchRef& b, double alpha, double beta,
                             const BatchRef* c_in, const BatchRef& c) {
  GemmDims d = check_gemm("gemm_masked", op_a, a, op_b, b, c_in, c);
  DM_CHECK(!symmetric || d.m == d.n, "gemm_masked: symmetric product is ", d.m, "x", d.n);
  DM_CHECK(mask.flags != nullptr || c.count == 0, "gemm_masked: no flags");
  if (any_f64(a, b, c_in, c))
    run_products<double>(symmetric, op_a, a, op_b, b, alpha, beta, c_in, c, d, &mask);
  else
    run_products<float>(symmetric, op_a, a, op_b, b, alpha, beta, c_in, c, d, &mask);
}

}  // namespace distmuon
