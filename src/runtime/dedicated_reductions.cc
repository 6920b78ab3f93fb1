// The dedicated runtime's reductions (distmuon/dedicated_transfers.h): each bucket's gradients to
// its owner in backward, in one fixed order; at finish() the vote, what was held back, the second
// pass and the owners' mean. Set-up and the forward's broadcasts: dedicated_transfers.cc.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "distmuon/dedicated_transfers.h"
#include "distmuon/error.h"

namespace distmuon {

// ---- backward ---------------------------------------------------------------------------------

std::vector<std::vector<int>> DedicatedTransfers::grad_ready(int j, void* stream) {
  DM_CHECK(j >= 0 && j < static_cast<int>(matrices_.size()), "dedicated transfers: no matrix ", j);
  std::vector<std::vector<int>> landed;
  if (state_[j] == State::kReady) return landed;  // not sent yet: accumulated in place
  if (state_[j] != State::kNone) {
    // Raised at finish() on every member (raising here, on the owner alone, would leave the
    // others waiting in a collective).
    if (prepared_[j]) late_[j] = true;
    dirty_[j] = true;
    return landed;
  }
  bind(stream);
  state_[j] = State::kReady;
  --missing_[layout_.bucket_of[j]];
  while (next_send_ < order_.size() && missing_[order_[next_send_]] == 0) {
    const int b = order_[next_send_];
    send(b, layout_.buckets[b].matrices);  // may throw (the memory's gradients): the cursor
    ++next_send_;                          // stays on it
  }
  advance(/*blocking=*/false, &landed);
  return landed;
}

// Stage 0: the bucket's gradients, one flat buffer, reduced inside the shard group to the
// owner's shard position.
void DedicatedTransfers::send(int b, const std::vector<int>& present) {
  const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
  grad_[b] = memory_.grads(b, present);
  if (role_of_bucket(b) == Role::kOwner) owned_grad_[b] = grad_[b];
  for (int j : bucket.matrices) state_[j] = State::kSkipped;
  for (int j : present) state_[j] = State::kSent;
  sent_[b] = true;
  if (world_.shard() > 1) {
    const int root = world_.position_of(bucket.owner);
    void* recv = root == world_.my_position() ? grad_[b].data : nullptr;
    reduction_[b] = {groups_.shard()->reduce(grad_[b].data, recv, bucket.numel,
                                             comm_type(bucket.dtype), ReduceOp::kSum, root),
                     grad_[b].keep};
  }
  if (role_of_bucket(b) != Role::kOwner)  // only the collective still needs them
    for (int j : present) memory_.drop_grad(j);
}

// Moves sent buckets on, in the fixed order: stage 1 across replicas (HSDP, at the owner's
// shard position), then arrival on the owner.
void DedicatedTransfers::advance(bool blocking, std::vector<std::vector<int>>* landed) {
  for (; next_move_ < next_send_; ++next_move_) {
    const int b = order_[next_move_];
    if (!sent_[b]) continue;
    if (!blocking && !done(reduction_[b])) break;
    const Role r = role_of_bucket(b);
    const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
    if (world_.replicate > 1 && r != Role::kSender) {
      order(reduction_[b]);  // stage 0 complete (on a stream: for the bound stream)
      reduction_[b] = {groups_.replica()->reduce(grad_[b].data, grad_[b].data, bucket.numel,
                                                 comm_type(bucket.dtype), ReduceOp::kSum,
                                                 world_.replica_of(bucket.owner)),
                       grad_[b].keep};
    } else if (r == Role::kSender) {
      // Nothing here reads the result: only the memory and the deadline are left to check.
      if (reduction_[b].handle.pending()) unchecked_.push_back(std::move(reduction_[b]));
      reduction_[b] = {};
      grad_[b] = {};
    }
    if (r == Role::kOwner) arriving_.push_back(b);
  }
  std::vector<int> still;
  for (int b : arriving_) {
    if (blocking || done(reduction_[b]))
      arrived(b, landed);
    else
      still.push_back(b);
  }
  arriving_ = std::move(still);
}

void DedicatedTransfers::arrived(int b, std::vector<std::vector<int>>* landed) {
  const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
  int count = 0;
  for (int j : bucket.matrices) {
    if (state_[j] != State::kSent) continue;
    state_[j] = State::kLanded;
    ++count;
  }
  const int unit = bucket.unit;
  landed_per_unit_[unit] += count;
  if (count == 0 || landed_per_unit_[unit] != mine_per_unit_[unit] || collecting_ ||
      landed == nullptr)
    return;
  std::vector<int> mine;
  for (int k : layout_.units[unit].matrices)
    if (matrices_[k].owner == world_.member) mine.push_back(k);
  landed->push_back(std::move(mine));
}

void DedicatedTransfers::wait(std::span<const int> js, void* stream) {
  bind(stream);
  std::vector<int> mine;
  for (int j : js) {
    DM_CHECK(j >= 0 && j < static_cast<int>(matrices_.size()), "dedicated transfers: no matrix ",
             j);
    complete(layout_.bucket_of[j]);
    if (matrices_[j].owner == world_.member && state_[j] == State::kLanded && !averaged_[j])
      mine.push_back(j);
  }
  average(std::move(mine), stream);
}

void DedicatedTransfers::complete(int b) {
  order(reduction_[b]);
  grad_[b] = {};
}

void DedicatedTransfers::prepared(std::span<const int> js) {
  for (int j : js) prepared_[j] = true;
}

// ---- step -------------------------------------------------------------------------------------

std::vector<int> DedicatedTransfers::finish(void* stream) {
  collecting_ = true;
  const int n = static_cast<int>(matrices_.size());
  if (world_.size == 1) {
    reset();
    return {};
  }
  bind(stream);
  // The last step's collectives that only a stream waited for: long complete on a healthy run;
  // a member that died since makes this raise after the timeout instead of hanging.
  for (InFlight& f : last_step_) f.handle.wait();
  last_step_.clear();

  // The vote: which matrices have a gradient anywhere, were reduced again, arrived late.
  std::vector<int32_t> flags(3 * static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    flags[j] = state_[j] != State::kNone || memory_.has_grad(j);
    flags[n + j] = dirty_[j];
    flags[2 * n + j] = late_[j];
  }
  control_->all_reduce(flags.data(), flags.data(), 3 * n, CommType::kI32, ReduceOp::kSum).wait();
  const auto present = [&](int j) { return flags[j] > 0; };

  // The buckets left: reduced whole if a matrix of theirs has a gradient anywhere (zeros for
  // the others), else skipped.
  const auto present_of = [&](int b) {
    std::vector<int> out;
    for (int j : layout_.buckets[b].matrices)
      if (present(j)) out.push_back(j);
    return out;
  };
  for (size_t pos = next_send_; pos < order_.size(); ++pos) {
    const int b = order_[pos];
    const std::vector<int> here = present_of(b);
    if (!here.empty()) {
      send(b, here);
    } else {
      for (int j : layout_.buckets[b].matrices) state_[j] = State::kSkipped;
    }
  }
  next_send_ = order_.size();
  advance(/*blocking=*/true, nullptr);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) complete(static_cast<int>(b));
  const auto late = std::find_if(flags.begin() + 2 * n, flags.end(), [](int32_t f) { return f; });
  if (late != flags.end()) {
    const std::string name = matrices_[late - flags.begin() - 2 * n].name;
    reset();
    DM_FAIL("a second gradient of dedicated matrix '", name,
            "' arrived after its update was prepared (overlap_step), so this step cannot include "
            "it; the step was not applied (the prepared matrices' momentum has advanced: restore "
            "a checkpoint). Accumulate micro-batches under Dedicated.no_sync() so that only the "
            "last backward reduces, or pass overlap_step=False");
  }
  std::vector<int> redo;  // buckets with a gradient that arrived after they were sent
  for (int b : order_)
    for (int j : layout_.buckets[b].matrices)
      if (flags[n + j] > 0) {
        redo.push_back(b);
        break;
      }
  if (!redo.empty()) {
    std::vector<std::vector<int>> present_in(layout_.buckets.size());
    for (int b : redo) present_in[b] = present_of(b);
    second_pass(redo, present_in);
  }

  std::vector<int> to_average;
  for (int j = 0; j < n; ++j)
    if (present(j) && matrices_[j].owner == world_.member && !prepared_[j] && !averaged_[j])
      to_average.push_back(j);
  average(to_average, stream);
  last_step_ = std::move(unchecked_);
  unchecked_.clear();
  reset();
  return to_average;
}

void DedicatedTransfers::second_pass(const std::vector<int>& redo,
                                     const std::vector<std::vector<int>>& present) {
  // The fixed order comes back even if a collective throws here (a later step uses it).
  struct Restore {
    std::vector<int>& order;
    std::vector<int> saved;
    ~Restore() { order = std::move(saved); }
  } restore{order_, std::exchange(order_, redo)};
  next_send_ = next_move_ = 0;
  arriving_.clear();
  sent_.assign(sent_.size(), false);
  for (int b : redo) {
    send(b, present[b]);
    ++next_send_;
  }
  advance(/*blocking=*/true, nullptr);
  for (int b : redo) complete(b);
}

// A division of the sum by the world size, as one process's mean is (the product with the
// reciprocal in double, rounded once: the quotient's rounding for float32 and the half types).
void DedicatedTransfers::average(std::vector<int> js, void* stream) {
  if (mean_ == nullptr || world_.size == 1 || js.empty()) return;
  DM_CHECK(mean_->native_stream() == stream, "dedicated transfers: the mean's backend ",
           mean_->name(), " does not issue on the stage's stream");
  std::sort(js.begin(), js.end(), [&](int a, int b) {
    return std::pair(layout_.bucket_of[a], layout_.offset[a]) <
           std::pair(layout_.bucket_of[b], layout_.offset[b]);
  });
  const ScaleSpec scale{.alpha = 1.0 / world_.size};
  for (size_t k = 0; k < js.size();) {
    const int b = layout_.bucket_of[js[k]];
    const DedicatedMemory::Region& region = owned_grad_[b];
    DM_CHECK(region.data != nullptr, "dedicated transfers: matrix '", matrices_[js[k]].name,
             "' has no reduced buffer on its owner");
    const DType t = layout_.buckets[b].dtype;
    const int64_t first = layout_.offset[js[k]];
    int64_t end = first + matrices_[js[k]].numel;
    for (++k; k < js.size() && layout_.bucket_of[js[k]] == b && layout_.offset[js[k]] == end; ++k)
      end += matrices_[js[k]].numel;
    void* data = static_cast<char*>(region.data) + first * static_cast<int64_t>(dtype_size(t));
    const BatchRef run = BatchRef::packed(data, t, 1, 1, end - first);
    mean_->scale_copy(run, false, scale, run);
  }
  for (int j : js) averaged_[j] = true;
}

}  // namespace distmuon
