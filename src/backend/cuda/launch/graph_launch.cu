// The condition of a conditional graph node (CudaBackend::begin_if_selected), set on the device
// when the graph runs: whether any matrix of a batch is selected by its flag.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void set_if_selected_kernel(cudaGraphConditionalHandle handle, const int32_t* flags,
                                       int32_t value, int64_t count) {
  int any = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) any |= flags[i] == value;
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) cudaGraphSetConditional(handle, any ? 1u : 0u);
}

}  // namespace

void launch_set_if_selected(cudaGraphConditionalHandle handle, const int32_t* flags, int32_t value,
                            int64_t count, cudaStream_t stream) {
  set_if_selected_kernel<<<1, kThreads, 0, stream>>>(handle, flags, value, count);
  DM_CHECK_LAUNCH();
}

}  // namespace distmuon::cuda
