// The CUDA backend's kernel-variant tuning: the kernel choices' JSON (on a GPU) and the shape
// heuristics (pure host code, runs without a GPU).
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/launch/sym_gemm.h"
#include "backend/cuda/tune/autotune.h"
#include "distmuon/error.h"

namespace distmuon::cuda {
namespace {

// The kernel choices travel through the measurement store as JSON: what one backend measured, a
// fresh backend (the next run) resolves the same way; a bad entry changes nothing. The store
// itself and the algorithm tuner are tested on the CPU (test_measure.cc).
TEST(CudaTune, KernelChoicesRoundTripThroughJson) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  CudaBackend a;
  EXPECT_NE(a.tuning_fingerprint().find(a.device_name() + "|driver "), std::string::npos);
  EXPECT_NE(a.tuning_fingerprint().find("|cublasLt "), std::string::npos);
  a.set_sym_choice(3584, 18944, 16, DType::kF16, SymKernel::kTri256x128, 5.7, 10.8);
  a.set_sym_choice(512, 4608, 3, DType::kBF16, SymKernel::kDenseMirror);
  CudaBackend b;
  b.load_kernel_choices_json(a.kernel_choices_json());
  EXPECT_EQ(b.kernel_choices_json(), a.kernel_choices_json());
  EXPECT_EQ(b.resolve_sym_kernel(3584, 18944, 16, DType::kF16),
            a.resolve_sym_kernel(3584, 18944, 16, DType::kF16));
  const std::string before = b.kernel_choices_json();
  EXPECT_THROW(b.load_kernel_choices_json(R"([{"m": 64, "k": 64, "count": 1, "dtype": "f16",)"
                                          R"( "kernel": "tri128"}, {"m": 1}])"),
               Error);
  EXPECT_EQ(b.kernel_choices_json(), before) << "a bad list was half applied";
  double runs = 0;
  EXPECT_GE(b.time_ms(3, {}, [&] { runs += 1; }), 0.0);
  EXPECT_EQ(runs, 3);
}

// The capture epoch (what the engine keys its step graph by) moves on a real change of the
// workspace or of a kernel choice only: an engine set up beside another, loading the same stored
// choices, must not make the other capture again.
TEST(CudaTune, CaptureEpochMovesOnRealChangesOnly) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  CudaBackend a;
  a.set_sym_choice(512, 4608, 3, DType::kBF16, SymKernel::kDenseMirror);
  uint64_t e = a.capture_epoch();
  a.load_kernel_choices_json(a.kernel_choices_json());  // the same choices again
  a.set_sym_choice(512, 4608, 3, DType::kBF16, SymKernel::kDenseMirror, 0.5);  // a time only
  a.set_sym_kernel(a.sym_kernel());
  a.set_workspace(nullptr, 0);  // already the backend's own
  EXPECT_EQ(a.capture_epoch(), e);
  a.set_sym_choice(512, 4608, 3, DType::kBF16, SymKernel::kTri128);
  EXPECT_NE(a.capture_epoch(), e);
  e = a.capture_epoch();
  a.set_sym_kernel(SymKernel::kTri128Pingpong);
  EXPECT_NE(a.capture_epoch(), e);
  e = a.capture_epoch();
  Buffer mine = a.alloc(CudaBackend::recommended_workspace_bytes());
  a.set_workspace(mine.data(), mine.bytes());
  EXPECT_NE(a.capture_epoch(), e);
  e = a.capture_epoch();
  a.set_workspace(mine.data(), mine.bytes());
  EXPECT_EQ(a.capture_epoch(), e);
  a.set_workspace(nullptr, 0);  // before `mine` is released
  EXPECT_NE(a.capture_epoch(), e);
}

TEST(CudaTune, TriangleTileCounts) {
  // 4096 with 128x128 tiles: 32 rows of tiles, 528 in the lower triangle (4 waves of 132).
  EXPECT_EQ(sym_tiles(SymKernel::kTri128, 4096), 528);
  // 256x128 tiles: row I of 256 needs 2(I+1) column tiles: 272.
  EXPECT_EQ(sym_tiles(SymKernel::kTri256x128, 4096), 272);
  // 2x1 clusters of 128x128: the same 272 cluster tiles, two CTAs each.
  EXPECT_EQ(sym_tiles(SymKernel::kTri128Cluster2, 4096), 544);
  // A ragged size: the last row of cluster tiles is clipped to the matrix.
  EXPECT_EQ(sym_tiles(SymKernel::kTri256x128, 300), 2 * 1 + 3);
}

TEST(CudaTune, HeuristicFollowsTheMeasurements) {
  if (!sym_sm90_built()) GTEST_SKIP() << "built without CUTLASS";
  // Long k, many tiles: 256x128 (measured 5.4 ms vs 8.7 for 128x128 at 16 x 3584 x 18944).
  EXPECT_EQ(heuristic_sym_kernel(3584, 18944, 16, 132, true), SymKernel::kTri256x128);
  // 4096 x 16384 once: 128x128 tiles fill exactly 4 waves (256x128 would leave a 2.06th wave).
  const SymKernel k = heuristic_sym_kernel(4096, 16384, 1, 132, true);
  EXPECT_TRUE(k == SymKernel::kTri128 || k == SymKernel::kTri128Pingpong) << sym_kernel_name(k);
  EXPECT_EQ(heuristic_sym_kernel(4096, 16384, 1, 132, false), SymKernel::kDenseMirror);
}

}  // namespace
}  // namespace distmuon::cuda
