// The dedicated mode's prepared updates (dedicated_prepare.cc): what Engine::prepare() computed
// during backward and the next step() applies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/types.h"

namespace distmuon {

// Dedicated mode with caller transfers: batches prepared since the last step (momentum and
// orthogonalization done, results in the arena x) whose updates step() applies.
struct PreparedUpdates {
  struct Batch {
    std::vector<int> mats;  // one owner batch, group and wide shape; wide matrices first
    int tall_begin = 0;     // first tall one (mats.size() when none)
    DType x_dtype = DType::kF32;
    size_t x_offset = 0;  // bytes into x
    int64_t slot = 0;     // first entry in norms / status
  };
  std::vector<Batch> batches;
  std::vector<char> is_prepared;  // per matrix
  Buffer x, norms, status;        // the arena: one slot per matrix this rank owns
  size_t x_used = 0;
  int64_t slots_used = 0;
  // Forgets the prepared batches (applied or discarded) and hands the arena out from the front.
  void reset();
};

}  // namespace distmuon
