#include "cuda_info.h"

#include "distmuon/error.h"

#if DISTMUON_TOOLS_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace distmuon::bench {

#if DISTMUON_TOOLS_HAVE_CUDA

void* current_context() {
  // The driver's cuCtxGetCurrent through the runtime's entry points (no libcuda link).
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  DM_CHECK(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, CUDA_VERSION, cudaEnableDefault,
                                            &status) == cudaSuccess &&
               status == cudaDriverEntryPointSuccess && fn,
           "the CUDA driver has no cuCtxGetCurrent");
  CUcontext ctx = nullptr;
  DM_CHECK(reinterpret_cast<decltype(&cuCtxGetCurrent)>(fn)(&ctx) == CUDA_SUCCESS,
           "cuCtxGetCurrent failed");
  return ctx;
}

int device_sm_count(int device) {
  cudaDeviceProp p{};
  DM_CHECK(cudaGetDeviceProperties(&p, device) == cudaSuccess, "CUDA device ", device,
           " cannot be queried");
  return p.multiProcessorCount;
}

#else

void* current_context() { return nullptr; }
int device_sm_count(int) { return 0; }

#endif

}  // namespace distmuon::bench
