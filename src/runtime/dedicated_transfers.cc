// The dedicated runtime's data movement (distmuon/dedicated_transfers.h): set-up, the state the
// stages share, the forward's broadcasts and the HSDP publication. The reductions of backward and
// finish(): dedicated_reductions.cc.
#include "distmuon/dedicated_transfers.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "distmuon/error.h"

namespace distmuon {

DedicatedTransfers::DedicatedTransfers(std::vector<DedicatedMatrix> matrices,
                                       DedicatedLayout layout, HsdpWorld world,
                                       Communicator* world_comm, Communicator* control,
                                       DedicatedMemory& memory, void* stream, Backend* mean)
    : matrices_(std::move(matrices)),
      layout_(std::move(layout)),
      world_(world),
      world_comm_(world_comm),
      control_(control),
      memory_(memory),
      mean_(mean) {
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
  averaged_.assign(n, false);
  owned_grad_.assign(buckets, {});
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
  // The memory first, then the broadcasts as one group (one launch on NCCL, one call into
  // Python on the torch communicator): a member that cannot provide a bucket issues none.
  std::vector<std::pair<int, DedicatedMemory::Region>> go;
  for (int b : layout_.units[unit].buckets) {
    if (issued_[b]) continue;
    wait_replica(b);
    go.emplace_back(b, memory_.bucket(b));
  }
  for (const auto& [b, buf] : go) {
    issued_[b] = true;
    pending_grads_[b] = static_cast<int>(layout_.buckets[b].matrices.size());
  }
  if (world_.shard() == 1 || go.empty()) return;
  groups_.shard()->grouped([&] {
    for (auto& [b, buf] : go) {
      const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
      broadcast_[b] = {groups_.shard()->broadcast(buf.data, bucket.numel, comm_type(bucket.dtype),
                                                  world_.position_of(bucket.owner)),
                       std::move(buf.keep)};
    }
  });
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
  // As issue(): the memory (and the last publication of each bucket) first, then one group.
  std::vector<std::pair<int, DedicatedMemory::Region>> go;
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    if (world_.position_of(layout_.buckets[b].owner) != world_.my_position()) continue;
    wait_replica(static_cast<int>(b));
    go.emplace_back(static_cast<int>(b), memory_.bucket(static_cast<int>(b)));
  }
  groups_.replica()->grouped([&] {
    for (auto& [b, buf] : go) {
      const DedicatedLayout::Bucket& bucket = layout_.buckets[b];
      publication_[b] = {
          groups_.replica()->broadcast(buf.data, bucket.numel, comm_type(bucket.dtype),
                                       world_.replica_of(bucket.owner)),
          std::move(buf.keep)};
    }
  });
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

CommStats DedicatedTransfers::traffic() const {
  if (world_.replicate > 1) return groups_.split_stats();
  return world_comm_ != nullptr ? world_comm_->stats() : CommStats{};
}

}  // namespace distmuon
