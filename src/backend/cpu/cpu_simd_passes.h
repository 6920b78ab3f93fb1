// The fused Muon passes of the CPU backend on AVX-512F, for fp32 gradient, momentum, weight and
// X (included by cpu_elementwise.cc only, called where avx512_available()). Each element is
// computed with the operations, and the roundings, of the scalar loops in cpu_elementwise.cc:
// float products and sums kept apart (no fused multiply-add: the functions are compiled with
// fp-contract off), U in double (muon_ref::scaled_input). Only the norm's double sum runs in
// another order (16 partial sums); muon_ref::float_precision makes such sums round alike.
// A transposed X (tall matrices) is written, and read back, in 16 x 16 blocks.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_simd.h"
#include "backend/muon_ref.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define DM_SIMD_PASS __attribute__((target("avx512f"), optimize("fp-contract=off")))

namespace distmuon::cpu::simd {

// Floats ahead of the current element that the passes prefetch: the hardware's stream
// prefetchers stop at each 4 KiB page.
constexpr int64_t kAhead = 512;

DM_SIMD_PASS inline void prefetch(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

DM_SIMD_PASS inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

DM_SIMD_PASS inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
DM_SIMD_PASS inline __m512d hi_pd(__m512 v) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
DM_SIMD_PASS inline __m512 join_ps(__m512d lo, __m512d hi) {
  const __m256 l = _mm512_cvtpd_ps(lo), h = _mm512_cvtpd_ps(hi);
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(l)), _mm256_castps_pd(h), 1));
}

// Inputs of 16 elements: B' = mu B + G (float), V = fl32(U * kMuonInputScale) with U = G + mu B'
// (nesterov) or B' in double, as lo/hi doubles in v_lo/v_hi and as float.
struct Input16 {
  __m512 bn, v;
  __m512d v_lo, v_hi;
};
DM_SIMD_PASS inline Input16 input16(__m512 g, __m512 b, float mu, bool nesterov) {
  Input16 in;
  in.bn = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(mu), b), g);
  __m512d ul = lo_pd(in.bn), uh = hi_pd(in.bn);
  if (nesterov) {
    const __m512d m = _mm512_set1_pd(static_cast<double>(mu));
    ul = _mm512_add_pd(lo_pd(g), _mm512_mul_pd(m, ul));
    uh = _mm512_add_pd(hi_pd(g), _mm512_mul_pd(m, uh));
  }
  const __m512d s = _mm512_set1_pd(muon_ref::kMuonInputScale);
  in.v = join_ps(_mm512_mul_pd(ul, s), _mm512_mul_pd(uh, s));
  in.v_lo = lo_pd(in.v);
  in.v_hi = hi_pd(in.v);
  return in;
}

DM_SIMD_PASS inline __mmask16 not_finite(__m512 x) {
  return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
}

// Pass 1 over rows [r0, r1): adds sum V^2 to *sum; clears *finite on a non-finite G or B'.
DM_SIMD_PASS inline void norm_rows(const float* g, int64_t ldg, const float* b, int64_t ldb,
                                   int64_t r0, int64_t r1, int64_t cols, float mu, bool nesterov,
                                   double* sum, bool* finite) {
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  __mmask16 bad = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = lanes(cols - c);
      prefetch(g + r * ldg + c + kAhead);
      prefetch(b + r * ldb + c + kAhead);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + r * ldg + c);
      const Input16 in = input16(gv, _mm512_maskz_loadu_ps(m, b + r * ldb + c), mu, nesterov);
      bad |= not_finite(gv) | not_finite(in.bn);
      acc_lo = _mm512_add_pd(acc_lo, _mm512_mul_pd(in.v_lo, in.v_lo));
      acc_hi = _mm512_add_pd(acc_hi, _mm512_mul_pd(in.v_hi, in.v_hi));
    }
  *sum += _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
  if (bad) *finite = false;
}

// Pass 2 on 16 elements of row r from column c: stores B', returns X (not stored).
DM_SIMD_PASS inline __m512 apply16(const float* g, int64_t ldg, float* b, int64_t ldb, int64_t r,
                                   int64_t c, __mmask16 m, float mu, bool nesterov, __m512d vf) {
  const Input16 in = input16(_mm512_maskz_loadu_ps(m, g + r * ldg + c),
                             _mm512_maskz_loadu_ps(m, b + r * ldb + c), mu, nesterov);
  _mm512_mask_storeu_ps(b + r * ldb + c, m, in.bn);
  return join_ps(_mm512_mul_pd(in.v_lo, vf), _mm512_mul_pd(in.v_hi, vf));
}

// Pass 2 over rows [r0, r1) of a slot whose status is ok: stores B' and X = fl32(V * f), X
// transposed (x holds cols x rows) when transpose.
DM_SIMD_PASS inline void apply_rows(const float* g, int64_t ldg, float* b, int64_t ldb, int64_t r0,
                                    int64_t r1, int64_t cols, float mu, bool nesterov, double f,
                                    float* x, int64_t ldx, bool transpose) {
  const __m512d vf = _mm512_set1_pd(f);
  if (!transpose) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        prefetch(g + r * ldg + c + kAhead);
        prefetch(b + r * ldb + c + kAhead);
        prefetch(x + r * ldx + c + kAhead);
        _mm512_mask_storeu_ps(x + r * ldx + c, m,
                              apply16(g, ldg, b, ldb, r, c, m, mu, nesterov, vf));
      }
    return;
  }
  alignas(64) float blk[16 * 16], tr[16 * 16];
  for (int64_t t0 = r0; t0 < r1; t0 += 16) {
    const int64_t rows = std::min<int64_t>(16, r1 - t0);
    const __mmask16 rm = lanes(rows);
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = lanes(cols - c);
      for (int64_t i = 0; i < 16; ++i) {  // the next tile's lines of G and B, and of X
        prefetch(g + (t0 + 16 + i) * ldg + c);
        prefetch(b + (t0 + 16 + i) * ldb + c);
        prefetch(x + (c + i) * ldx + t0 + 16);
      }
      for (int64_t i = 0; i < 16; ++i)
        _mm512_store_ps(blk + 16 * i, i < rows
                                          ? apply16(g, ldg, b, ldb, t0 + i, c, m, mu, nesterov, vf)
                                          : _mm512_setzero_ps());
      transpose16(blk, 16, tr, 16);
      for (int64_t j = 0; j < std::min<int64_t>(16, cols - c); ++j)
        _mm512_mask_storeu_ps(x + (c + j) * ldx + t0, rm, _mm512_load_ps(tr + 16 * j));
    }
  }
}

// Pass 3 on 16 elements of row r from column c, given O's.
DM_SIMD_PASS inline void update16(float* w, int64_t ldw, int64_t r, int64_t c, __mmask16 m,
                                  __m512 ov, __m512 vd, __m512 vs) {
  const __m512 wv = _mm512_maskz_loadu_ps(m, w + r * ldw + c);
  _mm512_mask_storeu_ps(w + r * ldw + c, m,
                        _mm512_sub_ps(_mm512_mul_ps(vd, wv), _mm512_mul_ps(vs, ov)));
}

// Pass 3 over rows [r0, r1): W = decay W - step O (float), O read transposed (o holds cols x
// rows) when transpose.
DM_SIMD_PASS inline void update_rows(const float* o, int64_t ldo, bool transpose, float* w,
                                     int64_t ldw, int64_t r0, int64_t r1, int64_t cols, float decay,
                                     float step) {
  const __m512 vd = _mm512_set1_ps(decay), vs = _mm512_set1_ps(step);
  if (!transpose) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 m = lanes(cols - c);
        prefetch(o + r * ldo + c + kAhead);
        prefetch(w + r * ldw + c + kAhead);
        update16(w, ldw, r, c, m, _mm512_maskz_loadu_ps(m, o + r * ldo + c), vd, vs);
      }
    return;
  }
  alignas(64) float blk[16 * 16], tr[16 * 16];
  for (int64_t t0 = r0; t0 < r1; t0 += 16) {
    const int64_t rows = std::min<int64_t>(16, r1 - t0);
    const __mmask16 rm = lanes(rows);
    for (int64_t c = 0; c < cols; c += 16) {
      const int64_t n = std::min<int64_t>(16, cols - c);
      // Rows c .. c+15 of o hold columns c .. c+15 of O, over O's rows t0 .. t0+15.
      for (int64_t j = 0; j < 16; ++j) {  // the next tile's lines of O and W
        prefetch(o + (c + j) * ldo + t0 + 16);
        prefetch(w + (t0 + 16 + j) * ldw + c);
      }
      for (int64_t j = 0; j < 16; ++j)
        _mm512_store_ps(blk + 16 * j, j < n ? _mm512_maskz_loadu_ps(rm, o + (c + j) * ldo + t0)
                                            : _mm512_setzero_ps());
      transpose16(blk, 16, tr, 16);
      for (int64_t i = 0; i < rows; ++i)
        update16(w, ldw, t0 + i, c, lanes(n), _mm512_load_ps(tr + 16 * i), vd, vs);
    }
  }
}

}  // namespace distmuon::cpu::simd

#undef DM_SIMD_PASS
#pragma GCC diagnostic pop
