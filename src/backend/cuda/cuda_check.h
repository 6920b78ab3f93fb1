// Error checks for every CUDA runtime and cuBLAS(Lt) call of the CUDA backend: a failure throws
// distmuon::Error naming the call, the library's message, and the file and line.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "distmuon/error.h"

namespace distmuon::cuda {

const char* cublas_status_name(cublasStatus_t s);

}  // namespace distmuon::cuda

#define DM_CHECK_CUDA(call)                                                                  \
  do {                                                                                       \
    cudaError_t dm_err_ = (call);                                                            \
    if (dm_err_ != cudaSuccess) [[unlikely]]                                                 \
      ::distmuon::detail::throw_error(                                                       \
          ::distmuon::detail::concat("CUDA error in ", #call, ": ", cudaGetErrorName(dm_err_), \
                                     " (", cudaGetErrorString(dm_err_), ")"),                \
          __FILE__, __LINE__);                                                               \
  } while (0)

#define DM_CHECK_CUBLAS(call)                                                                \
  do {                                                                                       \
    cublasStatus_t dm_st_ = (call);                                                          \
    if (dm_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                        \
      ::distmuon::detail::throw_error(                                                       \
          ::distmuon::detail::concat("cuBLAS error in ", #call, ": ",                        \
                                     ::distmuon::cuda::cublas_status_name(dm_st_)),          \
          __FILE__, __LINE__);                                                               \
  } while (0)

// After a kernel launch: a launch-configuration error surfaces here, not at the next sync.
#define DM_CHECK_LAUNCH() DM_CHECK_CUDA(cudaGetLastError())
