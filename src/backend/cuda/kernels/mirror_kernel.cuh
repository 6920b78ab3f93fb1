// The lower-to-upper mirror that makes one-triangle products exactly symmetric: the upper
// triangle becomes a bitwise copy of the lower one.
#pragma once

#include <cstdint>

namespace distmuon::cuda::dev {

// The tile pair (ti <= tj) that block x of a mirror visits. Whole triangle (band == 0): the
// T(T+1)/2 pairs in order, p = tj(tj+1)/2 + ti. Band of `band` tiles: only the pairs inside the
// diagonal blocks of band x band tiles, block after block (the symmetric kernels store the rest of
// the upper triangle themselves). Returns false for a pair past the matrix (the last block).
__device__ __forceinline__ bool mirror_pair(int64_t p, int64_t band, int64_t tiles, int64_t& ti,
                                            int64_t& tj) {
  int64_t first = 0;
  if (band > 0) {
    const int64_t per_block = band * (band + 1) / 2;
    first = (p / per_block) * band;
    p %= per_block;
  }
  tj = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(p) + 1.0) - 1.0) * 0.5);
  while (tj * (tj + 1) / 2 > p) --tj;
  while ((tj + 1) * (tj + 2) / 2 <= p) ++tj;
  ti = p - tj * (tj + 1) / 2 + first;
  tj += first;
  return tj < tiles;
}

// Copies the strict lower triangle of each n x n matrix onto the upper one (or, with band > 0,
// only inside the diagonal blocks of band x band tiles). Blocks visit only the tile pairs
// (ti <= tj) of the upper triangle: grid (pairs, count), block (32, 8). E is the element's
// storage (uint16_t, uint32_t or uint64_t). With flags, matrix b is mirrored only when
// flags[b] == value (its blocks return at once otherwise).
template <typename E>
__global__ void __launch_bounds__(256) mirror_kernel(E* data, int64_t n, int64_t ld, int64_t stride,
                                                     const int32_t* flags, int32_t value,
                                                     int64_t band) {
  if (flags && flags[blockIdx.y] != value) return;
  __shared__ E tile[32][33];
  int64_t ti, tj;
  if (!mirror_pair(blockIdx.x, band, (n + 31) / 32, ti, tj)) return;
  E* base = data + static_cast<int64_t>(blockIdx.y) * stride;
  // Source: lower block (rows tj*32.., cols ti*32..).
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = tj * 32 + threadIdx.y + 8 * k, c = ti * 32 + threadIdx.x;
    if (r < n && c < n) tile[threadIdx.y + 8 * k][threadIdx.x] = base[r * ld + c];
  }
  __syncthreads();
  // Destination: upper block (rows ti*32.., cols tj*32..), element (r, c) <- source (c, r).
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t r = ti * 32 + threadIdx.y + 8 * k, c = tj * 32 + threadIdx.x;
    if (r < n && c < n && r < c) base[r * ld + c] = tile[threadIdx.x][threadIdx.y + 8 * k];
  }
}

}  // namespace distmuon::cuda::dev

namespace distmuon::cuda::dev {

// The mirror for 16-bit elements with 16-byte accesses: 64x64 tiles, 256 threads. The source
// lower tile is read in rows of eight 16-byte vectors, staged in shared memory, and written as
// rows of the upper tile gathered down the staged columns. Needs n, ld and stride multiples of
// 8 and a 16-byte aligned base (the launcher checks). Diagonal tiles write element by element
// above the diagonal only. Flags and band as for mirror_kernel (band in 64-element tiles).
__global__ void __launch_bounds__(256) mirror16_kernel(uint16_t* data, int64_t n, int64_t ld,
                                                       int64_t stride, const int32_t* flags,
                                                       int32_t value, int64_t band) {
  if (flags && flags[blockIdx.y] != value) return;
  __shared__ uint16_t tile[64][64 + 2];  // +2: column reads hit distinct banks
  int64_t ti, tj;  // ti <= tj
  if (!mirror_pair(blockIdx.x, band, (n + 63) / 64, ti, tj)) return;
  uint16_t* base = data + static_cast<int64_t>(blockIdx.y) * stride;
  const int vec = threadIdx.x & 7, row = threadIdx.x >> 3;  // 8 vectors per 64-element row
  // Source: rows tj*64.., cols ti*64.. (lower triangle), 32 rows per pass.
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lr = row + 32 * pass;
    const int64_t r = tj * 64 + lr, c = ti * 64 + vec * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n && c < n) v = *reinterpret_cast<const uint4*>(base + r * ld + c);
    const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[lr][vec * 8 + k] = e[k];
  }
  __syncthreads();
  // Destination: rows ti*64.. (= source columns), cols tj*64.. (= source rows).
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int lr = row + 32 * pass;  // destination row within the tile = source column
    const int64_t r = ti * 64 + lr, c0 = tj * 64 + vec * 8;
    if (r >= n || c0 >= n) continue;
    uint16_t e[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = tile[vec * 8 + k][lr];
    if (ti != tj) {
      *reinterpret_cast<uint4*>(base + r * ld + c0) = *reinterpret_cast<const uint4*>(e);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (c0 + k > r && c0 + k < n) base[r * ld + c0 + k] = e[k];
    }
  }
}

}  // namespace distmuon::cuda::dev
