// The MPI communicator: non-blocking MPI collectives on host memory, completed by polling so
// that a deadline turns a hang into a TimeoutError. A background thread tests the requests in
// flight, because Open MPI only advances non-blocking collectives inside MPI calls: without it
// the next bucket's transfer would wait for the current bucket's compute to finish.
// Only the C API: Open MPI's deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <list>
#include <mutex>
#include <thread>

#include "comm/poll.h"
#include "common/half.h"
#include "common/log.h"
#include "distmuon/comm.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<size_t>(len));
}

#define DM_CHECK_MPI(call, ...)                               \
  do {                                                        \
    int dm_rc_ = (call);                                      \
    DM_CHECK(dm_rc_ == MPI_SUCCESS, __VA_ARGS__, ": ", #call, \
             " failed: ", mpi_error_string(dm_rc_));          \
  } while (0)

// Every MPI call distmuon makes holds this lock, so MPI_THREAD_SERIALIZED is enough even with
// the progress thread, and one request is never tested by two threads at once.
std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

struct RequestState {
  MPI_Request req = MPI_REQUEST_NULL;
  bool done = false;        // guarded by mpi_mutex()
  int error = MPI_SUCCESS;  // guarded by mpi_mutex()
  std::vector<int> ints;    // count/displacement arrays MPI reads until completion
  std::string what;

  // Tests once; the caller holds mpi_mutex().
  void test_locked() {
    if (done) return;
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Test(&req, &flag, &st);
    if (rc != MPI_SUCCESS) {
      error = rc;
      done = true;
    } else if (flag) {
      done = true;
    }
  }
};

// Sweeps the requests in flight every DISTMUON_MPI_PROGRESS_US microseconds.
class ProgressThread {
 public:
  static ProgressThread& get() {
    static ProgressThread* p = new ProgressThread();  // lives until exit; stopped explicitly
    return *p;
  }
  void add(std::shared_ptr<RequestState> s) {  // caller holds mpi_mutex()
    if (!enabled_) return;
    {
      std::lock_guard<std::mutex> lk(list_mu_);
      pending_.push_back(std::move(s));
    }
    cv_.notify_one();
  }
  void start() {
    std::lock_guard<std::mutex> lk(list_mu_);
    if (enabled_ || stop_) return;
    enabled_ = true;
    poll_ =
        std::chrono::microseconds(std::max<int64_t>(1, env::get_int("DISTMUON_MPI_PROGRESS_US")));
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(list_mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    enabled_ = false;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(list_mu_);
    while (!stop_) {
      if (pending_.empty()) {
        cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
        continue;
      }
      std::vector<std::shared_ptr<RequestState>> batch(pending_.begin(), pending_.end());
      lk.unlock();
      {
        std::lock_guard<std::mutex> mpi(mpi_mutex());
        for (auto& s : batch) s->test_locked();
      }
      lk.lock();
      pending_.remove_if([](const std::shared_ptr<RequestState>& s) { return s->done; });
      cv_.wait_for(lk, poll_, [&] { return stop_; });
    }
  }

  std::mutex list_mu_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<RequestState>> pending_;
  std::thread thread_;
  std::chrono::microseconds poll_{200};
  bool enabled_ = false, stop_ = false;
};

bool g_we_initialized = false;

void finalize_at_exit() {
  ProgressThread::get().stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && g_we_initialized) MPI_Finalize();
}

class MpiRequest final : public CommRequest {
 public:
  explicit MpiRequest(std::shared_ptr<RequestState> s) : s_(std::move(s)) {}
  bool test() override {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    s_->test_locked();
    check_error_locked();
    return s_->done;
  }
  void wait(double timeout_s) override {
    comm_detail::poll_until(
        deadline(timeout_s), std::chrono::microseconds(5), std::chrono::microseconds(1000),
        [&] {
          std::lock_guard<std::mutex> lk(mpi_mutex());
          s_->test_locked();
          check_error_locked();
          return s_->done;
        },
        [&] { throw TimeoutError(comm_timeout_message(s_->what, timeout_s), __FILE__, __LINE__); });
  }

 private:
  void check_error_locked() {
    DM_CHECK(s_->error == MPI_SUCCESS, s_->what, " failed: ", mpi_error_string(s_->error));
  }
  std::shared_ptr<RequestState> s_;
};

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::kF64:
      return MPI_DOUBLE;
    case CommType::kF32:
      return MPI_FLOAT;
    case CommType::kBF16:
      return MPI_UINT16_T;  // reductions use the ops below
    case CommType::kF16:
      return MPI_UINT16_T;
    case CommType::kI32:
      return MPI_INT32_T;
    case CommType::kI64:
      return MPI_INT64_T;
    case CommType::kU8:
      return MPI_UINT8_T;
  }
  DM_FAIL("mpi: unknown element type");
}

// Reductions of 16-bit floats: MPI has no bf16/fp16 type, so they travel as uint16 and are
// combined in fp32 with one rounding per combination (as NCCL does).
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int Kind>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]);
    float r = Kind == 0 ? x + y : Kind == 1 ? std::max(x, y) : std::min(x, y);
    b[i] = FromF(r);
  }
}

MPI_Op mpi_op(ReduceOp op, CommType t) {  // caller holds mpi_mutex()
  if (t != CommType::kBF16 && t != CommType::kF16) {
    switch (op) {
      case ReduceOp::kSum:
        return MPI_SUM;
      case ReduceOp::kMax:
        return MPI_MAX;
      case ReduceOp::kMin:
        return MPI_MIN;
    }
  }
  static MPI_Op ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                             {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
  static MPI_User_function* fns[2][3] = {
      {half_op<bf16_to_float, float_to_bf16, 0>, half_op<bf16_to_float, float_to_bf16, 1>,
       half_op<bf16_to_float, float_to_bf16, 2>},
      {half_op<f16_to_float, float_to_f16, 0>, half_op<f16_to_float, float_to_f16, 1>,
       half_op<f16_to_float, float_to_f16, 2>}};
  const int ti = t == CommType::kBF16 ? 0 : 1, oi = static_cast<int>(op);
  if (ops[ti][oi] == MPI_OP_NULL) DM_CHECK_MPI(MPI_Op_create(fns[ti][oi], 1, &ops[ti][oi]), "mpi");
  return ops[ti][oi];
}

int to_int(int64_t v, const std::string& what) {
  DM_CHECK(v >= 0 && v <= INT_MAX, what, ": count or displacement ", v,
           " does not fit MPI's int (split the buffer)");
  return static_cast<int>(v);
}

class MpiComm final : public Communicator {
 public:
  MpiComm(MPI_Comm comm, std::string name, std::vector<int> world_ranks)
      : Communicator(comm_rank(comm), comm_size(comm), std::move(name), std::move(world_ranks)),
        comm_(comm) {}
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    MPI_Comm_free(&comm_);
  }
  Device device() const override { return Device{DeviceKind::kCPU, 0}; }

 protected:
  std::unique_ptr<CommRequest> do_all_reduce(const void* send, void* recv, int64_t count,
                                             CommType type, ReduceOp op) override {
    auto s = state("all_reduce");
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, s->what),
                                mpi_type(type), mpi_op(op, type), comm_, &s->req),
                 s->what);
    return track(std::move(s));
  }
  std::unique_ptr<CommRequest> do_reduce(const void* send, void* recv, int64_t count, CommType type,
                                         ReduceOp op, int root) override {
    auto s = state("reduce");
    const bool in_place = rank() == root && send == recv;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Ireduce(in_place ? MPI_IN_PLACE : send, recv, to_int(count, s->what),
                             mpi_type(type), mpi_op(op, type), root, comm_, &s->req),
                 s->what);
    return track(std::move(s));
  }
  std::unique_ptr<CommRequest> do_broadcast(void* buf, int64_t count, CommType type,
                                            int root) override {
    auto s = state("broadcast");
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Ibcast(buf, to_int(count, s->what), mpi_type(type), root, comm_, &s->req),
                 s->what);
    return track(std::move(s));
  }
  std::unique_ptr<CommRequest> do_all_gather_v(const void* send, int64_t send_count, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
    auto s = state("all_gather_v");
    const int n = size();
    s->ints.resize(2 * n);
    for (int q = 0; q < n; ++q) {
      s->ints[q] = to_int(recv_counts[q], s->what);
      s->ints[n + q] = to_int(recv_displs[q], s->what);
    }
    const char* own = static_cast<const char*>(recv) + recv_displs[rank()] * comm_type_size(type);
    const bool in_place = send == own;
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(
        MPI_Iallgatherv(in_place ? MPI_IN_PLACE : send, to_int(send_count, s->what), mpi_type(type),
                        recv, s->ints.data(), s->ints.data() + n, mpi_type(type), comm_, &s->req),
        s->what);
    return track(std::move(s));
  }
  std::unique_ptr<CommRequest> do_all_to_all_v(const void* send,
                                               std::span<const int64_t> send_counts,
                                               std::span<const int64_t> send_displs, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
    auto s = state("all_to_all_v");
    const int n = size();
    s->ints.resize(4 * n);
    for (int q = 0; q < n; ++q) {
      s->ints[q] = to_int(send_counts[q], s->what);
      s->ints[n + q] = to_int(send_displs[q], s->what);
      s->ints[2 * n + q] = to_int(recv_counts[q], s->what);
      s->ints[3 * n + q] = to_int(recv_displs[q], s->what);
    }
    int* p = s->ints.data();
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Ialltoallv(send, p, p + n, mpi_type(type), recv, p + 2 * n, p + 3 * n,
                                mpi_type(type), comm_, &s->req),
                 s->what);
    return track(std::move(s));
  }
  std::unique_ptr<CommRequest> do_barrier() override {
    auto s = state("barrier");
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Ibarrier(comm_, &s->req), s->what);
    return track(std::move(s));
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    // Exchange (color, key) with a non-blocking all-gather first: its timeout catches members
    // that never arrive, and afterwards MPI_Comm_split cannot block on a missing member.
    std::vector<int64_t> mine = {color, key}, all(2 * static_cast<size_t>(size()));
    all_gather(mine.data(), all.data(), 2, CommType::kI64).wait();
    MPI_Comm sub = MPI_COMM_NULL;
    {
      std::lock_guard<std::mutex> lk(mpi_mutex());
      DM_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub),
                   describe("split"));
    }
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of my color
    for (int q = 0; q < size(); ++q)
      if (all[2 * q] == color) members.emplace_back(all[2 * q + 1], q);
    std::sort(members.begin(), members.end());
    std::vector<int> wr;
    for (auto& m : members) wr.push_back(world_ranks()[m.second]);
    {
      std::lock_guard<std::mutex> lk(mpi_mutex());
      MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    }
    return std::make_unique<MpiComm>(sub, name() + "/split(" + std::to_string(color) + ")",
                                     std::move(wr));
  }

 private:
  static int comm_rank(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static int comm_size(MPI_Comm c) {
    int s = 0;
    MPI_Comm_size(c, &s);
    return s;
  }
  std::shared_ptr<RequestState> state(const char* op) {
    auto s = std::make_shared<RequestState>();
    s->what = describe(op);
    return s;
  }
  std::unique_ptr<CommRequest> track(std::shared_ptr<RequestState> s) {  // holds mpi_mutex()
    ProgressThread::get().add(s);
    return std::make_unique<MpiRequest>(std::move(s));
  }

  MPI_Comm comm_;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Communicator> make_mpi_world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    // Open MPI's default MPI_Ireduce for large messages is a chain of 64 KiB segments, each of
    // which waits for one progress call: measured 0.03 GB/s on 40 MB between two ranks, against
    // 0.9 GB/s for the binomial tree. The user's own setting wins (no overwrite).
    setenv("OMPI_MCA_coll_libnbc_ireduce_algorithm", "2", 0);
    DM_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "mpi");
    g_we_initialized = true;
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  MPI_Comm world = MPI_COMM_NULL;
  {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    DM_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &world), "mpi");
    MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  }
  if (env::get_bool("DISTMUON_MPI_PROGRESS_THREAD")) {
    // distmuon serialises its own MPI calls, but other MPI users in the process would race
    // with the progress thread unless MPI runs at MPI_THREAD_MULTIPLE.
    if (provided >= MPI_THREAD_MULTIPLE || (g_we_initialized && provided >= MPI_THREAD_SERIALIZED))
      ProgressThread::get().start();
    else
      DM_LOG(kInfo, "mpi: thread level ", provided,
             " does not allow a progress thread; collectives advance only while waited on");
  }
  return std::make_unique<MpiComm>(world, "mpi:world", std::vector<int>{});
}

}  // namespace distmuon
