// Where each rank's device time goes in one step of the one-GPU cluster: kernel, copy and set
// intervals of every context, collected through CUPTI's activity API. libcupti is loaded at run
// time, so a machine without it runs the cluster without the breakdown (DeviceTrace::open says
// why). Intervals are classed as communication (NCCL's kernels, which include the time a rank
// spends waiting inside them for its peers) or compute (everything else the rank issued).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace distmuon::bench {

struct DeviceInterval {
  uint64_t start = 0, end = 0;  // ns, CUPTI's clock (DeviceTrace::now)
  uint32_t context = 0;
  bool comm = false;
};

// One rank's step, from its intervals inside [begin, end]:
//   compute  the union of its compute intervals
//   comm     the union of its NCCL intervals not under compute (communication not hidden)
//   overlap  NCCL time under compute
//   wait     the rest of the window: the device idle for this rank (host issue, skew)
struct StepBreakdown {
  double window_ms = 0, compute_ms = 0, comm_ms = 0, overlap_ms = 0, wait_ms = 0;
};
StepBreakdown break_down(const std::vector<DeviceInterval>& all, uint32_t context, uint64_t begin,
                         uint64_t end);

class DeviceTrace {
 public:
  // nullptr, with the reason in *why, where libcupti cannot be loaded or initialised.
  static std::unique_ptr<DeviceTrace> open(std::string* why);
  ~DeviceTrace();
  // CUPTI's id of a context (a CUcontext).
  uint32_t context_id(void* context) const;
  uint64_t now() const;  // ns
  // Records from start() to stop(); stop() flushes and returns what was recorded since start().
  void start();
  std::vector<DeviceInterval> stop();

  struct Api;  // the CUPTI functions, resolved at run time

 private:
  explicit DeviceTrace(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

}  // namespace distmuon::bench
