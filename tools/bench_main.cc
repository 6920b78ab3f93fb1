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
#include "cli.h"
#include "distmuon/backend.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "distmuon/workload.h"

namespace distmuon::bench {
namespace {

RunResult time_algorithm(Backend& be, BenchModel& model, const std::string& algo,
                         std::optional<double> gamma, const cli::Args& args) {
  MuonOptions muon;
  muon.ortho = parse_algorithm(algo);
  if (gamma) muon.cache = cache_options(args, *gamma);
  const double drift = args.number("drift");
  if (drift > 0) model.restart_gradients(static_cast<uint64_t>(args.integer("seed")) + 1);
  muon.ortho.work_dtype = parse_dtype(args.str("work-dtype") == "auto"
                                          ? (be.device().kind == DeviceKind::kCUDA ? "bf16" : "f32")
                                          : args.str("work-dtype"));
  Engine engine(be);
  model.register_with(engine, muon, AdamWOptions{});
  std::vector<ParamData> data = model.step_data();
  const int64_t warmup = args.integer("warmup"), steps = args.integer("steps");
  std::vector<double> times;
  double flops_before = 0;
  const std::string label = gamma ? algo + " g=" + cli::format_number(*gamma) : algo;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i > 0 && drift > 0) model.drift_gradients(drift);
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

int run(int argc, char** argv) {
  cli::Args args("distmuon-bench", "Times optimizer steps on a workload's shapes.");
  args.option("workload", "gpt2-small", "built-in name (gpt2-small, gpt2-large, pi0, qwen2.5-7b) or JSON file");
  args.option("backend", "cpu", "cpu | cuda");
  args.option("algo", "ns5,auto", "comma list of algorithms, each timed in the same run");
  args.option("steps", "5", "timed steps per algorithm");
  args.option("warmup", "1", "untimed steps first");
  args.option("layers", "0", "keep only the first K of each repeated tensor (0: all)");
  args.option("seed", "1", "random seed");
  args.option("dtype", "f32", "parameter and gradient dtype");
  args.option("work-dtype", "auto", "dtype of the iteration (auto: bf16 on cuda, f32 on cpu)");
  args.option("no-adamw", "0", "leave the AdamW tensors out of the step", true);
  args.option("json", "", "write the results as JSON to this path");
  declare_distributed_options(args);
  args.option("drift", "0", "each step's gradient = previous + relative noise EPS (0: fixed)");
  declare_cache_options(args);
  if (!args.parse(argc, argv)) return 0;
  if (wants_distributed(args)) return run_distributed(args);
  DM_CHECK(args.integer("steps") >= 1, "--steps must be >= 1");
  DM_CHECK(args.integer("warmup") >= 0, "--warmup must be >= 0");

  Workload w = load_workload(args.str("workload"));
  if (args.integer("layers") > 0) w = w.first_layers(args.integer("layers"));
  auto be = make_backend(args.str("backend"));
  std::fprintf(stderr, "distmuon-bench: %s on %s, allocating %lld Muon + %lld AdamW parameters\n",
               w.name.c_str(), be->name().c_str(), static_cast<long long>(w.muon_params()),
               static_cast<long long>(args.flag("no-adamw") ? 0 : w.adamw_params()));
  BenchModel model(*be, w, parse_dtype(args.str("dtype")), !args.flag("no-adamw"),
                   static_cast<uint64_t>(args.integer("seed")));

  DM_CHECK(args.number("drift") >= 0, "--drift must be >= 0");
  std::vector<RunResult> results;
  for (const std::string& algo : args.list("algo")) {
    results.push_back(time_algorithm(*be, model, algo, std::nullopt, args));
    for (double g : args.numbers("cache"))
      results.push_back(time_algorithm(*be, model, algo, g, args));
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
  if (!args.numbers("cache").empty()) print_cache_table(results);

  if (!args.str("json").empty()) {
    nlohmann::json j;
    j["workload"] = w.name;
    j["backend"] = args.str("backend");
    j["device"] = be->name();
    j["world_size"] = 1;
    j["layers"] = args.integer("layers");
    j["steps"] = args.integer("steps");
    j["warmup"] = args.integer("warmup");
    j["dtype"] = args.str("dtype");
    j["drift"] = args.number("drift");
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
      if (r.gamma) run["cache"] = cache_json(r, args);
    }
    std::ofstream f(args.str("json"));
    DM_CHECK(f.good(), "cannot write ", args.str("json"));
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace distmuon::bench

int main(int argc, char** argv) {
  try {
    return distmuon::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
