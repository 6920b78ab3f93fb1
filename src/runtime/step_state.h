// What a step records and knows: the device counters and statuses every step path writes
// (StepRecord), and the inputs of one step (StepContext).
#pragma once

#include <cstdint>
#include <vector>

#include "distmuon/engine.h"
#include "runtime/registry.h"

namespace distmuon {

// What one step knows beyond the registry.
struct StepContext {
  std::vector<ParamData> data;       // a copy: deferred stages outlive the caller's array
  std::vector<char> active;          // per parameter: stepped on every rank in this step
  std::vector<char> has_local;       // per parameter: this rank passed a gradient
  std::vector<MuonUpdateCoef> coef;  // distributed: per Muon matrix (index into Impl::mats)
  bool raise = false;                // NonFinitePolicy::kRaise
};

struct StepRecord {
  Buffer skip_counter;  // int64 on the device: matrices and tensors skipped, all steps
  // AdamW step counts on the device, one int64 per parameter (only AdamW entries are used):
  // adamw_update reads and advances them, so a replayed CUDA graph keeps counting. Until it is
  // allocated (the first step or setup) Param::step holds the count.
  Buffer step_counts;
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
  void allocate_step_status(Backend& backend);
};

}  // namespace distmuon
