// Device side of the lower-triangle symmetric product on Hopper: a persistent tile scheduler
// for CUTLASS's sm90 warp-specialized kernels that hands out only the output tiles touching
// the lower triangle (or, for masked dense products, every tile), optionally only for the
// matrices of the batch that a per-matrix flag in device memory selects, and the kernel types
// built around it (TMA loads, wgmma, TMA epilogue).
//
// Tiles are handed out at cluster granularity. A cluster tile is CM*BM rows by BN columns
// (CM CTAs stacked along M share each B tile through TMA multicast); with q = CM*BM/BN, cluster
// row I needs the column tiles j < q(I+1), the last row clipped to the matrix. Tiles beyond
// the diagonal that a cluster tile drags in are computed and later overwritten by the mirror.
// Linear order: batch-major, then row by row; CTAs stride over it (a static persistent grid).
// Dense products may instead go column by column (`column_order`): the CTAs in flight then share
// B's column tiles and sweep A, which stays in L2 where A is the smaller operand (Q X with Q
// m x m and X m x n, n >> m: row by row streams all of X from memory once per row of tiles).
//
// Masking: every thread counts the selected matrices once (flags are written by an earlier
// kernel in stream order) and the linear order runs over the selected matrices only, so the
// work of unselected ones is never scheduled and the remaining tiles stay evenly spread over
// the persistent CTAs. A CTA left without tiles falls through CUTLASS's loops and exits.
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

// The scheduler's arguments (outside the class: default member initializers of a nested class
// are not usable in the enclosing class's default arguments).
struct TileArguments : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::Arguments {
  bool lower = true;               // lower-triangle tiles only; false: every tile (dense)
  const int32_t* flags = nullptr;  // per matrix: computed only when flags[l] == flag_value
  int32_t flag_value = 1;
  bool column_order = false;       // dense only: tiles column by column instead of row by row
};

class LowerTriangleScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrderOptions = typename Base::RasterOrderOptions;
  static constexpr bool IsDynamicPersistent = false;

  using Arguments = TileArguments;

  struct Params : Base::Params {
    uint64_t tiles_per_batch = 0;  // cluster tiles of one product
    uint64_t total = 0;            // over the batch
    uint64_t full_rows = 0;        // cluster tiles in every row but the last: q * T(rows - 1)
    uint64_t tiles_n = 0;          // dense: column tiles per row
    int32_t rows = 0;              // cluster rows
    int32_t q = 1;
    int32_t cluster_m = 1;
    int32_t lower = 1;
    int32_t column_order = 0;
    const int32_t* flags = nullptr;
    int32_t flag_value = 1;
    int32_t batches = 0;
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
    p.lower = args.lower ? 1 : 0;
    p.column_order = !args.lower && args.column_order ? 1 : 0;
    if (!args.lower) {
      p.tiles_n = static_cast<uint64_t>((cute::get<1>(problem) + bn - 1) / bn);
      p.tiles_per_batch = p.tiles_n * static_cast<uint64_t>(p.rows);
    }
    p.total = p.tiles_per_batch * static_cast<uint64_t>(batches);
    p.flags = args.flags;
    p.flag_value = args.flag_value;
    p.batches = static_cast<int32_t>(batches);
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
    total_ = p.total;
    if (p.flags) {
      uint64_t active = 0;
      for (int32_t l = 0; l < p.batches; ++l) active += p.flags[l] == p.flag_value ? 1 : 0;
      total_ = active * p.tiles_per_batch;
    }
  }

  // The matrix of the rank-th selected one. The linear index only grows inside a CTA, so the
  // search resumes from the last answer (a lookahead may step back once: restart then).
  CUTLASS_DEVICE int32_t selected(uint64_t rank) const {
    if (cursor_l_ < 0 || rank < cursor_rank_) {
      cursor_l_ = 0;
      cursor_rank_ = 0;
      while (tri_.flags[cursor_l_] != tri_.flag_value) ++cursor_l_;
    }
    while (cursor_rank_ < rank) {
      ++cursor_l_;
      while (tri_.flags[cursor_l_] != tri_.flag_value) ++cursor_l_;
      ++cursor_rank_;
    }
    return cursor_l_;
  }

  CUTLASS_DEVICE WorkTileInfo work_for(uint64_t idx) const {
    if (idx >= total_) return WorkTileInfo::invalid_work_tile();
    const uint64_t rank = idx / tri_.tiles_per_batch;
    const uint64_t r = idx - rank * tri_.tiles_per_batch;
    const uint64_t l = tri_.flags ? static_cast<uint64_t>(selected(rank)) : rank;
    const uint64_t q = static_cast<uint64_t>(tri_.q);
    uint64_t row, col;
    if (!tri_.lower && tri_.column_order) {
      const uint64_t rows = static_cast<uint64_t>(tri_.rows);
      col = r / rows;
      row = r - col * rows;
    } else if (!tri_.lower) {
      row = r / tri_.tiles_n;
      col = r - row * tri_.tiles_n;
    } else if (r < tri_.full_rows) {
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
  uint64_t total_ = 0;  // tiles of the selected matrices
  mutable int32_t cursor_l_ = -1;
  mutable uint64_t cursor_rank_ = 0;
};

// ---- The mirror in the epilogue ------------------------------------------------------------
// A symmetric product computes the tiles of its lower triangle; the upper one must become their
// transpose, bit for bit. The epilogue stores each tile a second time through a column-major view
// of D (element (r, c) of the tile to D[c][r]): CUTLASS's auxiliary TMA store with an M-major
// layout, of the very values D gets (converted once). Only tiles that lie wholly left of their
// diagonal block do so. The diagonal blocks (a cluster tile's CM x BM rows, computed whole by
// the scheduler above, tiles right of the diagonal included) stay with the mirror kernel, which
// runs after the product: within the product no two stores meet, the transposed tiles landing
// strictly above the diagonal blocks, where the scheduler computes nothing. A null pointer turns
// the store off.

template <int ClusterM, class AuxStore>
struct MirrorStore : AuxStore {
  using AuxStore::AuxStore;

  template <class Callbacks>
  struct Guarded : Callbacks {
    bool active;
    CUTLASS_DEVICE Guarded(Callbacks&& c, bool a) : Callbacks(static_cast<Callbacks&&>(c)), active(a) {}
    CUTLASS_DEVICE void postreduce(int epi_m, int epi_n, int store_iteration, bool issue_smem_store) {
      Callbacks::postreduce(epi_m, epi_n, store_iteration, issue_smem_store && active);
    }
    CUTLASS_DEVICE void tma_store(int epi_m, int epi_n, int store_iteration, bool issue_tma_store) {
      Callbacks::tma_store(epi_m, epi_n, store_iteration, issue_tma_store && active);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto cb = AuxStore::template get_consumer_store_callbacks<ReferenceSrc>(args);
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int64_t bm = cute::size<0>(args.tile_shape_mnk), bn = cute::size<1>(args.tile_shape_mnk);
    // Columns [n bn, (n+1) bn) end before the first row of this tile's cluster-row block.
    const bool left_of_block = (int64_t(n) + 1) * bn <= int64_t(m) / ClusterM * ClusterM * bm;
    return Guarded<decltype(cb)>(static_cast<decltype(cb)&&>(cb), left_of_block);
  }
};

// D = alpha * acc + beta * C, also stored transposed where MirrorStore says (a FusionOperation,
// so that CUTLASS's builder picks the auxiliary store's shared-memory layout and copy).
template <class Element, int ClusterM>
struct MirroredLinearCombination
    : cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float> {
  using ElementAux = Element;
  using GmemLayoutTagAux = cutlass::layout::ColumnMajor;
  static constexpr int AlignmentAux = 128 / cutlass::sizeof_bits_v<Element>;  // 16 bytes, as D
  static constexpr bool IsAuxOutSupported = true;
};

// The callbacks tree of MirroredLinearCombination: the linear combination, then MirrorStore over
// CUTLASS's auxiliary store (which passes the values on unchanged to D's store).
template <class Element, int ClusterM, int Stages, class EpilogueTile, class SmemLayoutAtom,
          class CopyOpR2S>
using MirroredLinearCombinationTree = cutlass::epilogue::fusion::Sm90EVT<
    MirrorStore<ClusterM,
                cutlass::epilogue::fusion::Sm90AuxStore<
                    Stages, EpilogueTile, Element, cutlass::FloatRoundStyle::round_to_nearest,
                    cutlass::gemm::TagToStrideC_t<cutlass::layout::ColumnMajor>, SmemLayoutAtom,
                    CopyOpR2S, MirroredLinearCombination<Element, ClusterM>::AlignmentAux>>,
    cutlass::epilogue::fusion::Sm90LinearCombination<Element, float, Element, float>>;

// D = alpha * A B^T + beta * C, A and B row-major m x k (k contiguous), C and D row-major.
// PingPong: two consumer warpgroups alternate on whole tiles (else they split one tile).
// LayoutB_ = RowMajor instead gives D = alpha * A B + beta * C with B row-major k x n (the
// masked dense products Q X of CacheMuon). Mirror: the epilogue can also store the transpose
// (symmetric products; off when the arguments give it no pointer).
template <typename Element, class TileShape, class ClusterShape, bool PingPong = false,
          class LayoutB_ = cutlass::layout::ColumnMajor, bool Mirror = false>
struct SymGemm {
  using MainloopSchedule = std::conditional_t<PingPong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<PingPong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = LayoutB_;  // ColumnMajor: B as k x n column-major = n x k row-major
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes

  static_assert(!Mirror || (cute::size<0>(ClusterShape{}) * cute::size<0>(TileShape{})) %
                               cute::size<1>(TileShape{}) ==
                           0,
                "the epilogue mirror needs diagonal blocks of whole column tiles");
  using FusionOp = std::conditional_t<
      Mirror, MirroredLinearCombination<Element, cute::size<0>(ClusterShape{})>,
      cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC, kAlign,
      Element, LayoutC, kAlign, EpilogueSchedule, FusionOp>::CollectiveOp;

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

namespace cutlass::epilogue::fusion {
// The callbacks of MirroredLinearCombination (MirroredLinearCombinationTree) and its arguments.
template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore,
          class Element, int ClusterM, class CtaTileShapeMNK, class EpilogueTile,
          class SmemLayoutAtom, class CopyOpR2S>
struct FusionCallbacks<
    epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
    distmuon::cuda::sm90::MirroredLinearCombination<Element, ClusterM>, CtaTileShapeMNK,
    EpilogueTile, SmemLayoutAtom, CopyOpR2S>
    : distmuon::cuda::sm90::MirroredLinearCombinationTree<Element, ClusterM, StagesD, EpilogueTile,
                                                          SmemLayoutAtom, CopyOpR2S> {
  using Impl = distmuon::cuda::sm90::MirroredLinearCombinationTree<Element, ClusterM, StagesD,
                                                                   EpilogueTile, SmemLayoutAtom,
                                                                   CopyOpR2S>;
  using Operation = distmuon::cuda::sm90::MirroredLinearCombination<Element, ClusterM>;
  using StrideMirror = gemm::TagToStrideC_t<layout::ColumnMajor>;

  struct Arguments {
    float alpha = 1.0f;
    float beta = 0.0f;
    Element* mirror = nullptr;  // D itself; null: no transposed store
    StrideMirror dMirror = {};  // (1, ld, batch stride): D read column-major

    operator typename Impl::Arguments() const {
      using ScalarStride = Stride<_0, _0, int64_t>;
      return {
          {                                                      // beta * C + alpha * acc
           {{beta}, {nullptr}, {ScalarStride{_0{}, _0{}, 0}}},  // beta
           {},                                                   // C
           {{{alpha}, {nullptr}, {ScalarStride{_0{}, _0{}, 0}}}, {}, {}},  // alpha * acc
           {}},
          {mirror, dMirror}};  // the transposed store
    }
  };

  using Impl::Impl;
};
}  // namespace cutlass::epilogue::fusion

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<distmuon::cuda::sm90::LowerTriangleTag, ArchTag, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = distmuon::cuda::sm90::LowerTriangleScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
