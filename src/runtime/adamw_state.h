// AdamW for the parameters of AdamW groups (adamw_step.cc): one path for the single-process and
// every distributed step, with the staging it keeps between steps. Its state beside the weights
// (exp_avg, exp_avg_sq) is the registry's (Param::state0, state1), its statuses and step counts
// the StepRecord's.
#pragma once

#include <cstdint>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "runtime/dist_state.h"
#include "runtime/registry.h"
#include "runtime/step_state.h"

namespace distmuon {

struct AdamWState {
  AdamWState(Backend& backend, const Registry& registry, StepRecord& record, DistState& dist)
      : backend(backend), registry(registry), record(record), dist(dist) {}

  // begin (dedicated mode: the local gradients all-reduced in the wire dtype), check (statuses;
  // sharded modes agree on them), update (the update and the skip count). Every AdamW parameter
  // keeps its status entry, idle or not, so that statuses line up on every rank.
  void begin(const StepContext& ctx);
  void check(const StepContext& ctx);
  void update();
  // Dedicated mode moving gradients itself: AdamW gradients are all-reduced in the wire dtype.
  bool reduces_gradients() const {
    return dist.world && dist.options.mode == DistMode::kDedicated &&
           !dist.options.caller_transfers;
  }

  Backend& backend;
  const Registry& registry;
  StepRecord& record;
  DistState& dist;
  // Dedicated mode: local gradients copied in the wire dtype and all-reduced.
  Buffer stage, dummy;
  std::vector<int64_t> offset;  // bytes, per AdamW parameter
  std::vector<CommHandle> handles;
  std::vector<AdamSlot> slots;  // of this step, from check() to update()
};

}  // namespace distmuon
