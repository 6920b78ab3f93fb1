// Device side of the lower-triangle symmetric product on Hopper: a persistent tile scheduler
// for CUTLASS's sm90 warp-specialized kernels that hands out only the output tiles touching
// the lower triangle, and the kernel types built around it (TMA loads, wgmma, TMA epilogue).
//
// Tiles are handed out at cluster granularity. A cluster tile is CM*BM rows by BN columns
// (CM CTAs stacked along M share each B tile through TMA multicast); with q = CM*BM/BN, cluster
// row I needs the column tiles j < q(I+1), the last row clipped to the matrix. Tiles beyond
// the diagonal that a cluster tile drags in are computed and later overwritten by the mirror.
// Linear order: batch-major, then row by row; CTAs stride over it (a static persistent grid).
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace distmuon::cuda::sm90 {

struct LowerTriangleTag {};

class LowerTriangleScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using Arguments = typename Base::Arguments;
  using RasterOrderOptions = typename Base::RasterOrderOptions;
  static constexpr bool IsDynamicPersistent = false;

  struct Params : Base::Params {
    uint64_t tiles_per_batch = 0;  // cluster tiles of one product
    uint64_t total = 0;            // over the batch
    uint64_t full_rows = 0;        // cluster tiles in every row but the last: q * T(rows - 1)
    int32_t rows = 0;              // cluster rows
    int32_t q = 1;
    int32_t cluster_m = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster, cutlass::KernelHardwareInfo const& hw,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Arguments a = args;
    a.raster_order = RasterOrderOptions::AlongN;
    a.max_swizzle_size = 1;
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(
        problem, tile, cluster, hw, a, workspace, epilogue_subtile, ktile_start_alignment_count);
    const int bm = cute::size<0>(tile), bn = cute::size<1>(tile), cm = cute::size<0>(cluster);
    static_assert(cute::size<1>(ClusterShape{}) == 1, "clusters stack along M only");
    const int64_t m = cute::get<0>(problem);
    const int64_t batches = cute::get<3>(problem);
    p.cluster_m = cm;
    p.q = cm * bm / bn;
    p.rows = static_cast<int32_t>((m + int64_t(cm) * bm - 1) / (int64_t(cm) * bm));
    const int64_t tiles_n = (m + bn - 1) / bn;
    p.full_rows = static_cast<uint64_t>(p.q) * p.rows * (p.rows - 1) / 2;
    const int64_t last = std::min<int64_t>(int64_t(p.q) * p.rows, tiles_n);
    p.tiles_per_batch = p.full_rows + static_cast<uint64_t>(last);
    p.total = p.tiles_per_batch * static_cast<uint64_t>(batches);
    return p;
  }

  template <class ProblemShape, class TileShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShape, TileShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw_info, Arguments = Arguments{}) {
    uint64_t clusters = static_cast<uint64_t>(std::max(1, hw_info.sm_count / params.cluster_m));
    clusters = std::min<uint64_t>(clusters, std::max<uint64_t>(1, params.total));
    return dim3(params.cluster_m, static_cast<uint32_t>(clusters), 1);
  }

  CUTLASS_HOST_DEVICE LowerTriangleScheduler() {}

  CUTLASS_DEVICE explicit LowerTriangleScheduler(Params const& p) : Base(p), tri_(p) {
#if defined(__CUDA_ARCH__)
    linear_ = blockIdx.y;
    grid_ = gridDim.y;
#endif
  }

  CUTLASS_DEVICE WorkTileInfo work_for(uint64_t idx) const {
    if (idx >= tri_.total) return WorkTileInfo::invalid_work_tile();
    const uint64_t l = idx / tri_.tiles_per_batch;
    const uint64_t r = idx - l * tri_.tiles_per_batch;
    const uint64_t q = static_cast<uint64_t>(tri_.q);
    uint64_t row, col;
    if (r < tri_.full_rows) {
      // r = q * I(I+1)/2 + j with j < q(I+1).
      uint64_t i = static_cast<uint64_t>((sqrt(8.0 * static_cast<double>(r / q) + 1.0) - 1.0) * 0.5);
      while (i > 0 && q * i * (i + 1) / 2 > r) --i;
      while (q * (i + 1) * (i + 2) / 2 <= r) ++i;
      row = i;
      col = r - q * i * (i + 1) / 2;
    } else {
      row = static_cast<uint64_t>(tri_.rows - 1);
      col = r - tri_.full_rows;
    }
    auto [cta_m, cta_n, cta_l] = cute::block_id_in_cluster();
    (void)cta_n;
    (void)cta_l;
    return {static_cast<int32_t>(row * tri_.cluster_m + cta_m), static_cast<int32_t>(col),
            static_cast<int32_t>(l), true};
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_for(linear_); }
  CUTLASS_DEVICE WorkTileInfo get_current_work_for_linear_idx(uint64_t idx) const {
    return work_for(idx);
  }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    linear_ += grid_ * static_cast<uint64_t>(advance_count);
  }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return !work_for(linear_ + grid_ * static_cast<uint64_t>(advance_count)).is_valid();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, Pipeline&, PipelineState) {
    return fetch_next_work(w);
  }

 private:
  Params tri_;
  uint64_t linear_ = 0;
  uint64_t grid_ = 1;
};

// D = alpha * A B^T + beta * C, A and B row-major m x k (k contiguous), C and D row-major.
// PingPong: two consumer warpgroups alternate on whole tiles (else they split one tile).
template <typename Element, class TileShape, class ClusterShape, bool PingPong = false>
struct SymGemm {
  using MainloopSchedule = std::conditional_t<PingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<PingPong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;  // B as k x n column-major = n x k row-major
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC, kAlign,
      Element, LayoutC, kAlign, EpilogueSchedule>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue,
                                                      LowerTriangleTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace distmuon::cuda::sm90

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<distmuon::cuda::sm90::LowerTriangleTag, ArchTag, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = distmuon::cuda::sm90::LowerTriangleScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
