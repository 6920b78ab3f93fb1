// The one check for CUDA runtime calls, shared by the CUDA backend and the NCCL communicator: a
// failure throws distmuon::Error naming the call, CUDA's message, the file and line and, when
// given, what the caller was doing ("all_reduce on nccl:world (rank 1 of 2)").
#pragma once

#include <cuda_runtime_api.h>

#include "distmuon/error.h"

// DM_CHECK_CUDA(call) or DM_CHECK_CUDA(call, context...) with context parts concatenated.
#define DM_CHECK_CUDA(call, ...)                                                               \
  do {                                                                                         \
    cudaError_t dm_err_ = (call);                                                              \
    if (dm_err_ != cudaSuccess) [[unlikely]]                                                   \
      ::distmuon::detail::throw_error(                                                         \
          ::distmuon::detail::concat(__VA_OPT__(__VA_ARGS__, ": ", ) "CUDA error in ", #call,  \
                                     ": ", cudaGetErrorName(dm_err_), " (",                    \
                                     cudaGetErrorString(dm_err_), ")"),                        \
          __FILE__, __LINE__);                                                                 \
  } while (0)

// After a kernel launch: a launch-configuration error surfaces here, not at the next sync.
#define DM_CHECK_LAUNCH() DM_CHECK_CUDA(cudaGetLastError())
