// The distributed comparison of distmuon-bench: every mode timed in the same run, on the same
// ranks, from the same starting point to the same end point, so that the ratios are fair:
//
//   start: every rank holds its local, unreduced gradient of every tensor (what backward
//          leaves) and full weights;
//   end:   every rank holds the full updated weights (what the next forward needs).
//
// gather and sharded therefore include the FSDP2 gradient reduce-scatter before the optimizer
// and the weight all-gather after it, replicated the DDP all-reduce; dedicated reduces and
// broadcasts inside the engine. The engine's own share (time and bytes) is reported beside.
// The modes take turns step by step, so that a machine shared with other work slows them alike.
#include "bench_dist.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_model.h"
#include "common/fnv.h"
#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "distmuon/workload.h"

namespace distmuon::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct DTensor {
  std::string name;
  std::vector<int64_t> shape;
  bool muon = false;
  int64_t numel = 0, dim0 = 0, inner = 0;
  Buffer w, g;              // full weights and this rank's local gradient
  Buffer w_shard, g_shard;  // FSDP2 shards (gather and sharded modes)
};

std::pair<int64_t, int64_t> chunk(int64_t dim0, int parts, int pos) {  // as FSDP2's Shard(0)
  const int64_t cs = (dim0 + parts - 1) / parts;
  const int64_t b = std::min<int64_t>(pos * cs, dim0), e = std::min<int64_t>(b + cs, dim0);
  return {b, e - b};
}

struct ModeResult {
  std::string mode, algo;
  cli::Summary step_ms, engine_ms;
  double bytes_max = 0, bytes_mean = 0, engine_bytes_max = 0;
  double flops_max = 0, flops_mean = 0;
  int64_t owned_max = 0;
};

// Element-wise max (or sum) over ranks of a host vector, through the MPI world.
std::vector<double> over_ranks(Communicator& mpi, std::vector<double> v, ReduceOp op) {
  mpi.all_reduce(v.data(), v.data(), static_cast<int64_t>(v.size()), CommType::kF64, op).wait();
  return v;
}

class Comparison {
 public:
  Comparison(const BenchOptions& o, Communicator& mpi, Communicator& comm, Backend& be)
      : o_(o), mpi_(mpi), comm_(comm), be_(be) {
    Workload w = load_workload(o.workload);
    if (o.layers > 0) w = w.first_layers(o.layers);
    workload_ = w.name;
    dtype_ = parse_dtype(o.dtype);
    check_fits(be, w, dtype_, !o.no_adamw);
    // A pool of 2^21 values each (the model's filler keeps 2^22): two of them per rank.
    GaussianFiller weights(be, dtype_, o.seed, int64_t{1} << 21);
    GaussianFiller grads(be, dtype_, o.seed + 1 + comm.rank(), int64_t{1} << 21);
    const int p = comm.size();
    auto add = [&](const WorkloadEntry& e, bool muon) {
      for (int64_t l = 0; l < e.count; ++l) {
        DTensor t;
        t.name = e.name + "." + std::to_string(l);
        t.shape = e.shape;
        t.muon = muon;
        t.numel = e.numel();
        t.dim0 = e.shape[0];
        t.inner = t.numel / t.dim0;
        const size_t bytes = static_cast<size_t>(t.numel) * dtype_size(dtype_);
        t.w = be.alloc(bytes);
        t.g = be.alloc(bytes);
        weights.fill(t.w.data(), t.numel, 0.02f);
        grads.fill(t.g.data(), t.numel, 1e-3f);
        const int64_t rows = chunk(t.dim0, p, comm.rank()).second;
        t.w_shard = be.alloc(std::max<size_t>(1, rows * t.inner * dtype_size(dtype_)));
        t.g_shard = be.alloc(std::max<size_t>(1, rows * t.inner * dtype_size(dtype_)));
        tensors_.push_back(std::move(t));
      }
    };
    for (const auto& e : w.muon) add(e, true);
    if (!o.no_adamw)
      for (const auto& e : w.adamw) add(e, false);
    for (const DTensor& t : tensors_) {
      (t.muon ? muon_params_ : adamw_params_) += t.numel;
      if (t.muon) matrices_ += t.shape.size() == 3 ? t.shape[0] : 1;
    }
  }

  // One mode's engine and what its steps accumulate.
  struct Run {
    DistMode mode;
    std::string algo;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<Communicator> fsdp;  // the FSDP2 / DDP traffic around the optimizer
    std::vector<ParamData> data;
    std::vector<double> step_ms, engine_ms;
    EngineStats s0;
    CommStats f0;
  };

  std::unique_ptr<Run> prepare(DistMode mode, const std::string& algo) {
    const bool sharded = mode == DistMode::kSharded || mode == DistMode::kGather;
    const int p = comm_.size(), me = comm_.rank();
    auto run = std::make_unique<Run>();
    run->mode = mode;
    run->algo = algo;
    DistOptions opt;
    opt.mode = mode;
    opt.bucket_bytes = static_cast<int64_t>(o_.bucket_mb * (1 << 20));
    opt.planner = o_.planner;
    run->engine = std::make_unique<Engine>(be_, comm_, opt);
    Engine& engine = *run->engine;
    GroupOptions gm;
    gm.muon.ortho = parse_algorithm(algo);
    const std::string& wd = o_.work_dtype;
    gm.muon.ortho.work_dtype =
        parse_dtype(wd == "auto" ? (be_.device().kind == DeviceKind::kCUDA ? "bf16" : "f32") : wd);
    engine.add_group(gm);
    GroupOptions ga;
    ga.kind = ParamKind::kAdamW;
    engine.add_group(ga);
    for (const DTensor& t : tensors_) {
      ParamSpec s{t.name, t.muon ? 0 : 1, t.shape, dtype_};
      if (sharded) {
        auto [b, n] = chunk(t.dim0, p, me);
        s.shard = {b, n};
      }
      engine.add_param(s);
    }
    engine.setup();
    // A communicator of its own, so that the engine's bytes can be told apart.
    run->fsdp = comm_.split(0, me);
    for (DTensor& t : tensors_) {
      const bool empty = sharded && chunk(t.dim0, p, me).second == 0;
      if (sharded)
        run->data.push_back(
            {empty ? nullptr : t.w_shard.data(), empty ? nullptr : t.g_shard.data(), dtype_, {}});
      else
        run->data.push_back({t.w.data(), t.g.data(), dtype_, {}});
    }
    return run;
  }

  // One timed (or warm-up) step of one mode. The modes take turns step by step, so that a
  // machine shared with other work slows them alike.
  void step(Run& run, int64_t i) {
    const DistMode mode = run.mode;
    const bool sharded = mode == DistMode::kSharded || mode == DistMode::kGather;
    const int p = comm_.size(), me = comm_.rank();
    const int64_t warmup = o_.warmup, steps = o_.steps;
    const CommType ct = comm_type(dtype_);
    Communicator& fsdp = *run.fsdp;
    if (i == warmup) {
      run.s0 = run.engine->stats();
      run.f0 = fsdp.stats();
    }
    be_.synchronize();
    mpi_.barrier().wait();
    const auto t0 = Clock::now();
    std::vector<CommHandle> hs;
    for (DTensor& t : tensors_) {
      if (mode == DistMode::kReplicated) {  // DDP: gradients all-reduced before the step
        hs.push_back(fsdp.all_reduce(t.g.data(), t.g.data(), t.numel, ct, ReduceOp::kSum));
      } else if (sharded) {  // FSDP2: reduce-scatter of the gradient into dim-0 shards
        for (int q = 0; q < p; ++q) {
          auto [b, n] = chunk(t.dim0, p, q);
          if (n == 0) continue;
          hs.push_back(fsdp.reduce(t.g.as<char>() + b * t.inner * dtype_size(dtype_),
                                   q == me ? t.g_shard.data() : nullptr, n * t.inner, ct,
                                   ReduceOp::kSum, q));
        }
      }
    }
    wait_all(hs);
    be_.synchronize();
    const auto t1 = Clock::now();
    run.engine->step(run.data);
    run.engine->wait_published();
    be_.synchronize();
    const auto t2 = Clock::now();
    if (sharded) {  // the next forward all-gathers the updated shards
      for (DTensor& t : tensors_) {
        std::vector<int64_t> cnt(p), dsp(p);
        for (int q = 0; q < p; ++q) {
          auto [b, n] = chunk(t.dim0, p, q);
          cnt[q] = n * t.inner;
          dsp[q] = b * t.inner;
        }
        hs.push_back(fsdp.all_gather_v(t.w_shard.data(), cnt[me], t.w.data(), cnt, dsp, ct));
      }
      wait_all(hs);
    }
    be_.synchronize();
    const auto t3 = Clock::now();
    auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    if (i >= warmup) {
      run.step_ms.push_back(ms(t0, t3));
      run.engine_ms.push_back(ms(t1, t2));
    }
    if (me == 0)
      std::fprintf(stderr, "  %-10s %-8s %s %lld/%lld  %.1f ms (rank 0)\n", dist_mode_name(mode),
                   run.algo.c_str(), i < warmup ? "warmup" : "step  ",
                   static_cast<long long>(i < warmup ? i + 1 : i - warmup + 1),
                   static_cast<long long>(i < warmup ? warmup : steps), ms(t0, t3));
  }

  ModeResult result(Run& run) {
    const int p = comm_.size();
    const EngineStats s1 = run.engine->stats();
    const CommStats f1 = run.fsdp->stats();
    ModeResult r;
    r.mode = dist_mode_name(run.mode);
    r.algo = run.algo;
    // A step takes as long as its slowest rank.
    r.step_ms = cli::summarize(over_ranks(mpi_, run.step_ms, ReduceOp::kMax));
    r.engine_ms = cli::summarize(over_ranks(mpi_, run.engine_ms, ReduceOp::kMax));
    const double n = static_cast<double>(o_.steps);
    const CommStats e = s1.comm - run.s0.comm, f = f1 - run.f0;
    const double bytes = (e.bytes_sent + e.bytes_received + f.bytes_sent + f.bytes_received) / n;
    const double ebytes = (e.bytes_sent + e.bytes_received) / n;
    const double flops = (s1.ortho.flops - run.s0.ortho.flops) / n;
    std::vector<double> mx = over_ranks(
        mpi_, {bytes, ebytes, flops, static_cast<double>(s1.owned_matrices)}, ReduceOp::kMax);
    std::vector<double> sum = over_ranks(mpi_, {bytes, flops}, ReduceOp::kSum);
    r.bytes_max = mx[0];
    r.engine_bytes_max = mx[1];
    r.flops_max = mx[2];
    r.owned_max = static_cast<int64_t>(mx[3]);
    r.bytes_mean = sum[0] / p;
    r.flops_mean = sum[1] / p;
    return r;
  }

  const std::string& workload() const { return workload_; }
  int64_t matrices() const { return matrices_; }
  int64_t muon_params() const { return muon_params_; }
  int64_t adamw_params() const { return adamw_params_; }

 private:
  const BenchOptions& o_;
  Communicator& mpi_;
  Communicator& comm_;
  Backend& be_;
  std::string workload_;
  DType dtype_ = DType::kF32;
  std::vector<DTensor> tensors_;
  int64_t matrices_ = 0, muon_params_ = 0, adamw_params_ = 0;
};

// CPU ranks share the machine: each gets cores / local ranks threads unless told otherwise,
// because oversubscribed BLAS threads spin and distort every timing.
int threads_per_rank(int world_size) {
  if (std::getenv("DISTMUON_NUM_THREADS"))  // checked as everywhere; 0: the default below
    if (const int64_t t = env::get_int("DISTMUON_NUM_THREADS"); t > 0) return static_cast<int>(t);
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks = local ? std::max(1, std::atoi(local)) : world_size;
  const int n = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
  setenv("DISTMUON_NUM_THREADS", std::to_string(n).c_str(), 1);
  return n;
}

// Every rank must run the same comparison: ranks started with other options (an MPMD launch,
// a script that passes its arguments differently) would otherwise issue collectives of other
// sizes and stop inside MPI. Compares a digest of the options that shape the run, before any.
void check_same_options(Communicator& mpi, const BenchOptions& o) {
  std::string text = o.workload + "|" + o.backend + "|" + o.dtype + "|" + o.work_dtype + "|" +
                     o.planner + "|" + std::to_string(o.steps) + "|" + std::to_string(o.warmup) +
                     "|" + std::to_string(o.layers) + "|" + std::to_string(o.seed) + "|" +
                     std::to_string(o.no_adamw) + "|" + std::to_string(o.bucket_mb) + "|" +
                     std::to_string(o.ranks_per_gpu) + "|" + std::to_string(o.algos_given);
  for (const auto& list : {o.algos, o.modes})
    for (const std::string& v : list) text += "|" + v;
  const uint64_t d = fnv1a(text);
  // Two 32-bit halves: exact in doubles. Max and -min of each agree iff every rank's does.
  const double hi = static_cast<double>(d >> 32), lo = static_cast<double>(d & 0xffffffffu);
  const std::vector<double> m = over_ranks(mpi, {hi, lo, -hi, -lo}, ReduceOp::kMax);
  DM_CHECK(m[0] == -m[2] && m[1] == -m[3],
           "the ranks were started with different options (every rank of distmuon-bench needs "
           "the same command line)");
}

}  // namespace

int run_distributed(const BenchOptions& o) {
  std::unique_ptr<Communicator> mpi = make_mpi_world();
  const int rank = mpi->rank(), p = mpi->size();
  check_same_options(*mpi, o);
  const std::string& backend = o.backend;
  int threads = 0;
  if (backend == "cpu") {
    threads = threads_per_rank(p);
    omp_set_num_threads(threads);
  }
  auto be = make_backend(
      backend == "cuda" ? rank_device(rank, o.ranks_per_gpu, cuda_device_count()) : backend);
  // CPU: the MPI communicator moves host memory. CUDA: an NCCL communicator whose id rank 0
  // shares over MPI.
  std::unique_ptr<Communicator> nccl;
  if (be->device().kind == DeviceKind::kCUDA) {
    NcclUniqueId id;
    if (rank == 0) id = nccl_unique_id();
    mpi->broadcast(id.bytes, sizeof(id.bytes), CommType::kU8, 0).wait();
    nccl = make_nccl_communicator(id, rank, p, be->native_stream());  // the engine's stream
  }
  Communicator& comm = nccl ? *nccl : *mpi;
  std::vector<DistMode> modes;
  for (const std::string& m : o.modes) modes.push_back(parse_dist_mode(m));
  const std::vector<std::string> algos = o.algos_given ? o.algos : std::vector<std::string>{"auto"};

  Comparison cmp(o, *mpi, comm, *be);
  if (rank == 0)
    std::fprintf(stderr, "distmuon-bench: %s on %d ranks, %s%s\n", cmp.workload().c_str(), p,
                 be->name().c_str(),
                 threads ? (", " + std::to_string(threads) + " threads per rank").c_str() : "");
  std::vector<ModeResult> results;
  const int64_t total = o.warmup + o.steps;
  for (const std::string& algo : algos) {
    std::vector<std::unique_ptr<Comparison::Run>> runs;
    for (DistMode m : modes) runs.push_back(cmp.prepare(m, algo));
    for (int64_t i = 0; i < total; ++i)
      for (auto& r : runs) cmp.step(*r, i);
    for (auto& r : runs) results.push_back(cmp.result(*r));
  }
  if (rank != 0) return 0;

  auto gather_of = [&](const ModeResult& r) -> const ModeResult* {
    for (const ModeResult& g : results)
      if (g.mode == "gather" && g.algo == r.algo) return &g;
    return nullptr;
  };
  std::printf("\n%s on %d ranks (%s): %lld Muon matrices, %lld Muon + %lld AdamW parameters\n",
              cmp.workload().c_str(), p, be->name().c_str(), static_cast<long long>(cmp.matrices()),
              static_cast<long long>(cmp.muon_params()),
              static_cast<long long>(cmp.adamw_params()));
  std::printf(
      "step: local unreduced gradients -> full updated weights on every rank "
      "(gather/sharded include the FSDP2 reduce-scatter and weight all-gather, "
      "replicated the DDP all-reduce)\n");
  std::printf("%-11s %-6s %10s %10s %12s %12s %13s %13s %10s %10s %9s\n", "mode", "algo", "step ms",
              "engine ms", "MB/rank max", "engine MB", "GFLOP/rk max", "GFLOP/rk mean", "flops/gth",
              "bytes/gth", "speedup");
  for (const ModeResult& r : results) {
    const ModeResult* g = gather_of(r);
    char ratios[64] = "         -          -         -";
    if (g) {
      // One rank moves no bytes in any mode: its byte ratio is "-", not 0/0.
      char bytes[16] = "-";
      if (g->bytes_max > 0) std::snprintf(bytes, sizeof(bytes), "%.3f", r.bytes_max / g->bytes_max);
      std::snprintf(ratios, sizeof(ratios), "%10.3f %10s %8.2fx", r.flops_max / g->flops_max, bytes,
                    g->step_ms.median / r.step_ms.median);
    }
    std::printf("%-11s %-6s %10.1f %10.1f %12.1f %12.1f %13.2f %13.2f %s\n", r.mode.c_str(),
                r.algo.c_str(), r.step_ms.median, r.engine_ms.median, r.bytes_max / 1e6,
                r.engine_bytes_max / 1e6, r.flops_max / 1e9, r.flops_mean / 1e9, ratios);
  }
  if (!o.json.empty()) {
    nlohmann::json j;
    j["workload"] = cmp.workload();
    j["backend"] = backend;
    j["device"] = be->name();
    j["world_size"] = p;
    j["threads_per_rank"] = threads;
    j["layers"] = o.layers;
    j["steps"] = o.steps;
    j["warmup"] = o.warmup;
    j["dtype"] = o.dtype;
    j["bucket_mb"] = o.bucket_mb;
    j["planner"] = o.planner;
    j["ranks_per_gpu"] = o.ranks_per_gpu;
    j["step_definition"] =
        "from local unreduced gradients on every rank to full updated weights on every rank; "
        "gather/sharded include the FSDP2 reduce-scatter and weight all-gather, replicated the "
        "DDP all-reduce; step_ms is the median over steps of the slowest rank";
    j["comm_bytes_definition"] =
        "bytes sent plus received per rank and step (direct point-to-point payload), max over "
        "ranks";
    j["runs"] = nlohmann::json::array();
    for (const ModeResult& r : results) {
      const ModeResult* g = gather_of(r);
      auto summary = [](const cli::Summary& s) {
        return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
      };
      j["runs"].push_back(
          {{"mode", r.mode},
           {"algo", r.algo},
           {"step_ms", summary(r.step_ms)},
           {"engine_ms", summary(r.engine_ms)},
           {"comm_bytes_per_rank", r.bytes_max},
           {"comm_bytes_per_rank_mean", r.bytes_mean},
           {"engine_comm_bytes_per_rank", r.engine_bytes_max},
           {"ortho_flops_max_rank", r.flops_max},
           {"ortho_flops_mean_rank", r.flops_mean},
           {"owned_matrices_max_rank", r.owned_max},
           {"speedup_vs_gather",
            g ? nlohmann::json(g->step_ms.median / r.step_ms.median) : nlohmann::json()}});
    }
    std::ofstream f(o.json);
    DM_CHECK(f.good(), "cannot write ", o.json);
    f << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace distmuon::bench
