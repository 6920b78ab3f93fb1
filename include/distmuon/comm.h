// The Communicator: the collectives the distributed engine needs, on raw buffers in one device's
// memory, with asynchronous handles, timeouts and byte counters. Implementations: MPI (host
// memory; src/comm/mpi_comm.cc), NCCL (CUDA memory, own stream; src/comm/nccl_comm.cc) and, in
// the PyTorch front, one over torch.distributed. No MPI or NCCL type appears here, so a third
// implementation only subclasses Communicator and fills in the protected do_* methods.
//
// Contract shared by every operation
// - Collective: every member calls the same operations in the same order, with matching counts
//   and types. A mismatch is undefined in MPI and NCCL; the engine checks its own metadata
//   before any data moves so that users never reach that state.
// - Asynchronous: each call returns a CommHandle. The buffers must stay valid and unmodified
//   (inputs) or untouched (outputs) until the handle completes. Count and displacement spans
//   are only read during the call.
// - Ordering on devices with streams: an operation sees everything issued on the stream the
//   communicator was bound to before the call; after wait() returns, results are visible on
//   that stream and on the host; after wait_on_stream(), on that stream only (work issued there
//   afterwards waits for them on the device, the host does not).
// - Timeouts: CommHandle::wait() throws distmuon::TimeoutError naming the operation, the
//   communicator and its members when the operation does not complete in time
//   (DISTMUON_COMM_TIMEOUT_S by default). An NCCL communicator is aborted after a timeout. Over
//   NCCL an operation that took 90 % of the timeout on the device also times out, complete or
//   not: a member's abort can let it complete elsewhere with undefined data and no error.
//   After an operation fails (a timeout or an error), the handles of operations that were in
//   flight on that communicator then, that one included, are abandoned when destroyed instead
//   of each waiting out the timeout again: a dead member costs one timeout, not one per pending
//   operation. (An explicit wait() on them still waits.)
// - Counts and displacements are in elements of the given type.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "distmuon/types.h"

namespace distmuon {

// Element types a communicator moves: the float types of DType plus the integer types that
// metadata, status flags and votes use.
enum class CommType : int { kF64 = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kI32 = 4, kI64 = 5, kU8 = 6 };
CommType comm_type(DType t);
size_t comm_type_size(CommType t);
const char* comm_type_name(CommType t);

enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2 };
const char* reduce_op_name(ReduceOp op);

// One operation in flight, as an implementation tracks it.
class CommRequest {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~CommRequest() = default;
  // True once the operation completed. Never blocks; throws distmuon::Error if it failed.
  virtual bool test() = 0;
  // Blocks until completion, at most until timeout_s seconds after the operation was issued,
  // then throws TimeoutError (the operation may still be pending; waiting again is allowed
  // unless the communicator was aborted). The deadline runs from the issue, not from the call:
  // a step that waits for its collectives one after another is bounded by one timeout, not one
  // per collective, however long the host took to reach each wait.
  virtual void wait(double timeout_s) = 0;
  // Makes work issued afterwards on the bound stream wait for the results on the device, and
  // returns true; false where the implementation has no stream (host memory), and then the
  // caller must wait().
  virtual bool wait_on_stream() { return false; }
  // False while the operation is issued but not launched (inside Communicator::grouped()):
  // waiting on it then is a usage error, not a failed operation.
  virtual bool launched() const { return true; }

 protected:
  // When an operation issued at this object's construction has had timeout_s seconds.
  Clock::time_point deadline(double timeout_s) const {
    return issued_ +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  }
  // Seconds left until deadline(timeout_s) (negative once it has passed).
  double seconds_left(double timeout_s) const {
    return std::chrono::duration<double>(deadline(timeout_s) - Clock::now()).count();
  }

 private:
  Clock::time_point issued_ = Clock::now();
};

// The message of a collective that timed out (what: Communicator::describe's text).
std::string comm_timeout_message(const std::string& what, double timeout_s);

// Owning handle of one asynchronous operation (RAII: move-only; the destructor waits, because
// the buffers of a pending operation are still in use, and logs instead of throwing; it does not
// wait when an operation of its communicator failed after it was issued, see above).
class CommHandle {
 public:
  // Failures of a communicator, counted: a handle remembers the count when it was issued.
  using FailureCount = std::shared_ptr<std::atomic<int64_t>>;

  CommHandle() = default;  // an empty handle is complete
  CommHandle(std::unique_ptr<CommRequest> request, double timeout_s, FailureCount failures);
  CommHandle(CommHandle&&) noexcept = default;
  CommHandle& operator=(CommHandle&& o) noexcept;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  ~CommHandle();

  bool test();                  // true when complete (then the handle becomes empty)
  void wait();                  // with the communicator's timeout at issue time
  void wait(double timeout_s);  // throws TimeoutError
  // Orders the results before work issued afterwards on the communicator's stream without
  // blocking the host where the communicator has a stream (NCCL), else waits. A handle ordered
  // that way stays pending: its completion and deadline are still to be checked by wait() (the
  // engine does at the end of its step), so that a collective that never completes raises.
  void wait_on_stream();
  bool pending() const { return request_ != nullptr; }

 private:
  void finish_quietly() noexcept;
  void failed();  // records that this operation failed

  std::unique_ptr<CommRequest> request_;
  double timeout_s_ = 0;
  FailureCount failures_;
  int64_t failures_at_issue_ = 0;
};

// Waits for every handle in order (the first failure propagates; the rest are finished by their
// destructors, which abandon those of the failed communicator).
void wait_all(std::vector<CommHandle>& handles);

// Bytes this member moved, counted as direct point-to-point payload (each element once where
// it leaves its source and once where it arrives, self-copies excluded), whatever algorithm the
// library runs underneath:
//   reduce:        non-root sends n;            root receives (P-1) n
//   broadcast:     root sends (P-1) n;          non-root receives n
//   all_reduce:    sends and receives 2 (P-1)/P n (as reduce-scatter + all-gather)
//   all_gather_v:  sends (P-1) own;              receives total - own
//   all_to_all_v:  sends / receives the counts addressed to / from other members
// With one owner per matrix, reduce-to-owner over all matrices then equals a reduce-scatter
// and broadcast-from-owner an all-gather, so modes compare on the same scale.
struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t ops = 0;
  // Host launches: an operation, or a whole group where the implementation launches groups as
  // one (NCCL; Communicator::grouped). What the simulator's per-launch host cost counts.
  int64_t launches = 0;
  CommStats& operator+=(const CommStats& o);
  CommStats operator-(const CommStats& o) const;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // A name for messages, e.g. "mpi:world" or "nccl:world/split(1)".
  const std::string& name() const { return name_; }
  // The world ranks of the members, in member order (for messages).
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  // Where buffers must live: host memory (kCPU) or the CUDA device of the communicator.
  virtual Device device() const = 0;
  // Communicators that follow a CUDA stream (NCCL): the stream they follow now (nullptr: the
  // legacy default stream): operations start after the work issued on it, and wait() and
  // wait_on_stream() order their results before the work issued on it afterwards. Others (MPI,
  // the PyTorch front's): nullopt.
  virtual std::optional<void*> caller_stream() const { return std::nullopt; }
  // Makes this communicator, and those split from it, follow `stream` (a cudaStream_t; nullptr:
  // the legacy default stream) from now on, operations in flight included (their device-side
  // waits go to the new stream). No-op where there is no stream. The engine binds its
  // communicators to its backend's stream each time it issues work, so the two never diverge.
  virtual void bind_stream(void* stream) { (void)stream; }

  double timeout_s() const { return timeout_s_; }
  void set_timeout(double seconds);

  // recv = op over members of send (count elements). send == recv: in place.
  CommHandle all_reduce(const void* send, void* recv, int64_t count, CommType type, ReduceOp op);
  // The root's recv = op over members of send; recv is ignored elsewhere. send == recv on the
  // root: in place.
  CommHandle reduce(const void* send, void* recv, int64_t count, CommType type, ReduceOp op,
                    int root);
  // buf on every member = buf on root.
  CommHandle broadcast(void* buf, int64_t count, CommType type, int root);
  // recv[recv_displs[q] ...] = member q's send (recv_counts[q] elements). send_count must
  // equal recv_counts[rank()]; send may alias its own slot of recv.
  CommHandle all_gather_v(const void* send, int64_t send_count, void* recv,
                          std::span<const int64_t> recv_counts,
                          std::span<const int64_t> recv_displs, CommType type);
  // Uniform all-gather: recv holds size() * count elements, member q's at q * count.
  CommHandle all_gather(const void* send, void* recv, int64_t count, CommType type);
  // Member q receives send[send_displs[q] ...] (send_counts[q] elements) from every member;
  // what arrives from member q goes to recv[recv_displs[q] ...] (recv_counts[q] elements).
  // Counts may be uneven and zero; recv_counts[q] must equal member q's send_counts[rank()].
  CommHandle all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                          std::span<const int64_t> send_displs, void* recv,
                          std::span<const int64_t> recv_counts,
                          std::span<const int64_t> recv_displs, CommType type);
  CommHandle barrier();
  // Collective over this communicator: members with the same color form a new communicator,
  // ordered by (key, rank). color < 0 takes no part and gets nullptr. Not inside grouped().
  std::unique_ptr<Communicator> split(int color, int key);

  // Issues the operations that `issue` calls on this communicator as one launch where the
  // implementation can: NCCL launches them as one group, so the host pays its launch (a thread
  // start and a poll, ~0.1 ms on ranks that share a GPU) once per group rather than once per
  // operation; their handles then complete together. Elsewhere (MPI) they are issued as they
  // come. Every member groups the same operations. Handles must not be waited on inside `issue`
  // (the group is not launched yet); nested calls join the outer group; if `issue` throws, what
  // it issued is launched and the exception goes on.
  void grouped(const std::function<void()>& issue);

  // Memory on which this communicator's collectives need no SMs where it can give such memory
  // (NCCL under DISTMUON_NCCL_CTA_POLICY=zero: a symmetric window, on which all-gathers and
  // all-to-alls of equal counts run on the copy engines); null where it cannot (every other
  // case: the caller allocates its own). Collective: every member calls it in the same order,
  // and members get memory, or null, alike. The memory lives while the pointer (or a copy)
  // does.
  virtual std::shared_ptr<void> alloc_window(size_t bytes) {
    (void)bytes;
    return nullptr;
  }

  CommStats stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  Communicator(int rank, int size, std::string name, std::vector<int> world_ranks);

  // Implementations: arguments are validated and counted before these are called.
  virtual std::unique_ptr<CommRequest> do_all_reduce(const void* send, void* recv, int64_t count,
                                                     CommType type, ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> do_reduce(const void* send, void* recv, int64_t count,
                                                 CommType type, ReduceOp op, int root) = 0;
  virtual std::unique_ptr<CommRequest> do_broadcast(void* buf, int64_t count, CommType type,
                                                    int root) = 0;
  virtual std::unique_ptr<CommRequest> do_all_gather_v(const void* send, int64_t send_count,
                                                       void* recv,
                                                       std::span<const int64_t> recv_counts,
                                                       std::span<const int64_t> recv_displs,
                                                       CommType type) = 0;
  virtual std::unique_ptr<CommRequest> do_all_to_all_v(
      const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
      void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
      CommType type) = 0;
  virtual std::unique_ptr<CommRequest> do_barrier() = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;

  // The group hooks of grouped(), called for the outermost call only. Default: no grouping.
  virtual void do_group_begin() {}
  virtual void do_group_end() {}
  // Whether do_group_begin/end launch the group's operations as one (counted as one launch).
  virtual bool launches_groups() const { return false; }
  bool in_group() const { return group_depth_ > 0; }

  // "all_to_all_v on mpi:world (rank 2 of 4, world ranks 0,1,2,3)": for error messages.
  std::string describe(const char* op) const;

 private:
  void count(int64_t sent_elems, int64_t recv_elems, CommType type);
  CommHandle issue(std::unique_ptr<CommRequest> r);

  int rank_, size_;
  std::string name_;
  std::vector<int> world_ranks_;
  double timeout_s_;
  CommStats stats_;
  CommHandle::FailureCount failures_ = std::make_shared<std::atomic<int64_t>>(0);
  int group_depth_ = 0;
};

// ---- MPI (host memory) ------------------------------------------------------------------------
// True when this build has the MPI communicator.
bool mpi_available();
// A communicator over a duplicate of MPI_COMM_WORLD. Initialises MPI (thread level
// MPI_THREAD_MULTIPLE) when nobody did, and then finalises it at exit. Non-blocking operations
// are driven by a progress thread (DISTMUON_MPI_PROGRESS_THREAD) so that they advance while
// the host computes.
std::unique_ptr<Communicator> make_mpi_world();

// ---- NCCL (CUDA memory) -----------------------------------------------------------------------
struct NcclUniqueId {
  char bytes[128] = {};
};
// True when this build has the NCCL communicator.
bool nccl_available();
// Rank 0 creates the id and shares it with the others out of band (MPI, torch.distributed).
NcclUniqueId nccl_unique_id();
// A communicator of `size` members on the current CUDA device (several members may share one
// device with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1). `stream` is the cudaStream_t the
// caller's compute runs on (nullptr: the legacy default stream; bind_stream() changes it):
// operations start after the work issued on it and wait() makes it wait for their results.
// Collectives run on the communicator's own stream. Initialisation is bounded by the timeout.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     void* stream = nullptr);

// NCCL communicators let go are torn down on threads of their own (a member must not wait for the
// others to let go too); their device memory comes back when the teardown ends. What this process
// has handed over so far: still in flight, ended by destroy (memory back), ended by abort (a member
// did not let go within the timeout; the memory comes back late).
struct NcclTeardowns {
  int64_t in_flight = 0, destroyed = 0, aborted = 0;
};
NcclTeardowns nccl_teardowns();
// Waits up to `timeout_s` for the teardowns in flight (a process that builds communicators again
// and again, such as a test suite, bounds its device memory so); true when none is left.
bool wait_for_nccl_teardowns(double timeout_s);

}  // namespace distmuon
