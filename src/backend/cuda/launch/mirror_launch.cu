// Launcher of the lower-to-upper mirror (kernels/batch_kernels.cuh).
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/mirror_kernel.cuh"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {

void launch_mirror(const BatchRef& c, cudaStream_t stream, const int32_t* flags, int32_t value) {
  DM_CHECK(c.rows == c.cols, "mirror: matrices are ", c.rows, "x", c.cols, ", not square");
  if (c.count == 0 || c.rows <= 1) return;
  const bool vec16 = dtype_size(c.dtype) == 2 && c.rows % 8 == 0 && c.ld % 8 == 0 &&
                     c.stride % 8 == 0 && (reinterpret_cast<uintptr_t>(c.data) & 15u) == 0;
  if (vec16) {
    const int64_t t64 = (c.rows + 63) / 64, pairs64 = t64 * (t64 + 1) / 2;
    for (int64_t first = 0; first < c.count; first += 65535) {
      const int64_t n = std::min<int64_t>(65535, c.count - first);
      BatchRef s = c.slice(first, n);
      dev::mirror16_kernel<<<dim3(static_cast<unsigned>(pairs64), static_cast<unsigned>(n)), 256, 0,
                             stream>>>(static_cast<uint16_t*>(s.data), s.rows, s.ld, s.stride,
                                       flags ? flags + first : nullptr, value);
      DM_CHECK_LAUNCH();
    }
    return;
  }
  const int64_t tiles = (c.rows + 31) / 32;
  const int64_t pairs = tiles * (tiles + 1) / 2;
  DM_CHECK(pairs < (1LL << 31), "mirror: matrix too large");
  for (int64_t first = 0; first < c.count; first += 65535) {
    const int64_t n = std::min<int64_t>(65535, c.count - first);
    BatchRef s = c.slice(first, n);
    dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(n));
    const int32_t* f = flags ? flags + first : nullptr;
    switch (dtype_size(c.dtype)) {
      case 2:
        dev::mirror_kernel<uint16_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint16_t*>(s.data), s.rows, s.ld, s.stride, f, value);
        break;
      case 4:
        dev::mirror_kernel<uint32_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint32_t*>(s.data), s.rows, s.ld, s.stride, f, value);
        break;
      default:
        dev::mirror_kernel<uint64_t><<<grid, dim3(32, 8), 0, stream>>>(
            static_cast<uint64_t*>(s.data), s.rows, s.ld, s.stride, f, value);
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
