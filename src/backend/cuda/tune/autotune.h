// The autotuner: per (shape, batch size, dtype) it measures the candidates on the device and
// keeps the fastest one that passes a numerical check, printing progress to stderr.
//  - Symmetric products: each CUTLASS lower-triangle variant against the dense cuBLASLt product
//    + mirror. A variant is accepted only if its output equals the dense product within 1e-2
//    relative Frobenius error, is exactly symmetric and has no NaN.
//  - Orthogonalization: ns5-sym (bf16) against Gram NS (fp16) with restart sets {2} and {},
//    accepted only within `tolerance` relative Frobenius error of the fp32 dense iteration on
//    the same input (the float64 reference is too slow for 3584 x 18944 on the host; fp32 sits
//    ~1e-5 from it).
// Results go to the tune cache (tune_cache.h) and into the backend's per-shape choices.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/tune/tune_cache.h"
#include "distmuon/cuda_backend.h"
#include "distmuon/ortho.h"

namespace distmuon::cuda {

struct TuneOptions {
  int repeats = 10;          // timed repetitions per candidate (median)
  double tolerance = 2e-2;   // orthogonalization acceptance threshold
  int check_matrices = 2;    // matrices of the batch checked against the fp32 reference
  bool verbose = true;
};

SymChoice tune_sym(CudaBackend& be, int64_t m, int64_t k, int64_t count, DType dtype,
                   const TuneOptions& opt);

// `base` gives the coefficients and step count; rows x cols in any orientation.
AlgoChoice tune_algorithm(CudaBackend& be, int64_t rows, int64_t cols, int64_t count,
                          const OrthoConfig& base, const TuneOptions& opt);

// The OrthoConfig an AlgoChoice (or one of its candidates) stands for.
OrthoConfig config_of(const AlgoChoice& c, const OrthoConfig& base);
OrthoConfig config_of(const AlgoCandidate& c, const OrthoConfig& base);

// "jordan:5": the coefficients and step count a choice was measured with (AlgoChoice::schedule).
std::string schedule_name(const OrthoConfig& base);

// Pure selection rules of the engine's `auto` (host code, unit-tested without a GPU):
// The fastest accepted candidate whose Gram-NS restart set contains 2 (standard NS has none to
// check); with allow_restart_free any accepted one. nullptr when none qualifies.
const AlgoCandidate* select_candidate(const AlgoChoice& c, bool allow_restart_free);
// The stored choice for count wide m x n matrices measured with `schedule`: same sides in either
// orientation, the nearest batch size (the exact one when stored). nullptr when none.
const AlgoChoice* find_choice(const std::vector<AlgoChoice>& all, int64_t m, int64_t n,
                              int64_t count, const std::string& schedule);

// Median time in ms of `repeats` runs of f on the backend's stream (device events).
template <typename F>
double time_ms(CudaBackend& be, int repeats, F&& f);

}  // namespace distmuon::cuda

#include "backend/cuda/cuda_handles.h"

namespace distmuon::cuda {
double median_of(std::vector<double> v);

template <typename F>
double time_ms(CudaBackend& be, int repeats, F&& f) {
  f();  // warm-up: plans, kernel attributes
  std::vector<double> t;
  Event e0 = make_event(), e1 = make_event();
  for (int i = 0; i < repeats; ++i) {
    DM_CHECK_CUDA(cudaEventRecord(e0.get(), be.stream()));
    f();
    DM_CHECK_CUDA(cudaEventRecord(e1.get(), be.stream()));
    DM_CHECK_CUDA(cudaEventSynchronize(e1.get()));
    float ms = 0;
    DM_CHECK_CUDA(cudaEventElapsedTime(&ms, e0.get(), e1.get()));
    t.push_back(ms);
  }
  return median_of(t);
}
}  // namespace distmuon::cuda
