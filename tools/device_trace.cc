#include "device_trace.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "distmuon/error.h"

#if DISTMUON_TOOLS_HAVE_CUDA
#include <cupti_activity.h>
#include <dlfcn.h>
#endif

namespace distmuon::bench {
namespace {

// Total length of the union of [start, end) intervals.
double union_ns(std::vector<std::pair<uint64_t, uint64_t>> v) {
  std::sort(v.begin(), v.end());
  double total = 0;
  uint64_t cur_s = 0, cur_e = 0;
  bool open = false;
  for (auto [s, e] : v) {
    if (open && s <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) total += static_cast<double>(cur_e - cur_s);
    cur_s = s;
    cur_e = e;
    open = true;
  }
  if (open) total += static_cast<double>(cur_e - cur_s);
  return total;
}

}  // namespace

StepBreakdown break_down(const std::vector<DeviceInterval>& all, uint32_t context, uint64_t begin,
                         uint64_t end) {
  std::vector<std::pair<uint64_t, uint64_t>> compute, comm, any;
  for (const DeviceInterval& i : all) {
    if (i.context != context || i.end <= begin || i.start >= end) continue;
    const std::pair<uint64_t, uint64_t> c{std::max(i.start, begin), std::min(i.end, end)};
    (i.comm ? comm : compute).push_back(c);
    any.push_back(c);
  }
  StepBreakdown b;
  const double u_compute = union_ns(compute), u_comm = union_ns(comm), u_any = union_ns(any);
  b.window_ms = static_cast<double>(end - begin) * 1e-6;
  b.compute_ms = u_compute * 1e-6;
  b.comm_ms = (u_any - u_compute) * 1e-6;
  b.overlap_ms = (u_compute + u_comm - u_any) * 1e-6;
  b.wait_ms = b.window_ms - u_any * 1e-6;
  return b;
}

#if DISTMUON_TOOLS_HAVE_CUDA

struct DeviceTrace::Api {
  void* lib = nullptr;
  CUptiResult (*activity_enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*activity_disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc,
                                    CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*timestamp)(uint64_t*) = nullptr;
  CUptiResult (*context_id)(CUcontext, uint32_t*) = nullptr;
};

namespace {

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

// CUPTI hands completed buffers to a C callback: one collector per process.
std::mutex g_mu;
std::vector<DeviceInterval> g_intervals;
DeviceTrace::Api* g_api = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<DeviceInterval> got;
  CUpti_Activity* rec = nullptr;
  while (g_api && g_api->next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        const bool nccl =
            k->name && std::string_view(k->name).find("nccl") != std::string_view::npos;
        got.push_back({k->start, k->end, k->contextId, nccl});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        got.push_back({m->start, m->end, m->contextId, false});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        got.push_back({m->start, m->end, m->contextId, false});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_intervals.insert(g_intervals.end(), got.begin(), got.end());
}

template <class F>
bool resolve(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  return f != nullptr;
}

}  // namespace

std::unique_ptr<DeviceTrace> DeviceTrace::open(std::string* why) {
  auto api = std::make_unique<Api>();
  for (const char* name : {"libcupti.so", "libcupti.so.13", "libcupti.so.12"})
    if ((api->lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
  if (!api->lib) {
    if (why)
      *why = "libcupti could not be loaded (add the CUDA toolkit's CUPTI to LD_LIBRARY_PATH)";
    return nullptr;
  }
  Api& a = *api;
  if (!resolve(a.lib, "cuptiActivityEnable", a.activity_enable) ||
      !resolve(a.lib, "cuptiActivityDisable", a.activity_disable) ||
      !resolve(a.lib, "cuptiActivityRegisterCallbacks", a.register_callbacks) ||
      !resolve(a.lib, "cuptiActivityFlushAll", a.flush_all) ||
      !resolve(a.lib, "cuptiActivityGetNextRecord", a.next_record) ||
      !resolve(a.lib, "cuptiGetTimestamp", a.timestamp) ||
      !resolve(a.lib, "cuptiGetContextId", a.context_id)) {
    if (why) *why = "libcupti lacks the activity API";
    return nullptr;
  }
  g_api = api.get();
  if (a.register_callbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    g_api = nullptr;
    if (why) *why = "CUPTI refused the activity callbacks (another profiler attached?)";
    return nullptr;
  }
  return std::unique_ptr<DeviceTrace>(new DeviceTrace(std::move(api)));
}

DeviceTrace::DeviceTrace(std::unique_ptr<Api> api) : api_(std::move(api)) {}

DeviceTrace::~DeviceTrace() {
  if (!api_) return;
  for (CUpti_ActivityKind k : kKinds) api_->activity_disable(k);
  api_->flush_all(1);
  g_api = nullptr;  // the library stays loaded: CUPTI may still call back during exit
}

uint32_t DeviceTrace::context_id(void* context) const {
  uint32_t id = 0;
  api_->context_id(static_cast<CUcontext>(context), &id);
  return id;
}

uint64_t DeviceTrace::now() const {
  uint64_t t = 0;
  api_->timestamp(&t);
  return t;
}

void DeviceTrace::start() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_intervals.clear();
  }
  for (CUpti_ActivityKind k : kKinds)
    DM_CHECK(api_->activity_enable(k) == CUPTI_SUCCESS, "CUPTI: cannot enable activity kind ",
             static_cast<int>(k));
}

std::vector<DeviceInterval> DeviceTrace::stop() {
  for (CUpti_ActivityKind k : kKinds) api_->activity_disable(k);
  api_->flush_all(1);  // forced: buffers still being filled are handed over too
  std::lock_guard<std::mutex> lock(g_mu);
  return std::move(g_intervals);
}

#else  // no CUDA in this build

struct DeviceTrace::Api {};
std::unique_ptr<DeviceTrace> DeviceTrace::open(std::string* why) {
  if (why) *why = "this build has no CUDA";
  return nullptr;
}
DeviceTrace::DeviceTrace(std::unique_ptr<Api> api) : api_(std::move(api)) {}
DeviceTrace::~DeviceTrace() = default;
uint32_t DeviceTrace::context_id(void*) const { return 0; }
uint64_t DeviceTrace::now() const { return 0; }
void DeviceTrace::start() {}
std::vector<DeviceInterval> DeviceTrace::stop() { return {}; }

#endif

}  // namespace distmuon::bench
