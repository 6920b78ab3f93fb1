// distmuon-bench: times whole optimizer steps of a workload's shapes on a backend, one run per
// algorithm (and per CacheMuon gamma), all in the same process so that the ratios are measured
// side by side on the same gradient stream.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "bench_cache.h"
#include "bench_dist.h"
#include "bench_model.h"
#include "bench_options.h"
#include "cli.h"
#include "distmuon/backend.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "distmuon/workload.h"

namespace distmuon::bench {
namespace {

RunResult time_algorithm(Backend& be, BenchModel& model, const std::string& algo,
                         std::optional<double> gamma, const BenchOptions& o) {
  MuonOptions muon;
  muon.ortho = parse_algorithm(algo);
  if (gamma) muon.cache = cache_options(o, *gamma);
  if (o.drift > 0) model.restart_gradients(o.seed + 1);
  muon.ortho.work_dtype = parse_dtype(o.work_dtype == "auto"
                                          ? (be.device().kind == DeviceKind::kCUDA ? "bf16" : "f32")
                                          : o.work_dtype);
  Engine engine(be);
  model.register_with(engine, muon, AdamWOptions{});
  std::vector<ParamData> data = model.step_data();
  const int64_t warmup = o.warmup, steps = o.steps;
  std::vector<double> times;
  double flops_before = 0;
  const std::string label = gamma ? algo + " g=" + cli::format_number(*gamma) : algo;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i > 0 && o.drift > 0) model.drift_gradients(o.drift);
    if (i == warmup) flops_before = engine.stats().ortho.flops;
    be.synchronize();
    auto t0 = std::chrono::steady_clock::now();
    engine.step(data);
    be.synchronize();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) times.push_back(ms);
    std::fprintf(stderr, "  %-16s %s %lld/%lld  %.2f ms\n", label.c_str(),
                 i < warmup ? "warmup" : "step  ",
                 static_cast<long long>(i < warmup ? i + 1 : i - warmup + 1),
                 static_cast<long long>(i < warmup ? warmup : steps), ms);
  }
  RunResult r;
  r.algo = algo;
  r.gamma = gamma;
  r.step_ms = cli::summarize(times);
  EngineStats st = engine.stats();
  r.ortho_flops = (st.ortho.flops - flops_before) / static_cast<double>(steps);
  r.cache = st.cache;
  return r;
}

int run(const BenchOptions& o) {
  if (o.distributed()) return run_distributed(o);
  Workload w = load_workload(o.workload);
  if (o.layers > 0) w = w.first_layers(o.layers);
  auto be = make_backend(o.backend);
  check_fits(*be, w, parse_dtype(o.dtype), !o.no_adamw);  // before saying anything is allocated
  std::fprintf(stderr, "distmuon-bench: %s on %s, allocating %lld Muon + %lld AdamW parameters\n",
               w.name.c_str(), be->name().c_str(), static_cast<long long>(w.muon_params()),
               static_cast<long long>(o.no_adamw ? 0 : w.adamw_params()));
  BenchModel model(*be, w, parse_dtype(o.dtype), !o.no_adamw, o.seed);

  std::vector<RunResult> results;
  for (const std::string& algo : o.algos) {
    results.push_back(time_algorithm(*be, model, algo, std::nullopt, o));
    for (double g : o.cache) results.push_back(time_algorithm(*be, model, algo, g, o));
  }

  std::printf("\n%s on %s: %lld Muon matrices, %lld Muon + %lld AdamW parameters\n", w.name.c_str(),
              be->name().c_str(), static_cast<long long>(model.muon_matrices()),
              static_cast<long long>(model.muon_params()), static_cast<long long>(model.adamw_params()));
  std::printf("%-22s %12s %10s %10s %14s %10s\n", "algo", "median ms", "min ms", "max ms", "ortho GFLOP", "TFLOP/s");
  for (const RunResult& r : results) {
    const std::string name = r.gamma ? r.algo + " cache " + cli::format_number(*r.gamma) : r.algo;
    std::printf("%-22s %12.2f %10.2f %10.2f %14.1f %10.2f\n", name.c_str(), r.step_ms.median,
                r.step_ms.min, r.step_ms.max, r.ortho_flops / 1e9,
                r.ortho_flops / (r.step_ms.median * 1e-3) / 1e12);
  }
  if (!o.cache.empty()) print_cache_table(results);

  if (!o.json.empty()) {
    nlohmann::json j;
    j["workload"] = w.name;
    j["backend"] = o.backend;
    j["device"] = be->name();
    j["world_size"] = 1;
    j["layers"] = o.layers;
    j["steps"] = o.steps;
    j["warmup"] = o.warmup;
    j["dtype"] = o.dtype;
    j["drift"] = o.drift;
    j["runs"] = nlohmann::json::array();
    for (const RunResult& r : results) {
      nlohmann::json& run = j["runs"].emplace_back();
      run = {{"mode", "single"},
                           {"algo", r.algo},
                           {"step_ms", {{"median", r.step_ms.median}, {"min", r.step_ms.min}, {"max", r.step_ms.max}}},
                           {"ortho_flops", r.ortho_flops},
                           {"matrices", model.muon_matrices()},
                           {"params", model.muon_params() + model.adamw_params()},
                           {"muon_params", model.muon_params()},
                           {"adamw_params", model.adamw_params()}};
      if (r.gamma) run["cache"] = cache_json(r, o);
    }
    std::ofstream f(o.json);
    DM_CHECK(f.good(), "cannot write ", o.json);
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace distmuon::bench

int main(int argc, char** argv) {
  using namespace distmuon;
  CLI::App app("Times optimizer steps on a workload's shapes.", "distmuon-bench");
  bench::BenchOptions o;
  bench::add_bench_options(app, o);
  return cli::run(app, argc, argv, [&] { return bench::run(o); });
}
