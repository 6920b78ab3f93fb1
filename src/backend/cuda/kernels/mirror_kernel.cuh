// The lower-to-upper mirror that makes one-triangle products exactly symmetric: the upper
// triangle becomes a bitwise copy of the lower one.
#pragma once

#include <cstdint>

namespace distmuon::cuda::dev {

// Copies the strict lower triangle of each n x n matrix onto the upper one. Blocks visit only the
// T(T+1)/2 tile pairs (ti <= tj) of the upper triangle: grid (T(T+1)/2, count), block (32, 8).
// E is the element's storage (uint16_t, uint32_t or uint64_t).
template <typename E>
__global__ void __launch_bounds__(256) mirror_kernel(E* data, int64_t n, int64_t ld, int64_t stride,
                                                     int tiles) {
  __shared__ E tile[32][33];
  // p -> (tj, ti) with ti <= tj, tile rows of the lower triangle in order: p = tj(tj+1)/2 + ti.
  const int64_t p = blockIdx.x;
  int64_t tj = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(p) + 1.0) - 1.0) * 0.5);
  while (tj * (tj + 1) / 2 > p) --tj;
  while ((tj + 1) * (tj + 2) / 2 <= p) ++tj;
  const int64_t ti = p - tj * (tj + 1) / 2;
  (void)tiles;
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
