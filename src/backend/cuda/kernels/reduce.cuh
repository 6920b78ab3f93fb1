// Deterministic grid-wide sums without a second launch: each block writes its partial, and the
// last block of a group (found with an atomic ticket) adds the partials in a fixed order. The
// ticket counter resets itself, so the same counters serve every later launch in stream order.
#pragma once

#include "backend/cuda/kernels/dtype.cuh"

namespace distmuon::cuda::dev {

// Every thread of the block calls this with the block's total valid in thread 0. The last block
// of the group calls fin(sum) on thread 0 after summing partials[0, nblocks).
template <typename Fin>
__device__ __forceinline__ void group_sum_last(double block_total, double* partials,
                                               unsigned* counter, int nblocks, int me, Fin fin) {
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    partials[me] = block_total;
    __threadfence();
    const unsigned ticket = atomicAdd(counter, 1u);
    is_last = ticket == static_cast<unsigned>(nblocks - 1);
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  double s = 0;
  for (int i = threadIdx.x; i < nblocks; i += blockDim.x) s += __ldcg(partials + i);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    *counter = 0u;
    fin(s);
  }
}

}  // namespace distmuon::cuda::dev
