// The condition of a conditional graph node (CudaBackend::begin_if_selected and
// begin_if_some_selected), set on the device when the graph runs: whether any matrix of a batch
// is selected by its flag, or whether none, some or all are.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void set_if_selected_kernel(cudaGraphConditionalHandle handle, const int32_t* flags,
                                       int32_t value, int64_t count, bool two_bodies) {
  int64_t total = 0;  // every thread takes every round: the loop is uniform over the block
  for (int64_t first = 0; first < count; first += blockDim.x) {
    const int64_t i = first + threadIdx.x;
    total += __syncthreads_count(i < count && flags[i] == value);
  }
  if (threadIdx.x != 0) return;
  unsigned int cond;
  if (!two_bodies)
    cond = total > 0 ? 1u : 0u;
  else
    cond = total == 0 ? 2u : (total == count ? 1u : 0u);
  cudaGraphSetConditional(handle, cond);
}

}  // namespace

void launch_set_if_selected(cudaGraphConditionalHandle handle, const int32_t* flags, int32_t value,
                            int64_t count, bool two_bodies, cudaStream_t stream) {
  set_if_selected_kernel<<<1, kThreads, 0, stream>>>(handle, flags, value, count, two_bodies);
  DM_CHECK_LAUNCH();
}

}  // namespace distmuon::cuda
