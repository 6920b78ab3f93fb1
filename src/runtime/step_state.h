// What a step records and knows: the device counters and statuses every step path writes
// (StepRecord), and the inputs of one step (StepContext).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "distmuon/engine_types.h"
#include "runtime/dist_state.h"
#include "runtime/registry.h"

namespace distmuon {

// What one step knows beyond the registry.
struct StepContext {
  std::vector<ParamData> data;       // a copy: deferred stages outlive the caller's array
  std::vector<char> active;          // per parameter: stepped on every rank in this step
  std::vector<char> has_local;       // per parameter: this rank passed a gradient
  // Distributed: pass 3's coefficients per Muon matrix (index into Impl::mats), backend memory.
  const MuonUpdateCoef* coef = nullptr;
  bool raise = false;                // NonFinitePolicy::kRaise
};

// A step's hyperparameters in backend memory, where the fused passes read them (so that a
// replayed step, or a scheduler's new learning rate, needs no new launch): the momentum of every
// group, pass 3's coefficients of every Muon matrix and AdamW's of every AdamW parameter.
// Filled on the host, then uploaded at once (Backend::upload_small) before anything reads them.
struct StepScalars {
  void allocate(Backend& backend, int64_t groups, int64_t matrices, int64_t adam_params);
  // The host copy, written field by field, then uploaded whole.
  void set_mu(int group, float mu) { put(mu_at + group * sizeof(float), mu); }
  void set_coef(int64_t j, const MuonUpdateCoef& c) { put(coef_at + j * sizeof(c), c); }
  void set_adam(int64_t k, const AdamCoef& c) { put(k * sizeof(c), c); }
  void upload(Backend& backend) { backend.upload_small(device.data(), host.data(), host.size()); }
  // Where the passes read them.
  const float* mu(int group) const { return device.as<float>() + mu_at / sizeof(float) + group; }
  const MuonUpdateCoef* coef(int64_t j = 0) const {
    return reinterpret_cast<const MuonUpdateCoef*>(device.as<char>() + coef_at) + j;
  }
  const AdamCoef* adam(int64_t k) const { return device.as<AdamCoef>() + k; }

 private:
  template <typename T>
  void put(size_t at, const T& v) {
    std::memcpy(host.data() + at, &v, sizeof(T));
  }
  Buffer device;
  std::vector<char> host;  // the same layout: AdamW's, then the Muon coefficients, then mu
  size_t coef_at = 0, mu_at = 0;
};

struct StepRecord {
  StepScalars scalars;
  Buffer skip_counter;  // int64 on the device: matrices and tensors skipped, all steps
  // AdamW step counts on the device, one int64 per parameter (only AdamW entries are used):
  // adamw_update reads and advances them, so a replayed CUDA graph keeps counting. Until it is
  // allocated (the first step or setup) Param::step holds the count.
  Buffer step_counts;
  int64_t* step_count(int i) { return step_counts.as<int64_t>() + i; }
  // Muon: per matrix (Param::first_matrix + slice; distributed: its index in DistState::mats),
  // the steps pass 2 skipped it, counted on the device where its momentum is kept (its owner;
  // the rank of a single process; every holder of its rows in gather mode). A Muon parameter's
  // step count is Param::step minus the most skips of its matrices.
  Buffer matrix_skips;
  int64_t* skips_of(const Param& p, int64_t slice) {
    return matrix_skips.as<int64_t>() + p.first_matrix + slice;
  }
  // This step's statuses (int32: kStatusOk or why the entry is skipped) and pass 1's momentum
  // norms (double): one entry per Muon matrix (single process: class by class; distributed:
  // bucket by bucket), then one per AdamW parameter, in registration order.
  int64_t n_status = 0;
  Buffer step_status, step_norms;
  std::vector<int> adam_params;  // AdamW parameters in registration order
  int32_t* adam_status() { return step_status.as<int32_t>() + (n_status - adam_params.size()); }

  // Once n_status and adam_params are known: the statuses and norms, the scalars (`matrices`
  // coefficient slots), the step counts (from Param::step) and zeroed Muon skip counters.
  void allocate(Backend& backend, const Registry& registry, int64_t matrices,
                int64_t muon_matrices);
  // The step's hyperparameters from the groups' current options (before every step and every
  // dedicated prepare()): per group, per Muon matrix (distributed: per DistState::mats entry),
  // per AdamW parameter.
  void upload_scalars(Backend& backend, const Registry& registry, const DistState& dist);
  // The skips of every parameter's most-skipped matrix as this rank counted them (synchronises).
  std::vector<int64_t> skips_per_param(Backend& backend, const Registry& registry,
                                       int64_t muon_matrices) const;
  // Raise policy: fails, naming every entry that is not ok on some rank (world: all of them),
  // before anything changes. muon_names: per Muon status entry, the matrix it belongs to this
  // step ("" when none).
  void raise_if_nonfinite(Backend& backend, const Registry& registry, Communicator* world,
                          const std::vector<std::string>& muon_names) const;
};

}  // namespace distmuon
