// The NCCL communicator: collectives on CUDA memory, issued on the communicator's own stream
// after the caller's stream (event), completed by polling an event so that a deadline or an
// asynchronous NCCL error aborts the communicator instead of hanging the process. The
// communicator is non-blocking (ncclConfig_t.blocking = 0), so initialisation and split are
// bounded by the timeout too (DISTMUON_NCCL_BLOCKING=1 trades that for cheaper launches).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "comm/nccl_teardown.h"
#include "comm/poll.h"
#include "common/cuda_handles.h"
#include "common/log.h"
#include "distmuon/comm.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

// ncclInProgress is the normal answer of a non-blocking communicator: the call was accepted.
#define DM_CHECK_NCCL(call, ...)                                                        \
  do {                                                                                  \
    ncclResult_t dm_r_ = (call);                                                        \
    DM_CHECK(dm_r_ == ncclSuccess || dm_r_ == ncclInProgress, __VA_ARGS__, ": ", #call, \
             " failed: ", ncclGetErrorString(dm_r_));                                   \
  } while (0)

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// NCCL's own all-to-all (ncclAlltoAll), CTA policies and symmetric windows: NCCL >= 2.28.
#define DM_NCCL_HAS_WINDOWS (NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0))
#if !DM_NCCL_HAS_WINDOWS
#define NCCL_CTA_POLICY_DEFAULT 0
#define NCCL_CTA_POLICY_EFFICIENCY 1
#define NCCL_CTA_POLICY_ZERO 2
#endif

// DISTMUON_NCCL_CTA_POLICY: the SMs the engine's NCCL kernels take (ncclConfig_t.CTAPolicy);
// -1 where unset (NCCL's default, which its own NCCL_CTA_POLICY may set). `zero` also makes the
// communicator hand out symmetric windows (alloc_window), on which NCCL moves all-gathers and
// all-to-alls with the copy engines: transfers beside compute that take none of its SMs.
int cta_policy() {
  const std::string v = env::get("DISTMUON_NCCL_CTA_POLICY");
  if (v.empty()) return -1;
  if (v == "default") return NCCL_CTA_POLICY_DEFAULT;
  if (v == "efficiency") return NCCL_CTA_POLICY_EFFICIENCY;
  if (v == "zero") return NCCL_CTA_POLICY_ZERO;
  DM_FAIL("DISTMUON_NCCL_CTA_POLICY=", v, " is not one of default, efficiency, zero");
}

// Equal counts, member q's block at q * count: what NCCL's own all-gather and all-to-all take.
bool regular(std::span<const int64_t> counts, std::span<const int64_t> displs) {
  const int64_t c0 = counts[0];
  bool yes = c0 > 0;
  for (size_t q = 0; q < counts.size() && yes; ++q)
    yes = counts[q] == c0 && displs[q] == static_cast<int64_t>(q) * c0;
  return yes;
}

// Non-blocking by default: every NCCL call returns at once and is polled, so that a deadline holds
// everywhere. A non-blocking launch costs a thread NCCL starts per group (85-143 us of host time
// per launch measured between MPS ranks on an H100, most of a distributed step's host time at
// D = 8); DISTMUON_NCCL_BLOCKING=1 launches on the caller's thread instead, for measuring that.
ncclConfig_t comm_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = env::get_bool("DISTMUON_NCCL_BLOCKING") ? 1 : 0;
  if (const int policy = cta_policy(); policy >= 0) {
#if DM_NCCL_HAS_WINDOWS
    config.CTAPolicy = policy;
#else
    DM_FAIL("DISTMUON_NCCL_CTA_POLICY needs NCCL >= 2.28 at build time (built with ", NCCL_MAJOR,
            ".", NCCL_MINOR, ")");
#endif
  }
  return config;
}

// The caller's stream a communicator follows, shared with the communicators split from it and
// with the requests in flight, so that bind_stream() moves all of them at once.
struct StreamBinding {
  cudaStream_t stream = nullptr;
};

// The NCCL handle and its abort state, shared with the requests so a request can abort it.
struct Shared {
  ncclComm_t comm = nullptr;
  bool aborted = false;
  // While this thread's NCCL group holds operations of the communicator, an abort waits for the
  // group's end (do_group_end): aborting inside it would free what ncclGroupEnd then launches.
  bool in_group = false, abort_pending = false;
  std::string name;
  int device = 0;
  int cta_policy = -1;            // DISTMUON_NCCL_CTA_POLICY when it was made (cta_policy())
  double release_timeout_s = 60;  // the owner's timeout when it let go
  const pid_t pid = getpid();     // a forked child must not tear down its parent's communicator
  // The last holder (the communicator or a request that outlived it) hands the handle over.
  ~Shared() {
    if (comm && !aborted && getpid() == pid)
      comm_detail::start_nccl_teardown(comm, device, release_timeout_s, name);
  }
  void abort() {
    if (aborted || !comm) return;
    if (in_group) {
      abort_pending = true;
      return;
    }
    aborted = true;
    ncclCommAbort(comm);  // unblocks kernels stuck waiting for peers
  }
  // Throws if NCCL reported an asynchronous error (aborting first).
  void check_async(const std::string& what) {
    DM_CHECK(!aborted && !abort_pending, what, ": the communicator ", name,
             " was aborted after an earlier error");
    ncclResult_t r = ncclSuccess;
    ncclCommGetAsyncError(comm, &r);
    if (r != ncclSuccess && r != ncclInProgress) {
      abort();
      DM_FAIL(what, " failed: ", ncclGetErrorString(r), " (", ncclGetLastError(comm), ")");
    }
  }
  // Waits until a non-blocking call has been accepted (state leaves ncclInProgress).
  void wait_ready(const std::string& what, double timeout_s) {
    DM_CHECK(!aborted, what, ": the communicator ", name, " was aborted after an earlier error");
    comm_detail::poll_until_done(
        timeout_s, std::chrono::microseconds(50), std::chrono::microseconds(50),
        [&] {
          ncclResult_t r = ncclSuccess;
          ncclCommGetAsyncError(comm, &r);
          if (r != ncclSuccess && r != ncclInProgress) {
            abort();
            DM_FAIL(what, " failed: ", ncclGetErrorString(r));
          }
          return r == ncclSuccess;
        },
        [&] {
          abort();
          throw TimeoutError(detail::concat(what, " was not accepted within ", timeout_s,
                                            " s; the communicator was aborted"),
                             __FILE__, __LINE__);
        });
  }
};

// A collective that ran this fraction of its timeout on the device counts as timed out, even
// though it completed. When a member times out and aborts its communicator, the same collective
// pending on the other members may complete on their devices -- with undefined data, and without
// an error from NCCL -- instead of failing (seen on the H200 with 4 ranks on one GPU: a member's
// wait returned 9.97 s into a 10 s timeout, and only its next collective failed, a whole
// timeout later). Its device time then is the timeout less the members' skew in starting it.
constexpr double kTimedOutFraction = 0.9;

// The events around one launch on the communicator's stream: one collective, or every
// collective of a group (grouped()), whose requests share them.
struct LaunchEvents {
  cuda::Event start = cuda::make_event(true), done = cuda::make_event(true);
  bool launched = false;  // `done` is recorded
  std::string failed;     // why the group's launch failed, if it did
};

class NcclRequest final : public CommRequest {
 public:
  NcclRequest(std::shared_ptr<Shared> sh, int device, std::shared_ptr<StreamBinding> user,
              std::string what, double timeout_s, std::shared_ptr<LaunchEvents> ev)
      : sh_(std::move(sh)),
        device_(device),
        user_(std::move(user)),
        what_(std::move(what)),
        timeout_s_(timeout_s),
        ev_(std::move(ev)) {}

  bool test() override {
    if (finished_) return true;
    check_launched();
    DeviceGuard g(device_);
    sh_->check_async(what_);
    cudaError_t q = cudaEventQuery(ev_->done.get());
    if (q == cudaErrorNotReady) return false;
    DM_CHECK_CUDA(q, what_);
    sh_->check_async(what_);  // an error the library noticed while finishing it
    float ms = 0;
    DM_CHECK_CUDA(cudaEventElapsedTime(&ms, ev_->start.get(), ev_->done.get()), what_);
    if (ms * 1e-3 >= kTimedOutFraction * timeout_s_) {
      sh_->abort();
      throw TimeoutError(detail::concat(what_, " took ", ms * 1e-3, " s on the device, ",
                                        kTimedOutFraction * 100, " % or more of the timeout (",
                                        timeout_s_,
                                        " s, DISTMUON_COMM_TIMEOUT_S): a member most likely "
                                        "failed and aborted it, leaving its result undefined; "
                                        "the NCCL communicator was aborted"),
                         __FILE__, __LINE__);
    }
    // Results become visible to the caller's stream without a host round trip.
    DM_CHECK_CUDA(cudaStreamWaitEvent(user_->stream, ev_->done.get(), 0), what_);
    finished_ = true;
    return true;
  }
  bool wait_on_stream() override {
    check_launched();
    DeviceGuard g(device_);
    sh_->check_async(what_);
    DM_CHECK_CUDA(cudaStreamWaitEvent(user_->stream, ev_->done.get(), 0), what_);
    return true;
  }
  void wait(double timeout_s) override {
    comm_detail::poll_until(
        deadline(timeout_s), std::chrono::microseconds(2), std::chrono::microseconds(500),
        [&] { return test(); },
        [&] {
          sh_->abort();
          throw TimeoutError(
              comm_timeout_message(what_, timeout_s) + "; the NCCL communicator was aborted",
              __FILE__, __LINE__);
        });
  }

 private:
  std::shared_ptr<Shared> sh_;
  int device_;
  std::shared_ptr<StreamBinding> user_;
  // Waiting inside grouped() would wait for what is not launched yet (and a stream wait on an
  // unrecorded event orders nothing): a usage error, which CommHandle does not count as a failed
  // operation (launched()).
  void check_launched() const {
    DM_CHECK(ev_->failed.empty(), what_, ": its group's launch failed: ", ev_->failed);
    DM_CHECK(ev_->launched, what_, ": waited on inside grouped(), before the group was launched");
  }
  bool launched() const override { return ev_->launched || !ev_->failed.empty(); }

  std::string what_;
  double timeout_s_;
  std::shared_ptr<LaunchEvents> ev_;
  bool finished_ = false;
};

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::kF64:
      return ncclFloat64;
    case CommType::kF32:
      return ncclFloat32;
    case CommType::kBF16:
      return ncclBfloat16;
    case CommType::kF16:
      return ncclFloat16;
    case CommType::kI32:
      return ncclInt32;
    case CommType::kI64:
      return ncclInt64;
    case CommType::kU8:
      return ncclUint8;
  }
  DM_FAIL("nccl: unknown element type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  DM_FAIL("nccl: unknown reduction");
}

// The communicator whose grouped() is open on this thread: NCCL's group is per thread, so an
// operation of another NCCL communicator issued meanwhile would join it unbeknown to that
// communicator, which would record its completion before the group launched it.
thread_local const void* t_open_group = nullptr;

char* at(void* p, int64_t elems, CommType t) {
  return static_cast<char*>(p) + elems * static_cast<int64_t>(comm_type_size(t));
}
const char* at(const void* p, int64_t elems, CommType t) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(comm_type_size(t));
}

class NcclComm final : public Communicator {
 public:
  NcclComm(std::shared_ptr<Shared> sh, int rank, int size, std::vector<int> world_ranks, int device,
           std::shared_ptr<StreamBinding> user)
      : Communicator(rank, size, sh->name, std::move(world_ranks)),
        sh_(std::move(sh)),
        device_(device),
        user_(std::move(user)),
        stream_(cuda::make_stream()),
        ready_(cuda::make_event(false)),
        scratch_(cuda::device_alloc(2 * static_cast<size_t>(size) * sizeof(int64_t))) {}
  ~NcclComm() override {
    if (getpid() != sh_->pid) return;  // a forked child: the CUDA context is the parent's
    DeviceGuard g(device_);
    cudaStreamSynchronize(stream_.get());
    sh_->device = device_;
    sh_->release_timeout_s = timeout_s();  // ~Shared hands the handle to the Reaper
  }
  Device device() const override { return Device{DeviceKind::kCUDA, device_}; }
  std::optional<void*> caller_stream() const override { return static_cast<void*>(user_->stream); }
  void bind_stream(void* stream) override { user_->stream = static_cast<cudaStream_t>(stream); }

 protected:
  std::unique_ptr<CommRequest> do_all_reduce(const void* send, void* recv, int64_t count,
                                             CommType type, ReduceOp op) override {
    return launch("all_reduce", [&] {
      DM_CHECK_NCCL(
          ncclAllReduce(send, recv, count, nccl_type(type), nccl_op(op), sh_->comm, stream_.get()),
          describe("all_reduce"));
    });
  }
  std::unique_ptr<CommRequest> do_reduce(const void* send, void* recv, int64_t count, CommType type,
                                         ReduceOp op, int root) override {
    // Only the root writes recv; elsewhere it may be null, which NCCL's checks would reject.
    if (!recv) recv = const_cast<void*>(send);
    return launch("reduce", [&] {
      DM_CHECK_NCCL(ncclReduce(send, recv, count, nccl_type(type), nccl_op(op), root, sh_->comm,
                               stream_.get()),
                    describe("reduce"));
    });
  }
  std::unique_ptr<CommRequest> do_broadcast(void* buf, int64_t count, CommType type,
                                            int root) override {
    return launch("broadcast", [&] {
      DM_CHECK_NCCL(ncclBroadcast(buf, buf, count, nccl_type(type), root, sh_->comm, stream_.get()),
                    describe("broadcast"));
    });
  }
  std::unique_ptr<CommRequest> do_all_gather_v(const void* send, int64_t send_count, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
    (void)send_count;
    // Equal counts end to end (Communicator::all_gather; FSDP2-like shards of rows divisible by
    // the members): NCCL's own all-gather, its ring or NVLS, where each member's slot is its send
    // (in place when send is that slot, as NCCL defines it).
    if (regular(recv_counts, recv_displs))
      return launch("all_gather", [&] {
        DM_CHECK_NCCL(
            ncclAllGather(send, recv, recv_counts[0], nccl_type(type), sh_->comm, stream_.get()),
            describe("all_gather"));
      });
    // Otherwise one broadcast per member in a group (NCCL has no all-gather of unequal counts).
    return launch("all_gather_v", [&] {
      DM_CHECK_NCCL(ncclGroupStart(), describe("all_gather_v"));
      for (int q = 0; q < size(); ++q) {
        if (recv_counts[q] == 0) continue;
        void* dst = at(recv, recv_displs[q], type);
        const void* src = q == rank() ? send : dst;
        DM_CHECK_NCCL(
            ncclBroadcast(src, dst, recv_counts[q], nccl_type(type), q, sh_->comm, stream_.get()),
            describe("all_gather_v"));
      }
      DM_CHECK_NCCL(ncclGroupEnd(), describe("all_gather_v"));
    });
  }
  std::unique_ptr<CommRequest> do_all_to_all_v(const void* send,
                                               std::span<const int64_t> send_counts,
                                               std::span<const int64_t> send_displs, void* recv,
                                               std::span<const int64_t> recv_counts,
                                               std::span<const int64_t> recv_displs,
                                               CommType type) override {
#if DM_NCCL_HAS_WINDOWS
    // Equal blocks at the members' places on both sides (the sharded mode's layout on windows):
    // NCCL's own all-to-all, which symmetric windows under the zero-CTA policy move on the copy
    // engines.
    if (regular(send_counts, send_displs) && regular(recv_counts, recv_displs) &&
        send_counts[0] == recv_counts[0])
      return launch("all_to_all", [&] {
        DM_CHECK_NCCL(
            ncclAlltoAll(send, recv, send_counts[0], nccl_type(type), sh_->comm, stream_.get()),
            describe("all_to_all"));
      });
#endif
    return launch("all_to_all_v", [&] {
      const int me = rank();
      if (send_counts[me] > 0)
        DM_CHECK_CUDA(
            cudaMemcpyAsync(at(recv, recv_displs[me], type), at(send, send_displs[me], type),
                            send_counts[me] * comm_type_size(type), cudaMemcpyDeviceToDevice,
                            stream_.get()),
            describe("all_to_all_v"));
      DM_CHECK_NCCL(ncclGroupStart(), describe("all_to_all_v"));
      for (int q = 0; q < size(); ++q) {
        if (q == me) continue;
        if (send_counts[q] > 0)
          DM_CHECK_NCCL(ncclSend(at(send, send_displs[q], type), send_counts[q], nccl_type(type), q,
                                 sh_->comm, stream_.get()),
                        describe("all_to_all_v"));
        if (recv_counts[q] > 0)
          DM_CHECK_NCCL(ncclRecv(at(recv, recv_displs[q], type), recv_counts[q], nccl_type(type), q,
                                 sh_->comm, stream_.get()),
                        describe("all_to_all_v"));
      }
      DM_CHECK_NCCL(ncclGroupEnd(), describe("all_to_all_v"));
    });
  }
  std::shared_ptr<void> alloc_window(size_t bytes) override {
#if DM_NCCL_HAS_WINDOWS
    if (sh_->cta_policy != NCCL_CTA_POLICY_ZERO) return nullptr;
    DeviceGuard g(device_);
    const std::string what = describe("alloc_window");
    DM_CHECK(!in_group(), what, ": not inside grouped()");
    sh_->check_async(what);
    void* p = nullptr;
    DM_CHECK_NCCL(ncclMemAlloc(&p, bytes), what, " (", bytes, " bytes)");
    ncclWindow_t win = nullptr;
    try {
      DM_CHECK_NCCL(ncclCommWindowRegister(sh_->comm, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC),
                    what);
      sh_->wait_ready(what, timeout_s());
    } catch (...) {
      ncclMemFree(p);
      throw;
    }
    if (!win) {  // NCCL has no symmetric memory between these members (and says so: no window)
      ncclMemFree(p);
      return nullptr;
    }
    return std::shared_ptr<void>(p, [sh = sh_, win, device = device_](void* q) {
      DeviceGuard guard(device);
      if (!sh->aborted && getpid() == sh->pid) {
        const ncclResult_t r = ncclCommWindowDeregister(sh->comm, win);
        if (r != ncclSuccess && r != ncclInProgress)
          DM_LOG(kWarn, sh->name, ": ncclCommWindowDeregister failed: ", ncclGetErrorString(r));
      }
      ncclMemFree(q);
    });
#else
    (void)bytes;
    return nullptr;
#endif
  }

  std::unique_ptr<CommRequest> do_barrier() override {
    return launch("barrier", [&] {
      DM_CHECK_NCCL(
          ncclAllReduce(scratch(), scratch(), 1, ncclInt64, ncclSum, sh_->comm, stream_.get()),
          describe("barrier"));
    });
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    DeviceGuard g(device_);
    // Learn every member's (color, key) first, for the new communicator's world ranks; the
    // all-gather's timeout also catches members that never arrive.
    std::vector<int64_t> all(2 * static_cast<size_t>(size()));
    int64_t mine[2] = {color, key};
    DM_CHECK_CUDA(cudaMemcpy(scratch() + 2 * rank(), mine, sizeof(mine), cudaMemcpyHostToDevice),
                  describe("split"));
    all_gather(scratch() + 2 * rank(), scratch(), 2, CommType::kI64).wait();
    DM_CHECK_CUDA(
        cudaMemcpy(all.data(), scratch(), all.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
        describe("split"));
    ncclConfig_t config = comm_config();
    ncclComm_t sub = nullptr;
    DM_CHECK_NCCL(
        ncclCommSplit(sh_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, &config),
        describe("split"));
    sh_->wait_ready(describe("split"), timeout_s());
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;
    for (int q = 0; q < size(); ++q)
      if (all[2 * q] == color) members.emplace_back(all[2 * q + 1], q);
    std::sort(members.begin(), members.end());
    std::vector<int> wr;
    int my_rank = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      wr.push_back(world_ranks()[members[i].second]);
      if (members[i].second == rank()) my_rank = static_cast<int>(i);
    }
    auto sh = std::make_shared<Shared>();
    sh->comm = sub;
    sh->device = device_;
    sh->cta_policy = cta_policy();
    sh->name = name() + "/split(" + std::to_string(color) + ")";
    sh->wait_ready("initialisation of " + sh->name, timeout_s());
    return std::make_unique<NcclComm>(std::move(sh), my_rank, static_cast<int>(members.size()),
                                      std::move(wr), device_, user_);
  }

 private:
  template <typename F>
  std::unique_ptr<CommRequest> launch(const char* op, F&& issue) {
    DeviceGuard g(device_);
    const std::string what = describe(op);
    DM_CHECK(t_open_group == nullptr || t_open_group == this, what,
             ": issued inside another communicator's grouped(); only that communicator's "
             "operations may be");
    sh_->check_async(what);
    // Start after everything the caller issued on its stream (the inputs are ready then).
    DM_CHECK_CUDA(cudaEventRecord(ready_.get(), user_->stream), what);
    DM_CHECK_CUDA(cudaStreamWaitEvent(stream_.get(), ready_.get(), 0), what);
    if (group_) {  // launched with the group (do_group_end)
      issue();
      return std::make_unique<NcclRequest>(sh_, device_, user_, what, timeout_s(), group_);
    }
    auto ev = std::make_shared<LaunchEvents>();
    DM_CHECK_CUDA(cudaEventRecord(ev->start.get(), stream_.get()), what);
    issue();
    sh_->wait_ready(what, timeout_s());
    DM_CHECK_CUDA(cudaEventRecord(ev->done.get(), stream_.get()), what);
    ev->launched = true;
    DM_LOG(kDebug, what, " issued");
    return std::make_unique<NcclRequest>(sh_, device_, user_, what, timeout_s(), std::move(ev));
  }

  bool launches_groups() const override { return true; }
  void do_group_begin() override {
    DeviceGuard g(device_);
    const std::string what = describe("grouped");
    DM_CHECK(t_open_group == nullptr, what,
             ": another communicator's grouped() is open on this thread");
    sh_->check_async(what);
    group_ = std::make_shared<LaunchEvents>();
    DM_CHECK_NCCL(ncclGroupStart(), what);
    t_open_group = this;
    sh_->in_group = true;
  }
  void do_group_end() override {
    DeviceGuard g(device_);
    const std::string what = describe("grouped");
    std::shared_ptr<LaunchEvents> ev = std::move(group_);
    group_.reset();
    // The group's kernels go on the stream at ncclGroupEnd, after the waits each operation
    // recorded: the start event goes just before them. The group is ended whatever happens, so
    // that this thread's NCCL group state is not left open; an abort asked for meanwhile runs
    // after it.
    const cudaError_t recorded = cudaEventRecord(ev->start.get(), stream_.get());
    const ncclResult_t ended = ncclGroupEnd();
    t_open_group = nullptr;
    sh_->in_group = false;
    try {
      if (sh_->abort_pending) {
        sh_->abort_pending = false;
        sh_->abort();
        DM_FAIL(what, ": the communicator ", sh_->name, " was aborted after an error in the group");
      }
      DM_CHECK_CUDA(recorded, what);
      DM_CHECK_NCCL(ended, what);
      sh_->wait_ready(what, timeout_s());
      DM_CHECK_CUDA(cudaEventRecord(ev->done.get(), stream_.get()), what);
    } catch (const std::exception& e) {
      ev->failed = e.what();  // its requests say so instead of "waited on inside grouped()"
      throw;
    }
    ev->launched = true;
    DM_LOG(kDebug, what, " issued");
  }

  int64_t* scratch() const { return static_cast<int64_t*>(scratch_.get()); }

  std::shared_ptr<Shared> sh_;
  int device_;
  std::shared_ptr<StreamBinding> user_;
  cuda::Stream stream_;
  cuda::Event ready_;
  cuda::DevicePtr scratch_;  // a few int64 for the barrier and split exchanges
  std::shared_ptr<LaunchEvents> group_;  // while grouped() issues
};

}  // namespace

bool nccl_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  DM_CHECK_NCCL(ncclGetUniqueId(&id), "nccl");
  NcclUniqueId out;
  static_assert(sizeof(out.bytes) == sizeof(id.internal), "NCCL unique id size changed");
  std::memcpy(out.bytes, id.internal, sizeof(out.bytes));
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& uid, int rank, int size,
                                                     void* stream) {
  DM_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl: rank ", rank, " of ", size,
           " is not valid");
  int device = 0;
  DM_CHECK_CUDA(cudaGetDevice(&device), "nccl: no CUDA device");
  ncclUniqueId id;
  std::memcpy(id.internal, uid.bytes, sizeof(id.internal));
  ncclConfig_t config = comm_config();
  auto sh = std::make_shared<Shared>();
  sh->name = "nccl:world";
  sh->device = device;
  sh->cta_policy = cta_policy();
  DM_CHECK_NCCL(ncclCommInitRankConfig(&sh->comm, size, id, rank, &config),
                "nccl: initialisation of rank ", rank, " of ", size);
  // The first communicator's timeout is the environment's (set_timeout applies afterwards).
  auto binding = std::make_shared<StreamBinding>();
  binding->stream = static_cast<cudaStream_t>(stream);
  auto comm = std::make_unique<NcclComm>(sh, rank, size, std::vector<int>{}, device, binding);
  sh->wait_ready(detail::concat("nccl: initialisation of rank ", rank, " of ", size,
                                " (all members must call make_nccl_communicator with one id)"),
                 comm->timeout_s());
  return comm;
}

}  // namespace distmuon
