// Launchers of the fused Muon passes (kernels/muon_kernels.cuh).
#include <algorithm>

#include "backend/backend_checks.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/muon_kernels.cuh"
#include "backend/cuda/launch/launchers.h"

namespace distmuon::cuda {

int blocks_per_matrix(int64_t numel, int64_t matrices, int sm_count) {
  // One block per 16K elements: each of 256 threads makes 8 vector steps, enough to hide the
  // block's start-up and its reduction; the grid-stride loop covers larger matrices once the
  // cap (which bounds the reduction partials) is reached. Tiny batches still get a full wave.
  constexpr int64_t kPerBlock = 16 * 1024;
  int64_t bpm = (numel + kPerBlock - 1) / kPerBlock;
  const int64_t wave = (2LL * sm_count + matrices - 1) / std::max<int64_t>(1, matrices);
  bpm = std::max(bpm, std::min(wave, (numel + 2047) / 2048));
  return static_cast<int>(std::clamp<int64_t>(bpm, 1, 2048));
}

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Fills the table for slots [first, first + n). Returns true when every matrix is packed and
// 16-byte aligned with numel % 8 == 0 (the vector path).
bool fill_table(MuonTable& t, std::span<const MuonSlot> slots, size_t first, int n) {
  const MuonSlot& s0 = slots[first];
  t.rows = s0.grad.rows;
  t.cols = s0.grad.cols;
  t.ld_g = s0.grad.ld;
  t.ld_b = s0.momentum.ld;
  t.ld_w = s0.weight.ld;
  t.n = n;
  t.first = static_cast<int>(first);
  bool vec = (t.rows * t.cols) % 8 == 0 && t.ld_g == t.cols && t.ld_b == t.cols && t.ld_w == t.cols;
  for (int i = 0; i < n; ++i) {
    const MuonSlot& s = slots[first + i];
    DM_CHECK(s.grad.rows == t.rows && s.grad.cols == t.cols && s.momentum.rows == t.rows &&
                 s.momentum.cols == t.cols && s.weight.rows == t.rows && s.weight.cols == t.cols,
             "cuda Muon pass: every matrix of one call must have the same shape");
    DM_CHECK(s.grad.ld == t.ld_g && s.momentum.ld == t.ld_b && s.weight.ld == t.ld_w,
             "cuda Muon pass: every matrix of one call must have the same layout");
    t.g[i] = s.grad.data;
    t.b[i] = s.momentum.data;
    t.w[i] = s.weight.data;
    t.g_dt[i] = static_cast<int8_t>(s.grad.dtype);
    t.b_dt[i] = static_cast<int8_t>(s.momentum.dtype);
    t.w_dt[i] = static_cast<int8_t>(s.weight.dtype);
    t.coef[i] = s.coef;
    t.skips[i] = s.skips;
    vec = vec && aligned16(s.grad.data) && aligned16(s.momentum.data) && aligned16(s.weight.data);
  }
  return vec;
}

// The 64x64 vector transposing kernels: fp32 G, B, W with 16-byte aligned rows, rows % 8 == 0,
// cols % 4 == 0; X/O rows (length `rows`) 16-byte aligned.
bool t64_ok(std::span<const MuonSlot> slots, size_t first, int n, const MuonTable& t,
            const BatchRef& x) {
  if (t.rows % 8 != 0 || t.cols % 4 != 0 || t.ld_g % 4 != 0 || t.ld_b % 4 != 0 || t.ld_w % 4 != 0)
    return false;
  for (int i = 0; i < n; ++i) {
    const MuonSlot& s = slots[first + i];
    if (s.grad.dtype != DType::kF32 || s.momentum.dtype != DType::kF32 || s.weight.dtype != DType::kF32)
      return false;
    if (!aligned16(s.grad.data) || !aligned16(s.momentum.data) || !aligned16(s.weight.data)) return false;
  }
  const int64_t es = static_cast<int64_t>(dtype_size(x.dtype));
  return x.dtype != DType::kF64 && x.ld % 8 == 0 && aligned16(x.data) && (x.stride * es) % 16 == 0;
}

MatOut mat_out(const BatchRef& x) {
  return MatOut{x.data, x.stride, x.ld, static_cast<int>(x.dtype)};
}

bool out_vec_ok(const BatchRef& x) {
  const size_t es = dtype_size(x.dtype);
  return x.ld == x.cols && aligned16(x.data) && (x.stride * static_cast<int64_t>(es)) % 16 == 0;
}

}  // namespace

void launch_muon_norm(std::span<const MuonSlot> slots, const float* mu, bool nesterov, double* norms,
                      int32_t* status, const Scratch& scratch, int sm_count, cudaStream_t stream) {
  for (size_t first = 0; first < slots.size(); first += kMaxMuonSlots) {
    const int n = static_cast<int>(std::min<size_t>(kMaxMuonSlots, slots.size() - first));
    MuonTable t{};
    const bool vec = fill_table(t, slots, first, n);
    if (t.rows * t.cols == 0) {
      DM_CHECK_CUDA(cudaMemsetAsync(norms + first, 0, sizeof(double) * n, stream));
      DM_CHECK_CUDA(cudaMemsetAsync(status + first, 0, sizeof(int32_t) * n, stream));
      continue;
    }
    int bpm = blocks_per_matrix(t.rows * t.cols, n, sm_count);
    bpm = std::min<int>(bpm, static_cast<int>(scratch.partial_count / n));
    DM_CHECK(bpm >= 1 && n <= scratch.counter_count, "cuda: workspace too small for a norm pass");
    dim3 grid(bpm, n);
    if (vec)
      dev::muon_norm_kernel<true><<<grid, 256, 0, stream>>>(t, mu, nesterov, norms, status,
                                                             scratch.partials, scratch.counters);
    else
      dev::muon_norm_kernel<false><<<grid, 256, 0, stream>>>(t, mu, nesterov, norms, status,
                                                              scratch.partials, scratch.counters);
    DM_CHECK_LAUNCH();
  }
}

void launch_muon_apply(std::span<const MuonSlot> slots, const float* mu, bool nesterov,
                       const int32_t* status, const ScaleSpec& scale, bool transpose,
                       const BatchRef& x, int sm_count, cudaStream_t stream) {
  check_slots("muon_momentum_apply", slots, x, transpose);
  const ScaleArgs sc{scale.norms, scale.norm_mul, scale.eps, scale.alpha};
  for (size_t first = 0; first < slots.size(); first += kMaxMuonSlots) {
    const int n = static_cast<int>(std::min<size_t>(kMaxMuonSlots, slots.size() - first));
    MuonTable t{};
    const bool vec = fill_table(t, slots, first, n);
    if (t.rows * t.cols == 0) continue;
    if (transpose && t64_ok(slots, first, n, t, x)) {
      dim3 grid((t.cols + 63) / 64, (t.rows + 63) / 64, n);
      dev::muon_apply_t64_kernel<<<grid, 256, 0, stream>>>(t, mu, nesterov, status, sc, mat_out(x));
    } else if (transpose) {
      dim3 grid((t.cols + 31) / 32, (t.rows + 31) / 32, n);
      dev::muon_apply_t_kernel<<<grid, dim3(32, 8), 0, stream>>>(t, mu, nesterov, status, sc, mat_out(x));
    } else {
      dim3 grid(blocks_per_matrix(t.rows * t.cols, n, sm_count), n);
      if (vec && out_vec_ok(x))
        dev::muon_apply_kernel<true><<<grid, 256, 0, stream>>>(t, mu, nesterov, status, sc, mat_out(x));
      else
        dev::muon_apply_kernel<false><<<grid, 256, 0, stream>>>(t, mu, nesterov, status, sc, mat_out(x));
    }
    DM_CHECK_LAUNCH();
  }
}

void launch_muon_update(std::span<const MuonSlot> slots, const int32_t* status, const BatchRef& o,
                        bool transpose, int sm_count, cudaStream_t stream) {
  check_slots("muon_update", slots, o, transpose);
  check_coefs("muon_update", slots);
  for (size_t first = 0; first < slots.size(); first += kMaxMuonSlots) {
    const int n = static_cast<int>(std::min<size_t>(kMaxMuonSlots, slots.size() - first));
    MuonTable t{};
    const bool vec = fill_table(t, slots, first, n);
    if (t.rows * t.cols == 0) continue;
    if (transpose && t64_ok(slots, first, n, t, o)) {
      dim3 grid((t.cols + 63) / 64, (t.rows + 63) / 64, n);
      dev::muon_update_t64_kernel<<<grid, 256, 0, stream>>>(t, status, mat_out(o));
    } else if (transpose) {
      dim3 grid((t.cols + 31) / 32, (t.rows + 31) / 32, n);
      dev::muon_update_t_kernel<<<grid, dim3(32, 8), 0, stream>>>(t, status, mat_out(o));
    } else {
      dim3 grid(blocks_per_matrix(t.rows * t.cols, n, sm_count), n);
      if (vec && out_vec_ok(o))
        dev::muon_update_kernel<true><<<grid, 256, 0, stream>>>(t, status, mat_out(o));
      else
        dev::muon_update_kernel<false><<<grid, 256, 0, stream>>>(t, status, mat_out(o));
    }
    DM_CHECK_LAUNCH();
  }
}

}  // namespace distmuon::cuda
