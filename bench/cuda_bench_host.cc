// distmuon-cuda-bench --host-issue: where an eager step's host time goes. The distributed modes
// issue their steps eagerly (only a single-process engine replays a graph), and on
// deepseek-v2-lite's many small matrices five eager steps issued back to back took 32 ms of host
// time each for about 200 operations, against about 12 us per operation on gpt2-small (one step
// alone: 2.37 ms, the 32 ms were a full launch queue; H200). For each
// shape class of each workload this times, on the host, one call of each operation an
// orthogonalization issues (the symmetric product with its mirror, in both of its sizes; the
// dense product Q X; a linear combination) and one whole solve per algorithm, with the device
// time of the same call (graph replay) beside it.
//
// First, per workload, one eager engine step's host time, alone and back to back.
// Host time: `kCalls` calls issued back to back after a device synchronisation (so that a full
// launch queue never blocks the issue), the median of `kRounds` such bursts, per call.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include "cuda_bench.h"
#include "distmuon/engine.h"
#include "distmuon/ortho.h"
#include "measure/tuner.h"

namespace distmuon::bench {

using nlohmann::json;

namespace {

constexpr int kCalls = 10;
constexpr int kRounds = 3;

// Median over kRounds bursts of the host microseconds one call of f takes to issue.
double host_us(CudaBackend& be, const std::function<void()>& f) {
  f();  // plans, kernel attributes
  std::vector<double> t;
  for (int r = 0; r < kRounds; ++r) {
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) f();
    const auto t1 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls);
  }
  be.synchronize();
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

json time_op(CudaBackend& be, const std::function<void()>& f) {
  return {{"host_us", host_us(be, f)}, {"device_us", graph_ms(be, kCalls, f) * 1e3}};
}

json class_row(CudaBackend& be, const ShapeClass& s) {
  const int64_t c = s.count, m = s.rows, n = s.cols;
  std::vector<Buffer> keep;
  const DType t = DType::kBF16;
  const float sx = 1.0f / static_cast<float>(std::sqrt(double(m) * double(n)));
  BatchRef x = dev_batch(be, keep, t, c, m, n, 21, sx);
  BatchRef y = dev_batch(be, keep, t, c, m, n, 22, 1.0f);
  BatchRef r = dev_batch(be, keep, t, c, m, m, 23, 1.0f);
  BatchRef z = dev_batch(be, keep, t, c, m, m, 24, 1.0f);
  be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, r);  // R symmetric
  json row = {{"rows", m}, {"cols", n}, {"count", c}};
  row["sym_xxt"] = time_op(be, [&] { be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, z); });
  row["sym_rr"] = time_op(be, [&] { be.gemm_symmetric(Op::kN, r, Op::kN, r, 1.0, 0.0, nullptr, z); });
  row["dense_qx"] = time_op(be, [&] { be.gemm(Op::kN, r, Op::kN, x, 1.0, 0.0, nullptr, y); });
  row["lincomb"] = time_op(be, [&] { be.lincomb(1.0, r, 0.5, &r, 1.0, z); });
  OrthoConfig base;
  base.work_dtype = DType::kBF16;
  Orthogonalizer ortho(be);
  for (const measure::AlgoCandidate& k : measure::tuner_candidates()) {
    const OrthoConfig cfg = resolve(measure::config_of(k, base), m, n);
    BatchRef w = BatchRef::packed(nullptr, iteration_dtype(cfg), c, m, n);
    keep.push_back(be.alloc(w.bytes()));
    w.data = keep.back().data();
    const size_t ws_bytes = Orthogonalizer::workspace_bytes(cfg, c, m, n);
    keep.push_back(be.alloc(std::max<size_t>(ws_bytes, 1)));
    void* ws = keep.back().data();
    be.scale_copy(x, false, ScaleSpec{}, w);
    // The solve runs in place on w: its values drift from call to call, the work does not.
    row["solve " + measure::candidate_name(k)] =
        time_op(be, [&] { ortho.run(cfg, w, w, ws, ws_bytes); });
  }
  return row;
}

// One eager step() of the workload's Muon matrices (fp32, `auto` by the heuristic, graphs off:
// as the distributed modes issue): its host time after a device synchronisation (median of 5),
// and the host time per step of 5 steps issued back to back, which the launch queue caps once it
// fills (the host then waits for the device: deepseek-v2-lite's 32 ms per step came from that).
json eager_step(CudaBackend& be, const std::string& spec) {
  const Workload w = workload_of(parse_workload_spec(spec));
  EngineOptions eo;
  eo.autotune = AutoTune::kOff;
  eo.graphs = false;
  Engine engine(be, eo);
  GroupOptions g;
  g.muon.ortho.iteration = Iteration::kAuto;
  g.muon.ortho.work_dtype = DType::kBF16;
  engine.add_group(g);
  std::vector<Buffer> keep;
  std::vector<ParamData> data = add_workload_params(engine, be, w, keep, 300);
  engine.step(data);  // set-up: buffers, plans
  using clock = std::chrono::steady_clock;
  std::vector<double> single;
  for (int k = 0; k < 5; ++k) {
    be.synchronize();
    const auto t0 = clock::now();
    engine.step(data);
    single.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  be.synchronize();
  std::sort(single.begin(), single.end());
  const auto t0 = clock::now();
  for (int k = 0; k < 5; ++k) engine.step(data);
  const double burst = std::chrono::duration<double, std::milli>(clock::now() - t0).count() / 5;
  be.synchronize();
  const double device = cuda::time_ms(be, 5, [&] { engine.step(data); });
  std::fprintf(stderr, "[host-issue] %s eager step: host %.2f ms alone, %.2f ms per step of 5 back "
               "to back, device %.2f ms\n", spec.c_str(), single[2], burst, device);
  return {{"host_ms_alone", single[2]}, {"host_ms_back_to_back", burst}, {"device_ms", device},
          {"matrices", w.muon_matrices()}};
}

}  // namespace

json host_issue(CudaBackend& be, const std::vector<std::string>& specs) {
  json out = json::array();
  for (const std::string& spec : specs) {
    const std::vector<ShapeClass> cls = classes_of(workload_of(parse_workload_spec(spec)));
    json jw = {{"workload", spec}, {"eager_step", eager_step(be, spec)}, {"classes", json::array()}};
    std::fprintf(stderr, "[host-issue] %s: us per call, host / device\n", spec.c_str());
    for (const ShapeClass& s : cls) {
      json row = class_row(be, s);
      std::string line;
      for (const auto& [k, v] : row.items())
        if (v.is_object()) {
          char buf[96];
          std::snprintf(buf, sizeof(buf), " %s %.0f/%.0f", k.c_str(), v["host_us"].get<double>(),
                        v["device_us"].get<double>());
          line += buf;
        }
      std::fprintf(stderr, "  %lld x %lldx%lld:%s\n", (long long)s.count, (long long)s.rows,
                   (long long)s.cols, line.c_str());
      jw["classes"].push_back(row);
    }
    out.push_back(jw);
  }
  return out;
}

}  // namespace distmuon::bench
