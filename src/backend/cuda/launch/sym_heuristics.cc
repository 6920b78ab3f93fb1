// Pure shape heuristics for the symmetric products, and the stubs used when the build has no
// CUTLASS headers.
#include <algorithm>
#include <cmath>

#include "backend/cuda/launch/sym_gemm.h"
#include "distmuon/env.h"

namespace distmuon::cuda {

namespace {
struct TileCfg {
  int bm, bn, cm;
  double efficiency;  // expected fraction of the dense bf16 rate on full tiles
};
// Priors read off H200 measurements (2026-11-29): 128x128 tiles keep up
// with 256x128 ones while k is a few thousand (their epilogue share is what limits both), but
// lose 10-40% at k >= 8K (0.82 of the dense rate at 4096 x 16384, 0.60 at 16 x 3584 x 18944),
// their operand traffic per FLOP being twice that of 256x128; the 2x1 cluster halves B's
// traffic and sits between. The autotuner replaces these with measurements per shape.
TileCfg cfg(SymKernel v, int64_t k) {
  const bool long_k = k >= 8192;
  const SymTileShape t = sym_tile_shape(v);
  double efficiency = 1.0;
  switch (v) {
    case SymKernel::kTri128: efficiency = long_k ? 0.70 : 0.84; break;
    case SymKernel::kTri256x128: efficiency = 0.92; break;
    case SymKernel::kTri128Cluster2: efficiency = long_k ? 0.78 : 0.84; break;
    case SymKernel::kTri128Pingpong: efficiency = long_k ? 0.72 : 0.86; break;
    default: break;
  }
  return {t.bm, t.bn, t.cm, efficiency};
}
}  // namespace

int64_t sym_diagonal_block(SymKernel v) {
  if (v == SymKernel::kDenseMirror || v == SymKernel::kAuto) return 0;
  const SymTileShape t = sym_tile_shape(v);
  return int64_t(t.cm) * t.bm;
}

bool sym_epilogue_mirror() {
  // Set but empty counts as unset (on).
  static const bool on = env::get("DISTMUON_SYM_EPILOGUE_MIRROR").empty() ||
                         env::get_bool("DISTMUON_SYM_EPILOGUE_MIRROR");
  return on;
}

int64_t sym_tiles(SymKernel v, int64_t m) {
  const TileCfg c = cfg(v, 0);
  if (v == SymKernel::kDenseMirror || v == SymKernel::kAuto) {
    const int64_t t = (m + 127) / 128;
    return t * t;
  }
  const int64_t q = int64_t(c.cm) * c.bm / c.bn;
  const int64_t rows = (m + int64_t(c.cm) * c.bm - 1) / (int64_t(c.cm) * c.bm);
  const int64_t tiles_n = (m + c.bn - 1) / c.bn;
  const int64_t cluster_tiles = q * rows * (rows - 1) / 2 + std::min(q * rows, tiles_n);
  return cluster_tiles * c.cm;
}

SymKernel heuristic_sym_kernel(int64_t m, int64_t k, int64_t count, int sm_count, bool sm90) {
  if (!sm90 || !sym_sm90_built()) return SymKernel::kDenseMirror;
  // Time in units of one 128x128xk tile at the dense rate on one SM.
  auto waves_time = [&](SymKernel v) {
    const TileCfg c = cfg(v, k);
    const double tiles = static_cast<double>(sym_tiles(v, m)) * count;
    // Ping-pong keeps two tiles per SM in flight, each at half the SM's rate.
    const double slots = v == SymKernel::kTri128Pingpong ? 2.0 * sm_count : sm_count;
    const double per_tile = v == SymKernel::kTri128Pingpong ? 2.0 : 1.0;
    const double waves = std::ceil(tiles / slots);
    return waves * per_tile * (double(c.bm) * c.bn / (128.0 * 128.0)) / c.efficiency;
  };
  const double t128 = (m + 127) / 128;
  // Dense: cuBLAS with near-perfect load balance on the full square, then the mirror (about
  // 2 m^2 bytes against k m^2 FLOPs: negligible unless k is small, counted as 3% here).
  const double dense = t128 * t128 * count / sm_count * 1.03 + 0.5;
  SymKernel best = SymKernel::kDenseMirror;
  double best_t = dense;
  for (SymKernel v : {SymKernel::kTri256x128, SymKernel::kTri128Cluster2, SymKernel::kTri128,
                      SymKernel::kTri128Pingpong}) {
    const double t = waves_time(v);
    if (t < best_t) {
      best = v;
      best_t = t;
    }
  }
  return best;
}

#ifndef DISTMUON_HAVE_CUTLASS
bool sym_sm90_built() { return false; }
bool run_sym_sm90_bf16(SymKernel, const SymGemmArgs&, int, void*, size_t, cudaStream_t) { return false; }
bool run_sym_sm90_f16(SymKernel, const SymGemmArgs&, int, void*, size_t, cudaStream_t) { return false; }
bool run_dense_nn_sm90_bf16(const SymGemmArgs&, int, void*, size_t, cudaStream_t) { return false; }
bool run_dense_nn_sm90_f16(const SymGemmArgs&, int, void*, size_t, cudaStream_t) { return false; }
#else
bool sym_sm90_built() { return true; }
#endif

}  // namespace distmuon::cuda
