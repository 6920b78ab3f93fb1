#include "bench_compare.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "bench_model.h"
#include "common/fnv.h"
#include "distmuon/error.h"
#include "distmuon/workload.h"

namespace distmuon::bench {
namespace {

using Clock = std::chrono::steady_clock;

std::pair<int64_t, int64_t> chunk(int64_t dim0, int parts, int pos) {  // as FSDP2's Shard(0)
  const int64_t cs = (dim0 + parts - 1) / parts;
  const int64_t b = std::min<int64_t>(pos * cs, dim0), e = std::min<int64_t>(b + cs, dim0);
  return {b, e - b};
}

// Modes whose parameters are FSDP2 shards: the reduce-scatter before, the all-gather after.
bool fsdp_sharded(const Comparison::Run& r) {
  return r.mode == "adamw" || r.dist == DistMode::kSharded || r.dist == DistMode::kGather;
}

// True when any element of `n` values of dtype `t` at `p` (host) is an infinity or a NaN.
bool any_nonfinite(const char* p, int64_t n, DType t) {
  auto scan = [&](auto bits, auto mask) {
    using U = decltype(bits);
    for (int64_t i = 0; i < n; ++i) {
      U v;
      std::memcpy(&v, p + i * sizeof(U), sizeof(U));
      if ((v & mask) == mask) return true;
    }
    return false;
  };
  switch (t) {
    case DType::kF64:
      return scan(uint64_t{}, uint64_t{0x7ff0000000000000});
    case DType::kF32:
      return scan(uint32_t{}, uint32_t{0x7f800000});
    case DType::kBF16:
      return scan(uint16_t{}, uint16_t{0x7f80});
    case DType::kF16:
      return scan(uint16_t{}, uint16_t{0x7c00});
  }
  return false;
}

// The gather run a mode's ratios are taken against (same algorithm; any for the AdamW baseline).
const ModeResult* gather_of(const std::vector<ModeResult>& results, const ModeResult& r) {
  for (const ModeResult& g : results)
    if (g.mode == "gather" && (g.algo == r.algo || r.mode == "adamw")) return &g;
  return nullptr;
}

}  // namespace

std::vector<double> over_ranks(Communicator& host, std::vector<double> v, ReduceOp op) {
  host.all_reduce(v.data(), v.data(), static_cast<int64_t>(v.size()), CommType::kF64, op).wait();
  return v;
}

Comparison::Comparison(const BenchOptions& o, Communicator& host, Communicator& comm, Backend& be)
    : o_(o), host_(host), comm_(comm), be_(be) {
  Workload w = load_workload(o.workload);
  if (o.layers > 0) w = w.first_layers(o.layers);
  workload_ = w.name;
  dtype_ = parse_dtype(o.dtype);
  check_fits(be, w, dtype_, !o.no_adamw);
  // A pool of 2^21 values each (the model's filler keeps 2^22): two of them per rank.
  GaussianFiller weights(be, dtype_, o.seed, int64_t{1} << 21);
  GaussianFiller grads(be, dtype_, o.seed + 1 + comm.rank(), int64_t{1} << 21);
  const int p = comm.size();
  auto add = [&](const WorkloadEntry& e, int64_t index, bool muon) {
    Tensor t;
    t.name = e.name + "." + std::to_string(index);
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
  };
  // Muon tensors in model order (layer by layer), as a model registers them and the planner and
  // the simulator take them; the AdamW ones after them, in the root's FSDP2 unit.
  for (const Workload::TensorRef& t : w.muon_tensors())
    add(w.muon[static_cast<size_t>(t.entry)], t.index, true);
  units_ = w.fsdp_units();
  if (!o.no_adamw) {
    const int first = static_cast<int>(tensors_.size());
    for (const auto& e : w.adamw)
      for (int64_t k = 0; k < e.count; ++k) add(e, k, false);
    units_.emplace_back();
    for (int i = first; i < static_cast<int>(tensors_.size()); ++i) units_.back().push_back(i);
  }
  for (const Tensor& t : tensors_) {
    (t.muon ? muon_params_ : adamw_params_) += t.numel;
    if (t.muon) matrices_ += t.shape.size() == 3 ? t.shape[0] : 1;
  }
}

std::vector<std::vector<int64_t>> Comparison::muon_shapes() const {
  std::vector<std::vector<int64_t>> out;
  for (const Tensor& t : tensors_) {
    if (!t.muon) continue;
    const int64_t n = t.shape.size() == 3 ? t.shape[0] : 1;
    const int64_t rows = t.shape.size() == 3 ? t.shape[1] : t.shape[0];
    for (int64_t i = 0; i < n; ++i) out.push_back({rows, t.numel / n / rows});
  }
  return out;
}

std::unique_ptr<Comparison::Run> Comparison::prepare(const std::string& mode,
                                                     const std::string& algo) {
  auto run = std::make_unique<Run>();
  run->mode = mode;
  const bool adamw = mode == "adamw";
  run->dist = adamw ? DistMode::kSharded : parse_dist_mode(mode);
  run->algo = adamw ? "-" : algo;
  const bool sharded = fsdp_sharded(*run);
  const int p = comm_.size(), me = comm_.rank();
  DistOptions opt;
  opt.mode = run->dist;
  opt.bucket_bytes = static_cast<int64_t>(o_.bucket_mb * (1 << 20));
  opt.batches_across_buckets = !o_.batches_per_bucket;
  opt.planner = o_.planner;
  // Only the modes that move gradients and updates take a narrower wire (the others refuse it).
  if (!o_.wire_dtype.empty() && !adamw && sharded) opt.wire_dtype = parse_dtype(o_.wire_dtype);
  run->engine = std::make_unique<Engine>(be_, comm_, opt);
  Engine& engine = *run->engine;
  if (!adamw) {
    GroupOptions gm;
    gm.muon.ortho = parse_algorithm(algo);
    const std::string& wd = o_.work_dtype;
    gm.muon.ortho.work_dtype =
        parse_dtype(wd == "auto" ? (be_.device().kind == DeviceKind::kCUDA ? "bf16" : "f32") : wd);
    engine.add_group(gm);
  }
  GroupOptions ga;
  ga.kind = ParamKind::kAdamW;
  engine.add_group(ga);
  const int adamw_group = adamw ? 0 : 1;
  for (const Tensor& t : tensors_) {
    ParamSpec s{t.name, t.muon && !adamw ? 0 : adamw_group, t.shape, dtype_};
    if (sharded) {
      auto [b, n] = chunk(t.dim0, p, me);
      s.shard = {b, n};
    }
    engine.add_param(s);
  }
  engine.setup();
  // A communicator of its own, so that the engine's bytes can be told apart.
  run->fsdp = comm_.split(0, me);
  for (Tensor& t : tensors_) {
    const bool empty = sharded && chunk(t.dim0, p, me).second == 0;
    if (sharded)
      run->data.push_back(
          {empty ? nullptr : t.w_shard.data(), empty ? nullptr : t.g_shard.data(), dtype_, {}});
    else
      run->data.push_back({t.w.data(), t.g.data(), dtype_, {}});
  }
  return run;
}

void Comparison::step(Run& run, int64_t i) {
  const bool sharded = fsdp_sharded(run);
  const int p = comm_.size(), me = comm_.rank();
  const int64_t warmup = o_.warmup, steps = o_.steps;
  const CommType ct = comm_type(dtype_);
  Communicator& fsdp = *run.fsdp;
  if (i == warmup) {
    run.s0 = run.engine->stats();
    run.f0 = fsdp.stats();
  }
  be_.synchronize();
  host_.barrier().wait();
  if (hook_) hook_(run, i, true);
  const auto t0 = Clock::now();
  std::vector<CommHandle> hs;
  if (run.dist == DistMode::kReplicated) {  // DDP: gradients all-reduced before the step
    for (Tensor& t : tensors_)
      hs.push_back(fsdp.all_reduce(t.g.data(), t.g.data(), t.numel, ct, ReduceOp::kSum));
  } else if (sharded) {  // FSDP2: reduce-scatter of the gradients into dim-0 shards
    // One launch per unit, as FSDP2 reduce-scatters a unit's gradients in one collective.
    for (const std::vector<int>& unit : units_)
      fsdp.grouped([&] {
        for (int i : unit) {
          Tensor& t = tensors_[static_cast<size_t>(i)];
          for (int q = 0; q < p; ++q) {
            auto [b, n] = chunk(t.dim0, p, q);
            if (n == 0) continue;
            hs.push_back(fsdp.reduce(t.g.as<char>() + b * t.inner * dtype_size(dtype_),
                                     q == me ? t.g_shard.data() : nullptr, n * t.inner, ct,
                                     ReduceOp::kSum, q));
          }
        }
      });
  }
  wait_all(hs);
  be_.synchronize();
  const auto t1 = Clock::now();
  run.engine->step(run.data);
  run.engine->wait_published();
  be_.synchronize();
  const auto t2 = Clock::now();
  if (sharded) {  // the next forward all-gathers the updated shards, a unit per launch
    for (const std::vector<int>& unit : units_)
      fsdp.grouped([&] {
        for (int i : unit) {
          Tensor& t = tensors_[static_cast<size_t>(i)];
          std::vector<int64_t> cnt(p), dsp(p);
          for (int q = 0; q < p; ++q) {
            auto [b, n] = chunk(t.dim0, p, q);
            cnt[q] = n * t.inner;
            dsp[q] = b * t.inner;
          }
          hs.push_back(fsdp.all_gather_v(t.w_shard.data(), cnt[me], t.w.data(), cnt, dsp, ct));
        }
      });
    wait_all(hs);
  }
  be_.synchronize();
  const auto t3 = Clock::now();
  // After the timed part: stats() synchronizes with the device.
  const double issue_ms = run.engine->stats().issue_ms;
  if (hook_) hook_(run, i, false);
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  if (i >= warmup && i < warmup + steps) {
    run.step_ms.push_back(ms(t0, t3));
    run.engine_ms.push_back(ms(t1, t2));
    run.host_ms.push_back(issue_ms);
  }
  if (me == 0)
    std::fprintf(stderr, "  %-10s %-8s %s %lld/%lld  %.1f ms (rank 0)\n", run.mode.c_str(),
                 run.algo.c_str(),
                 i < warmup           ? "warmup"
                 : i < warmup + steps ? "step  "
                                      : "extra ",
                 static_cast<long long>(i < warmup ? i + 1 : i - warmup + 1),
                 static_cast<long long>(i < warmup ? warmup : steps), ms(t0, t3));
}

ModeResult Comparison::result(Run& run) {
  const int p = comm_.size();
  const EngineStats s1 = run.engine->stats();
  const CommStats f1 = run.fsdp->stats();
  ModeResult r;
  r.mode = run.mode;
  r.algo = run.algo;
  if (const Plan* plan = run.engine->plan()) r.plan_costs = plan->costs;
  // A step takes as long as its slowest rank.
  r.step_ms = cli::summarize(over_ranks(host_, run.step_ms, ReduceOp::kMax));
  r.engine_ms = cli::summarize(over_ranks(host_, run.engine_ms, ReduceOp::kMax));
  r.host_ms = cli::summarize(over_ranks(host_, run.host_ms, ReduceOp::kMax));
  const double n = static_cast<double>(o_.steps);
  const CommStats e = s1.comm - run.s0.comm, f = f1 - run.f0;
  const double bytes = (e.bytes_sent + e.bytes_received + f.bytes_sent + f.bytes_received) / n;
  const double ebytes = (e.bytes_sent + e.bytes_received) / n;
  const double flops = (s1.ortho.flops - run.s0.ortho.flops) / n;
  const double elaunches = static_cast<double>(e.launches) / n;
  const double launches = static_cast<double>(e.launches + f.launches) / n;
  std::vector<double> mx = over_ranks(
      host_, {bytes, ebytes, flops, static_cast<double>(s1.owned_matrices), elaunches, launches},
      ReduceOp::kMax);
  std::vector<double> sum = over_ranks(host_, {bytes, flops}, ReduceOp::kSum);
  r.bytes_max = mx[0];
  r.engine_bytes_max = mx[1];
  r.flops_max = mx[2];
  r.owned_max = static_cast<int64_t>(mx[3]);
  r.engine_launches_max = mx[4];
  r.launches_max = mx[5];
  r.bytes_mean = sum[0] / p;
  r.flops_mean = sum[1] / p;
  return r;
}

void Comparison::check_weights_agree() {
  be_.synchronize();
  uint64_t digest = kFnvOffset;
  bool finite = true;
  std::vector<char> host;
  for (const Tensor& t : tensors_) {
    host.resize(t.w.bytes());
    be_.copy_to_host(host.data(), t.w.data(), host.size());
    be_.synchronize();
    digest = fnv1a(digest, host.data(), host.size());
    finite = finite && !any_nonfinite(host.data(), t.numel, dtype_);
  }
  // Two 32-bit halves: exact in doubles. Max and -min of each agree iff every rank's does.
  const double hi = static_cast<double>(digest >> 32),
               lo = static_cast<double>(digest & 0xffffffffu);
  const std::vector<double> m =
      over_ranks(host_, {hi, lo, -hi, -lo, finite ? 0.0 : 1.0}, ReduceOp::kMax);
  DM_CHECK(m[4] == 0, "the weights are not finite on some rank after the steps");
  DM_CHECK(m[0] == -m[2] && m[1] == -m[3],
           "the ranks hold different weights after the steps (every mode ends with the same full "
           "weights on every rank): a transfer went wrong");
}

void print_comparison(const Comparison& cmp, const std::vector<ModeResult>& results, int world,
                      const std::string& device) {
  std::printf("\n%s on %d ranks (%s): %lld Muon matrices, %lld Muon + %lld AdamW parameters\n",
              cmp.workload().c_str(), world, device.c_str(), static_cast<long long>(cmp.matrices()),
              static_cast<long long>(cmp.muon_params()),
              static_cast<long long>(cmp.adamw_params()));
  std::printf(
      "step: local unreduced gradients -> full updated weights on every rank "
      "(gather/sharded/adamw include the FSDP2 reduce-scatter and weight all-gather, "
      "replicated the DDP all-reduce)\n");
  std::printf("%-11s %-6s %10s %10s %12s %12s %13s %13s %10s %10s %9s\n", "mode", "algo", "step ms",
              "engine ms", "MB/rank max", "engine MB", "GFLOP/rk max", "GFLOP/rk mean", "flops/gth",
              "bytes/gth", "speedup");
  for (const ModeResult& r : results) {
    const ModeResult* g = gather_of(results, r);
    char ratios[64] = "         -          -         -";
    if (g) {
      // One rank moves no bytes in any mode: its byte ratio is "-", not 0/0.
      char bytes[16] = "-", flops[16] = "-";
      if (g->bytes_max > 0) std::snprintf(bytes, sizeof(bytes), "%.3f", r.bytes_max / g->bytes_max);
      if (g->flops_max > 0) std::snprintf(flops, sizeof(flops), "%.3f", r.flops_max / g->flops_max);
      std::snprintf(ratios, sizeof(ratios), "%10s %10s %8.2fx", flops, bytes,
                    g->step_ms.median / r.step_ms.median);
    }
    std::printf("%-11s %-6s %10.1f %10.1f %12.1f %12.1f %13.2f %13.2f %s\n", r.mode.c_str(),
                r.algo.c_str(), r.step_ms.median, r.engine_ms.median, r.bytes_max / 1e6,
                r.engine_bytes_max / 1e6, r.flops_max / 1e9, r.flops_mean / 1e9, ratios);
  }
}

nlohmann::json comparison_runs_json(const std::vector<ModeResult>& results) {
  auto summary = [](const cli::Summary& s) {
    return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}};
  };
  nlohmann::json runs = nlohmann::json::array();
  for (const ModeResult& r : results) {
    const ModeResult* g = gather_of(results, r);
    runs.push_back({{"mode", r.mode},
                    {"algo", r.algo},
                    {"step_ms", summary(r.step_ms)},
                    {"engine_ms", summary(r.engine_ms)},
                    {"host_ms", summary(r.host_ms)},
                    {"comm_bytes_per_rank", r.bytes_max},
                    {"comm_bytes_per_rank_mean", r.bytes_mean},
                    {"engine_comm_bytes_per_rank", r.engine_bytes_max},
                    {"engine_launches_per_step", r.engine_launches_max},
                    {"launches_per_step", r.launches_max},
                    {"ortho_flops_max_rank", r.flops_max},
                    {"ortho_flops_mean_rank", r.flops_mean},
                    {"owned_matrices_max_rank", r.owned_max},
                    {"plan_costs", r.plan_costs},
                    {"speedup_vs_gather",
                     g ? nlohmann::json(g->step_ms.median / r.step_ms.median) : nlohmann::json()}});
  }
  return runs;
}

}  // namespace distmuon::bench
