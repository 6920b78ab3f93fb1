// The products of the CUDA backend. Dense: cuBLASLt, strided batched, with separate C and D
// so that Cin need not alias the output. Symmetric: the lower-triangle CUTLASS kernel (or the
// dense fallback) followed by the mirror kernel, so the result is exactly symmetric.
//
// Row-major to cuBLASLt's column-major: a row-major r x c matrix with leading dimension ld is
// the column-major c x r matrix with the same ld, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T with the operands swapped and the transposes kept.
#include <cstdio>
#include <string>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch/cuda_backend_impl.h"
#include "backend/cuda/launch/sym_gemm.h"

namespace distmuon {
namespace {

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::kF64: return CUDA_R_64F;
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

cublasLtMatrixLayout_t make_layout(DType t, int64_t rows, int64_t cols, int64_t ld, int64_t count,
                                   int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  DM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&l, lt_type(t), rows, cols, ld));
  int32_t n = static_cast<int32_t>(count);
  DM_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)));
  DM_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                   &stride, sizeof(stride)));
  return l;
}

int align_bits(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  return (v & 15) == 0 ? 16 : (v & 7) == 0 ? 8 : (v & 3) == 0 ? 4 : 2;
}

}  // namespace

void CudaBackend::gemm(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b, double alpha,
                       double beta, const BatchRef* c_in, const BatchRef& c) {
  GemmDims dm = check_gemm("gemm", op_a, a, op_b, b, c_in, c);
  Impl& s = *impl_;
  if (c.count == 0 || dm.m == 0 || dm.n == 0) return;
  DM_CHECK(a.dtype == b.dtype, "cuda gemm: A is ", dtype_name(a.dtype), " but B is ",
           dtype_name(b.dtype), " (convert one with scale_copy first)");
  const bool f64 = a.dtype == DType::kF64;
  DM_CHECK(!f64 || c.dtype == DType::kF64, "cuda gemm: fp64 inputs need an fp64 output");
  // Cin of another dtype than C: bring it into C first, then accumulate in place.
  const BatchRef* cin = (c_in && beta != 0.0) ? c_in : nullptr;
  if (cin && cin->dtype != c.dtype) {
    scale_copy(*cin, false, ScaleSpec{}, c);
    cin = &c;
  }
  if (dm.k == 0) {  // C = beta Cin
    if (cin) lincomb(beta, *cin, 0.0, nullptr, 0.0, c);
    else lincomb(0.0, c, 0.0, nullptr, 0.0, c);
    return;
  }
  const BatchRef& csrc = cin ? *cin : c;
  char key[512];
  std::snprintf(key, sizeof(key), "%d%d|%d%d%d|%lld %lld %lld %lld|%lld %lld %lld %lld|%lld %lld|%d%d%d%d",
                int(op_a), int(op_b), int(a.dtype), int(c.dtype), int(csrc.dtype),
                (long long)dm.m, (long long)dm.n, (long long)dm.k, (long long)c.count,
                (long long)a.ld, (long long)b.ld, (long long)csrc.ld, (long long)c.ld,
                (long long)a.stride, (long long)b.stride, align_bits(a.data), align_bits(b.data),
                align_bits(csrc.data), align_bits(c.data));
  std::string k(key);
  k += "|" + std::to_string(csrc.stride) + " " + std::to_string(c.stride);
  LtPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.plans_mu);
    auto it = s.plans.find(k);
    if (it != s.plans.end()) plan = it->second.get();
  }
  if (!plan) {
    auto p = std::make_unique<LtPlan>();
    p->f64 = f64;
    const cublasComputeType_t ct = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
    const cudaDataType_t st = f64 ? CUDA_R_64F : CUDA_R_32F;
    DM_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p->op, ct, st));
    // Swapped operands: cuBLASLt's A is our B, its B is our A.
    cublasOperation_t ta = op_b == Op::kT ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = op_a == Op::kT ? CUBLAS_OP_T : CUBLAS_OP_N;
    DM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    DM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    p->a = make_layout(b.dtype, b.cols, b.rows, b.ld, c.count, b.stride);
    p->b = make_layout(a.dtype, a.cols, a.rows, a.ld, c.count, a.stride);
    p->c = make_layout(csrc.dtype, dm.n, dm.m, csrc.ld, c.count, csrc.stride);
    p->d = make_layout(c.dtype, dm.n, dm.m, c.ld, c.count, c.stride);
    cublasLtMatmulPreference_t pref = nullptr;
    DM_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = s.lt_bytes;
    DM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    cublasStatus_t st_h = cublasLtMatmulAlgoGetHeuristic(s.lt.get(), p->op, p->a, p->b, p->c, p->d,
                                                          pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    DM_CHECK(st_h == CUBLAS_STATUS_SUCCESS && found > 0, "cuda gemm: cuBLASLt has no algorithm for ",
             dtype_name(a.dtype), " ", dm.m, "x", dm.k, " times ", dm.k, "x", dm.n, " -> ",
             dtype_name(c.dtype), " (", cuda::cublas_status_name(st_h), ")");
    p->algo = res.algo;
    std::lock_guard<std::mutex> lock(s.plans_mu);
    plan = p.get();
    s.plans[k] = std::move(p);
  }
  const float fa = static_cast<float>(alpha), fb = cin ? static_cast<float>(beta) : 0.0f;
  const double da = alpha, db = cin ? beta : 0.0;
  const void* pa = f64 ? static_cast<const void*>(&da) : static_cast<const void*>(&fa);
  const void* pb = f64 ? static_cast<const void*>(&db) : static_cast<const void*>(&fb);
  DM_CHECK_CUBLAS(cublasLtMatmul(s.lt.get(), plan->op, pa, b.data, plan->a, a.data, plan->b, pb,
                                 csrc.data, plan->c, c.data, plan->d, &plan->algo, s.lt_workspace(),
                                 s.lt_bytes, s.stream));
}

void CudaBackend::gemm_symmetric(Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                                 double alpha, double beta, const BatchRef* c_in,
                                 const BatchRef& c) {
  GemmDims dm = check_gemm("gemm_symmetric", op_a, a, op_b, b, c_in, c);
  DM_CHECK(dm.m == dm.n, "gemm_symmetric: the product is ", dm.m, "x", dm.n, ", not square");
  if (c.count == 0 || dm.m == 0) return;
  Impl& s = *impl_;
  const BatchRef* cin = (c_in && beta != 0.0) ? c_in : nullptr;
  // The lower-triangle kernel computes D = A B^T with both operands k-contiguous: op(B) = B^T
  // directly, or op(B) = B for a symmetric square B (then B^T = B, the caller's contract).
  const bool tn_form = op_a == Op::kN && (op_b == Op::kT || (b.rows == b.cols && b.rows == dm.k));
  const bool same_dtype = a.dtype == b.dtype && a.dtype == c.dtype && (!cin || cin->dtype == c.dtype);
  SymKernel variant = resolve_sym_kernel(dm.m, dm.k, c.count, c.dtype);
  bool done = false;
  int64_t diagonal_block = 0;  // > 0: the epilogue stored the upper triangle outside these
  if (variant != SymKernel::kDenseMirror && tn_form && same_dtype) {
    cuda::SymGemmArgs g = cuda::make_sym_args(a, b, cin, c, dm.k, alpha, beta);
    g.mirror = cuda::sym_epilogue_mirror();
    if (c.dtype == DType::kBF16)
      done = cuda::run_sym_sm90_bf16(variant, g, s.sm_count, s.tail_workspace(), s.tail_bytes(), s.stream);
    else if (c.dtype == DType::kF16)
      done = cuda::run_sym_sm90_f16(variant, g, s.sm_count, s.tail_workspace(), s.tail_bytes(), s.stream);
    if (done && g.mirror) diagonal_block = cuda::sym_diagonal_block(variant);
  }
  if (!done) gemm(op_a, a, op_b, b, alpha, beta, c_in, c);
  cuda::launch_mirror(c, s.stream, nullptr, 1, diagonal_block);
}

}  // namespace distmuon
