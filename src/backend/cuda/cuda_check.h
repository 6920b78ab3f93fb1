// Error checks of the CUDA backend: the CUDA runtime check shared with the NCCL communicator
// (common/cuda_check.h) and the cuBLAS(Lt) check; a failure throws distmuon::Error naming the
// call, the library's message, and the file and line.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include "common/cuda_check.h"

namespace distmuon::cuda {

const char* cublas_status_name(cublasStatus_t s);

}  // namespace distmuon::cuda

#define DM_CHECK_CUBLAS(call)                                                                \
  do {                                                                                       \
    cublasStatus_t dm_st_ = (call);                                                          \
    if (dm_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                        \
      ::distmuon::detail::throw_error(                                                       \
          ::distmuon::detail::concat("cuBLAS error in ", #call, ": ",                        \
                                     ::distmuon::cuda::cublas_status_name(dm_st_)),          \
          __FILE__, __LINE__);                                                               \
  } while (0)
