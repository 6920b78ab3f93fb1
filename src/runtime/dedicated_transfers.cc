// The dedicated runtime's data movement (distmuon/dedicated_transfers.h).
#include "distmuon/dedicated_transfers.h"

#include <algorithm>
#include <utility>

#include "distmuon/error.h"

namespace distmuon {

DedicatedTransfers::DedicatedTransfers(std::vector<DedicatedMatrix> matrices,
                                       DedicatedLayout layout, HsdpWorld world,
                                       Communicator* world_comm, Communicator* control,
                                       DedicatedMemory& memory, void* stream)
    : matrices_(std::move(matrices)),
      layout_(std::move(layout)),
      world_(world),
      world_comm_(world_comm),
      control_(control),
      memory_(memory) {
  world_.check("dedicated transfers");
  DM_CHECK(layout_.unit_of.size() == matrices_.size(), "dedicated transfers: a layout of ",
           layout_.unit_of.size(), " matrices for ", matrices_.size());
  if (world_.size > 1) {
    DM_CHECK(world_comm_ && control_, "dedicated transfers: ", world_.size,
             " members need a world and a control communicator");
    DM_CHECK(world_comm_->size() == world_.size && world_comm_->rank() == world_.member &&
                 control_->size() == world_.size && control_->rank() == world_.member,
             "dedicated transfers: the communicators (", world_comm_->name(), ", ",
             control_->name(), ") are not the dedicated world of ", world_.size, " (member ",
             world_.member, ")");
    DM_CHECK(control_->device().kind == DeviceKind::kCPU,
             "dedicated transfers: the control communicator ", control_->name(),
             " must move host memory");
    DM_CHECK(control_ != world_comm_, "dedicated transfers: the control communicator must be one ",
             "of its own (its vote runs while the world's reductions may be pending)");
  }
  bind(stream);
  groups_ = HsdpComms(world_comm_, world_);  // the engine's split (dist_setup.cc)
  const size_t buckets = layout_.buckets.size();
  broadcast_.resize(buckets);
  publication_.resize(buckets);
  issued_.assign(buckets, false);
  pending_grads_.assign(buckets, 0);
  // The expected backward order: units in reverse; inside one, a bucket is complete once its
  // first matrix is (matrices in reverse), so the bucket whose first matrix comes last goes first.
  for (auto u = layout_.units.rbegin(); u != layout_.units.rend(); ++u) {
    std::vector<int> bs = u->buckets;
    const auto first = [&](int b) {
      return std::find(u->matrices.begin(), u->matrices.end(),
                       layout_.buckets[b].matrices.front()) -
             u->matrices.begin();
    };
    std::stable_sort(bs.begin(), bs.end(), [&](int a, int b) { return first(a) > first(b); });
    order_.insert(order_.end(), bs.begin(), bs.end());
  }
  DM_CHECK(order_.size() == buckets, "dedicated transfers: the layout's units hold ",
           order_.size(), " of its ", buckets, " buckets");
  for (const DedicatedLayout::Unit& u : layout_.units)
    mine_per_unit_.push_back(
        static_cast<int>(std::count_if(u.matrices.begin(), u.matrices.end(), [&](int j) {
          return matrices_[j].owner == world_.member;
        })));
  reduction_.resize(buckets);
  reset();
}

// Collectives still in flight are waited by their handles' destructors; a failed communicator's
// are abandoned (CommHandle).
DedicatedTransfers::~DedicatedTransfers() = default;

void DedicatedTransfers::bind(void* stream) {
  if (follows_stream()) world_comm_->bind_stream(stream);
  retire();
}

bool DedicatedTransfers::follows_stream() const {
  return world_comm_ != nullptr && world_comm_->caller_stream().has_value();
}

DedicatedTransfers::Role DedicatedTransfers::role(int j) const {
  const int owner = matrices_[j].owner;
  if (owner == world_.member) return Role::kOwner;
  if (world_.replicate > 1 && world_.position_of(owner) == world_.my_position())
    return Role::kRelay;
  return Role::kSender;
}

// Whether a stage may move on. On a stream at once (its successor is ordered on the device):
// the stages then go out in one order on every member, whatever completes first where. Moving on
// only once the host sees a stage complete lets that order differ between members, and NCCL
// collectives of two communicators queued on each member's one stream in different orders wait
// for each other forever (seen on the H200: HSDP 2 x 2 hung at its first reduction). The cost:
// under HSDP on NCCL the stream waits for reductions that a member holding a matrix back issues
// only at finish(), so the device must not be synchronised before then (docs/dedicated.md).
bool DedicatedTransfers::done(InFlight& f) {
  return !f.handle.pending() || follows_stream() || f.handle.test();
}

void DedicatedTransfers::order(InFlight& f) {
  if (follows_stream()) {
    f.handle.wait_on_stream();
    if (f.handle.pending()) unchecked_.push_back(std::move(f));
  } else {
    f.handle.wait();
  }
  f = {};
}

void DedicatedTransfers::retire() {
  std::erase_if(unchecked_, [](InFlight& f) { return f.handle.test(); });
  // The last step's too: they hold gradient buffers that backward would otherwise allocate anew.
  std::erase_if(last_step_, [](InFlight& f) { return f.handle.test(); });
}

void DedicatedTransfers::reset() {
  const size_t n = matrices_.size(), buckets = layout_.buckets.size();
  state_.assign(n, State::kNone);
  missing_.resize(buckets);
  for (size_t b = 0; b < buckets; ++b)
    missing_[b] = static_cast<int>(layout_.buckets[b].matrices.size());
  sent_.assign(buckets, false);
  next_send_ = next_move_ = 0;
  arriving_.clear();
  dirty_.assign(n, false);
  prepared_.assign(n, false);
  late_.assign(n, false);
  landed_per_unit_.assign(layout_.units.size(), 0);
  collecting_ = false;
  forwards_since_finish_ = 0;
  grad_.assign(buckets, {});
}

// ---- forward ----------------------------------------------------------------------------------

void DedicatedTransfers::begin_forward() {
  if (forwards_since_finish_++ > 0 && world_.size > 1) {
    // Every member runs the same forwards, so every member takes part.
    std::vector<int64_t> sent = {static_cast<int64_t>(next_send_),
                                 -static_cast<int64_t>(next_send_)};
    control_->all_reduce(sent.data(), sent.data(), 2, CommType::kI64, ReduceOp::kMax).wait();
    if (sent[0] != -sent[1]) {
      --forwards_since_finish_;  // nothing changed: the check runs again at the next forward
      DM_FAIL("a forward after a synchronised backward, before step(): members have sent ",
              -sent[1], " to ", sent[0],
              " gradients of dedicated matrices (one without a gradient on some member is held "
              "back until step()), so this forward's broadcasts would meet other members' "
              "reductions; call step() first, or accumulate micro-batches under "
              "Dedicated.no_sync() (nothing was changed: step() still applies the gradients)");
    }
  }
  issued_.assign(issued_.size(), false);
}

void DedicatedTransfers::issue(int unit, void* stream) {
  if (unit < 0 || unit >= static_cast<int>(layout_.units.size())) return;
  bind(stream);
  for (int b : layout_.units[unit].buckets) {
    if (issued_[b]) continue;
    issued_[b] = true;
    const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
    pending_grads_[b] = static_cast<int>(bucket.matrices.size());
    wait_replica(b);
    DedicatedMemory::Region buf = memory_.bucket(b);
    if (world_.shard() > 1) {
      broadcast_[b] = {groups_.shard()->broadcast(buf.data, bucket.numel, comm_type(bucket.dtype),
                                                  world_.position_of(bucket.owner)),
                       std::move(buf.keep)};
    }
  }
}

void DedicatedTransfers::wait_unit(int unit, void* stream) {
  DM_CHECK(unit >= 0 && unit < static_cast<int>(layout_.units.size()),
           "dedicated transfers: no unit ", unit);
  issue(unit, stream);
  for (int b : layout_.units[unit].buckets) order(broadcast_[b]);
}

void DedicatedTransfers::used(int bucket) {
  if (--pending_grads_[bucket] <= 0 && !broadcast_[bucket].handle.pending())
    memory_.release_bucket(bucket);
}

void DedicatedTransfers::release_unit(int unit) {
  for (int b : layout_.units[unit].buckets)
    if (!broadcast_[b].handle.pending()) memory_.release_bucket(b);
}

void DedicatedTransfers::release_all(void* stream) {
  bind(stream);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    order(broadcast_[b]);
    memory_.release_bucket(static_cast<int>(b));
  }
}

void DedicatedTransfers::publish(void* stream) {
  if (world_.replicate == 1) return;
  bind(stream);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
    if (world_.position_of(bucket.owner) != world_.my_position()) continue;
    DedicatedMemory::Region buf = memory_.bucket(static_cast<int>(b));
    publication_[b] = {groups_.replica()->broadcast(buf.data, bucket.numel, comm_type(bucket.dtype),
                                                    world_.replica_of(bucket.owner)),
                       std::move(buf.keep)};
  }
}

void DedicatedTransfers::wait_replica(int b) { order(publication_[b]); }

void DedicatedTransfers::wait_published(void* stream) {
  bind(stream);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) wait_replica(static_cast<int>(b));
}

void DedicatedTransfers::broadcast_bucket(int b, void* buf, void* stream) {
  DM_CHECK(b >= 0 && b < static_cast<int>(layout_.buckets.size()),
           "dedicated transfers: no bucket ", b);
  if (world_.shard() == 1) return;
  bind(stream);
  const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
  InFlight f{groups_.shard()->broadcast(buf, bucket.numel, comm_type(bucket.dtype),
                                        world_.position_of(bucket.owner)),
             nullptr};
  order(f);
}

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
  for (int j : js) {
    DM_CHECK(j >= 0 && j < static_cast<int>(matrices_.size()), "dedicated transfers: no matrix ",
             j);
    complete(layout_.bucket_of[j]);
  }
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
    if (present(j) && matrices_[j].owner == world_.member && !prepared_[j]) to_average.push_back(j);
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

CommStats DedicatedTransfers::traffic() const {
  if (world_.replicate > 1) return groups_.split_stats();
  return world_comm_ != nullptr ? world_comm_->stats() : CommStats{};
}

}  // namespace distmuon
