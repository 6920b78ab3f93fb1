// The synthetic model distmuon-bench steps: every tensor of a workload allocated on a backend,
// with random weights and gradients.
#pragma once

#include <random>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/engine.h"
#include "distmuon/workload.h"

namespace distmuon::bench {

// Fills backend buffers with scaled Gaussian values in any parameter dtype: windows of one pool
// of values at random offsets. Generating billions of fresh values on the host would dominate
// start-up on the large workloads.
class GaussianFiller {
 public:
  GaussianFiller(Backend& be, DType dtype, uint64_t seed, int64_t pool_size = int64_t{1} << 22);
  void fill(void* dst, int64_t numel, double scale);
  // The generator behind the offsets (and the pool's values): reseeding it replays the fills.
  std::mt19937_64& rng() { return rng_; }

 private:
  Backend& be_;
  DType dtype_;
  std::mt19937_64 rng_;
  std::vector<float> pool_;
};

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  bool muon = false;
  Buffer weight, grad;
  int64_t numel() const;
};

// Refuses, before anything is allocated, a model that cannot fit: on the CPU backend more
// weights, gradients and optimizer state than the machine's memory (the kernel would kill the
// process part-way instead of failing an allocation). Device backends fail their allocations.
void check_fits(const Backend& be, const Workload& w, DType param_dtype, bool include_adamw);

class BenchModel {
 public:
  // Allocates and fills every tensor of `w` (Muon entries first); with include_adamw false the
  // AdamW tensors are left out.
  BenchModel(Backend& be, const Workload& w, DType param_dtype, bool include_adamw, uint64_t seed);

  // Registers the tensors with an engine: group 0 Muon with `muon`, group 1 AdamW.
  void register_with(Engine& engine, const MuonOptions& muon, const AdamWOptions& adamw) const;
  std::vector<ParamData> step_data() const;
  // Replaces the gradients with fresh random values (same distribution).
  void refresh_gradients();
  // g <- g + eps * ||g||/sqrt(numel) * noise for every Muon gradient (a slowly drifting stream).
  void drift_gradients(double eps);
  // Refills every gradient from a generator seeded with `seed`, so that several runs in one
  // process see the same gradient stream (drift included).
  void restart_gradients(uint64_t seed);

  const std::vector<Tensor>& tensors() const { return tensors_; }
  int64_t muon_params() const;
  int64_t adamw_params() const;
  int64_t muon_matrices() const;
  DType dtype() const { return dtype_; }

 private:
  Backend& be_;
  DType dtype_;
  std::vector<Tensor> tensors_;
  GaussianFiller filler_;
};

}  // namespace distmuon::bench
