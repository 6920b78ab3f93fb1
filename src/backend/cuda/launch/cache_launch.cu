// Launchers of the CacheMuon kernels (kernels/cache_kernels.cuh). Nothing here reads device
// memory from the host: the decisions and flags stay on the device.
#include <algorithm>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/cache_kernels.cuh"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {
namespace {

BatchArg arg(const BatchRef& b) {
  return BatchArg{b.data, b.stride, b.ld, static_cast<int>(b.dtype)};
}

bool vec_ok(const BatchRef& b) {
  const int64_t es = static_cast<int64_t>(dtype_size(b.dtype));
  return b.ld == b.cols && (reinterpret_cast<uintptr_t>(b.data) & 15u) == 0 &&
         (b.stride * es) % 16 == 0 && (b.rows * b.cols) % 8 == 0 && b.dtype != DType::kF64;
}

constexpr int64_t kMaxGridY = 65535;

// Runs launch(part, grid, first) over the batch in parts of at most kMaxGridY matrices (the
// grid's y), each matrix spread over blocks_per_matrix blocks along x.
template <typename F>
void for_each_grid_part(const BatchRef& b, int sm_count, F&& launch) {
  for (int64_t first = 0; first < b.count; first += kMaxGridY) {
    const int64_t n = std::min(kMaxGridY, b.count - first);
    launch(b.slice(first, n),
           dim3(blocks_per_matrix(b.rows * b.cols, n, sm_count), static_cast<unsigned>(n)), first);
    DM_CHECK_LAUNCH();
  }
}

}  // namespace

void launch_cache_gate(const CacheGateArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return;
  if (args.batch && !args.plan) {  // one block reduces the call (a plan pass is per matrix)
    dev::cache_gate_kernel<<<1, dev::kCacheGateBatchThreads, 0, stream>>>(args);
    DM_CHECK_LAUNCH();
    return;
  }
  const int64_t blocks = (args.count + dev::kCacheGateThreads - 1) / dev::kCacheGateThreads;
  DM_CHECK(blocks < (1LL << 31), "cache_gate: ", args.count, " matrices");
  dev::cache_gate_kernel<<<static_cast<unsigned>(blocks), dev::kCacheGateThreads, 0, stream>>>(
      args);
  DM_CHECK_LAUNCH();
}

void launch_copy_masked(const BatchRef& src, const BatchRef& dst, const int32_t* flags,
                        int32_t value, int sm_count, cudaStream_t stream) {
  check_same_shape("copy_masked", src, dst);
  if (src.count == 0 || src.rows * src.cols == 0) return;
  DM_CHECK(flags != nullptr, "copy_masked: no flags");
  const bool vec = vec_ok(src) && vec_ok(dst);
  for_each_grid_part(src, sm_count, [&](const BatchRef& s, dim3 grid, int64_t first) {
    const BatchRef d = dst.slice(first, s.count);
    if (vec)
      dev::copy_masked_kernel<true>
          <<<grid, 256, 0, stream>>>(src.rows, src.cols, arg(s), arg(d), flags + first, value);
    else
      dev::copy_masked_kernel<false>
          <<<grid, 256, 0, stream>>>(src.rows, src.cols, arg(s), arg(d), flags + first, value);
  });
}

void launch_fill_normal_ref(const BatchRef& dst, uint64_t seed, uint64_t counter, int sm_count,
                            cudaStream_t stream) {
  if (dst.count == 0 || dst.rows * dst.cols == 0) return;
  for_each_grid_part(dst, sm_count, [&](const BatchRef& d, dim3 grid, int64_t first) {
    dev::fill_normal_ref_kernel<<<grid, 256, 0, stream>>>(dst.rows, dst.cols, arg(d), seed, counter,
                                                          first);
  });
}

void launch_fingerprint(const BatchRef& x, uint64_t* keys, cudaStream_t stream) {
  if (x.count == 0) return;
  DM_CHECK(x.count < (int64_t{1} << 31), "fingerprint: ", x.count, " matrices in one batch");
  dev::fingerprint_kernel<<<static_cast<unsigned>(x.count), cache_ref::kFingerprintSamples, 0,
                            stream>>>(x.rows, x.cols, arg(x), keys);
  DM_CHECK_LAUNCH();
}

void launch_fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys,
                              int sm_count, cudaStream_t stream) {
  if (dst.count == 0 || dst.rows * dst.cols == 0) return;
  for_each_grid_part(dst, sm_count, [&](const BatchRef& d, dim3 grid, int64_t first) {
    dev::fill_normal_keyed_kernel<<<grid, 256, 0, stream>>>(dst.rows, dst.cols, arg(d), seed, keys,
                                                            first);
  });
}

}  // namespace distmuon::cuda
