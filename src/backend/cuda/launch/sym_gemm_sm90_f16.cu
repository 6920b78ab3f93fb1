// The lower-triangle symmetric kernels in fp16 (fp32 accumulation), for Gram Newton-Schulz.
#include "backend/cuda/launch/sym_gemm_sm90_run.h"

namespace distmuon::cuda {

bool run_sym_sm90_f16(SymKernel variant, const SymGemmArgs& args, int sm_count, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  return sm90::run_variant<cutlass::half_t>(variant, args, sm_count, workspace, workspace_bytes,
                                            stream);
}

}  // namespace distmuon::cuda
