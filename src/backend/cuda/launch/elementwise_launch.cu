// Launchers of the batched helpers and AdamW (kernels/batch_kernels.cuh, adamw_kernels.cuh).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/adamw_kernels.cuh"
#include "backend/cuda/kernels/batch_kernels.cuh"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

BatchArg arg(const BatchRef& b) {
  return BatchArg{b.data, b.stride, b.ld, static_cast<int>(b.dtype)};
}

// Packed, 16-byte aligned and every matrix start 16-byte aligned: the 8-wide vector path.
bool vec_ok(const BatchRef& b) {
  const int64_t es = static_cast<int64_t>(dtype_size(b.dtype));
  return b.ld == b.cols && aligned16(b.data) && (b.stride * es) % 16 == 0 &&
         (b.rows * b.cols) % 8 == 0 && b.dtype != DType::kF64;
}

// Grid for (blocks per matrix, matrices) in chunks of 65535 matrices (gridDim.y limit).
template <typename F>
void for_batch_chunks(int64_t count, F&& f) {
  for (int64_t first = 0; first < count; first += 65535) f(first, std::min<int64_t>(65535, count - first));
}

}  // namespace

void launch_lincomb(double alpha, const BatchRef& a, double beta, const BatchRef* b, double diag,
                    const BatchRef& out, int sm_count, cudaStream_t stream) {
  check_lincomb("lincomb", a, b, diag, out);
  if (out.count == 0 || out.rows * out.cols == 0) return;
  const bool f64 = a.dtype == DType::kF64 || out.dtype == DType::kF64 || (b && b->dtype == DType::kF64);
  const bool vec = vec_ok(a) && vec_ok(out) && (!b || vec_ok(*b));
  for_batch_chunks(out.count, [&](int64_t first, int64_t n) {
    BatchRef sa = a.slice(first, n), so = out.slice(first, n);
    BatchRef sb = b ? b->slice(first, n) : BatchRef{};
    dim3 grid(blocks_per_matrix(out.rows * out.cols, n, sm_count), static_cast<unsigned>(n));
    if (f64)
      dev::lincomb_kernel<double, false><<<grid, 256, 0, stream>>>(
          out.rows, out.cols, alpha, arg(sa), beta, arg(sb), b != nullptr, diag, arg(so));
    else if (vec)
      dev::lincomb_kernel<float, true><<<grid, 256, 0, stream>>>(
          out.rows, out.cols, static_cast<float>(alpha), arg(sa), static_cast<float>(beta), arg(sb),
          b != nullptr, static_cast<float>(diag), arg(so));
    else
      dev::lincomb_kernel<float, false><<<grid, 256, 0, stream>>>(
          out.rows, out.cols, static_cast<float>(alpha), arg(sa), static_cast<float>(beta), arg(sb),
          b != nullptr, static_cast<float>(diag), arg(so));
    DM_CHECK_LAUNCH();
  });
}

void launch_lincomb_grouped(std::span<const LincombProblem> problems, int sm_count,
                            cudaStream_t stream) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (const LincombProblem& p : problems) {
    const BatchRef* b = p.b.data ? &p.b : nullptr;
    check_lincomb("lincomb_grouped", p.a, b, p.diag, p.out);
    DM_CHECK(p.out.rows <= kMax && p.out.cols <= kMax && p.a.ld <= kMax && p.out.ld <= kMax &&
                 (!b || b->ld <= kMax),
             "lincomb_grouped: a matrix of ", p.out.rows, " x ", p.out.cols,
             " exceeds the kernel's int32 sides");
  }
  // Every matrix of every problem becomes a table row of the vector or the scalar kernel;
  // fp64 problems (double arithmetic) go to lincomb itself.
  std::vector<LincombSlotArgs> todo[2];
  for (const LincombProblem& p : problems) {
    const BatchRef* b = p.b.data ? &p.b : nullptr;
    if (p.out.count == 0 || p.out.rows * p.out.cols == 0) continue;
    if (p.a.dtype == DType::kF64 || p.out.dtype == DType::kF64 || (b && b->dtype == DType::kF64)) {
      launch_lincomb(p.alpha, p.a, p.beta, b, p.diag, p.out, sm_count, stream);
      continue;
    }
    const bool vec = vec_ok(p.a) && vec_ok(p.out) && (!b || vec_ok(*b));
    const int blocks = blocks_per_matrix(p.out.rows * p.out.cols, p.out.count, sm_count);
    for (int64_t i = 0; i < p.out.count; ++i) {
      LincombSlotArgs s{};
      s.a = p.a.matrix(i).data;
      s.b = b ? b->matrix(i).data : nullptr;
      s.out = p.out.matrix(i).data;
      s.alpha = static_cast<float>(p.alpha);
      s.beta = static_cast<float>(p.beta);
      s.diag = static_cast<float>(p.diag);
      s.rows = static_cast<int32_t>(p.out.rows);
      s.cols = static_cast<int32_t>(p.out.cols);
      s.ld_a = static_cast<int32_t>(p.a.ld);
      s.ld_b = b ? static_cast<int32_t>(b->ld) : 0;
      s.ld_out = static_cast<int32_t>(p.out.ld);
      s.blocks = blocks;
      s.a_dt = static_cast<int8_t>(p.a.dtype);
      s.b_dt = b ? static_cast<int8_t>(b->dtype) : 0;
      s.out_dt = static_cast<int8_t>(p.out.dtype);
      todo[vec ? 1 : 0].push_back(s);
    }
  }
  for (int vec = 0; vec < 2; ++vec)
    for (size_t first = 0; first < todo[vec].size(); first += kMaxLincombSlots) {
      LincombTable t{};
      t.n = static_cast<int>(std::min<size_t>(kMaxLincombSlots, todo[vec].size() - first));
      int blocks = 1;
      for (int i = 0; i < t.n; ++i) {
        t.s[i] = todo[vec][first + i];
        blocks = std::max(blocks, t.s[i].blocks);
      }
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(t.n));
      if (vec) dev::lincomb_grouped_kernel<true><<<grid, 256, 0, stream>>>(t);
      else dev::lincomb_grouped_kernel<false><<<grid, 256, 0, stream>>>(t);
      DM_CHECK_LAUNCH();
    }
}

void launch_frob_norm(const BatchRef& a, double* norms, const Scratch& scratch, int sm_count,
                      cudaStream_t stream) {
  if (a.count == 0) return;
  if (a.rows * a.cols == 0) {
    DM_CHECK_CUDA(cudaMemsetAsync(norms, 0, sizeof(double) * a.count, stream));
    return;
  }
  const int64_t per = std::min<int64_t>(a.count, scratch.counter_count);
  for (int64_t first = 0; first < a.count; first += per) {
    const int64_t n = std::min(per, a.count - first);
    int bpm = blocks_per_matrix(a.rows * a.cols, n, sm_count);
    bpm = std::min<int>(bpm, static_cast<int>(scratch.partial_count / n));
    DM_CHECK(bpm >= 1, "cuda frob_norm: workspace too small");
    const dim3 grid(bpm, static_cast<unsigned>(n));
    const auto kernel = vec_ok(a) ? dev::frob_norm_kernel<true> : dev::frob_norm_kernel<false>;
    kernel<<<grid, 256, 0, stream>>>(a.rows, a.cols, arg(a), norms, scratch.partials,
                                     scratch.counters, static_cast<int>(first));
    DM_CHECK_LAUNCH();
  }
}

void launch_scale_copy(const BatchRef& src, bool transpose, const ScaleSpec& scale,
                       const BatchRef& dst, int sm_count, cudaStream_t stream) {
  DM_CHECK(src.count == dst.count, "scale_copy: batch counts differ");
  DM_CHECK(transpose ? (dst.rows == src.cols && dst.cols == src.rows)
                     : (dst.rows == src.rows && dst.cols == src.cols),
           "scale_copy: destination is ", dst.rows, "x", dst.cols, " for a ", src.rows, "x",
           src.cols, " source", transpose ? " (transposed)" : "");
  if (src.count == 0 || src.rows * src.cols == 0) return;
  const bool f64 = src.dtype == DType::kF64 || dst.dtype == DType::kF64;
  for_batch_chunks(src.count, [&](int64_t first, int64_t n) {
    BatchRef s = src.slice(first, n), d = dst.slice(first, n);
    const double* norms = scale.norms ? scale.norms + first : nullptr;
    if (transpose) {
      dim3 grid((src.cols + 31) / 32, (src.rows + 31) / 32, static_cast<unsigned>(n));
      if (f64)
        dev::scale_copy_t_kernel<double><<<grid, dim3(32, 8), 0, stream>>>(
            src.rows, src.cols, arg(s), arg(d), norms, scale.norm_mul, scale.eps, scale.alpha);
      else
        dev::scale_copy_t_kernel<float><<<grid, dim3(32, 8), 0, stream>>>(
            src.rows, src.cols, arg(s), arg(d), norms, scale.norm_mul, scale.eps, scale.alpha);
    } else {
      dim3 grid(blocks_per_matrix(src.rows * src.cols, n, sm_count), static_cast<unsigned>(n));
      if (f64)
        dev::scale_copy_kernel<double><<<grid, 256, 0, stream>>>(src.rows, src.cols, arg(s), arg(d), norms,
                                                                 scale.norm_mul, scale.eps, scale.alpha);
      else
        dev::scale_copy_kernel<float><<<grid, 256, 0, stream>>>(src.rows, src.cols, arg(s), arg(d), norms,
                                                                scale.norm_mul, scale.eps, scale.alpha);
    }
    DM_CHECK_LAUNCH();
  });
}

void launch_copy_blocks(std::span<const BlockCopy> copies, int sm_count, cudaStream_t stream) {
  check_block_copies(copies);
  std::vector<BlockCopy> todo;  // the empty copies dropped: each block of the grid has work
  todo.reserve(copies.size());
  for (const BlockCopy& c : copies)
    if (c.numel > 0) todo.push_back(c);
  for (size_t first = 0; first < todo.size(); first += kMaxBlockCopies) {
    const int n = static_cast<int>(std::min<size_t>(kMaxBlockCopies, todo.size() - first));
    BlockCopyTable t{};
    t.n = n;
    int64_t most = 0;
    for (int i = 0; i < n; ++i) {
      const BlockCopy& c = todo[first + i];
      t.src[i] = c.src;
      t.dst[i] = c.dst;
      t.numel[i] = c.numel;
      t.src_dt[i] = static_cast<int8_t>(c.src_dtype);
      t.dst_dt[i] = static_cast<int8_t>(c.dst_dtype);
      most = std::max(most, c.numel);
    }
    // Elements per block as for the elementwise passes; same-type copies move 16 bytes a thread.
    dim3 grid(blocks_per_matrix(most, n, sm_count), static_cast<unsigned>(n));
    dev::copy_blocks_kernel<<<grid, 256, 0, stream>>>(t);
    DM_CHECK_LAUNCH();
  }
}

namespace {
int64_t max_numel(std::span<const AdamSlot> slots, size_t first, int n) {
  int64_t m = 0;
  for (int i = 0; i < n; ++i) m = std::max(m, slots[first + i].numel);
  return m;
}
}  // namespace

void launch_adamw_check(std::span<const AdamSlot> slots, int32_t* status, int sm_count,
                        cudaStream_t stream) {
  if (slots.empty()) return;
  DM_CHECK_CUDA(cudaMemsetAsync(status, 0, sizeof(int32_t) * slots.size(), stream));
  for (size_t first = 0; first < slots.size(); first += kMaxAdamSlots) {
    const int n = static_cast<int>(std::min<size_t>(kMaxAdamSlots, slots.size() - first));
    AdamTable t{};
    t.n = n;
    t.first = static_cast<int>(first);
    for (int i = 0; i < n; ++i) {
      const AdamSlot& s = slots[first + i];
      t.g[i] = s.grad;
      t.numel[i] = s.numel;
      t.g_dt[i] = static_cast<int8_t>(s.grad_dtype);
    }
    const int64_t mx = max_numel(slots, first, n);
    if (mx == 0) continue;
    dim3 grid(blocks_per_matrix(mx, n, sm_count), n);
    dev::adamw_check_kernel<<<grid, 256, 0, stream>>>(t, status);
    DM_CHECK_LAUNCH();
  }
}

void launch_adamw_update(std::span<const AdamSlot> slots, const int32_t* status, int sm_count,
                         cudaStream_t stream) {
  check_coefs("adamw_update", slots);
  for (size_t first = 0; first < slots.size(); first += kMaxAdamSlots) {
    const int n = static_cast<int>(std::min<size_t>(kMaxAdamSlots, slots.size() - first));
    AdamTable t{};
    t.n = n;
    t.first = static_cast<int>(first);
    for (int i = 0; i < n; ++i) {
      const AdamSlot& s = slots[first + i];
      t.coef[i] = s.coef;
      t.steps[i] = s.step;
      t.p[i] = s.param;
      t.g[i] = s.grad;
      t.m[i] = static_cast<float*>(s.exp_avg);
      t.v[i] = static_cast<float*>(s.exp_avg_sq);
      t.numel[i] = s.numel;
      t.p_dt[i] = static_cast<int8_t>(s.param_dtype);
      t.g_dt[i] = static_cast<int8_t>(s.grad_dtype);
      t.vec[i] = s.numel % 8 == 0 && aligned16(s.param) && aligned16(s.grad) &&
                 aligned16(s.exp_avg) && aligned16(s.exp_avg_sq) &&
                 s.param_dtype != DType::kF64 && s.grad_dtype != DType::kF64;
    }
    const int64_t mx = max_numel(slots, first, n);
    if (mx > 0) {
      dim3 grid(blocks_per_matrix(mx, n, sm_count), n);
      dev::adamw_update_kernel<<<grid, 256, 0, stream>>>(t, status);
      DM_CHECK_LAUNCH();
    }
    bool counters = false;
    for (int i = 0; i < n; ++i) counters |= t.steps[i] != nullptr;
    if (counters) {  // after the update kernel: every block of a slot read the same count
      dev::adam_advance_kernel<<<1, kMaxAdamSlots, 0, stream>>>(t, status);
      DM_CHECK_LAUNCH();
    }
  }
}

void launch_count_status(const int32_t* status, int64_t n, int64_t* counter, cudaStream_t stream) {
  if (n <= 0) return;
  dev::count_status_kernel<<<1, 256, 0, stream>>>(status, n,
                                                  reinterpret_cast<unsigned long long*>(counter));
  DM_CHECK_LAUNCH();
}

}  // namespace distmuon::cuda

namespace distmuon::cuda {
namespace {

// One launch's share of an upload: the bytes are the kernel's parameters, copied when it is
// launched (or captured), so the host buffer is free at once and nothing waits.
constexpr int kUploadChunk = 4000;  // within the 4 KB of parameters every CUDA version accepts
struct UploadChunk {
  void* dst;
  int bytes;
  unsigned char data[kUploadChunk];
};

__global__ void __launch_bounds__(256) upload_kernel(const UploadChunk c) {
  for (int i = threadIdx.x; i < c.bytes; i += blockDim.x) static_cast<unsigned char*>(c.dst)[i] = c.data[i];
}

}  // namespace

void launch_upload_small(void* dst, const void* host_src, size_t bytes, cudaStream_t stream) {
  for (size_t off = 0; off < bytes; off += kUploadChunk) {
    UploadChunk c;
    c.dst = static_cast<char*>(dst) + off;
    c.bytes = static_cast<int>(std::min<size_t>(kUploadChunk, bytes - off));
    std::memcpy(c.data, static_cast<const char*>(host_src) + off, static_cast<size_t>(c.bytes));
    upload_kernel<<<1, 256, 0, stream>>>(c);
    DM_CHECK_LAUNCH();
  }
}

}  // namespace distmuon::cuda
