// The autotuner's JSON cache: choices per (shape, batch size, dtype), stored under a key made of
// the GPU's name, the driver, the CUDA runtime and cuBLASLt versions, so that a cache written
// on one machine or library version is never applied to another. File: DISTMUON_TUNE_CACHE,
// else $XDG_CACHE_HOME/distmuon/tune.json, else ~/.cache/distmuon/tune.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/cuda_backend.h"
#include "distmuon/types.h"

namespace distmuon::cuda {

struct TuneKey {
  // The tuner's candidate set: measurements of an older set are not reused (they never timed
  // the candidates added since). 2: dense ns5 joined ns5-sym and gram-ns.
  static constexpr int kTunerVersion = 2;
  std::string gpu;
  int driver = 0, runtime = 0;
  size_t cublaslt = 0;
  std::string str() const;  // "NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100|tuner 2"
  static TuneKey current(const std::string& gpu_name);
};

// Symmetric-product kernel for count products m x m with inner size k.
struct SymChoice {
  int64_t m = 0, k = 0, count = 0;
  DType dtype = DType::kBF16;
  SymKernel kernel = SymKernel::kDenseMirror;
  double ms = 0;            // measured time of the chosen kernel
  double dense_ms = 0;      // measured dense cuBLASLt product + mirror
};

// One measured candidate of an algorithm choice.
struct AlgoCandidate {
  std::string algorithm;      // parse_algorithm() spec, e.g. "gram-ns" or "ns5-sym"
  std::vector<int> restarts;  // Gram NS restart set
  DType work_dtype = DType::kBF16;
  double ms = 0;
  double rel_err = 0;         // against the fp32 dense iteration on the same input
  bool accepted = false;      // passed the numerical check
};

// Orthogonalization algorithm for a class of count matrices rows x cols: the fastest accepted
// candidate (algorithm ... rel_err) and every candidate measured, so that a caller with a
// narrower policy (restart sets) can pick among them without measuring again.
struct AlgoChoice {
  int64_t rows = 0, cols = 0, count = 0;
  std::string algorithm;
  std::vector<int> restarts;
  DType work_dtype = DType::kBF16;
  double ms = 0;
  double rel_err = 0;
  std::string schedule = "jordan:5";  // coefficients and steps the candidates ran with
  std::vector<AlgoCandidate> candidates;  // entries written before they existed: the choice alone
};

std::string tune_cache_path();
std::vector<SymChoice> load_sym_choices(const TuneKey& key);
std::vector<AlgoChoice> load_algo_choices(const TuneKey& key);
// Merges the entries into the file (same shape replaces the old entry).
void save_choices(const TuneKey& key, const std::vector<SymChoice>& sym,
                  const std::vector<AlgoChoice>& algo);

}  // namespace distmuon::cuda
