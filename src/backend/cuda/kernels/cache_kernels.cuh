// Device side of the CacheMuon operations: the accept/refresh gate (one thread per matrix, the
// same cache_ref::gate_one the CPU runs; the per-batch gate in one block that ANDs the votes),
// the flag-checked copy that selects between cached and fresh results on the device, the
// counter-based normal fills, and the per-matrix fingerprint that keys the probes.
#pragma once

#include <cstdint>

#include "backend/cache_ref.h"
#include "backend/cuda/kernels/batch_arg.cuh"

namespace distmuon::cuda::dev {

// The gate, one kernel for both gates (a second kernel would make ptxas outline the fp64
// division's slow path of hist_bin, which then spills). The arguments travel by value: a graph
// replays them.
//  - per matrix: grid ceil(count / 128), block 128, a thread per matrix;
//  - per batch (g.batch, not a plan pass): one block of kCacheGateBatchThreads for the whole
//    call, so that the call's verdict is a block reduction rather than a second kernel. Each
//    thread votes for matrices threadIdx.x, threadIdx.x + blockDim.x, ..., the barrier ANDs the
//    votes (every vote is read before any matrix is written), then each thread decides the same
//    matrices with the call's verdict, as cache_ref::gate_call does on the host. A call holds a
//    batch of matrices (tens to thousands): a few passes of the loop.
constexpr int kCacheGateThreads = 128, kCacheGateBatchThreads = 256;
__global__ void __launch_bounds__(kCacheGateBatchThreads) cache_gate_kernel(CacheGateArgs g) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool batch_hits = true;
  if (g.batch && !g.plan) {  // the same branch for every thread: the barrier is reached by all
    bool votes = true;
    for (int64_t i = first; i < g.count; i += stride) votes = votes && cache_ref::batch_vote(g, i);
    batch_hits = __syncthreads_and(votes ? 1 : 0) != 0;
  }
  for (int64_t i = first; i < g.count; i += stride) cache_ref::gate_one(g, i, batch_hits);
}

// dst_i = src_i rounded to dst's dtype for the matrices with flags[i] == value; the blocks of
// the others return before touching memory. grid (blocks per matrix, count). VEC: both packed
// and 16-byte aligned, no fp64 (8 elements per thread through fp32, which holds every
// non-fp64 value exactly, so the rounding equals the scalar path's).
template <bool VEC>
__global__ void __launch_bounds__(256)
    copy_masked_kernel(int64_t rows, int64_t cols, BatchArg src, BatchArg dst, const int32_t* flags,
                       int32_t value) {
  const int64_t m = blockIdx.y;
  if (flags[m] != value) return;
  const void* ps = mat_ptr(src, m);
  void* pd = const_cast<void*>(mat_ptr(dst, m));
  const int64_t numel = rows * cols;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (VEC) {
    for (int64_t i = first * 8; i < numel; i += step * 8)
      store8(pd, dst.dt, i, load8(ps, src.dt, i));
  } else {
    for (int64_t i = first; i < numel; i += step) {
      const int64_t r = i / cols, c = i - r * cols;
      store1d(pd, dst.dt, r * dst.ld + c, load1d(ps, src.dt, r * src.ld + c));
    }
  }
}

// Element (first + b, r, c) of the batch gets normal_sample(seed, counter + ((first + b) * rows
// + r) * cols + c), rounded to dst's dtype as the CPU rounds it (double -> float -> half).
// grid (blocks per matrix, matrices of this launch).
__global__ void __launch_bounds__(256)
    fill_normal_ref_kernel(int64_t rows, int64_t cols, BatchArg dst, uint64_t seed,
                           uint64_t counter, int64_t first) {
  const int64_t m = blockIdx.y;
  void* pd = const_cast<void*>(mat_ptr(dst, m));
  const uint64_t base = counter + static_cast<uint64_t>((first + m) * rows * cols);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    store1d(pd, dst.dt, r * dst.ld + c,
            cache_ref::normal_sample(seed, base + static_cast<uint64_t>(i)));
  }
}

// Backend::fingerprint: one block of kFingerprintSamples threads per matrix (grid x: matrices);
// each thread hashes one sampled element, the block XOR-reduces (order-free, as on the CPU).
__global__ void __launch_bounds__(cache_ref::kFingerprintSamples)
    fingerprint_kernel(int64_t rows, int64_t cols, BatchArg x, uint64_t* keys) {
  static_assert(cache_ref::kFingerprintSamples == 64, "two warps");
  const int t = threadIdx.x;
  const size_t es = static_cast<size_t>(elem_bytes(x.dt));
  const char* base = static_cast<const char*>(mat_ptr(x, blockIdx.x));
  uint64_t h = cache_ref::fingerprint_term(
      rows * cols != 0 ? cache_ref::element_bits(
                        base + cache_ref::fingerprint_offset(t, rows, cols, x.ld) * es, es)
                  : 0,
      t);
  for (int o = 16; o > 0; o >>= 1) h ^= __shfl_xor_sync(0xffffffffu, h, o);
  __shared__ uint64_t warp[2];
  if ((t & 31) == 0) warp[t >> 5] = h;
  __syncthreads();
  if (t == 0) keys[blockIdx.x] = cache_ref::fingerprint_finish(warp[0] ^ warp[1], rows, cols);
}

// Backend::fill_normal_keyed: element (first + b, r, c) gets normal_sample(seed ^ keys[first +
// b], r * cols + c). grid (blocks per matrix, matrices of this launch).
__global__ void __launch_bounds__(256)
    fill_normal_keyed_kernel(int64_t rows, int64_t cols, BatchArg dst, uint64_t seed,
                             const uint64_t* keys, int64_t first) {
  const int64_t m = blockIdx.y;
  void* pd = const_cast<void*>(mat_ptr(dst, m));
  const uint64_t s = seed ^ keys[first + m];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    store1d(pd, dst.dt, r * dst.ld + c, cache_ref::normal_sample(s, static_cast<uint64_t>(i)));
  }
}

}  // namespace distmuon::cuda::dev
