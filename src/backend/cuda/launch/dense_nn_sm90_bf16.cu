// The masked dense product D = A B (B row-major k x n) in bf16, every tile, with the cooperative
// kernel of args.tile (fp32 accumulation). A translation unit of its own: CUTLASS compiles slowly.
#include "backend/cuda/launch/sym_gemm_sm90_run.h"

namespace distmuon::cuda {

bool run_dense_nn_sm90_bf16(const SymGemmArgs& args, int sm_count, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  return sm90::run_dense_nn<cutlass::bfloat16_t>(args, sm_count, workspace, workspace_bytes,
                                                 stream);
}

}  // namespace distmuon::cuda
