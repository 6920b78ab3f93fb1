// Launcher of the lower-to-upper mirror (kernels/mirror_kernel.cuh).
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/mirror_kernel.cuh"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {

namespace {

// Tile pairs a mirror visits: the whole upper triangle of `tiles` x `tiles` tiles, or only the
// pairs inside its diagonal blocks of `band` x `band` tiles.
int64_t mirror_pairs(int64_t tiles, int64_t band) {
  if (band <= 0 || band >= tiles) return tiles * (tiles + 1) / 2;
  return (tiles + band - 1) / band * (band * (band + 1) / 2);
}

}  // namespace

void launch_mirror(const BatchRef& c, cudaStream_t stream, const int32_t* flags, int32_t value,
                   int64_t diagonal_block) {
  DM_CHECK(c.rows == c.cols, "mirror: matrices are ", c.rows, "x", c.cols, ", not square");
  if (c.count == 0 || c.rows <= 1) return;
  DM_CHECK(diagonal_block % 64 == 0, "mirror: diagonal blocks of ", diagonal_block,
           " rows, not a multiple of 64");
  const bool vec16 = dtype_size(c.dtype) == 2 && c.rows % 8 == 0 && c.ld % 8 == 0 &&
                     c.stride % 8 == 0 && (reinterpret_cast<uintptr_t>(c.data) & 15u) == 0;
  if (vec16) {
    const int64_t t64 = (c.rows + 63) / 64, band64 = diagonal_block / 64;
    const int64_t pairs64 = mirror_pairs(t64, band64);
    for (int64_t first = 0; first < c.count; first += 65535) {
      const int64_t n = std::min<int64_t>(65535, c.count - first);
      BatchRef s = c.slice(first, n);
      dev::mirror16_kernel<<<dim3(static_cast<unsigned>(pairs64), static_cast<unsigned>(n)), 256, 0,
                             stream>>>(static_cast<uint16_t*>(s.data), s.rows, s.ld, s.stride,
                                       flags ? flags + first : nullptr, value,
                                       band64 >= t64 ? 0 : band64);
      DM_CHECK_LAUNCH();
    }
    return;
  }
  const int64_t tiles = (c.rows + 31) / 32, band = diagonal_block / 32;
  const int64_t pairs = mirror_pairs(tiles, band);
  const int64_t band_arg = band >= tiles ? 0 : band;
  DM_CHECK(pairs < (1LL << 31), "mirror: matrix too large");
  for (int64_t first = 0; first < c.count; first += 65535) {
    const int64_t n = std::min<int64_t>(65535, c.count - first);
    BatchRef s = c.slice(first, n);
    dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(n));
    const int32_t* f = flags ? flags + first : nullptr;
    switch (dtype_size(c.dtype)) {
      case 2:
        dev::mirror_kernel<uint16_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint16_t*>(s.data), s.rows, s.ld, s.stride, f, value, band_arg);
        break;
      case 4:
        dev::mirror_kernel<uint32_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint32_t*>(s.data), s.rows, s.ld, s.stride, f, value, band_arg);
        break;
      default:
        dev::mirror_kernel<uint64_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint64_t*>(s.data), s.rows, s.ld, s.stride, f, value, band_arg);
    }
    DM_CHECK_LAUNCH();
  }
}

}  // namespace distmuon::cuda

#include "backend/cuda/kernels/random_kernels.cuh"

namespace distmuon::cuda {

void launch_fill_normal(void* data, DType dtype, int64_t n, uint64_t seed, float scale,
                        cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 32);
  dev::fill_normal_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      data, static_cast<int>(dtype), n, seed, scale);
  DM_CHECK_LAUNCH();
}

}  // namespace distmuon::cuda
