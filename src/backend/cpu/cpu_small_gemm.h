// The CPU backend's own fp32 product for small matrices on AVX-512 (included by cpu_gemm.cc
// only). OpenBLAS's kernels follow OPENBLAS_CORETYPE, and an environment that pins an older core
// type (Haswell: AVX2) halves the rate of the products that dominate a step of small matrices
// (128 x 128 x 128: 114 GFLOP/s against 190-200 with AVX-512 kernels on a Zen 5 core). This
// kernel runs wherever the CPU has AVX-512F, whatever OpenBLAS was told, and computes only the
// tiles of the lower triangle of a symmetric product (62.5 % of a 128 x 128 one), where BLAS has
// syrk only for X X^T. Larger products, and CPUs without AVX-512F, keep OpenBLAS.
//
// C (m x n, row-major, ldc) = alpha op(A) op(B) + beta C, beta 0: C is not read. Tiles of 8 rows
// by 32 columns, accumulated in registers over the whole k: each element is one sequence of
// fused multiply-adds in k order, then alpha acc + beta c. A is read in place (the tile's 8 rows
// are broadcast, whatever op(A)); op(B) is read in place when not transposed, else packed by
// 16 x 16 transposes into a k x 32 panel.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

// GCC 12 reports its own _mm512_undefined_* as uninitialised once inlined here.
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

inline bool small_gemm_available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
}

namespace small_gemm {

constexpr int kMR = 8;   // rows of a tile
constexpr int kNR = 32;  // columns of a tile (two 16-float vectors)

// dst (16 rows of 32 floats, ld_dst) = the transpose of src's 16 x 16 block (ld_src).
__attribute__((target("avx512f"))) inline void transpose16(const float* src, int64_t ld_src,
                                                           float* dst, int64_t ld_dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4q + s] holds, in each 128-bit lane L, column 4L + s of rows 4q .. 4q+3.
  for (int s = 0; s < 4; ++s) {
    for (int q = 0; q < 4; q += 2) {
      t[4 * q + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0x88);      // lanes 0,2 | 0,2
      t[4 * q + 4 + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0xDD);  // lanes 1,3 | 1,3
    }
  }
  // t[s] = rows 0-3 | 8-11 ... (lanes 0,2 of q=0 then q=1): reorder to full columns.
  for (int s = 0; s < 4; ++s) {
    const __m512 a = t[s], b = t[8 + s], c = t[4 + s], d = t[12 + s];
    // a: col s of rows 0-3 (lane L0), col 8+s rows 0-3 (L2) -> after 0x88: [q0.L0, q0.L2, q1.L0, q1.L2]
    // combine to column s: rows 0-3 (a.0), 4-7 (a.2), 8-11 (b.0), 12-15 (b.2)
    _mm512_storeu_ps(dst + (s)*ld_dst, _mm512_shuffle_f32x4(a, b, 0x88));
    _mm512_storeu_ps(dst + (8 + s) * ld_dst, _mm512_shuffle_f32x4(a, b, 0xDD));
    _mm512_storeu_ps(dst + (4 + s) * ld_dst, _mm512_shuffle_f32x4(c, d, 0x88));
    _mm512_storeu_ps(dst + (12 + s) * ld_dst, _mm512_shuffle_f32x4(c, d, 0xDD));
  }
}

// The k x 32 panel of op(B) = B^T starting at column j0: panel[kk * 32 + jj] = b[(j0 + jj) * ldb
// + kk], zero past column n.
__attribute__((target("avx512f"))) inline void pack_bt(const float* b, int64_t ldb, int64_t n,
                                                       int64_t k, int64_t j0, float* panel) {
  const int64_t cols = std::min<int64_t>(kNR, n - j0);
  int64_t kk = 0;
  if (cols == kNR)
    for (; kk + 16 <= k; kk += 16)
      for (int h = 0; h < 2; ++h)
        transpose16(b + (j0 + 16 * h) * ldb + kk, ldb, panel + kk * kNR + 16 * h, kNR);
  for (; kk < k; ++kk)
    for (int jj = 0; jj < kNR; ++jj)
      panel[kk * kNR + jj] = jj < cols ? b[(j0 + jj) * ldb + kk] : 0.0f;
}

// One tile: rows [r0, r0 + rows) and columns [c0, c0 + 32); op(B) loaded under lm0 | lm1 and C
// stored under sm0 | sm1 (and, when lower, column <= row). A's element (r, kk) is a[r * sr + kk * sk]; op(B)'s row kk of the
// tile's columns is at b + kk * sb.
__attribute__((target("avx512f"))) inline void tile(int64_t k, const float* a, int64_t sr,
                                                    int64_t sk, const float* b, int64_t sb,
                                                    int rows, __mmask16 lm0, __mmask16 lm1,
                                                    __mmask16 sm0, __mmask16 sm1, float alpha, float beta, float* c,
                                                    int64_t ldc, bool lower, int64_t r0,
                                                    int64_t c0) {
  __m512 acc[kMR][2];
  for (int r = 0; r < kMR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const float* ar[kMR];
  for (int r = 0; r < kMR; ++r) ar[r] = a + std::min(r, rows - 1) * sr;
  const bool full = lm0 == 0xFFFF && lm1 == 0xFFFF;
  if (sk == 1 && full) {
#pragma GCC unroll 2
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m512 b0 = _mm512_loadu_ps(b + kk * sb), b1 = _mm512_loadu_ps(b + kk * sb + 16);
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m512 av = _mm512_set1_ps(ar[r][kk]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      }
    }
  } else {
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m512 b0 = _mm512_maskz_loadu_ps(lm0, b + kk * sb);
      const __m512 b1 = _mm512_maskz_loadu_ps(lm1, b + kk * sb + 16);
      const int64_t off = kk * sk;
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m512 av = _mm512_set1_ps(ar[r][off]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
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
        const __mmask16 keep =
            last < 0 ? 0 : last >= 15 ? 0xFFFF : static_cast<__mmask16>((1u << (last + 1)) - 1);
        m[h] &= keep;
      }
    }
    float* cr = c + (r0 + r) * ldc + c0;
    for (int h = 0; h < 2; ++h) {
      if (!m[h]) continue;
      __m512 v = _mm512_mul_ps(va, acc[r][h]);
      if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m[h], cr + 16 * h), v);
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

// C = alpha op(A) op(B) + beta C for small_gemm_fits sizes on a CPU with AVX-512F; lower: only
// the elements on and below the diagonal (m == n) are written.
__attribute__((target("avx512f"))) inline void small_sgemm(bool ta, bool tb, int64_t m,
                                                           int64_t n, int64_t k, float alpha,
                                                           const float* a, int64_t lda,
                                                           const float* b, int64_t ldb, float beta,
                                                           float* c, int64_t ldc, bool lower) {
  using namespace small_gemm;
  const int64_t sr = ta ? 1 : lda, sk = ta ? lda : 1;
  float* panel = tb ? panel_scratch(k * kNR) : nullptr;
  for (int64_t c0 = 0; c0 < n; c0 += kNR) {
    const int64_t cols = std::min<int64_t>(kNR, n - c0);
    const __mmask16 cm0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 cm1 =
        cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
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
      tile(k, a + r0 * sr, sr, sk, bp, sb, rows, tb ? 0xFFFF : cm0, tb ? 0xFFFF : cm1, cm0, cm1,
           alpha, beta, c, ldc, lower, r0, c0);
    }
  }
}

}  // namespace distmuon::cpu

#pragma GCC diagnostic pop
