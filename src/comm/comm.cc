// The implementation-independent half of the Communicator: argument checks, byte counters,
// handles and the element types. Implementations only see validated calls.
#include "distmuon/comm.h"

#include <numeric>
#include <sstream>

#include "common/log.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon {

CommType comm_type(DType t) {
  switch (t) {
    case DType::kF64:
      return CommType::kF64;
    case DType::kF32:
      return CommType::kF32;
    case DType::kBF16:
      return CommType::kBF16;
    case DType::kF16:
      return CommType::kF16;
  }
  DM_FAIL("comm_type: unknown dtype ", static_cast<int>(t));
}

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::kF64:
      return 8;
    case CommType::kF32:
      return 4;
    case CommType::kBF16:
      return 2;
    case CommType::kF16:
      return 2;
    case CommType::kI32:
      return 4;
    case CommType::kI64:
      return 8;
    case CommType::kU8:
      return 1;
  }
  DM_FAIL("comm_type_size: unknown type ", static_cast<int>(t));
}

const char* comm_type_name(CommType t) {
  switch (t) {
    case CommType::kF64:
      return "f64";
    case CommType::kF32:
      return "f32";
    case CommType::kBF16:
      return "bf16";
    case CommType::kF16:
      return "f16";
    case CommType::kI32:
      return "i32";
    case CommType::kI64:
      return "i64";
    case CommType::kU8:
      return "u8";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

// ---- handles ----------------------------------------------------------------------------------

std::string comm_timeout_message(const std::string& what, double timeout_s) {
  std::ostringstream os;
  os << what << " did not complete within " << timeout_s
     << " s (the timeout, DISTMUON_COMM_TIMEOUT_S): a member is slow, has died, or called a "
        "different collective";
  return os.str();
}

CommHandle::CommHandle(std::unique_ptr<CommRequest> request, double timeout_s,
                       FailureCount failures)
    : request_(std::move(request)),
      timeout_s_(timeout_s),
      failures_(std::move(failures)),
      failures_at_issue_(failures_ ? failures_->load() : 0) {}

CommHandle& CommHandle::operator=(CommHandle&& o) noexcept {
  if (this != &o) {
    finish_quietly();  // what this handle held must complete before its buffers are reused
    request_ = std::move(o.request_);
    timeout_s_ = o.timeout_s_;
    failures_ = std::move(o.failures_);
    failures_at_issue_ = o.failures_at_issue_;
  }
  return *this;
}

CommHandle::~CommHandle() { finish_quietly(); }

void CommHandle::finish_quietly() noexcept {
  if (!request_) return;
  // An operation of this communicator failed since this one was issued (this one, or one it
  // may depend on), and that failure was raised: waiting would most likely cost the whole
  // timeout again for nothing.
  if (failures_ && failures_->load() > failures_at_issue_) {
    request_.reset();
    return;
  }
  try {
    DM_LOG(kDebug, "a dropped handle waits for its collective");
    request_->wait(timeout_s_);
  } catch (const std::exception& e) {
    // Destructors must not throw; the error is reported and the request is abandoned.
    DM_LOG(kError, "abandoning a pending collective: ", e.what());
  }
  request_.reset();
}

void CommHandle::failed() {
  if (failures_) failures_->fetch_add(1);
}

bool CommHandle::test() {
  if (!request_) return true;
  if (!request_->launched()) request_->test();  // throws the usage error, counted as no failure
  try {
    if (!request_->test()) return false;
  } catch (...) {
    failed();
    throw;
  }
  request_.reset();
  return true;
}

void CommHandle::wait() { wait(timeout_s_); }

void CommHandle::wait(double timeout_s) {
  if (!request_) return;
  if (!request_->launched()) request_->test();  // throws the usage error, counted as no failure
  try {
    request_->wait(timeout_s);
  } catch (...) {
    failed();  // kept: waiting again is allowed, but the destructor will not
    throw;
  }
  request_.reset();
}

void CommHandle::wait_on_stream() {
  if (request_ && !request_->wait_on_stream()) wait();
}

void wait_all(std::vector<CommHandle>& handles) {
  for (CommHandle& h : handles) h.wait();
  handles.clear();
}

CommStats& CommStats::operator+=(const CommStats& o) {
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  ops += o.ops;
  launches += o.launches;
  return *this;
}

CommStats CommStats::operator-(const CommStats& o) const {
  return {bytes_sent - o.bytes_sent, bytes_received - o.bytes_received, ops - o.ops,
          launches - o.launches};
}

// ---- communicator -----------------------------------------------------------------------------

Communicator::Communicator(int rank, int size, std::string name, std::vector<int> world_ranks)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      world_ranks_(std::move(world_ranks)),
      timeout_s_(env::get_double("DISTMUON_COMM_TIMEOUT_S")) {
  DM_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "communicator ", name_, ": rank ", rank_,
           " of ", size_, " is not valid");
  if (world_ranks_.empty()) {
    world_ranks_.resize(size_);
    std::iota(world_ranks_.begin(), world_ranks_.end(), 0);
  }
  DM_CHECK(static_cast<int>(world_ranks_.size()) == size_, "communicator ", name_, ": ",
           world_ranks_.size(), " world ranks for ", size_, " members");
  DM_CHECK(timeout_s_ > 0, "DISTMUON_COMM_TIMEOUT_S must be > 0 (got ", timeout_s_, ")");
}

void Communicator::set_timeout(double seconds) {
  DM_CHECK(seconds > 0, "communicator timeout must be > 0 seconds (got ", seconds, ")");
  timeout_s_ = seconds;
}

std::string Communicator::describe(const char* op) const {
  std::ostringstream os;
  os << op << " on " << name_ << " (rank " << rank_ << " of " << size_ << ", world ranks ";
  for (int i = 0; i < size_; ++i) os << (i ? "," : "") << world_ranks_[i];
  os << ")";
  return os.str();
}

void Communicator::count(int64_t sent_elems, int64_t recv_elems, CommType type) {
  const auto es = static_cast<int64_t>(comm_type_size(type));
  stats_.bytes_sent += sent_elems * es;
  stats_.bytes_received += recv_elems * es;
  stats_.ops += 1;
  if (group_depth_ == 0 || !launches_groups()) stats_.launches += 1;
}

CommHandle Communicator::issue(std::unique_ptr<CommRequest> r) {
  return CommHandle(std::move(r), timeout_s_, failures_);
}

namespace {
void check_count(const std::string& what, int64_t n) {
  DM_CHECK(n >= 0, what, ": negative count ", n);
}
}  // namespace

CommHandle Communicator::all_reduce(const void* send, void* recv, int64_t count_, CommType type,
                                    ReduceOp op) {
  check_count(describe("all_reduce"), count_);
  const int64_t moved = size_ > 1 ? 2 * (size_ - 1) * count_ / size_ : 0;
  count(moved, moved, type);
  return issue(do_all_reduce(send, recv, count_, type, op));
}

CommHandle Communicator::reduce(const void* send, void* recv, int64_t count_, CommType type,
                                ReduceOp op, int root) {
  check_count(describe("reduce"), count_);
  DM_CHECK(root >= 0 && root < size_, describe("reduce"), ": root ", root, " is not a member");
  if (rank_ == root)
    count(0, (size_ - 1) * count_, type);
  else
    count(count_, 0, type);
  return issue(do_reduce(send, recv, count_, type, op, root));
}

CommHandle Communicator::broadcast(void* buf, int64_t count_, CommType type, int root) {
  check_count(describe("broadcast"), count_);
  DM_CHECK(root >= 0 && root < size_, describe("broadcast"), ": root ", root, " is not a member");
  if (rank_ == root)
    count((size_ - 1) * count_, 0, type);
  else
    count(0, count_, type);
  return issue(do_broadcast(buf, count_, type, root));
}

CommHandle Communicator::all_gather_v(const void* send, int64_t send_count, void* recv,
                                      std::span<const int64_t> recv_counts,
                                      std::span<const int64_t> recv_displs, CommType type) {
  const std::string what = describe("all_gather_v");
  DM_CHECK(static_cast<int>(recv_counts.size()) == size_ &&
               static_cast<int>(recv_displs.size()) == size_,
           what, ": ", recv_counts.size(), " counts and ", recv_displs.size(),
           " displacements for ", size_, " members");
  DM_CHECK(send_count == recv_counts[rank_], what, ": sends ", send_count,
           " elements but its own slot holds ", recv_counts[rank_]);
  int64_t total = 0;
  for (int q = 0; q < size_; ++q) {
    check_count(what, recv_counts[q]);
    DM_CHECK(recv_displs[q] >= 0, what, ": negative displacement for member ", q);
    total += recv_counts[q];
  }
  count((size_ - 1) * send_count, total - send_count, type);
  return issue(do_all_gather_v(send, send_count, recv, recv_counts, recv_displs, type));
}

CommHandle Communicator::all_gather(const void* send, void* recv, int64_t count_, CommType type) {
  std::vector<int64_t> counts(size_, count_), displs(size_);
  for (int q = 0; q < size_; ++q) displs[q] = q * count_;
  return all_gather_v(send, count_, recv, counts, displs, type);
}

CommHandle Communicator::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                      std::span<const int64_t> send_displs, void* recv,
                                      std::span<const int64_t> recv_counts,
                                      std::span<const int64_t> recv_displs, CommType type) {
  const std::string what = describe("all_to_all_v");
  DM_CHECK(static_cast<int>(send_counts.size()) == size_ &&
               static_cast<int>(send_displs.size()) == size_ &&
               static_cast<int>(recv_counts.size()) == size_ &&
               static_cast<int>(recv_displs.size()) == size_,
           what, ": count and displacement lists must have one entry per member (", size_, ")");
  DM_CHECK(send_counts[rank_] == recv_counts[rank_], what, ": sends ", send_counts[rank_],
           " elements to itself but expects ", recv_counts[rank_]);
  int64_t sent = 0, received = 0;
  for (int q = 0; q < size_; ++q) {
    check_count(what, send_counts[q]);
    check_count(what, recv_counts[q]);
    DM_CHECK(send_displs[q] >= 0 && recv_displs[q] >= 0, what,
             ": negative displacement for member ", q);
    if (q == rank_) continue;
    sent += send_counts[q];
    received += recv_counts[q];
  }
  count(sent, received, type);
  return issue(
      do_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type));
}

CommHandle Communicator::barrier() {
  count(0, 0, CommType::kU8);
  return issue(do_barrier());
}

void Communicator::grouped(const std::function<void()>& issue) {
  const bool outermost = group_depth_ == 0;  // nested calls join the outer group
  if (outermost) do_group_begin();
  const int64_t ops_before = stats_.ops;
  const auto end = [&] {  // launches what was issued, so that its handles complete
    if (launches_groups() && stats_.ops > ops_before) stats_.launches += 1;
    do_group_end();
  };
  ++group_depth_;
  try {
    issue();
  } catch (...) {
    --group_depth_;
    if (outermost) {
      try {
        end();
      } catch (const std::exception& e) {
        DM_LOG(kError, describe("grouped"), ": ", e.what());
      }
    }
    throw;
  }
  --group_depth_;
  if (outermost) end();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  DM_CHECK(group_depth_ == 0, describe("split"), ": not inside grouped() (a split completes before it returns)");
  std::unique_ptr<Communicator> c = do_split(color, key);
  if (c) c->set_timeout(timeout_s_);
  return c;
}

// ---- builds without MPI or NCCL ---------------------------------------------------------------

#ifndef DISTMUON_HAVE_MPI
bool mpi_available() { return false; }
std::unique_ptr<Communicator> make_mpi_world() {
  DM_FAIL("this build of distmuon has no MPI communicator (configure with MPI installed)");
}
#endif

#ifndef DISTMUON_HAVE_NCCL
bool nccl_available() { return false; }
NcclTeardowns nccl_teardowns() { return {}; }
bool wait_for_nccl_teardowns(double) { return true; }
NcclUniqueId nccl_unique_id() {
  DM_FAIL("this build of distmuon has no NCCL communicator (configure with CUDA and NCCL)");
}
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int, int, void*) {
  DM_FAIL("this build of distmuon has no NCCL communicator (configure with CUDA and NCCL)");
}
#endif

}  // namespace distmuon
