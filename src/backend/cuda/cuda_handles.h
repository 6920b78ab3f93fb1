// RAII owners of the CUDA backend: the runtime's (common/cuda_handles.h) and a cuBLASLt handle.
#pragma once

#include <cublasLt.h>

#include "backend/cuda/cuda_check.h"
#include "common/cuda_handles.h"

namespace distmuon::cuda {

struct LtDeleter {
  void operator()(cublasLtHandle_t h) const { cublasLtDestroy(h); }
};
using LtHandle = Handle<cublasLtHandle_t, LtDeleter>;

}  // namespace distmuon::cuda
