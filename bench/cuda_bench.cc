// distmuon-cuda-bench: the H200 measurements of issue 6 in one process, side by side.
//  1. ceilings: dense bf16 GEMM rate (8192^3, cuBLASLt) and device copy bandwidth;
//  2. X X^T of a 4096 x 16384 bf16 input: each lower-triangle kernel vs cuBLASLt's dense product;
//  3. CacheMuon: a cache hit against a fresh solve on qwen's MLP shapes, and gpt2-small engine
//     steps with the cache under drifting gradients (cuda_bench_cache.cc);
//  4. per workload: the autotuner per shape class, then whole optimizer steps (Muon matrices,
//     fp32 parameters, random gradients, `auto` resolved by the engine from the measurement
//     store)
//     timed eagerly and as a replayed CUDA graph, and the floor (counted FLOPs of the cheapest
//     algorithm over the GEMM rate + 20 bytes per parameter over the copy bandwidth).
// With --auto-check, instead: `auto` against each algorithm on every shape class
// (cuda_bench_auto.cc); with --host-issue, the host time of each operation of an eager step
// (cuda_bench_host.cc).
// Writes one JSON file; bench/make_report.py merges it with the torch baselines.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "cuda_bench.h"
#include "distmuon/engine.h"
#include "distmuon/workload.h"
#include "measure/store.h"
#include "measure/tuner.h"

namespace distmuon::bench {
namespace {

using nlohmann::json;
using cuda::time_ms;

struct Opts {
  std::vector<std::string> workloads = {"gpt2-small", "gpt2-large", "pi0", "qwen2.5-7b:8"};
  std::string json_path = "cuda_bench.json";
  int steps = 10;
  bool micro = true, tune = true, cache = true, cache_hit = true;
  bool auto_check = false;  // only the check of `auto` against each algorithm (cuda_bench_auto.cc)
  int rounds = 3;           // its interleaved measurement rounds
  bool host_issue = false;  // only the host time per operation (cuda_bench_host.cc)
};

// Per-operation GPU times on gpt2-small's shapes (12 matrices, m = 768), graph-replayed so that
// launch gaps do not count: where a small-matrix step spends its time.
json breakdown(CudaBackend& be) {
  json j;
  std::vector<Buffer> keep;
  const int64_t c = 12, m = 768, n = 2304;
  BatchRef x = dev_batch(be, keep, DType::kF16, c, m, n, 11, 1.0f / 48);
  BatchRef r = dev_batch(be, keep, DType::kF16, c, m, m, 12, 1.0f / 28);
  BatchRef z = dev_batch(be, keep, DType::kF16, c, m, m, 13, 1.0f);
  BatchRef o = dev_batch(be, keep, DType::kF16, c, m, m, 14, 1.0f);
  BatchRef y = dev_batch(be, keep, DType::kF16, c, m, n, 15, 1.0f);
  be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, r);  // symmetric R
  be.gemm_symmetric(Op::kN, r, Op::kN, r, 1.0, 0.0, nullptr, z);  // symmetric Z
  for (SymKernel s : {SymKernel::kDenseMirror, SymKernel::kTri128, SymKernel::kTri256x128,
                      SymKernel::kTri128Cluster2, SymKernel::kTri128Pingpong}) {
    be.set_sym_kernel(s);
    j[std::string("sym_768x768x768_") + sym_kernel_name(s)] =
        graph_ms(be, 20, [&] { be.gemm_symmetric(Op::kN, r, Op::kN, z, 1.0, 0.5, &r, o); });
    j[std::string("sym_768x768x2304_") + sym_kernel_name(s)] =
        graph_ms(be, 20, [&] { be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, o); });
  }
  be.set_sym_kernel(SymKernel::kAuto);
  j["dense_768x768x768"] = graph_ms(be, 20, [&] { be.gemm(Op::kN, r, Op::kN, z, 1.0, 0.5, &r, o); });
  j["dense_QX_768x2304x768"] = graph_ms(be, 20, [&] { be.gemm(Op::kN, r, Op::kN, x, 1.0, 0.0, nullptr, y); });
  j["mirror_768"] = graph_ms(be, 20, [&] { cuda::launch_mirror(o, be.stream()); });
  j["lincomb_768"] = graph_ms(be, 20, [&] { be.lincomb(1.0, z, 0.0, nullptr, 3.4, o); });
  // Fused passes on 12 fp32 768 x 2304 matrices (tall: the transposing kernels).
  std::vector<MuonSlot> slots;
  const std::vector<MuonUpdateCoef> coef(c, {0.99f, 0.01f});
  const float mu_host = 0.95f;
  keep.push_back(be.alloc(sizeof(MuonUpdateCoef) * c));
  const MuonUpdateCoef* dcoef = keep.back().as<MuonUpdateCoef>();
  be.upload_small(keep.back().data(), coef.data(), sizeof(MuonUpdateCoef) * c);
  keep.push_back(be.alloc(sizeof(float)));
  const float* mu = keep.back().as<float>();
  be.upload_small(keep.back().data(), &mu_host, sizeof(float));
  for (int64_t i = 0; i < c; ++i) {
    BatchRef g = dev_batch(be, keep, DType::kF32, 1, n, m, 20 + i, 1e-3f);
    BatchRef b = dev_batch(be, keep, DType::kF32, 1, n, m, 40 + i, 1e-3f);
    BatchRef w = dev_batch(be, keep, DType::kF32, 1, n, m, 60 + i, 0.02f);
    slots.push_back({g.matrix(0), b.matrix(0), w.matrix(0), nullptr, dcoef + i});
  }
  Buffer nb = be.alloc(sizeof(double) * c), sb = be.alloc(sizeof(int32_t) * c);
  BatchRef xb = dev_batch(be, keep, DType::kBF16, c, m, n, 99, 1.0f);
  const double bytes = double(c) * m * n;
  const double t1 = graph_ms(be, 10, [&] { be.muon_momentum_norm(slots, mu, true, nb.as<double>(), sb.as<int32_t>()); });
  const double t2 = graph_ms(be, 10, [&] {
    be.muon_momentum_apply(slots, mu, true, sb.as<int32_t>(), {nb.as<double>(), 1.0, 1e-7, 1.0}, true, xb);
  });
  const double t3 = graph_ms(be, 10, [&] { be.muon_update(slots, sb.as<int32_t>(), xb, true); });
  j["muon_norm_ms"] = t1;
  j["muon_apply_t_ms"] = t2;
  j["muon_update_t_ms"] = t3;
  j["muon_norm_tbps"] = 8 * bytes / (t1 * 1e-3) / 1e12;
  j["muon_apply_t_tbps"] = 14 * bytes / (t2 * 1e-3) / 1e12;
  j["muon_update_t_tbps"] = 10 * bytes / (t3 * 1e-3) / 1e12;
  for (auto& [k, v] : j.items()) std::fprintf(stderr, "[breakdown] %-32s %.4f\n", k.c_str(), v.get<double>());
  return j;
}

json micro(CudaBackend& be, double& tflops, double& tbps) {
  json j;
  std::vector<Buffer> keep;
  {
    const int64_t n = 8192;
    BatchRef a = dev_batch(be, keep, DType::kBF16, 1, n, n, 1, 1.0f);
    BatchRef b = dev_batch(be, keep, DType::kBF16, 1, n, n, 2, 1.0f);
    BatchRef c = dev_batch(be, keep, DType::kBF16, 1, n, n, 3, 1.0f);
    const double ms = time_ms(be, 20, [&] { be.gemm(Op::kN, a, Op::kN, b, 1.0, 0.0, nullptr, c); });
    tflops = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
    j["gemm_8192_ms"] = ms;
    std::fprintf(stderr, "[micro] dense bf16 8192^3: %.3f ms, %.0f TFLOP/s\n", ms, tflops);
  }
  {
    const size_t bytes = size_t{4} << 30;
    Buffer s = be.alloc(bytes), d = be.alloc(bytes);
    be.fill_zero(s.data(), bytes);
    const double ms = time_ms(be, 10, [&] { be.copy(d.data(), s.data(), bytes); });
    tbps = 2.0 * bytes / (ms * 1e-3) / 1e12;
    j["copy_4gib_ms"] = ms;
    std::fprintf(stderr, "[micro] device copy 4 GiB: %.3f ms, %.2f TB/s (read + write)\n", ms, tbps);
  }
  keep.clear();
  {
    const int64_t m = 4096, k = 16384;
    BatchRef x = dev_batch(be, keep, DType::kBF16, 1, m, k, 4, 1.0f / 128);
    BatchRef c = dev_batch(be, keep, DType::kBF16, 1, m, m, 5, 1.0f);
    const double dense = time_ms(be, 20, [&] { be.gemm(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, c); });
    json v;
    double best = 1e30;
    std::string best_name;
    for (SymKernel s : {SymKernel::kDenseMirror, SymKernel::kTri128, SymKernel::kTri256x128,
                        SymKernel::kTri128Cluster2, SymKernel::kTri128Pingpong}) {
      be.set_sym_kernel(s);
      const double ms = time_ms(be, 20, [&] {
        be.gemm_symmetric(Op::kN, x, Op::kT, x, 1.0, 0.0, nullptr, c);
      });
      v[sym_kernel_name(s)] = ms;
      std::fprintf(stderr, "[micro] X X^T 4096x16384 bf16 %-12s %.3f ms (%.3f of dense %.3f ms)\n",
                   sym_kernel_name(s), ms, ms / dense, dense);
      if (ms < best) {
        best = ms;
        best_name = sym_kernel_name(s);
      }
    }
    be.set_sym_kernel(SymKernel::kAuto);
    j["syrk_4096x16384"] = {{"dense_ms", dense}, {"variants_ms", v}, {"best", best_name},
                            {"best_ms", best}};
    j["syrk_over_dense"] = best / dense;
  }
  return j;
}

json run_workload(CudaBackend& be, const std::string& spec, const Opts& o, double tflops, double tbps) {
  const auto [name, layers] = parse_workload_spec(spec);
  const Workload w = workload_of({name, layers});
  std::fprintf(stderr, "[bench] %s%s: %lld Muon matrices, %lld parameters\n", name.c_str(),
               layers ? (" (" + std::to_string(layers) + " layers)").c_str() : "",
               (long long)w.muon_matrices(), (long long)w.muon_params());
  const OrthoConfig base = [] { OrthoConfig c; c.work_dtype = DType::kBF16; return c; }();
  std::vector<ShapeClass> cls = classes_of(w);
  json jc = json::array();
  std::vector<cuda::SymChoice> syms;
  std::vector<measure::AlgoChoice> algos;
  double floor_flops = 0, floor_bytes = 0, tuned_total_flops = 0;
  for (const ShapeClass& s : cls) {
    const int64_t m = s.rows, n = s.cols;
    OrthoConfig ns = base, gram = base;
    ns.iteration = Iteration::kStandardSym;
    gram.iteration = Iteration::kGram;
    floor_flops += s.count * std::min(ortho_flops(ns, m, n), ortho_flops(gram, m, n));
    floor_bytes += 20.0 * m * n * s.count;
    json e = {{"rows", m}, {"cols", n}, {"count", s.count}};
    if (o.tune) {  // measure every candidate; the engine's `auto` then applies its policy
      cuda::TuneOptions to;
      to.repeats = 5;
      json ks;
      for (DType t : {DType::kBF16, DType::kF16})
        for (int64_t k : {n, m}) {
          syms.push_back(cuda::tune_sym(be, m, k, s.count, t, to));
          ks[std::string(dtype_name(t)) + " k=" + std::to_string(k)] = sym_kernel_name(syms.back().kernel);
        }
      measure::TuneOptions mo;  // the engine's tuner's rounds and repeats
      mo.graph = true;  // timed as the engine below runs them: replayed in its step's graph
      algos.push_back(measure::tune_algorithm(be, m, n, s.count, base, mo));
      e["sym_kernels"] = ks;
      const measure::AlgoChoice& a = algos.back();
      e["tuner_fastest"] = measure::candidate_name({a.algorithm, a.restarts, a.work_dtype});
      e["rel_err_vs_fp32"] = algos.back().rel_err;
      json cands = json::array();
      for (const measure::AlgoCandidate& k : algos.back().candidates)
        cands.push_back({{"algorithm", k.algorithm}, {"restarts", k.restarts}, {"ms", k.ms},
                         {"rel_err", k.rel_err}, {"accepted", k.accepted}});
      e["candidates"] = cands;
    }
    jc.push_back(e);
  }
  if (o.tune) {  // into the measurement store (DISTMUON_COST_CACHE), where the engine reads them
    const std::string fp = be.tuning_fingerprint();
    measure::save_tuning(measure::store_path(), measure::tuner_key(fp, true), algos, "[]");
    measure::save_tuning(measure::store_path(), measure::tuner_key(fp), {}, be.kernel_choices_json());
  }
  // The model: one Muon group with `auto`, resolved per shape by the engine from the measurement
  // store under its default policy (restart set {2} kept); fp32 weights and gradients.
  EngineOptions eo;
  eo.autotune = o.tune ? AutoTune::kCached : AutoTune::kOff;
  Engine engine(be, eo);
  GroupOptions g;
  g.muon.ortho = base;
  engine.add_group(g);
  std::vector<Buffer> keep;
  std::vector<ParamData> data = add_workload_params(engine, be, w, keep, 100);
  engine.step(data);  // resolves `auto` per class, allocates the per-class buffers
  for (size_t i = 0; i < cls.size(); ++i) {
    int param = 0;  // a parameter of this class
    for (int p = 0; p < engine.num_params(); ++p) {
      const auto [m, n, per] = wide_of(engine.param(p).shape);
      if (m == cls[i].rows && n == cls[i].cols) param = p;
    }
    const OrthoConfig chosen = engine.resolved_ortho(param);
    std::string restarts;
    for (int k : chosen.restarts) restarts += (restarts.empty() ? "" : ",") + std::to_string(k);
    jc[i]["algorithm"] = algorithm_name(chosen);
    jc[i]["restarts"] = chosen.iteration == Iteration::kGram ? "{" + restarts + "}" : "";
    const double f = cls[i].count * ortho_flops(chosen, cls[i].rows, cls[i].cols);
    tuned_total_flops += f;
    jc[i]["tuned_gflop"] = f / 1e9;
    for (const measure::AlgoChoice& a : algos)  // the chosen candidate's own measurement
      if (a.rows == cls[i].rows && a.cols == cls[i].cols)
        for (const measure::AlgoCandidate& k : a.candidates) {
          const OrthoConfig kc = resolve(measure::config_of(k, base), a.rows, a.cols);
          if (kc.iteration == chosen.iteration &&
              (kc.iteration != Iteration::kGram || kc.restarts == chosen.restarts)) {
            jc[i]["algo_ms"] = k.ms;
            jc[i]["rel_err_vs_fp32"] = k.rel_err;
          }
        }
  }
  be.synchronize();
  // The engine's own graphs (EngineOptions::graphs, DISTMUON_GRAPHS) replay from its second
  // step on: "eager" is a step() as a user calls it. Its host time: the wall clock around
  // step() calls, which queue work without waiting for it (until the launch queue fills).
  const double eager = time_ms(be, o.steps, [&] { engine.step(data); });
  be.synchronize();
  const auto h0 = std::chrono::steady_clock::now();
  for (int k = 0; k < 5; ++k) engine.step(data);
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count() / 5;
  be.synchronize();
  const EngineStats st = engine.stats();
  cuda::GraphExec exec = cuda::capture_graph(be.stream(), [&] { engine.step(data); });
  const double replay =
      time_ms(be, o.steps, [&] { DM_CHECK_CUDA(cudaGraphLaunch(exec.get(), be.stream())); });
  const double floor_ms = floor_flops / (tflops * 1e12) * 1e3 + floor_bytes / (tbps * 1e12) * 1e3;
  std::fprintf(stderr,
               "[bench] %s: step() %.2f ms (host %.2f ms, engine graph replays %lld), caller graph "
               "%.2f ms, floor %.2f ms (%.1f GFLOP, %.2f GB)\n",
               spec.c_str(), eager, host_ms, static_cast<long long>(st.graph_replays), replay,
               floor_ms, floor_flops / 1e9, floor_bytes / 1e9);
  return {{"name", name + (layers ? "-" + std::to_string(layers) + "-layers" : "")},
          {"muon_params", w.muon_params()}, {"matrices", w.muon_matrices()},
          {"distmuon_eager_ms", eager}, {"distmuon_graph_ms", replay}, {"floor_ms", floor_ms},
          {"distmuon_host_ms", host_ms}, {"engine_graph_replays", st.graph_replays},
          {"floor_flops", floor_flops}, {"floor_bytes", floor_bytes},
          // The same floor with the FLOPs of the algorithms the engine ran.
          {"floor_tuned_ms", tuned_total_flops / (tflops * 1e12) * 1e3 + floor_bytes / (tbps * 1e12) * 1e3},
          {"tuned_flops", tuned_total_flops}, {"classes", jc}};
}

int run(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      DM_CHECK(i + 1 < argc, a, " needs a value");
      return argv[++i];
    };
    if (a == "--json") o.json_path = next();
    else if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--no-micro") o.micro = false;
    else if (a == "--no-tune") o.tune = false;
    else if (a == "--no-cache") o.cache = false;
    else if (a == "--no-cache-hit") o.cache_hit = false;
    else if (a == "--auto-check") o.auto_check = true;
    else if (a == "--rounds") o.rounds = std::stoi(next());
    else if (a == "--host-issue") o.host_issue = true;
    else if (a == "--workloads") {
      o.workloads.clear();
      std::stringstream ss(next());
      for (std::string p; std::getline(ss, p, ',');) if (!p.empty()) o.workloads.push_back(p);
    } else DM_FAIL("unknown option ", a, " (--json F --steps N --workloads a,b:8 --no-micro --no-tune --no-cache --no-cache-hit --auto-check --rounds N --host-issue)");
  }
  CudaBackend be;
  std::fprintf(stderr, "[bench] %s\n", be.name().c_str());
  json out;
  out["device"] = be.name();
  if (o.auto_check) {
    out["auto_check"] = auto_check(be, o.workloads, o.rounds);
    std::ofstream(o.json_path) << out.dump(2) << "\n";
    return out["auto_check"]["pass"].get<bool>() ? 0 : 2;
  }
  if (o.host_issue) {
    out["host_issue"] = host_issue(be, o.workloads);
    std::ofstream(o.json_path) << out.dump(2) << "\n";
    return 0;
  }
  double tflops = 760, tbps = 4.2;
  if (o.micro) {
    json m = micro(be, tflops, tbps);
    out["micro"] = m;
    out["syrk_over_dense"] = m["syrk_over_dense"];
    out["breakdown_gpt2_small"] = breakdown(be);
  }
  out["gemm_tflops"] = tflops;
  out["copy_tbps"] = tbps;
  if (o.cache) {  // CacheMuon on the device (cuda_bench_cache.cc)
    if (o.cache_hit) {
      out["cache"]["masked_dense_order"] = masked_dense_order(be);
      out["cache"]["hit_qwen_mlp"] = cache_hit_cost(be);
      out["cache"]["hit_small_mlp"] = cache_hit_cost_small(be);
      out["cache"]["hit_medium_mlp"] = cache_hit_cost_medium(be);
      out["cache"]["conditional_node"] = conditional_overhead(be);
    }
    std::ofstream(o.json_path) << out.dump(2) << "\n";
    out["cache"]["engine_gpt2_small"] = cache_engine_drift(be, 30);
    std::ofstream(o.json_path) << out.dump(2) << "\n";
  }
  out["workloads"] = json::array();
  for (const std::string& w : o.workloads) {
    out["workloads"].push_back(run_workload(be, w, o, tflops, tbps));
    std::ofstream(o.json_path) << out.dump(2) << "\n";  // partial results survive a timeout
  }
  std::ofstream f(o.json_path);
  f << out.dump(2) << "\n";
  return 0;
}

}  // namespace
}  // namespace distmuon::bench

int main(int argc, char** argv) {
  try {
    return distmuon::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distmuon-cuda-bench: %s\n", e.what());
    return 1;
  }
}
