// The CPU backend's own fp32 product for small matrices on AVX-512 (included by cpu_gemm.cc
// only). OpenBLAS's kernels follow OPENBLAS_CORETYPE, and an environment that pins an older core
// type (Haswell: AVX2) halves the rate of the products that dominate a step of small matrices
// (128 x 128 x 128: 114 GFLOP/s against 190-200 with AVX-512 kernels on a Zen 5 core). This
// kernel runs wherever the CPU has AVX-512F, whatever OpenBLAS was told, and computes only the
// tiles of the lower triangle of a symmetric product (56 % of a 128 x 128 one's multiply-adds),
// where BLAS has syrk only for X X^T. Larger products, and CPUs without AVX-512F, keep OpenBLAS.
//
// C (m x n, row-major, ldc) = alpha op(A) op(B) + beta Cin, beta 0: Cin is not read. Tiles of 8
// rows by 32 columns, accumulated in registers over the whole k: each element is one sequence of
// fused multiply-adds in k order, then alpha acc + beta cin. A is read in place (the tile's 8 rows
// are broadcast, whatever op(A)); op(B) is read in place when not transposed, else packed by
// 16 x 16 transposes into a k x 32 panel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "backend/cpu/cpu_simd.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace distmuon::cpu {

// The largest product the kernel takes: every dimension up to 2048 (a 32-column panel of op(B)
// stays within 256 KiB) and at most 2^28 multiply-adds (512^3 x 2): above, OpenBLAS's blocking
// for the caches and its threads pay.
inline bool small_gemm_fits(int64_t m, int64_t n, int64_t k) {
  return m > 0 && n > 0 && k > 0 && m <= 2048 && n <= 2048 && k <= 2048 &&
         m * n * k <= (int64_t{1} << 28);
}

inline bool small_gemm_available() { return avx512_available(); }

namespace small_gemm {

constexpr int kMR = 8;   // rows of a tile
constexpr int kNR = 32;  // columns of a tile (two 16-float vectors)

// The k x 32 panel of op(B) = B^T starting at column j0: panel[kk * 32 + jj] = b[(j0 + jj) * ldb
// + kk], zero past column n.
__attribute__((target("avx512f"))) inline void pack_bt(const float* b, int64_t ldb, int64_t n,
                                                       int64_t k, int64_t j0, float* panel) {
  const int64_t cols = std::min<int64_t>(kNR, n - j0);
  int64_t kk = 0;
  if (cols == kNR)
    for (; kk + 16 <= k; kk += 16)
      for (int h = 0; h < 2; ++h)
        simd::transpose16(b + (j0 + 16 * h) * ldb + kk, ldb, panel + kk * kNR + 16 * h, kNR);
  for (; kk < k; ++kk)
    for (int jj = 0; jj < kNR; ++jj)
      panel[kk * kNR + jj] = jj < cols ? b[(j0 + jj) * ldb + kk] : 0.0f;
}

// One tile: rows [r0, r0 + rows) and columns [c0, c0 + 32); op(B) loaded under lm0 | lm1 and C
// stored under sm0 | sm1 (and, when lower, column <= row). A's element (r, kk) is at
// a[r * sr + kk * sk]; op(B)'s row kk of the tile's columns at b + kk * sb. NV 1: the first 16
// columns only (a tile of a lower triangle whose other 16 lie above the diagonal).
template <int NV>
__attribute__((target("avx512f"))) inline void tile(
    int64_t k, const float* a, int64_t sr, int64_t sk, const float* b, int64_t sb, int rows,
    __mmask16 lm0, __mmask16 lm1, __mmask16 sm0, __mmask16 sm1, float alpha, float beta,
    const float* cin, int64_t ldcin, float* c, int64_t ldc, bool lower, int64_t r0, int64_t c0) {
  __m512 acc[kMR][2];
  for (int r = 0; r < kMR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  if (NV == 1) lm1 = sm1 = 0;
  const float* ar[kMR];
  for (int r = 0; r < kMR; ++r) ar[r] = a + std::min(r, rows - 1) * sr;
  const bool full = lm0 == 0xFFFF && (NV == 1 || lm1 == 0xFFFF);
  if (sk == 1 && full) {
#pragma GCC unroll 2
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m512 b0 = _mm512_loadu_ps(b + kk * sb);
      const __m512 b1 = NV == 2 ? _mm512_loadu_ps(b + kk * sb + 16) : b0;
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m512 av = _mm512_set1_ps(ar[r][kk]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        if (NV == 2) acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      }
    }
  } else {
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m512 b0 = _mm512_maskz_loadu_ps(lm0, b + kk * sb);
      const __m512 b1 = NV == 2 ? _mm512_maskz_loadu_ps(lm1, b + kk * sb + 16) : b0;
      const int64_t off = kk * sk;
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m512 av = _mm512_set1_ps(ar[r][off]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        if (NV == 2) acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      }
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int r = 0; r < rows; ++r) {
    __mmask16 m[2] = {sm0, sm1};
    if (lower) {
      // Lanes whose column c0 + 16h + lane is at most the row r0 + r.
      for (int h = 0; h < 2; ++h) {
        const int64_t last = r0 + r - (c0 + 16 * h);  // last lane kept
        const __mmask16 keep = last < 0     ? 0
                               : last >= 15 ? 0xFFFF
                                            : static_cast<__mmask16>((1u << (last + 1)) - 1);
        m[h] &= keep;
      }
    }
    float* cr = c + (r0 + r) * ldc + c0;
    const float* cir = beta != 0.0f ? cin + (r0 + r) * ldcin + c0 : nullptr;
    for (int h = 0; h < NV; ++h) {
      if (!m[h]) continue;
      __m512 v = _mm512_mul_ps(va, acc[r][h]);
      if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m[h], cir + 16 * h), v);
      _mm512_mask_storeu_ps(cr + 16 * h, m[h], v);
    }
  }
}

inline float* panel_scratch(int64_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf;
  thread_local int64_t size = 0;
  if (size < floats) {
    buf.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(floats) * 4)));
    size = floats;
  }
  return buf.get();
}

}  // namespace small_gemm

// C = alpha op(A) op(B) + beta Cin for small_gemm_fits sizes on a CPU with AVX-512F (beta 0:
// Cin is not read; it may be C itself); lower: only the elements on and below the diagonal
// (m == n) are written, and only those of Cin read.
__attribute__((target("avx512f"))) inline void small_sgemm(bool ta, bool tb, int64_t m, int64_t n,
                                                           int64_t k, float alpha, const float* a,
                                                           int64_t lda, const float* b, int64_t ldb,
                                                           float beta, const float* cin,
                                                           int64_t ldcin, float* c, int64_t ldc,
                                                           bool lower) {
  using namespace small_gemm;
  const int64_t sr = ta ? 1 : lda, sk = ta ? lda : 1;
  float* panel = tb ? panel_scratch(k * kNR) : nullptr;
  for (int64_t c0 = 0; c0 < n; c0 += kNR) {
    const int64_t cols = std::min<int64_t>(kNR, n - c0);
    const __mmask16 cm0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 cm1 = cols >= 32   ? 0xFFFF
                          : cols <= 16 ? 0
                                       : static_cast<__mmask16>((1u << (cols - 16)) - 1);
    const float* bp = b + c0;
    int64_t sb = ldb;
    if (tb) {
      pack_bt(b, ldb, n, k, c0, panel);
      bp = panel;
      sb = kNR;
    }
    // Lower: the first tile with a row at or below the panel's first column.
    const int64_t first = lower ? c0 / kMR * kMR : 0;
    for (int64_t r0 = first; r0 < m; r0 += kMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMR, m - r0));
      // A packed panel is zero-padded: its loads need no mask.
      const __mmask16 lm0 = tb ? 0xFFFF : cm0, lm1 = tb ? 0xFFFF : cm1;
      if (lower && r0 + rows - 1 < c0 + 16)  // columns c0 + 16 ... all above the diagonal
        tile<1>(k, a + r0 * sr, sr, sk, bp, sb, rows, lm0, lm1, cm0, cm1, alpha, beta, cin, ldcin,
                c, ldc, lower, r0, c0);
      else
        tile<2>(k, a + r0 * sr, sr, sk, bp, sb, rows, lm0, lm1, cm0, cm1, alpha, beta, cin, ldcin,
                c, ldc, lower, r0, c0);
    }
  }
}

}  // namespace distmuon::cpu

#pragma GCC diagnostic pop
