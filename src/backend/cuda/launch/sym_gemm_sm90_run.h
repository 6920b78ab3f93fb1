// Host side of the lower-triangle CUTLASS kernels: builds the arguments, checks that the kernel
// can run them (alignment, shared memory), and launches on the caller's stream. Included by
// sym_gemm_sm90_bf16.cu and sym_gemm_sm90_f16.cu, one element type each.
#pragma once

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels/sym_gemm_sm90.cuh"
#include "backend/cuda/launch/sym_gemm.h"

namespace distmuon::cuda::sm90 {

template <typename Element, class TileShape, class ClusterShape, bool PingPong = false,
          class LayoutB = cutlass::layout::ColumnMajor, bool Mirror = false>
bool run_sym(const SymGemmArgs& g, int sm_count, void* workspace, size_t workspace_bytes,
             cudaStream_t stream) {
  using Gemm = typename SymGemm<Element, TileShape, ClusterShape, PingPong, LayoutB, Mirror>::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  const int m = static_cast<int>(g.m), k = static_cast<int>(g.k), l = static_cast<int>(g.count);
  const int n = g.n > 0 ? static_cast<int>(g.n) : m;
  if (g.lower && n != m) return false;
  StrideA sa = cute::make_stride(g.lda, cute::Int<1>{}, g.stride_a);
  StrideB sb;
  if constexpr (std::is_same_v<LayoutB, cutlass::layout::RowMajor>)
    sb = cute::make_stride(cute::Int<1>{}, g.ldb, g.stride_b);  // k x n, n contiguous
  else
    sb = cute::make_stride(g.ldb, cute::Int<1>{}, g.stride_b);  // n x k, k contiguous
  StrideC sc = cute::make_stride(g.ldc, cute::Int<1>{}, g.stride_c);
  StrideD sd = cute::make_stride(g.ldd, cute::Int<1>{}, g.stride_d);
  cutlass::KernelHardwareInfo hw;
  DM_CHECK_CUDA(cudaGetDevice(&hw.device_id));
  hw.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, l},
      {static_cast<const Element*>(g.a), sa, static_cast<const Element*>(g.b), sb},
      {{g.alpha, g.beta}, static_cast<const Element*>(g.c ? g.c : g.d), sc,
       static_cast<Element*>(g.d), sd},
      hw};
  if constexpr (Mirror) {
    if (g.lower && g.mirror) {
      args.epilogue.thread.mirror = static_cast<Element*>(g.d);
      args.epilogue.thread.dMirror = cute::make_stride(cute::Int<1>{}, g.ldd, g.stride_d);
    }
  }
  args.scheduler.lower = g.lower;
  args.scheduler.flags = g.flags;
  args.scheduler.flag_value = g.flag_value;
  args.scheduler.column_order =
      g.order == TileOrder::kColumns || (g.order == TileOrder::kAuto && m <= n);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  cutlass::Status st = gemm.initialize(args, workspace, stream);
  DM_CHECK(st == cutlass::Status::kSuccess, "sm90 symmetric kernel: initialize failed (",
           cutlassGetStatusString(st), ")");
  st = gemm.run(stream);
  DM_CHECK(st == cutlass::Status::kSuccess, "sm90 symmetric kernel: launch failed (",
           cutlassGetStatusString(st), ")");
  DM_CHECK_LAUNCH();
  return true;
}

// A lower-triangle variant with the tile and cluster of its row in sym_tile_shape.
template <typename Element, SymKernel V, bool PingPong, bool Mirror>
bool run_tri(const SymGemmArgs& g, int sm_count, void* ws, size_t ws_bytes, cudaStream_t stream) {
  using namespace cute;
  constexpr SymTileShape t = sym_tile_shape(V);
  return run_sym<Element, Shape<Int<t.bm>, Int<t.bn>, _64>, Shape<Int<t.cm>, _1, _1>, PingPong,
                 cutlass::layout::ColumnMajor, Mirror>(g, sm_count, ws, ws_bytes, stream);
}

template <typename Element>
bool run_variant(SymKernel variant, const SymGemmArgs& g, int sm_count, void* ws, size_t ws_bytes,
                 cudaStream_t stream) {
  using namespace cute;
  // TMA: 16-byte aligned bases, leading dimensions and batch strides.
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (!al(g.a) || !al(g.b) || !al(g.d) || (g.c && !al(g.c))) return false;
  for (int64_t v : {g.lda, g.ldb, g.ldc, g.ldd, g.stride_a, g.stride_b, g.stride_c, g.stride_d})
    if (v % 8 != 0) return false;
  if (g.m > (1LL << 30) || g.n > (1LL << 30) || g.k > (1LL << 30) || g.count > (1LL << 30))
    return false;
  // Kernels with the transposed store in their epilogue only where it is used: its shared
  // memory costs the others a main-loop stage.
  const bool mirror = g.lower && g.mirror;
  switch (variant) {
    case SymKernel::kTri128:
      return mirror ? run_tri<Element, SymKernel::kTri128, false, true>(g, sm_count, ws, ws_bytes, stream)
                    : run_tri<Element, SymKernel::kTri128, false, false>(g, sm_count, ws, ws_bytes, stream);
    case SymKernel::kTri256x128:
      return mirror ? run_tri<Element, SymKernel::kTri256x128, false, true>(g, sm_count, ws, ws_bytes, stream)
                    : run_tri<Element, SymKernel::kTri256x128, false, false>(g, sm_count, ws, ws_bytes, stream);
    case SymKernel::kTri128Cluster2:
      return mirror ? run_tri<Element, SymKernel::kTri128Cluster2, false, true>(g, sm_count, ws, ws_bytes, stream)
                    : run_tri<Element, SymKernel::kTri128Cluster2, false, false>(g, sm_count, ws, ws_bytes, stream);
    case SymKernel::kTri128Pingpong:
      return mirror ? run_tri<Element, SymKernel::kTri128Pingpong, true, true>(g, sm_count, ws, ws_bytes, stream)
                    : run_tri<Element, SymKernel::kTri128Pingpong, true, false>(g, sm_count, ws, ws_bytes, stream);
    default: return false;
  }
}

template <typename Element>
bool run_dense_nn(const SymGemmArgs& g, int sm_count, void* ws, size_t ws_bytes,
                  cudaStream_t stream) {
  using namespace cute;
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if (!al(g.a) || !al(g.b) || !al(g.d) || (g.c && !al(g.c)) || g.lower) return false;
  for (int64_t v : {g.lda, g.ldb, g.ldc, g.ldd, g.stride_a, g.stride_b, g.stride_c, g.stride_d})
    if (v % 8 != 0) return false;
  if (g.m > (1LL << 30) || g.n > (1LL << 30) || g.k > (1LL << 30) || g.count > (1LL << 30))
    return false;
  if (g.tile == DenseTile::k128x256Cluster2)
    return run_sym<Element, Shape<_128, _256, _64>, Shape<_2, _1, _1>, false,
                   cutlass::layout::RowMajor>(g, sm_count, ws, ws_bytes, stream);
  return run_sym<Element, Shape<_256, _128, _64>, Shape<_1, _1, _1>, false,
                 cutlass::layout::RowMajor>(g, sm_count, ws, ws_bytes, stream);
}

}  // namespace distmuon::cuda::sm90
