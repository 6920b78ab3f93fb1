// The autotuner's cache and the shape heuristics: pure host code, runs without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "backend/cuda/launch/sym_gemm.h"
#include "backend/cuda/tune/autotune.h"
#include "backend/cuda/tune/tune_cache.h"

namespace distmuon::cuda {
namespace {

TEST(CudaTune, CacheRoundTripKeyedByDeviceAndVersions) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("dm_tune_" + std::to_string(::getpid()) + ".json")).string();
  setenv("DISTMUON_TUNE_CACHE", path.c_str(), 1);
  TuneKey a{"NVIDIA H200", 13000, 13000, 130100}, b{"NVIDIA H100", 13000, 13000, 130100};
  SymChoice s{3584, 18944, 16, DType::kF16, SymKernel::kTri256x128, 5.7, 10.8};
  AlgoChoice g{18944, 3584, 16, "gram-ns", {}, DType::kF16, 44.6, 3.2e-3, "jordan:5", {}};
  save_choices(a, {s}, {g});
  s.kernel = SymKernel::kTri128Pingpong;  // a second save replaces the entry of the same shape
  save_choices(a, {s}, {});
  auto sym = load_sym_choices(a);
  auto algo = load_algo_choices(a);
  ASSERT_EQ(sym.size(), 1u);
  EXPECT_EQ(sym[0].kernel, SymKernel::kTri128Pingpong);
  EXPECT_EQ(sym[0].m, 3584);
  EXPECT_EQ(sym[0].dtype, DType::kF16);
  ASSERT_EQ(algo.size(), 1u);
  EXPECT_EQ(algo[0].algorithm, "gram-ns");
  EXPECT_TRUE(algo[0].restarts.empty());
  ASSERT_EQ(algo[0].candidates.size(), 1u);  // an entry without candidates stands for itself
  EXPECT_TRUE(algo[0].candidates[0].accepted);
  g.candidates = {{"gram-ns", {2}, DType::kF16, 50.1, 2e-3, true},
                  {"gram-ns", {}, DType::kF16, 44.6, 3.2e-3, true}};
  save_choices(a, {}, {g});
  algo = load_algo_choices(a);
  ASSERT_EQ(algo.size(), 1u);
  ASSERT_EQ(algo[0].candidates.size(), 2u);
  EXPECT_EQ(algo[0].candidates[0].restarts, std::vector<int>{2});
  EXPECT_EQ(algo[0].schedule, "jordan:5");
  EXPECT_TRUE(load_sym_choices(b).empty()) << "another GPU must not see these choices";
  std::filesystem::remove(path);
  unsetenv("DISTMUON_TUNE_CACHE");
}

// The engine's `auto` takes the fastest accepted candidate whose Gram-NS restart set contains 2,
// unless restart-free Gram NS is allowed explicitly.
TEST(CudaTune, SelectionKeepsRestartTwoUnlessAllowed) {
  AlgoChoice c;
  c.rows = 18944;
  c.cols = 3584;
  c.count = 24;
  c.candidates = {{"ns5-sym", {}, DType::kBF16, 60.0, 1.1e-2, true},
                  {"gram-ns", {2}, DType::kF16, 50.0, 2.0e-3, true},
                  {"gram-ns", {}, DType::kF16, 44.0, 3.2e-3, true}};
  EXPECT_EQ(select_candidate(c, false)->ms, 50.0);
  EXPECT_EQ(select_candidate(c, true)->ms, 44.0);
  c.candidates[1].accepted = false;  // failed its check: standard NS is next
  EXPECT_EQ(select_candidate(c, false)->algorithm, "ns5-sym");
  c.candidates[0].accepted = false;
  EXPECT_EQ(select_candidate(c, false), nullptr);
  c.candidates = {{"gram-ns", {2, 4}, DType::kF16, 55.0, 2.0e-3, true}};
  EXPECT_EQ(select_candidate(c, false)->ms, 55.0);
  // Lookup: either orientation, same schedule, nearest batch size.
  AlgoChoice d = c;
  d.count = 8;
  std::vector<AlgoChoice> all = {c, d};
  EXPECT_EQ(find_choice(all, 3584, 18944, 10, "jordan:5")->count, 8);
  EXPECT_EQ(find_choice(all, 3584, 18944, 20, "jordan:5")->count, 24);
  EXPECT_EQ(find_choice(all, 3584, 18944, 20, "you:5"), nullptr);
  EXPECT_EQ(find_choice(all, 3584, 14336, 24, "jordan:5"), nullptr);
}

// Dense ns5 is a candidate: where it is the fastest accepted one (small, launch-bound shapes),
// `auto` runs it, as the dense iteration; and measurements of the older candidate set, stored
// under a key without the tuner's version, are not reused.
TEST(CudaTune, DenseNs5IsACandidateAndOlderSetsAreNotReused) {
  AlgoChoice c;
  c.rows = 512;
  c.cols = 4608;
  c.count = 3;
  c.candidates = {{"ns5", {}, DType::kBF16, 0.050, 4.0e-3, true},
                  {"ns5-sym", {}, DType::kBF16, 0.061, 4.0e-3, true},
                  {"gram-ns", {2}, DType::kF16, 0.083, 2.0e-3, true},
                  {"gram-ns", {}, DType::kF16, 0.079, 3.2e-3, true}};
  const AlgoCandidate* pick = select_candidate(c, false);
  ASSERT_NE(pick, nullptr);
  EXPECT_EQ(pick->algorithm, "ns5");
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  EXPECT_EQ(config_of(*pick, base).iteration, Iteration::kStandardDense);
  EXPECT_EQ(config_of(*pick, base).steps, 5);

  const TuneKey now{"NVIDIA H200", 13000, 13000, 130100};
  EXPECT_NE(now.str().find("|tuner " + std::to_string(TuneKey::kTunerVersion)), std::string::npos);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("dm_tune_old_" + std::to_string(::getpid()) + ".json"))
                               .string();
  {  // what the previous tuner wrote: the same device and versions, no tuner field
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(R"({"NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100": {"algo": [)"
               R"({"rows": 512, "cols": 4608, "count": 3, "algorithm": "ns5-sym", "restarts": [],)"
               R"( "work_dtype": "bf16", "ms": 0.061, "rel_err": 0.004, "schedule": "jordan:5"}]}})",
               f);
    std::fclose(f);
  }
  setenv("DISTMUON_TUNE_CACHE", path.c_str(), 1);
  EXPECT_TRUE(load_algo_choices(now).empty()) << "an older tuner's choice was reused";
  std::filesystem::remove(path);
  unsetenv("DISTMUON_TUNE_CACHE");
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
