// Launchers of the fused Muon passes (kernels/muon_kernels.cuh).
#include <algorithm>
#include <limits>
#include <vector>

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

// Which kernel a matrix of pass 2 or 3 takes: flat, transposing through 32x32 tiles, or the
// transposing vector kernel (fp32 G, B, W with rows % 8 == 0, cols % 4 == 0 and 16-byte aligned
// rows; X/O rows 16-byte aligned).
enum Kind { kFlat = 0, kT32 = 1, kT64 = 2, kKinds = 3 };

Kind kind_of(MuonPass pass, const MuonPassBatch& b, const MuonSlot& s, const MuonSlotArgs& a) {
  if (pass == MuonPass::kNorm || !b.transpose) return kFlat;
  const bool t64 =
      a.rows % 8 == 0 && a.cols % 4 == 0 && a.ld_g % 4 == 0 && a.ld_b % 4 == 0 &&
      a.ld_w % 4 == 0 && s.grad.dtype == DType::kF32 && s.momentum.dtype == DType::kF32 &&
      s.weight.dtype == DType::kF32 && aligned16(a.g) && aligned16(a.b) && aligned16(a.w) &&
      b.x.dtype != DType::kF64 && b.x.ld % 8 == 0 && aligned16(a.x);
  return t64 ? kT64 : kT32;
}

// Matrix i of batch b as the kernels see it.
MuonSlotArgs slot_args(MuonPass pass, const MuonPassBatch& b, size_t i, int sm_count) {
  const MuonSlot& s = b.slots[i];
  MuonSlotArgs a{};
  a.g = s.grad.data;
  a.b = s.momentum.data;
  a.w = s.weight.data;
  a.coef = s.coef;
  a.skips = s.skips;
  a.mu = b.mu;
  a.nesterov = b.nesterov;
  a.norm = b.norms ? b.norms + i : nullptr;
  a.status = b.status ? b.status + i : nullptr;
  a.scale_norm = b.scale.norms ? b.scale.norms + i : nullptr;
  a.norm_mul = b.scale.norm_mul;
  a.eps = b.scale.eps;
  a.alpha = b.scale.alpha;
  a.rows = static_cast<int32_t>(s.grad.rows);  // (check_batch: every side fits)
  a.cols = static_cast<int32_t>(s.grad.cols);
  a.ld_g = static_cast<int32_t>(s.grad.ld);
  a.ld_b = static_cast<int32_t>(s.momentum.ld);
  a.ld_w = static_cast<int32_t>(s.weight.ld);
  a.g_dt = static_cast<int8_t>(s.grad.dtype);
  a.b_dt = static_cast<int8_t>(s.momentum.dtype);
  a.w_dt = static_cast<int8_t>(s.weight.dtype);
  const int64_t numel = static_cast<int64_t>(a.rows) * a.cols;
  a.vec = numel % 8 == 0 && a.ld_g == a.cols && a.ld_b == a.cols && a.ld_w == a.cols &&
          aligned16(a.g) && aligned16(a.b) && aligned16(a.w);
  if (pass != MuonPass::kNorm) {
    const BatchRef& x = b.x;
    a.x = static_cast<char*>(x.data) +
          static_cast<size_t>(static_cast<int64_t>(i) * x.stride) * dtype_size(x.dtype);
    a.ld_x = static_cast<int32_t>(x.ld);
    a.x_dt = static_cast<int8_t>(x.dtype);
    a.vec = a.vec && x.ld == x.cols && aligned16(a.x);
  }
  // Blocks from the matrix's own batch size, so that a matrix takes the same blocks (and its
  // norm the same summation order) whatever else shares its launch.
  a.blocks = blocks_per_matrix(numel, static_cast<int64_t>(b.slots.size()), sm_count);
  return a;
}

void check_batch(MuonPass pass, const MuonPassBatch& b) {
  static const char* names[] = {"muon_momentum_norm", "muon_momentum_apply", "muon_update"};
  const char* what = names[static_cast<int>(pass)];
  if (b.slots.empty()) return;
  if (pass != MuonPass::kNorm) check_slots(what, b.slots, b.x, b.transpose);
  if (pass == MuonPass::kUpdate) check_coefs(what, b.slots);
  if (pass != MuonPass::kUpdate)
    DM_CHECK(b.mu != nullptr && b.status != nullptr, what, ": needs mu and the statuses");
  if (pass == MuonPass::kNorm) DM_CHECK(b.norms != nullptr, what, ": needs the norms");
  // The table's int32 sides and leading dimensions; the transposing kernels' grid (32-row tiles
  // along y).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (const MuonSlot& s : b.slots)
    DM_CHECK(s.grad.rows <= kMax && s.grad.cols <= kMax && s.grad.ld <= kMax &&
                 s.momentum.ld <= kMax && s.weight.ld <= kMax && b.x.ld <= kMax,
             what, ": a matrix of ", s.grad.rows, " x ", s.grad.cols, " (ld ", s.grad.ld,
             ") exceeds the kernels' int32 sides");
  if (pass != MuonPass::kNorm && b.transpose)
    for (const MuonSlot& s : b.slots)
      DM_CHECK(s.grad.rows <= 65535LL * 32, what, ": a tall matrix of ", s.grad.rows,
               " rows (at most ", 65535LL * 32, ")");
  if (pass == MuonPass::kNorm)  // (check_slots covers the other passes)
    for (const MuonSlot& s : b.slots)
      DM_CHECK(s.momentum.rows == s.grad.rows && s.momentum.cols == s.grad.cols &&
                   s.weight.rows == s.grad.rows && s.weight.cols == s.grad.cols,
               what, ": momentum/weight shape differs from the gradient");
}

void launch(MuonPass pass, Kind kind, const MuonTable& t, const Scratch& scratch,
            cudaStream_t stream) {
  int64_t blocks = 1, tiles_x = 1, tiles_y = 1;
  const int tile = kind == kT64 ? 64 : 32;
  for (int i = 0; i < t.n; ++i) {
    blocks = std::max<int64_t>(blocks, t.s[i].blocks);
    tiles_x = std::max<int64_t>(tiles_x, (int64_t{t.s[i].cols} + tile - 1) / tile);
    tiles_y = std::max<int64_t>(tiles_y, (int64_t{t.s[i].rows} + tile - 1) / tile);
  }
  const unsigned n = static_cast<unsigned>(t.n);
  const dim3 flat(static_cast<unsigned>(blocks), n);
  const dim3 tiled(static_cast<unsigned>(tiles_x), static_cast<unsigned>(tiles_y), n);
  switch (pass) {
    case MuonPass::kNorm:
      dev::muon_norm_kernel<<<flat, 256, 0, stream>>>(t, scratch.partials, scratch.counters);
      break;
    case MuonPass::kApply:
      if (kind == kFlat) dev::muon_apply_kernel<<<flat, 256, 0, stream>>>(t);
      else if (kind == kT64) dev::muon_apply_t64_kernel<<<tiled, 256, 0, stream>>>(t);
      else dev::muon_apply_t_kernel<<<tiled, dim3(32, 8), 0, stream>>>(t);
      break;
    case MuonPass::kUpdate:
      if (kind == kFlat) dev::muon_update_kernel<<<flat, 256, 0, stream>>>(t);
      else if (kind == kT64) dev::muon_update_t64_kernel<<<tiled, 256, 0, stream>>>(t);
      else dev::muon_update_t_kernel<<<tiled, dim3(32, 8), 0, stream>>>(t);
      break;
  }
  DM_CHECK_LAUNCH();
}

}  // namespace

void launch_muon_pass(MuonPass pass, std::span<const MuonPassBatch> batches,
                      const Scratch& scratch, int sm_count, cudaStream_t stream) {
  // Every batch is checked before anything is issued: a bad one leaves all untouched.
  for (const MuonPassBatch& b : batches) check_batch(pass, b);
  DM_CHECK(scratch.counter_count >= kMaxMuonSlots && scratch.partial_count >= kMaxMuonSlots,
           "cuda: workspace too small for the Muon passes");
  // Pass 1's partial sums: each matrix of a launch its own range of the scratch, at most a
  // table's share (a bound that never binds with the backend's workspace, and the same for a
  // matrix whatever shares its launch).
  const int64_t most_blocks = static_cast<int64_t>(scratch.partial_count) / kMaxMuonSlots;
  std::vector<MuonSlotArgs> todo[kKinds];
  for (const MuonPassBatch& b : batches)
    for (size_t i = 0; i < b.slots.size(); ++i) {
      MuonSlotArgs a = slot_args(pass, b, i, sm_count);
      todo[kind_of(pass, b, b.slots[i], a)].push_back(a);
    }
  for (int kind = 0; kind < kKinds; ++kind) {
    const std::vector<MuonSlotArgs>& all = todo[kind];
    for (size_t first = 0; first < all.size(); first += kMaxMuonSlots) {
      MuonTable t{};
      t.n = static_cast<int>(std::min<size_t>(kMaxMuonSlots, all.size() - first));
      int64_t partial = 0;
      for (int i = 0; i < t.n; ++i) {
        t.s[i] = all[first + i];
        if (pass == MuonPass::kNorm) {
          t.s[i].blocks = static_cast<int32_t>(std::min<int64_t>(t.s[i].blocks, most_blocks));
          t.s[i].partial0 = static_cast<int32_t>(partial);
          partial += t.s[i].blocks;
        }
      }
      launch(pass, static_cast<Kind>(kind), t, scratch, stream);
    }
  }
}

}  // namespace distmuon::cuda
