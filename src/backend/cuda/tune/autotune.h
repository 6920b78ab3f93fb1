// The CUDA backend's kernel-variant tuning: per symmetric product (m x m outputs, inner size k,
// batch size, dtype) each CUTLASS lower-triangle variant is measured against the dense
// cuBLASLt product + mirror, and the fastest that passes a numerical check is kept. A variant
// is accepted only if its output equals the dense product within 1e-2 relative Frobenius
// error, is exactly symmetric and has no NaN. Which algorithm runs `auto` is not decided here:
// that is the measurement layer's tuner (src/measure/tuner.h), which also keeps these choices
// in its store (CudaBackend::kernel_choices_json).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/cuda_backend.h"

namespace distmuon::cuda {

// Symmetric-product kernel for count products m x m with inner size k.
struct SymChoice {
  int64_t m = 0, k = 0, count = 0;
  DType dtype = DType::kBF16;
  SymKernel kernel = SymKernel::kDenseMirror;
  double ms = 0;        // measured time of the chosen kernel (0: not measured here)
  double dense_ms = 0;  // measured dense cuBLASLt product + mirror
};

struct TuneOptions {
  int repeats = 10;  // timed repetitions per variant (median)
  bool verbose = true;
};

// Measures the variants of one product, records the choice in the backend (set_sym_choice) and
// returns it.
SymChoice tune_sym(CudaBackend& be, int64_t m, int64_t k, int64_t count, DType dtype,
                   const TuneOptions& opt);

// "NVIDIA H200|driver 13000|runtime 13000|cublasLt 130100": what a kernel's speed depends on.
std::string tuning_fingerprint(const std::string& gpu_name);

double median_of(std::vector<double> v);

// Median time in ms of `repeats` runs of f on the backend's stream (device events), after one
// warm-up run (plans, kernel attributes).
template <typename F>
double time_ms(CudaBackend& be, int repeats, F&& f) {
  f();
  return be.time_ms(repeats, {}, f);
}

}  // namespace distmuon::cuda
