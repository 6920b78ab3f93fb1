// The CUDA backend's masked and CacheMuon operations: nothing here reads a flag, a residual or
// a decision on the host, so a CacheMuon step issues the same kernels whatever the device
// decides and can be captured in a CUDA graph.
//
// How a masked product skips work: the per-matrix flags are handed to the CUTLASS kernels'
// tile scheduler (kernels/sym_gemm_sm90.cuh), which schedules the tiles of the selected
// matrices only; the mirror's blocks of unselected matrices return at once. A product whose
// every matrix is unselected costs one launch of CTAs that find no work (a few microseconds).
//  - symmetric products: the lower-triangle kernel of the shape's variant (kTri128 where the
//    shape would use the dense cuBLASLt fallback: masking needs our scheduler);
//  - dense products op(B) = B (Q X, Q P): the 256x128 cooperative kernel with B row-major;
//    op(B) = B^T: the 256x128 symmetric kernel over every tile.
// cuBLASLt cannot skip matrices of a strided batch from device memory, so dense masked
// products do not use it; a selected matrix therefore equals gemm()'s result to rounding (same
// inputs, fp32 accumulation in another order), and gemm_symmetric()'s bit for bit when that
// runs the same CUTLASS variant. Products outside these kernels' reach (fp32/fp64, an operand
// transposed on the left, leading dimensions not multiples of 8, devices other than sm_90)
// use the Backend default, which synchronises, and say so once in the log.
#include <atomic>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch/cuda_backend_impl.h"
#include "backend/cuda/launch/sym_gemm.h"
#include "common/log.h"

namespace distmuon {

bool CudaBackend::masked_capturable(DType t) const {
  return (t == DType::kBF16 || t == DType::kF16) && has_sm90_kernels();
}

bool CudaBackend::masked_on_device(const BatchMask& mask, bool symmetric, Op op_a,
                                   const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                                   double beta, const BatchRef* c_in, const BatchRef& c,
                                   int64_t k) {
  Impl& s = *impl_;
  const BatchRef* cin = (c_in && beta != 0.0) ? c_in : nullptr;
  const bool same = a.dtype == c.dtype && b.dtype == c.dtype && (!cin || cin->dtype == c.dtype);
  if (!masked_capturable(c.dtype) || !same || op_a != Op::kN || k == 0) return false;
  cuda::SymGemmArgs g = cuda::make_sym_args(a, b, cin, c, k, alpha, beta);
  g.flags = mask.flags;
  g.flag_value = mask.value;
  const bool bf = c.dtype == DType::kBF16;
  auto run_variant = [&](SymKernel v) {
    return bf ? cuda::run_sym_sm90_bf16(v, g, s.sm_count, s.tail_workspace(), s.tail_bytes(),
                                        s.stream)
              : cuda::run_sym_sm90_f16(v, g, s.sm_count, s.tail_workspace(), s.tail_bytes(),
                                       s.stream);
  };
  if (symmetric) {
    // As gemm_symmetric: op(B) = B^T, or B itself when it is symmetric and square.
    if (!(op_b == Op::kT || (b.rows == b.cols && b.rows == k))) return false;
    SymKernel v = resolve_sym_kernel(c.rows, k, c.count, c.dtype);
    if (v == SymKernel::kDenseMirror) v = SymKernel::kTri128;
    g.mirror = cuda::sym_epilogue_mirror();
    if (!run_variant(v)) return false;
    cuda::launch_mirror(c, s.stream, mask.flags, mask.value,
                        g.mirror ? cuda::sym_diagonal_block(v) : 0);
    return true;
  }
  g.lower = false;
  if (op_b == Op::kT) return run_variant(SymKernel::kTri256x128);
  return bf ? cuda::run_dense_nn_sm90_bf16(g, s.sm_count, s.tail_workspace(), s.tail_bytes(),
                                           s.stream)
            : cuda::run_dense_nn_sm90_f16(g, s.sm_count, s.tail_workspace(), s.tail_bytes(),
                                          s.stream);
}

void CudaBackend::gemm_masked(const BatchMask& mask, bool symmetric, Op op_a, const BatchRef& a,
                              Op op_b, const BatchRef& b, double alpha, double beta,
                              const BatchRef* c_in, const BatchRef& c) {
  GemmDims dm = check_gemm("gemm_masked", op_a, a, op_b, b, c_in, c);
  DM_CHECK(!symmetric || dm.m == dm.n, "gemm_masked: symmetric product is ", dm.m, "x", dm.n);
  if (c.count == 0 || dm.m == 0 || dm.n == 0) return;
  DM_CHECK(mask.flags != nullptr, "gemm_masked: no flags");
  if (masked_on_device(mask, symmetric, op_a, a, op_b, b, alpha, beta, c_in, c, dm.k)) return;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    DM_LOG(kWarn, "cuda gemm_masked: ", dtype_name(a.dtype), " ", dm.m, "x", dm.n, "x", dm.k,
           op_a == Op::kT ? " (A transposed)" : "",
           " has no device-masked kernel; this and "
           "similar products read the flags on the host (synchronising)");
  Backend::gemm_masked(mask, symmetric, op_a, a, op_b, b, alpha, beta, c_in, c);
}

void CudaBackend::copy_masked(const BatchMask& mask, const BatchRef& src, const BatchRef& dst) {
  cuda::launch_copy_masked(src, dst, mask.flags, mask.value, impl_->sm_count, impl_->stream);
}

void CudaBackend::cache_gate(const CacheGateArgs& args) {
  DM_CHECK(args.count == 0 ||
               ((args.plan || args.residual) && args.entry_key && args.age && args.decision),
           "cache_gate: missing buffers");
  DM_CHECK(args.key != 0, "cache_gate: key 0 is reserved for empty entries");
  cuda::launch_cache_gate(args, impl_->stream);
}

void CudaBackend::fill_normal(const BatchRef& dst, uint64_t seed, uint64_t counter) {
  cuda::launch_fill_normal_ref(dst, seed, counter, impl_->sm_count, impl_->stream);
}

void CudaBackend::fingerprint(const BatchRef& x, uint64_t* keys) {
  cuda::launch_fingerprint(x, keys, impl_->stream);
}

void CudaBackend::fill_normal_keyed(const BatchRef& dst, uint64_t seed, const uint64_t* keys) {
  cuda::launch_fill_normal_keyed(dst, seed, keys, impl_->sm_count, impl_->stream);
}

}  // namespace distmuon
