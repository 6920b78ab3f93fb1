#include "bench_options.h"

#include <algorithm>
#include <cstdlib>

#include "distmuon/error.h"

namespace distmuon::bench {
namespace {

const CLI::Validator kBackend(
    [](std::string& v) -> std::string {
      const bool indexed = v.rfind("cuda:", 0) == 0 && v.size() > 5 && v.size() < 9 &&
                           v.find_first_not_of("0123456789", 5) == std::string::npos;
      return v == "cpu" || v == "cuda" || indexed ? "" : "expected cpu, cuda or cuda:N";
    },
    "{cpu, cuda, cuda:N}", "BACKEND");

// Help groups; the cache group's options are checked together (check_bench_options).
const std::string kDistGroup = "Distributed comparison (under mpirun)";
const std::string kCacheGroup = "CacheMuon";

void check_bench_options(const CLI::App& app, BenchOptions& o) {
  o.algos_given = app.count("--algo") > 0;
  DM_CHECK(!o.algos.empty(), "--algo needs at least one algorithm");
  DM_CHECK(!o.modes.empty(), "--mode needs at least one mode");
  const bool single = std::find(o.modes.begin(), o.modes.end(), "single") != o.modes.end();
  DM_CHECK(!single || o.modes.size() == 1,
           "--mode single runs one process; it cannot be combined with distributed modes");
  DM_CHECK(o.drift == 0 || o.dtype == "f32" || o.dtype == "float32",
           "--drift needs f32 parameters (--dtype f32)");
  DM_CHECK(!o.distributed() || o.backend.rfind("cuda:", 0) != 0, "--backend ", o.backend,
           ": distributed ranks choose their device from their local "
           "rank (use --backend cuda and --ranks-per-gpu)");
  DM_CHECK(o.ranks_per_gpu == 1 || (o.distributed() && o.backend == "cuda"),
           "--ranks-per-gpu applies to distributed runs with --backend cuda");
  for (const char* name : {"--calibrate", "--profile"})
    DM_CHECK(app.count(name) == 0 || (o.distributed() && o.backend == "cuda"), name,
             " applies to the distributed modes on CUDA (--mode ... --backend cuda)");
  // An option of a part of the tool that does not run is refused, not silently ignored.
  for (const char* name : {"--bucket-mb", "--planner", "--batches-per-bucket"})
    DM_CHECK(o.distributed() || app.count(name) == 0, name,
             " applies to the distributed modes (--mode gather, replicated, sharded, dedicated)");
  std::vector<std::string> single_only = {"--drift"};
  for (const CLI::Option* opt :
       app.get_options([](const CLI::Option* opt) { return opt->get_group() == kCacheGroup; })) {
    const std::string name = opt->get_name();
    single_only.push_back(name);
    DM_CHECK(name == "--cache" || !o.cache.empty() || opt->count() == 0, name,
             " needs --cache (a list of gammas)");
  }
  for (const std::string& name : single_only)
    DM_CHECK(!o.distributed() || app.count(name) == 0, name,
             " applies to --mode single (the distributed comparison runs the fresh solve on "
             "fixed gradients)");
}

// The rank's index on its node, from the launcher.
int local_rank(int world_rank) {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return world_rank;
}
}  // namespace

void add_bench_options(CLI::App& app, BenchOptions& o) {
  app.option_defaults()->always_capture_default();
  app.add_option("--workload", o.workload, cli::workload_help())->check(cli::kWorkload);
  app.add_option("--backend", o.backend,
                 "where the step runs (distributed cuda: each rank on the device of its local "
                 "rank, see --ranks-per-gpu)")
      ->check(kBackend);
  app.add_option("--algo", o.algos,
                 "comma list of algorithms, each timed in the same run (default: ns5,auto; "
                 "auto alone in the distributed modes)")
      ->delimiter(',')
      ->check(cli::kAlgorithm);
  app.add_option("--steps", o.steps, "timed steps per algorithm")
      ->check(cli::at_least(1, cli::kMaxRepeats));
  app.add_option("--warmup", o.warmup, "untimed steps first")
      ->check(cli::at_least(0, cli::kMaxRepeats));
  app.add_option("--progress-s", o.progress_s,
                 "distributed modes: say every S seconds that a step is still running (0: never)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--layers", o.layers, "keep only the first K of each repeated tensor (0: all)")
      ->check(cli::at_least(0, cli::kMaxRepeats));
  app.add_option("--seed", o.seed, "random seed")->check(cli::at_least(0, 1.8446744073709552e19));
  app.add_option("--dtype", o.dtype, "parameter and gradient dtype")->check(cli::kDType);
  app.add_option("--work-dtype", o.work_dtype,
                 "dtype of the iteration (auto: bf16 on cuda, f32 on cpu)")
      ->check(cli::kDType | CLI::IsMember({"auto"}));
  app.add_flag("--no-adamw", o.no_adamw, "leave the AdamW tensors out of the step");
  app.add_option("--json", o.json, "write the results as JSON to this path")
      ->check(cli::kWritableFile);
  app.add_option("--drift", o.drift,
                 "each step's gradient = previous + relative noise EPS (0: fixed; f32 only)")
      ->check(cli::at_least(0, 10));

  const std::string& dist = kDistGroup;
  app.add_option("--mode", o.modes,
                 "single (one process) or a comma list of gather, replicated, sharded, dedicated "
                 "and adamw (fused AdamW on the FSDP2 shards of every tensor: the baseline), each "
                 "timed in the same run")
      ->delimiter(',')
      ->check(CLI::IsMember({"single", "gather", "replicated", "sharded", "dedicated", "adamw"}))
      ->group(dist);
  app.add_option("--bucket-mb", o.bucket_mb, "MiB of full matrices per bucket")
      ->check(cli::above(0, 1 << 20))
      ->group(dist);
  app.add_flag("--batches-per-bucket", o.batches_per_bucket,
               "owner modes: one orthogonalization batch per run of a bucket, right after it "
               "lands (DistOptions::batches_across_buckets off; default: each plan batch once, "
               "after its last bucket)")
      ->group(dist);
  app.add_option("--wire-dtype", o.wire_dtype,
                 "sharded and gather modes: what travels for wider parameters (DistOptions::"
                 "wire_dtype; default: the parameters' dtype); the other modes keep theirs")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->group(dist);
  app.add_option("--planner", o.planner, "owner planner")
      ->check(CLI::IsMember({"milp", "lpt", "round-robin"}))
      ->group(dist);
  app.add_option("--ranks-per-gpu", o.ranks_per_gpu,
                 "with --backend cuda: K ranks share each GPU; a rank uses CUDA device "
                 "local_rank / K (local rank from OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, "
                 "SLURM_LOCALID or LOCAL_RANK). Sharing needs NCCL >= 2.30 with "
                 "NCCL_MULTI_RANK_GPU_ENABLE=1; they run at once only under CUDA MPS "
                 "(docs/distributed.md, the one-GPU cluster)")
      ->check(cli::at_least(1, cli::kMaxRanks))
      ->group(dist);
  app.add_flag("--calibrate", o.calibrate,
               "distributed modes on CUDA: first measure each rank's GEMM rate and copy bandwidth "
               "with all ranks busy, and the NCCL bandwidth between ranks")
      ->group(dist);
  app.add_flag("--profile", o.profile,
               "distributed modes on CUDA: one more profiled step per mode (CUPTI): each rank's "
               "time computing, communicating and waiting")
      ->group(dist);

  const std::string& cache = kCacheGroup;
  app.add_option("--cache", o.cache, "comma list of gammas, each run beside the fresh runs")
      ->delimiter(',')
      ->check(cli::above(0))
      ->group(cache);
  app.add_option("--cache-residual", o.cache_residual, "how the cache test measures its residual")
      ->check(CLI::IsMember({"exact", "probe"}))
      ->group(cache);
  app.add_option("--cache-probes", o.cache_probes, "Gaussian probes for --cache-residual probe")
      ->check(cli::at_least(1))
      ->group(cache);
  app.add_option("--cache-staleness", o.cache_staleness,
                 "refresh an entry after S reuses (0: no limit)")
      ->check(cli::at_least(0))
      ->group(cache);
  app.add_option("--cache-backoff", o.cache_backoff,
                 "test an entry that keeps refreshing after 1, 2, 4, ... misses, at most B (0: "
                 "every call)")
      ->check(cli::at_least(0))
      ->group(cache);
  app.add_option("--cache-gate", o.cache_gate,
                 "matrix: each matrix hits alone; batch: a call hits only when all its matrices "
                 "pass, else all refresh")
      ->check(CLI::IsMember({"matrix", "batch"}))
      ->group(cache);
  app.add_option("--cache-dtype", o.cache_dtype,
                 "precision of the cached transforms (work: the iteration's dtype)")
      ->check(CLI::IsMember({"work", "f32", "f16", "bf16"}))
      ->group(cache);
  app.add_option("--cache-layout", o.cache_layout, "product | factors (restarted solves)")
      ->check(CLI::IsMember({"product", "factors"}))
      ->group(cache);
  app.add_flag("--cache-shadow", o.cache_shadow,
               "also run the fresh solve to measure the update error (syncs)")
      ->group(cache);
  app.add_flag("--cache-per-matrix", o.cache_per_matrix, "print per-matrix cache statistics")
      ->group(cache);
  app.callback([&app, &o] { check_bench_options(app, o); });
}

std::string rank_device(int world_rank, int ranks_per_gpu, int visible) {
  const int local = local_rank(world_rank), device = local / ranks_per_gpu;
  DM_CHECK(visible > 0, "rank ", world_rank,
           ": no CUDA device is visible (see CUDA_VISIBLE_DEVICES; a CPU-only build sees none)");
  DM_CHECK(device < visible, "rank ", world_rank, " (local rank ", local,
           ") would use CUDA device ", device, " with --ranks-per-gpu ", ranks_per_gpu, ", but ",
           visible, " device", visible == 1 ? " is" : "s are", " visible; run at most ",
           visible * ranks_per_gpu,
           " ranks per node or raise --ranks-per-gpu (several ranks per GPU need NCCL >= 2.30 "
           "with NCCL_MULTI_RANK_GPU_ENABLE=1)");
  return "cuda:" + std::to_string(device);
}

}  // namespace distmuon::bench
