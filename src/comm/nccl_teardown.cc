// The teardown of the NCCL communicators a process lets go (nccl_teardown.h).
#include "comm/nccl_teardown.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/log.h"
#include "distmuon/comm.h"

namespace distmuon {
namespace {

// Tears NCCL communicators down off the caller's thread. NCCL's orderly teardown
// (ncclCommFinalize, then ncclCommDestroy) completes only when every member has let go, and
// members may let go at different moments (Python collects an optimizer whenever its own
// allocations say so). Measured on 2-4 NCCL ranks of one GPU (H100, H200):
// - waited for in the destructor, GIL held, it kept the other ranks waiting in torch's
//   collectives for a timeout per communicator;
// - a non-blocking finalize issued from the caller's thread, even unwaited, held up that
//   thread's next collective on another communicator (NCCL's group jobs are per thread);
// - left entirely to other threads, the memory came back a test late (17.5 GB in use after the
//   4-rank HSDP engine test against 10.5 when the destructor waited);
// - ncclCommAbort is local but kept the memory long enough that the 4-rank tests ran out of it.
// So each communicator is torn down on a detached thread of its own, which aborts it past its
// timeout, and the caller waits for it only briefly (start_nccl_teardown). Nothing is joined,
// so a forked child (data loader workers) inherits nothing to wait for; at exit the owning
// process gives the teardowns in flight a short grace.
class Teardowns {
 public:
  static Teardowns& instance() {
    static Teardowns* t = new Teardowns();  // never freed: a thread may outlive static objects
    return *t;
  }
  // Starts the teardown and waits for it up to kCallerWait: when every member lets go at once
  // (an engine or a test that ends on all ranks) it should be done by then, so that its memory
  // is back before the caller builds the next communicators; a member that lets go alone goes
  // on after kCallerWait.
  void start(ncclComm_t comm, int device, double timeout_s, std::string name) {
    auto done = std::make_shared<Done>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!exit_hook_) {
        exit_hook_ = true;
        std::atexit([] { instance().drain_at_exit(); });
      }
      ++in_flight_;
    }
    std::thread([this, done, comm, device, timeout_s, name = std::move(name)] {
      const Ended ended = tear_down(comm, device, timeout_s, name);
      {
        std::lock_guard<std::mutex> lock(done->mu);
        done->yes = true;
      }
      done->cv.notify_all();
      std::lock_guard<std::mutex> lock(mu_);  // one snapshot sees it in flight or ended, once
      --in_flight_;
      if (ended == Ended::kDestroyed) ++destroyed_;
      if (ended == Ended::kAborted) ++aborted_;
      cv_.notify_all();
    }).detach();
    // A caller whose last wait ran out lets its peers' lateness be known: the next teardowns
    // (an engine holds several communicators) do not wait again, so a rank dropping an engine
    // alone pays kCallerWait once, not once per communicator.
    thread_local std::chrono::steady_clock::time_point last_late{};
    const auto now = std::chrono::steady_clock::now();
    if (now - last_late < kLateMemory) return;
    std::unique_lock<std::mutex> lock(done->mu);
    if (!done->cv.wait_for(lock, kCallerWait, [&] { return done->yes; }))
      last_late = std::chrono::steady_clock::now();
  }
  NcclTeardowns counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return {in_flight_, destroyed_, aborted_};
  }
  bool wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return in_flight_ == 0; });
  }

 private:
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool yes = false;
  };
  static constexpr std::chrono::seconds kCallerWait{1};
  static constexpr std::chrono::seconds kLateMemory{5};
  static constexpr std::chrono::seconds kExitGrace{5};

  enum class Ended { kDestroyed, kAborted, kLeft };
  Ended tear_down(ncclComm_t comm, int device, double timeout_s, const std::string& name) {
    cudaSetDevice(device);
    ncclResult_t r = ncclCommFinalize(comm);  // non-blocking: NCCL's own thread waits
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout_s));
    while (r == ncclSuccess || r == ncclInProgress) {
      ncclCommGetAsyncError(comm, &r);
      if (r != ncclInProgress || exiting_ || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (r == ncclSuccess) {
      ncclCommDestroy(comm);  // local now: the members are done
      return Ended::kDestroyed;
    }
    if (exiting_) return Ended::kLeft;  // the process is ending: the driver takes it all back
    DM_LOG(kWarn, "nccl: ", name,
           r == ncclInProgress ? " was not let go by every member in time" : " failed to finalize",
           "; aborted instead (its device memory may come back late)");
    ncclCommAbort(comm);
    return Ended::kAborted;
  }
  void drain_at_exit() {
    // A forked child: the threads (and the lock) are the parent's.
    if (getpid() != owner_pid_) return;
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, kExitGrace, [&] { return in_flight_ == 0; }))
      exiting_ = true;  // what is left stops touching NCCL and CUDA; exit goes on
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t in_flight_ = 0, destroyed_ = 0, aborted_ = 0;
  bool exit_hook_ = false;
  std::atomic<bool> exiting_{false};
  const pid_t owner_pid_ = getpid();
};

}  // namespace

namespace comm_detail {
void start_nccl_teardown(ncclComm_t comm, int device, double timeout_s, std::string name) {
  Teardowns::instance().start(comm, device, timeout_s, std::move(name));
}
}  // namespace comm_detail

NcclTeardowns nccl_teardowns() { return Teardowns::instance().counts(); }
bool wait_for_nccl_teardowns(double timeout_s) { return Teardowns::instance().wait(timeout_s); }

}  // namespace distmuon
