// The dedicated runtime's data movement for a front end that keeps the model's memory itself
// (distmuon.torch.dedicate): weights out of the owners in forward, gradients into them in
// backward, the vote at step() and, in HSDP, the publication of updated weights to the other
// replicas. The front calls these stages from its hooks; the memory (a bucket's flat buffer, a
// matrix's gradient) stays the front's and is asked for through DedicatedMemory when a stage
// needs it.
//
// Ordering. Members must issue the collectives of one communicator in the same order. Forward
// broadcasts follow the unit order of the forward pass. Gradients are reduced a bucket at a time
// (the bucket's matrices have one owner: one reduction of the bucket's flat gradient buffer, and
// in HSDP one more across replicas, instead of one per matrix), once every matrix of the bucket
// has its gradient here, in one fixed order of the buckets (the expected backward order: units
// in reverse, and inside one the bucket whose first matrix comes last first): a bucket is
// reduced only once every bucket before it has been, so members whose gradients complete in
// another order still agree. What is left at finish() (buckets with a matrix without a gradient
// here, or held back by an earlier one) is reduced then, after a vote on the host control
// communicator says which matrices have a gradient anywhere.
//
// Streams. With communicators that follow a stream (NCCL) every stage binds them to the stream
// it is given and orders results on it (CommHandle::wait_on_stream), so a stage is issued right
// after the previous one and the host never waits mid-step; the handles are checked for
// completion and deadline later (polled at each stage, host-waited at the next finish()). With
// host communicators (MPI, gloo through the PyTorch front) a stage is issued once the previous
// one completed, checked without blocking each time backward delivers a gradient.
//
// The mean. Given a backend (`mean`), the owner turns each reduced sum into the mean here: one
// division per run of adjacent matrices of a bucket's buffer, on the stage's stream, once the
// matrix's last reduction is ordered there (wait(), finish()); without one, finish() leaves the
// division to the caller.
//
// Files: dedicated_transfers.cc (set-up, forward broadcasts, HSDP publication),
// dedicated_reductions.cc (backward reductions, the vote, what is left and the mean at finish()).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/dedicated.h"
#include "distmuon/hsdp.h"

namespace distmuon {

// The front's side: the memory of the buffers a stage moves.
class DedicatedMemory {
 public:
  virtual ~DedicatedMemory() = default;
  // Memory a collective reads or writes, and what keeps it alive until the collective is done.
  struct Region {
    void* data = nullptr;
    std::shared_ptr<void> keep;
  };
  // Bucket b's flat buffer, materialised where this member does not keep it between steps.
  virtual Region bucket(int b) = 0;
  // This member is done with bucket b's weights for now: their memory may go unless kept.
  virtual void release_bucket(int b) = 0;
  // Bucket b's gradients as one flat buffer of the bucket's numel (matrix j at the layout's
  // offset[j]) for one reduction: this member's gradient of each matrix of `present` (those with
  // a gradient on some member), zeros where it has none and for the bucket's other matrices. The
  // owner keeps the `present` ones as its matrices' gradients, views of the buffer (the
  // reduction writes the sums there). A front whose gradients already are such views lends the
  // buffer as it is; otherwise it copies them in (work ordered on the stream of the stage that
  // asks, no host wait).
  virtual Region grads(int b, std::span<const int> present) = 0;
  // A non-owner sent matrix j's gradient (in its bucket's buffer): it may drop it (the
  // transfers keep the region alive for the collective).
  virtual void drop_grad(int j) = 0;
  // This member has a gradient of matrix j (for the vote of finish()).
  virtual bool has_grad(int j) = 0;
};

class DedicatedTransfers {
 public:
  // `world_comm`: a communicator over the dedicated world in member order (nullptr for one
  // member); with replicate > 1 it is split here into the shard and replica groups (HsdpComms:
  // the engine's split, collective). `control`: a host-memory communicator of its own over the
  // same members for the vote and the forward's check (nullptr for one member): they run while
  // the world's reductions may be pending, so not the world communicator itself. Both must
  // outlive this object, as must `memory`. `stream` orders the split's collectives, as every
  // stage's: a world communicator that follows a stream is bound to it first (it may still be
  // bound to the stream of an earlier user, since gone). `mean` (may be null): the backend the
  // owners' sums are divided on, which must issue on the stream of the stage that divides
  // (wait(), finish()) and outlive this object.
  DedicatedTransfers(std::vector<DedicatedMatrix> matrices, DedicatedLayout layout, HsdpWorld world,
                     Communicator* world_comm, Communicator* control, DedicatedMemory& memory,
                     void* stream, Backend* mean = nullptr);
  // Waits for the collectives still in flight, ordered on the stream of the last stage: that
  // stream (or the world's rebinding to another) must outlive this object.
  ~DedicatedTransfers();
  DedicatedTransfers(const DedicatedTransfers&) = delete;
  DedicatedTransfers& operator=(const DedicatedTransfers&) = delete;

  const DedicatedLayout& layout() const { return layout_; }

  // Every stage takes the stream (a cudaStream_t; ignored by host communicators) it orders its
  // results on; communicators that follow a stream are bound to it first.

  // ---- forward: one broadcast per bucket, from its owner in the shard group -----------------
  // From the second forward since the last finish() on, first checks (a small all-reduce on the
  // control communicator, on every member) that all members have sent the same gradients: a
  // matrix without a gradient on some member is held back until finish(), and a forward's
  // broadcasts would then meet another member's reductions. Throws on every member if not
  // (nothing changed: step() still works).
  void begin_forward();
  // Starts the broadcasts of a unit's buckets not started in this forward (none past the last),
  // as one group (Communicator::grouped: one launch).
  void issue(int unit, void* stream);
  // The unit's weights are in place (for work issued afterwards on `stream`).
  void wait_unit(int unit, void* stream);
  // One gradient of the bucket is complete; after its last one the weights may go.
  void used(int bucket);
  // The unit's weights may go (a forward without backward).
  void release_unit(int unit);
  // Every broadcast done, every bucket released.
  void release_all(void* stream);

  // ---- backward: gradients reduced to the owners, one reduction per bucket ------------------
  // Backward completed matrix j's gradient on this member; the bucket's reduction is issued
  // once its last matrix's gradient is here (and the buckets before it in the fixed order are
  // sent). Returns, for each unit whose
  // matrices owned here all landed now, those matrices (during backward only): the caller may
  // wait() on them and prepare their updates, then report it with prepared().
  std::vector<std::vector<int>> grad_ready(int j, void* stream);
  // The matrices' reductions are complete for work issued afterwards on `stream`; with `mean`,
  // those owned here hold their means (divided once: finish() leaves them).
  void wait(std::span<const int> js, void* stream);
  // The owner prepared these matrices' updates from their landed gradients.
  void prepared(std::span<const int> js);

  // ---- step ---------------------------------------------------------------------------------
  // Sends what is left (zeros from members without a gradient, nothing for matrices without
  // one anywhere, as the vote says), reduces again the gradients that arrived after a matrix
  // was sent (several synchronised backwards before one step) and orders everything on
  // `stream`. Throws, on every member, when a gradient arrived after its matrix's update was
  // prepared; the state is reset either way. Returns the matrices owned here that hold the sum
  // of their gradients over the members and are not prepared (nor averaged by wait()): with
  // `mean` they hold the mean on return, divided by the world size on `stream`; else the caller
  // divides them.
  std::vector<int> finish(void* stream);

  // HSDP: each owner sends its updated buckets to the members at its shard position in the
  // other replicas, as one group (waited before the bucket's next broadcast, or by
  // wait_published()).
  void publish(void* stream);
  void wait_published(void* stream);
  // Collective: bucket b as its owner holds it, into `buf` (of the bucket's size) on every
  // member of the shard group, complete for `stream` on return (for a model state_dict).
  void broadcast_bucket(int b, void* buf, void* stream);

  // What the communicators of the dedicated traffic moved so far (the shard group's, which is
  // the world when flat, and the replica group's): collectives and bytes, for tests.
  CommStats traffic() const;

 private:
  enum class State { kNone, kReady, kSkipped, kSent, kLanded };
  enum class Role { kOwner, kRelay, kSender };
  struct InFlight {  // one collective and the memory it uses
    InFlight() = default;
    InFlight(CommHandle h, std::shared_ptr<void> k) : keep(std::move(k)), handle(std::move(h)) {}
    // Declared first, so destroyed last: after the handle, whose destructor waits.
    std::shared_ptr<void> keep;
    CommHandle handle;
  };

  void bind(void* stream);
  bool follows_stream() const;
  Role role(int j) const;
  Role role_of_bucket(int b) const { return role(layout_.buckets[b].matrices.front()); }
  bool done(InFlight& f);  // complete, or ordered on a stream (test() may finish it)
  // Completes `f` for work issued afterwards on the bound stream (host communicators: waits).
  void order(InFlight& f);
  void complete(int b);  // order() on bucket b's reduction; its gradients are no longer needed
  void retire();         // drops the ordered collectives that completed (polled)
  void reset();
  // Stage 0 of bucket b: its flat gradient buffer reduced in the shard group. `present`: the
  // matrices with a gradient on some member (all of them during backward).
  void send(int b, const std::vector<int>& present);
  void advance(bool blocking, std::vector<std::vector<int>>* landed);
  void arrived(int b, std::vector<std::vector<int>>* landed);
  // Buckets `redo` reduced again, each with its present matrices.
  void second_pass(const std::vector<int>& redo, const std::vector<std::vector<int>>& present);
  // With `mean`: the owned matrices js, whose last reductions are ordered on the bound stream,
  // divided by the world size in their buckets' buffers, each run of adjacent ones at once.
  void average(std::vector<int> js, void* stream);
  void wait_replica(int b);

  std::vector<DedicatedMatrix> matrices_;
  DedicatedLayout layout_;
  HsdpWorld world_;
  Communicator* world_comm_ = nullptr;
  Communicator* control_ = nullptr;
  HsdpComms groups_;  // the shard group (the world itself when flat) and the replica group
  DedicatedMemory& memory_;
  Backend* mean_ = nullptr;
  // Collectives nothing waits for any more (ordered on a stream, or a sender's), kept until
  // they complete for their memory and deadline; those of the last step are host-waited at the
  // next finish().
  std::vector<InFlight> unchecked_, last_step_;

  // Forward.
  std::vector<InFlight> broadcast_, publication_;  // per bucket
  std::vector<bool> issued_;        // per bucket: its broadcast started in this forward
  std::vector<int> pending_grads_;  // per bucket: gradients still to come

  // Backward.
  std::vector<int> order_;  // the fixed reduction order of the buckets
  std::vector<int> mine_per_unit_;
  std::vector<State> state_;                   // per matrix
  std::vector<int> missing_;                   // per bucket: matrices without a gradient yet
  std::vector<bool> sent_;                     // per bucket: stage 0 issued in this pass
  std::vector<InFlight> reduction_;            // per bucket: the stage in flight
  std::vector<DedicatedMemory::Region> grad_;  // per bucket: the gradients the stages reduce
  // Per bucket owned here: the buffer of its last reduction, which holds the owner's sums (its
  // gradients are views of it), kept until reset() for the mean.
  std::vector<DedicatedMemory::Region> owned_grad_;
  size_t next_send_ = 0, next_move_ = 0;  // positions in order_
  std::vector<int> arriving_;             // owner: buckets whose final stage is issued
  std::vector<bool> dirty_, prepared_, late_, averaged_;
  std::vector<int> landed_per_unit_;
  bool collecting_ = false;
  int forwards_since_finish_ = 0;
};

}  // namespace distmuon
