// Helpers shared by the parts of distmuon-cuda-bench (cuda_bench.cc: ceilings, products,
// workloads; cuda_bench_cache.cc: CacheMuon on the device).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_handles.h"
#include "backend/cuda/launch/launchers.h"
#include "backend/cuda/tune/autotune.h"
#include "distmuon/cuda_backend.h"
#include "distmuon/engine.h"
#include "distmuon/workload.h"

namespace distmuon::bench {

// A fresh device batch of N(0, scale^2) values, kept alive by `keep`.
inline BatchRef dev_batch(Backend& be, std::vector<Buffer>& keep, DType t, int64_t c, int64_t r,
                          int64_t k, uint64_t seed, float scale) {
  BatchRef b = BatchRef::packed(nullptr, t, c, r, k);
  keep.push_back(be.alloc(b.bytes()));
  b.data = keep.back().data();
  cuda::launch_fill_normal(b.data, t, c * r * k, seed, scale,
                           static_cast<CudaBackend&>(be).stream());
  return b;
}

// GPU time of one call of f: `reps` calls captured in one CUDA graph, replayed, divided. The
// capture itself fails if f synchronises with the host.
template <typename F>
double graph_ms(CudaBackend& be, int reps, F&& f) {
  f();
  be.synchronize();
  cuda::GraphExec exec = cuda::capture_graph(be.stream(), [&] {
    for (int i = 0; i < reps; ++i) f();
  });
  return cuda::time_ms(be, 5, [&] { DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream())); }) / reps;
}

// Shape classes as the engine batches them: tall and wide weights of the same sides together,
// in the wide orientation (m = rows <= n = cols).
struct ShapeClass {
  int64_t rows, cols, count;
};

// (m, n, matrices) of one tensor: 2D as is, 3D a stack of matrices, 4D (out, in * kh * kw).
inline std::tuple<int64_t, int64_t, int64_t> wide_of(const std::vector<int64_t>& sh) {
  int64_t r = sh[0], c = 1, per = 1;
  if (sh.size() == 2) c = sh[1];
  if (sh.size() == 3) { per = sh[0]; r = sh[1]; c = sh[2]; }
  if (sh.size() == 4) c = sh[1] * sh[2] * sh[3];
  return {std::min(r, c), std::max(r, c), per};
}

inline std::vector<ShapeClass> classes_of(const Workload& w) {
  std::vector<ShapeClass> out;
  for (const WorkloadEntry& e : w.muon) {
    const auto [m, n, per] = wide_of(e.shape);
    bool found = false;
    for (ShapeClass& s : out)
      if (s.rows == m && s.cols == n) { s.count += e.count * per; found = true; }
    if (!found) out.push_back({m, n, e.count * per});
  }
  return out;
}

// A workload spec: a built-in name or JSON file path, optionally ":K" for its first K layers
// ("qwen2.5-7b:8").
struct WorkloadSpec {
  std::string name;
  int64_t layers = 0;  // 0: all
};
inline WorkloadSpec parse_workload_spec(const std::string& spec) {
  const size_t colon = spec.rfind(':');
  const bool layered = colon != std::string::npos && colon + 1 < spec.size() &&
                       spec.find_first_not_of("0123456789", colon + 1) == std::string::npos;
  if (!layered) return {spec, 0};
  return {spec.substr(0, colon), std::stoll(spec.substr(colon + 1))};
}
inline Workload workload_of(const WorkloadSpec& s) {
  Workload w = load_workload(s.name);
  return s.layers > 0 ? w.first_layers(s.layers) : w;
}

// The workload's Muon matrices registered with `engine` as fp32 parameters of group 0, with
// random weights and gradients on the device (seeds counting up from `seed`), kept alive by
// `keep`: the data a step() takes.
inline std::vector<ParamData> add_workload_params(Engine& engine, Backend& be, const Workload& w,
                                                  std::vector<Buffer>& keep, uint64_t seed) {
  std::vector<ParamData> data;
  for (const WorkloadEntry& e : w.muon)
    for (int64_t l = 0; l < e.count; ++l) {
      int64_t numel = 1;
      for (int64_t d : e.shape) numel *= d;
      engine.add_param({e.name + "." + std::to_string(l), 0, e.shape, DType::kF32});
      BatchRef wt = dev_batch(be, keep, DType::kF32, 1, 1, numel, seed++, 0.02f);
      BatchRef gr = dev_batch(be, keep, DType::kF32, 1, 1, numel, seed++, 1e-3f);
      data.push_back({wt.data, gr.data, DType::kF32, {}});
    }
  return data;
}

// `auto` against ns5, ns5-sym and Gram NS {2} on every shape class of `workloads` (cuda_bench_auto.cc).
nlohmann::json auto_check(CudaBackend& be, const std::vector<std::string>& workloads, int rounds);

// Host and device microseconds per call of each operation and solve of an eager step, per shape
// class of `workloads` (cuda_bench_host.cc).
nlohmann::json host_issue(CudaBackend& be, const std::vector<std::string>& workloads);

// CacheMuon hit against a fresh solve on qwen2.5-7b's MLP shapes (24 x 3584 x 18944: 8 layers
// of gate, up and down in one batch), exact and probe residuals.
nlohmann::json cache_hit_cost(CudaBackend& be);
// The same on the quality study's launch-bound MLP shapes: the 6 x 384 model's 12 x 384 x 1536
// and the 12 x 768 model's 24 x 768 x 3072.
nlohmann::json cache_hit_cost_small(CudaBackend& be);
nlohmann::json cache_hit_cost_medium(CudaBackend& be);
nlohmann::json conditional_overhead(CudaBackend& be);
// The masked dense product Q X on the same shapes, tiles row by row and column by column, against
// cuBLASLt's unmasked product (what the kernel's tile order costs).
nlohmann::json masked_dense_order(CudaBackend& be);
// gpt2-small engine steps with the cache off and on (gamma 2) under drifting gradients: device
// time per step, host issue time, hit rate, and a captured step (no host synchronisation).
nlohmann::json cache_engine_drift(CudaBackend& be, int steps);

}  // namespace distmuon::bench
