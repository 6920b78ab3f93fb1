// Helpers shared by the parts of distmuon-cuda-bench (cuda_bench.cc: ceilings, products,
// workloads; cuda_bench_cache.cc: CacheMuon on the device).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "backend/cuda/cuda_handles.h"
#include "backend/cuda/launch/launchers.h"
#include "backend/cuda/tune/autotune.h"
#include "distmuon/cuda_backend.h"

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

// CacheMuon hit against a fresh solve on qwen2.5-7b's MLP shapes (24 x 3584 x 18944: 8 layers
// of gate, up and down in one batch), exact and probe residuals.
nlohmann::json cache_hit_cost(CudaBackend& be);
// The masked dense product Q X on the same shapes, tiles row by row and column by column, against
// cuBLASLt's unmasked product (what the kernel's tile order costs).
nlohmann::json masked_dense_order(CudaBackend& be);
// gpt2-small engine steps with the cache off and on (gamma 2) under drifting gradients: device
// time per step, host issue time, hit rate, and a captured step (no host synchronisation).
nlohmann::json cache_engine_drift(CudaBackend& be, int steps);

}  // namespace distmuon::bench
