// CacheMuon parts of distmuon-bench: its options as the engine takes them, the results table
// and the runs[].cache JSON object.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_options.h"
#include "cli.h"
#include "distmuon/cache.h"

namespace distmuon::bench {

struct RunResult {
  std::string algo;
  std::optional<double> gamma;  // CacheMuon runs
  cli::Summary step_ms;
  double ortho_flops = 0;  // per step
  CacheStats cache;        // over every step of the run, warm-up included
};

// The cache options of a run with this gamma, from the command line.
CacheOptions cache_options(const BenchOptions& o, double gamma);
void print_cache_table(const std::vector<RunResult>& results);
nlohmann::json cache_json(const RunResult& r, const BenchOptions& o);

}  // namespace distmuon::bench
