// What the CPU backend's AVX-512 code shares: whether the CPU has AVX-512F, and a 16 x 16
// transpose. Functions are compiled for AVX-512F by their target attribute (the library itself
// targets baseline x86-64) and called only where avx512_available().
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// GCC 12 reports its own _mm512_undefined_* as uninitialised once inlined here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace distmuon::cpu {

inline bool avx512_available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return ok;
}

namespace simd {

// dst's 16 x 16 block (ld_dst) = the transpose of src's 16 x 16 block (ld_src).
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
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4q + s] holds, in its 128-bit lane L, column 4L + s of rows 4q .. 4q+3. Per s: t[s] =
  // lanes (0, 2) of r[s] and r[4 + s], t[4 + s] = their lanes (1, 3); t[8 + s] and t[12 + s]
  // the same of r[8 + s] and r[12 + s]. Then column 4L + s is lanes (0, 2) or (1, 3) of
  // t[s] | t[8 + s] (L = 0, 2) or t[4 + s] | t[12 + s] (L = 1, 3).
  for (int s = 0; s < 4; ++s) {
    for (int q = 0; q < 4; q += 2) {
      t[4 * q + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0x88);
      t[4 * q + 4 + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0xDD);
    }
  }
  for (int s = 0; s < 4; ++s) {
    const __m512 a = t[s], b = t[8 + s], c = t[4 + s], d = t[12 + s];
    _mm512_storeu_ps(dst + s * ld_dst, _mm512_shuffle_f32x4(a, b, 0x88));
    _mm512_storeu_ps(dst + (8 + s) * ld_dst, _mm512_shuffle_f32x4(a, b, 0xDD));
    _mm512_storeu_ps(dst + (4 + s) * ld_dst, _mm512_shuffle_f32x4(c, d, 0x88));
    _mm512_storeu_ps(dst + (12 + s) * ld_dst, _mm512_shuffle_f32x4(c, d, 0xDD));
  }
}

// The upper triangle of an n x n matrix (ld) from its lower one: 16 x 16 blocks below the
// diagonal transposed whole, the diagonal blocks and the edges element by element.
__attribute__((target("avx512f"))) inline void mirror_lower(float* a, int64_t n, int64_t ld) {
  const int64_t nb = n / 16 * 16;
  for (int64_t i = 16; i < nb; i += 16)
    for (int64_t j = 0; j < i; j += 16) transpose16(a + i * ld + j, ld, a + j * ld + i, ld);
  for (int64_t d = 0; d < n; d += 16)  // diagonal blocks, and the last partial block column
    for (int64_t j = d; j < std::min(n, d + 16); ++j)
      for (int64_t r = d; r < j; ++r) a[r * ld + j] = a[j * ld + r];
  for (int64_t j = nb; j < n; ++j)  // rows past the last whole block: their columns below nb
    for (int64_t r = 0; r < std::min(j, nb); ++r) a[r * ld + j] = a[j * ld + r];
}

}  // namespace simd
}  // namespace distmuon::cpu

#pragma GCC diagnostic pop
