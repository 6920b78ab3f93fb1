// The command line of distmuon-bench: its settings and their declaration (types, ranges and
// choices checked by CLI11 before any work; see cli.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli.h"
#include "distmuon/types.h"

namespace distmuon::bench {

struct BenchOptions {
  std::string workload = "gpt2-small";
  std::string backend = "cpu";
  std::vector<std::string> algos = {"ns5", "auto"};
  bool algos_given = false;  // distributed runs default to auto alone
  int64_t steps = 5, warmup = 1, layers = 0;
  uint64_t seed = 1;
  std::string dtype = "f32", work_dtype = "auto";
  bool no_adamw = false;
  std::string json;
  double drift = 0;
  // Distributed comparison (bench_dist.cc).
  std::vector<std::string> modes = {"single"};
  double bucket_mb = static_cast<double>(kDefaultBucketBytes) / (1 << 20);
  bool batches_per_bucket = false;  // DistOptions::batches_across_buckets off
  std::string wire_dtype;           // DistOptions::wire_dtype ("": the parameters')
  std::string planner = "milp";
  int ranks_per_gpu = 1;
  double progress_s = 30;  // a step still running says so this often (rank 0; 0: never)
  // With distributed CUDA ranks (bench_rank.h): a calibration first, a profiled step per mode.
  bool calibrate = false, profile = false;
  // CacheMuon (bench_cache.cc).
  std::vector<double> cache;
  std::string cache_residual = "probe";  // CacheOptions' default
  int cache_probes = 8, cache_staleness = 0, cache_backoff = 0;
  std::string cache_dtype = "work", cache_layout = "product", cache_gate = "matrix";
  bool cache_shadow = false, cache_per_matrix = false;

  bool distributed() const { return modes != std::vector<std::string>{"single"}; }
};

// Declares every option on `app`, bound to `o`, and the checks that involve several options
// (run at the end of parsing, before any work).
void add_bench_options(CLI::App& app, BenchOptions& o);

// The CUDA device ("cuda:N") of a distributed rank: ranks_per_gpu consecutive local ranks share
// one device; an error names the visible devices when the index does not exist.
std::string rank_device(int world_rank, int ranks_per_gpu, int visible_devices);

}  // namespace distmuon::bench
