// CudaBackend::gemm_grouped: the problems of one call as launches of the grouped kernel
// (kernels/grouped_gemm_kernel.cuh), one per kind of B (as stored or transposed) and per
// kGroupedMaxProblems problems; other problems (fp32, A transposed, mixed dtypes) go through
// gemm() one by one, as the default does.
#include <algorithm>
#include <limits>
#include <vector>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/grouped_gemm_kernel.cuh"
#include "backend/cuda/launch/cuda_backend_impl.h"
#include "distmuon/cuda_backend.h"

namespace distmuon {

namespace {

bool half_dtype(DType t) { return t == DType::kBF16 || t == DType::kF16; }

// Blocks of one launch at most (a grid's x extent is below 2^31).
constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max() / 2;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether the kernel computes this problem; then fills `out` (all but first_block).
bool describe(const GemmProblem& p, DType t, cuda::dev::GroupedProblem* out) {
  const GemmDims dm = check_gemm("gemm_grouped", p.op_a, p.a, p.op_b, p.b,
                                 p.c_in.data ? &p.c_in : nullptr, p.c);
  const bool src = p.c_in.data && p.beta != 0.0;
  if (p.op_a != Op::kN || p.a.dtype != t || p.b.dtype != t || p.c.dtype != t ||
      (src && p.c_in.dtype != t))
    return false;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (int64_t v : {dm.m, dm.n, dm.k, p.a.ld, p.b.ld, p.c.ld, src ? p.c_in.ld : 0})
    if (v > kMax) return false;
  const int64_t tiles_m = (dm.m + cuda::dev::kGroupedTile - 1) / cuda::dev::kGroupedTile;
  const int64_t tiles_n = (dm.n + cuda::dev::kGroupedTile - 1) / cuda::dev::kGroupedTile;
  if (tiles_m * tiles_n > kMax / 2) return false;  // by shape alone: never by count
  cuda::dev::GroupedProblem g{};
  g.a = p.a.data;
  g.b = p.b.data;
  g.c = src ? p.c_in.data : nullptr;
  g.d = p.c.data;
  g.stride_a = p.a.stride;
  g.stride_b = p.b.stride;
  g.stride_c = src ? p.c_in.stride : 0;
  g.stride_d = p.c.stride;
  g.m = static_cast<int32_t>(dm.m);
  g.n = static_cast<int32_t>(dm.n);
  g.k = static_cast<int32_t>(dm.k);
  g.lda = static_cast<int32_t>(p.a.ld);
  g.ldb = static_cast<int32_t>(p.b.ld);
  g.ldc = src ? static_cast<int32_t>(p.c_in.ld) : 0;
  g.ldd = static_cast<int32_t>(p.c.ld);
  g.b_trans = p.op_b == Op::kT ? 1 : 0;
  g.vec = aligned16(p.a.data) && aligned16(p.b.data) && p.a.ld % 8 == 0 && p.b.ld % 8 == 0 &&
                  (p.a.count <= 1 || p.a.stride % 8 == 0) &&
                  (p.b.count <= 1 || p.b.stride % 8 == 0)
              ? 1
              : 0;
  g.tiles_n = static_cast<int32_t>(tiles_n);
  g.tiles = static_cast<int32_t>(tiles_m * tiles_n);
  g.alpha = static_cast<float>(p.alpha);
  g.beta = src ? static_cast<float>(p.beta) : 0.0f;
  *out = g;
  return true;
}

template <typename T>
void launch_table(const cuda::dev::GroupedTable& table, int64_t blocks, bool trans_b,
                  cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks)), block(cuda::dev::kGroupedThreads);
  if (trans_b)
    cuda::dev::grouped_gemm_kernel<T, true><<<grid, block, 0, stream>>>(table);
  else
    cuda::dev::grouped_gemm_kernel<T, false><<<grid, block, 0, stream>>>(table);
  DM_CHECK_LAUNCH();
}

}  // namespace

bool CudaBackend::grouped_gemm_native(DType t) const { return half_dtype(t); }

void CudaBackend::gemm_grouped(std::span<const GemmProblem> problems) {
  // Every problem is checked before anything is issued, so that a bad one leaves nothing done.
  // Launch lists by dtype (fp16, bf16) and kind of B (as stored, transposed); `first_block`
  // holds a problem's matrix count until its launch is laid out.
  std::vector<cuda::dev::GroupedProblem> lists[2][2];
  std::vector<const GemmProblem*> one_by_one;
  for (const GemmProblem& p : problems) {
    cuda::dev::GroupedProblem g;
    const DType t = p.c.dtype;
    if (!half_dtype(t) || !describe(p, t, &g)) {
      one_by_one.push_back(&p);
      continue;
    }
    if (p.c.count == 0 || g.m == 0 || g.n == 0) continue;
    g.first_block = static_cast<int32_t>(std::min<int64_t>(p.c.count, kMaxBlocks / g.tiles));
    // A problem of more matrices than one launch can take goes in several entries.
    for (int64_t first = 0; first < p.c.count; first += g.first_block) {
      cuda::dev::GroupedProblem part = g;
      const int64_t n = std::min<int64_t>(g.first_block, p.c.count - first);
      auto at = [&](const void* base, int64_t stride, DType dt) {
        return static_cast<const char*>(base) + first * stride * dtype_size(dt);
      };
      part.a = at(g.a, g.stride_a, t);
      part.b = at(g.b, g.stride_b, t);
      part.c = g.c ? at(g.c, g.stride_c, t) : nullptr;
      part.d = const_cast<char*>(at(g.d, g.stride_d, t));
      part.first_block = static_cast<int32_t>(n);
      lists[t == DType::kBF16 ? 1 : 0][g.b_trans].push_back(part);
    }
  }
  for (const GemmProblem* p : one_by_one)
    gemm(p->op_a, p->a, p->op_b, p->b, p->alpha, p->beta, p->c_in.data ? &p->c_in : nullptr, p->c);
  cudaStream_t stream = impl_->stream;
  for (int bf16 = 0; bf16 < 2; ++bf16)
    for (int trans = 0; trans < 2; ++trans) {
      const std::vector<cuda::dev::GroupedProblem>& list = lists[bf16][trans];
      cuda::dev::GroupedTable table{};
      int64_t blocks = 0;
      auto flush = [&] {
        if (table.count == 0) return;
        if (bf16)
          launch_table<__nv_bfloat16>(table, blocks, trans == 1, stream);
        else
          launch_table<__half>(table, blocks, trans == 1, stream);
        table = {};
        blocks = 0;
      };
      for (cuda::dev::GroupedProblem g : list) {
        const int64_t count = g.first_block;
        if (table.count == cuda::dev::kGroupedMaxProblems || blocks + count * g.tiles > kMaxBlocks)
          flush();
        g.first_block = static_cast<int32_t>(blocks);
        blocks += count * g.tiles;
        table.p[table.count++] = g;
      }
      flush();
    }
}

}  // namespace distmuon
