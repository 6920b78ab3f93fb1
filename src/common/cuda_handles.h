// RAII owners of CUDA runtime resources, shared by the CUDA backend, the NCCL communicator, the
// tests and the benchmarks: a stream, an event, a device allocation and a CUDA graph (and its
// capture). Destructors never throw.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "common/cuda_check.h"

namespace distmuon::cuda {

template <typename T, typename Deleter>
class Handle {
 public:
  Handle() = default;
  explicit Handle(T h) : h_(h) {}
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, T{})) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, T{});
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }
  void reset() {
    if (h_) Deleter{}(h_);
    h_ = T{};
  }
  T get() const { return h_; }
  explicit operator bool() const { return h_ != T{}; }

 private:
  T h_{};
};

struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct GraphDeleter {
  void operator()(cudaGraph_t g) const { cudaGraphDestroy(g); }
};
struct GraphExecDeleter {
  void operator()(cudaGraphExec_t g) const { cudaGraphExecDestroy(g); }
};

using Stream = Handle<cudaStream_t, StreamDeleter>;
using Event = Handle<cudaEvent_t, EventDeleter>;
using DevicePtr = Handle<void*, DeviceFree>;
using Graph = Handle<cudaGraph_t, GraphDeleter>;
using GraphExec = Handle<cudaGraphExec_t, GraphExecDeleter>;

inline Stream make_stream() {
  cudaStream_t s = nullptr;
  DM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s);
}
inline Event make_event(bool timing = true) {
  cudaEvent_t e = nullptr;
  DM_CHECK_CUDA(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return Event(e);
}
inline DevicePtr device_alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes) DM_CHECK_CUDA(cudaMalloc(&p, bytes));
  return DevicePtr(p);
}
// The work f() issues on `stream`, captured into an executable graph. The capture fails if f
// synchronises with the host; if f throws, the capture is ended before the exception leaves.
template <typename F>
GraphExec capture_graph(cudaStream_t stream, F&& f) {
  cudaGraph_t raw = nullptr;
  DM_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    f();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &raw) == cudaSuccess && raw) cudaGraphDestroy(raw);
    throw;
  }
  DM_CHECK_CUDA(cudaStreamEndCapture(stream, &raw));
  Graph graph(raw);
  cudaGraphExec_t exec = nullptr;
  DM_CHECK_CUDA(cudaGraphInstantiate(&exec, raw, 0));
  return GraphExec(exec);
}

}  // namespace distmuon::cuda
