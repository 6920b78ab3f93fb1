// The state behind CudaBackend: device properties, the current stream, the workspace split
// (cuBLASLt's part and the reduction partials), the self-resetting reduction tickets, cached
// cuBLASLt plans and the per-shape symmetric-kernel choices.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_handles.h"
#include "backend/cuda/launch/launchers.h"
#include "backend/cuda/tune/autotune.h"
#include "distmuon/cuda_backend.h"

namespace distmuon {

// A cuBLASLt matmul ready to run: descriptors and the algorithm chosen by the heuristic.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool f64 = false;
  ~LtPlan();
};

using SymKey = std::tuple<int64_t, int64_t, int64_t, int>;  // m, k, count, dtype

struct CudaBackend::Impl {
  int device = 0;
  std::string name;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  cuda::Stream own_stream;
  cudaStream_t stream = nullptr;
  cuda::Stream capture_stream;  // Backend::capture records here (created on first use)
  bool own_capture = false;     // inside capture(): conditional blocks may open
  // Open conditional blocks (begin_if_selected), innermost last: the stream to return to when
  // each ends, and the body still to capture (else_if_all_selected; null for one body). The
  // bodies are captured on streams of their own, one per depth, kept for reuse.
  struct OpenBlock {
    cudaStream_t parent;
    cudaGraph_t all_body;
  };
  std::vector<OpenBlock> open_blocks;
  bool blocks_open(int64_t count) const;
  // Captures what follows into `body` (on this depth's body stream) until the block ends;
  // all_body: the second body, still to capture.
  void capture_body(cudaGraph_t body, cudaGraph_t all_body);
  std::vector<cuda::Stream> body_streams;
  cuda::LtHandle lt;
  cuda::DevicePtr own_workspace;
  size_t own_bytes = 0;
  char* workspace = nullptr;
  size_t workspace_bytes = 0;
  size_t lt_bytes = 0;  // first part of the workspace, for cuBLASLt
  cuda::DevicePtr counters;
  static constexpr int kCounters = 4096;
  SymKernel forced = SymKernel::kAuto;
  std::map<SymKey, cuda::SymChoice> sym_choices;  // tuned or loaded from the measurement store
  // capture_epoch(): moved only by a real change of the workspace or of a kernel choice, so that
  // an engine set up beside a capturing one (loading the same stored choices) costs no capture.
  uint64_t epoch = 0;
  std::map<std::string, std::unique_ptr<LtPlan>> plans;
  std::mutex plans_mu;

  void use_workspace(char* ptr, size_t bytes);
  // Records a symmetric-kernel choice; the epoch moves when it changes the kernel of its product.
  void choose(const cuda::SymChoice& c);
  cuda::Scratch scratch() const;
  void* lt_workspace() const { return workspace; }
  // The scratch after cuBLASLt's part, for CUTLASS kernels that ask for a workspace.
  void* tail_workspace() const { return workspace + lt_bytes; }
  size_t tail_bytes() const { return workspace_bytes - lt_bytes; }
};

}  // namespace distmuon
