#include "bench_rank.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_compare.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "plan/sim_step.h"

namespace distmuon::bench {
namespace {

// While alive, says every `every_s` seconds how long `what` has been running, where `on` (rank
// 0): a first step on a small part of a GPU (planning, allocation, graph capture, the whole
// model on 14 SMs) can take minutes and would otherwise look like a hang. It only waits on a
// condition variable, so it costs the timed steps nothing.
class Heartbeat {
 public:
  Heartbeat(bool on, std::string what, double every_s) {
    if (!on) return;
    thread_ = std::thread([this, what = std::move(what), every_s] {
      const auto t0 = std::chrono::steady_clock::now();
      std::unique_lock<std::mutex> lk(mu_);
      while (!cv_.wait_for(lk, std::chrono::duration<double>(every_s), [this] { return done_; })) {
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "distmuon-bench: %s: still running after %.3g s\n", what.c_str(), s);
      }
    });
  }
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- calibration ------------------------------------------------------------------------------

struct Calibration {
  double gemm_tflops = 0;  // this rank's bf16 GEMM rate while every rank runs one
  double copy_gbs = 0;     // this rank's kernel copy bandwidth (read + write) likewise
  // This rank's AdamW pass (the engine's check and update) likewise, counted at the bytes the
  // simulator charges an element (sim_detail::kAdamWBytesPerElement): its --adamw-tbs.
  double adamw_gbs = 0;
  double allgather_gbs = 0;  // NCCL all-gather bus bandwidth between the ranks
  double allreduce_gbs = 0;  // NCCL all-reduce bus bandwidth
  double broadcast_gbs = 0;  // NCCL broadcast (root 0) bus bandwidth: the dedicated mode's
  double reduce_gbs = 0;     // NCCL reduce (to root 0) bus bandwidth: the dedicated mode's
  double alltoall_gbs = 0;   // NCCL all-to-all bus bandwidth: the sharded mode's
  bool alltoall_windows = false;  // ... timed in equal blocks on the communicator's windows
  // Host time per collective when many small ones are issued back to back, as the FSDP2
  // emulation and the engine issue them (the simulator's --collective-latency-us).
  double collective_us = 0;
  // Share of a rank's compute an NCCL kernel takes while it waits for a peer (its CTAs spin on
  // the SMs they hold): the simulator's --comm-wait-share where ranks share a GPU.
  double wait_share = 0;
};

// Median device ms of `reps` runs of `run` on every rank at once (a barrier before each).
double timed_together(Communicator& host, Backend& be, int reps, const std::function<void()>& run) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    be.synchronize();
    host.barrier().wait();
    ms.push_back(be.time_ms(1, {}, run));
  }
  return cli::summarize(ms).median;
}

// `say` reports each stage's end (rank 0 prints it), so that a run that stops says where.
Calibration calibrate(Communicator& host, Backend& be, Communicator& comm,
                      const std::function<void(const std::string&)>& say) {
  Calibration c;
  char line[160];
  // bf16 8192 x 8192 x 8192: about 1.1 TFLOP, long enough on the smallest part
  const int64_t n = 8192;
  const size_t gemm_bytes = static_cast<size_t>(n * n) * 2;
  Buffer a = be.alloc(gemm_bytes), b = be.alloc(gemm_bytes), d = be.alloc(gemm_bytes);
  const BatchRef ra = BatchRef::packed(a.data(), DType::kBF16, 1, n, n);
  const BatchRef rb = BatchRef::packed(b.data(), DType::kBF16, 1, n, n);
  const BatchRef rd = BatchRef::packed(d.data(), DType::kBF16, 1, n, n);
  be.fill_normal(ra, 1, 0);
  be.fill_normal(rb, 2, 0);
  auto gemm = [&] { be.gemm(Op::kN, ra, Op::kN, rb, 1.0, 0.0, nullptr, rd); };
  gemm();  // cuBLASLt picks and loads its kernel
  const double gemm_ms = timed_together(host, be, 5, gemm);
  c.gemm_tflops = 2.0 * n * n * n / (gemm_ms * 1e-3) / 1e12;
  std::snprintf(line, sizeof(line), "calibration: GEMM %.0f TFLOP/s on rank 0", c.gemm_tflops);
  say(line);
  {  // 1 GiB copied by a kernel on the rank's SMs (the engine's lincomb: what its elementwise
     // passes get), not by a copy engine, which no SM partition confines
    const int64_t rows = 16384, cols = 32768;  // bf16: 1 GiB
    const size_t bytes = static_cast<size_t>(rows * cols) * 2;
    Buffer src = be.alloc(bytes), dst = be.alloc(bytes);
    const BatchRef s = BatchRef::packed(src.data(), DType::kBF16, 1, rows, cols);
    const BatchRef d = BatchRef::packed(dst.data(), DType::kBF16, 1, rows, cols);
    be.fill_normal(s, 3, 0);
    auto copy = [&] { be.lincomb(1.0, s, 0.0, nullptr, 0.0, d); };
    copy();
    const double ms = timed_together(host, be, 5, copy);
    c.copy_gbs = 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
    std::snprintf(line, sizeof(line), "calibration: copy %.0f GB/s on rank 0", c.copy_gbs);
    say(line);
  }
  {  // 64 Mi bf16 parameters with fp32 moments as one AdamW tensor: the AdamW baseline's pass
    const int64_t numel = int64_t{64} << 20;
    Buffer prm = be.alloc(static_cast<size_t>(numel) * 2),
           grd = be.alloc(static_cast<size_t>(numel) * 2);
    Buffer m = be.alloc(static_cast<size_t>(numel) * 4),
           v = be.alloc(static_cast<size_t>(numel) * 4);
    Buffer coef = be.alloc(sizeof(AdamCoef)), status = be.alloc(sizeof(int32_t));
    be.fill_normal(BatchRef::packed(prm.data(), DType::kBF16, 1, 1, numel), 4, 0);
    be.fill_normal(BatchRef::packed(grd.data(), DType::kBF16, 1, 1, numel), 5, 0);
    be.fill_zero(m.data(), static_cast<size_t>(numel) * 4);
    be.fill_zero(v.data(), static_cast<size_t>(numel) * 4);
    const AdamCoef host_coef{};
    be.copy_from_host(coef.data(), &host_coef, sizeof(AdamCoef));
    const AdamSlot slot{prm.data(),   grd.data(), m.data(), v.data(),           DType::kBF16,
                        DType::kBF16, numel,      nullptr,  coef.as<AdamCoef>()};
    auto pass = [&] {
      be.adamw_check({&slot, 1}, status.as<int32_t>());
      be.adamw_update({&slot, 1}, status.as<int32_t>());
    };
    pass();
    const double ms = timed_together(host, be, 5, pass);
    c.adamw_gbs =
        sim_detail::kAdamWBytesPerElement * static_cast<double>(numel) / (ms * 1e-3) / 1e9;
    std::snprintf(line, sizeof(line), "calibration: AdamW pass %.0f GB/s on rank 0", c.adamw_gbs);
    say(line);
  }
  const int p = comm.size();
  if (p > 1) {  // 256 MiB of bf16 per rank; bus bandwidth as nccl-tests counts it
    const int64_t count = int64_t{128} << 20;
    const double bytes = static_cast<double>(count) * 2;
    Buffer send = be.alloc(static_cast<size_t>(bytes));
    Buffer recv = be.alloc(static_cast<size_t>(bytes) * p);
    be.fill_zero(send.data(), static_cast<size_t>(bytes));
    auto all_gather = [&] {
      comm.all_gather(send.data(), recv.data(), count, CommType::kBF16).wait();
    };
    auto all_reduce = [&] {
      comm.all_reduce(send.data(), send.data(), count, CommType::kBF16, ReduceOp::kSum).wait();
    };
    auto broadcast = [&] { comm.broadcast(send.data(), count, CommType::kBF16, 0).wait(); };
    auto reduce = [&] {
      comm.reduce(send.data(), comm.rank() == 0 ? recv.data() : nullptr, count, CommType::kBF16,
                  ReduceOp::kSum, 0)
          .wait();
    };
    // The send buffer cut in p equal slots, one per member, each sent to its member; nothing to
    // itself, as the sharded mode sends (a rank's own rows go straight to its stage), so the
    // bytes on the wire are nccl-tests' alltoall's of the same 256 MiB.
    const int64_t slot = count / p;
    std::vector<int64_t> counts(static_cast<size_t>(p), slot), displs(static_cast<size_t>(p));
    for (int q = 0; q < p; ++q) displs[static_cast<size_t>(q)] = q * slot;
    counts[static_cast<size_t>(comm.rank())] = 0;
    // Where the communicator gives windows (DISTMUON_NCCL_CTA_POLICY=zero), the sharded mode
    // sends equal blocks on them, its own included (the copy engines move them): timed so.
    std::shared_ptr<void> wsend = comm.alloc_window(static_cast<size_t>(bytes));
    std::shared_ptr<void> wrecv = wsend ? comm.alloc_window(static_cast<size_t>(bytes)) : nullptr;
    c.alltoall_windows = wsend && wrecv;
    const std::vector<int64_t> equal(static_cast<size_t>(p), slot);
    auto all_to_all = [&] {
      if (c.alltoall_windows)
        comm.all_to_all_v(wsend.get(), equal, displs, wrecv.get(), equal, displs, CommType::kBF16)
            .wait();
      else
        comm.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs, CommType::kBF16)
            .wait();
    };
    all_gather();
    all_reduce();
    broadcast();
    reduce();
    all_to_all();
    say("calibration: the first NCCL all-gather, all-reduce, broadcast, reduce and all-to-all "
        "ended");
    auto host_ms = [&](const std::function<void()>& f) {  // the slowest rank's, per repetition
      std::vector<double> ms;
      for (int i = 0; i < 5; ++i) {
        be.synchronize();
        host.barrier().wait();
        const auto t0 = Clock::now();
        f();
        be.synchronize();
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      return cli::summarize(over_ranks(host, ms, ReduceOp::kMax)).median;
    };
    c.allgather_gbs = (p - 1.0) * bytes / (host_ms(all_gather) * 1e-3) / 1e9;
    c.allreduce_gbs = 2.0 * (p - 1.0) / p * bytes / (host_ms(all_reduce) * 1e-3) / 1e9;
    c.broadcast_gbs = bytes / (host_ms(broadcast) * 1e-3) / 1e9;
    c.reduce_gbs = bytes / (host_ms(reduce) * 1e-3) / 1e9;
    // (p-1)/p * bytes / time, as nccl-tests counts an alltoall: what a rank sends to its peers.
    c.alltoall_gbs = (p - 1.0) * static_cast<double>(slot) * 2 / (host_ms(all_to_all) * 1e-3) / 1e9;
    std::snprintf(line, sizeof(line),
                  "calibration: NCCL all-gather %.0f GB/s, all-reduce %.0f, broadcast %.0f, "
                  "reduce %.0f, all-to-all %.0f GB/s (bus)",
                  c.allgather_gbs, c.allreduce_gbs, c.broadcast_gbs, c.reduce_gbs, c.alltoall_gbs);
    say(line);
    // 256 all-gathers of 1 KiB per rank issued back to back, then waited for: the issue path
    // (NCCL's non-blocking launch, the communicator's polling) sets the pace, not the bytes.
    constexpr int kSmall = 256;
    auto small = [&] {
      std::vector<CommHandle> hs;
      for (int i = 0; i < kSmall; ++i)
        hs.push_back(comm.all_gather(send.data(), recv.data(), 512, CommType::kBF16));
      wait_all(hs);
    };
    small();
    c.collective_us = host_ms(small) * 1e3 / kSmall;
    // Every rank but the last issues a 1 KiB broadcast rooted at the last one and runs the GEMM
    // beside its NCCL kernel, which waits; the root joins once every rank's GEMM has ended. The
    // GEMM's slow-down there is the waiting kernel's share (a dedicated step's peers wait so on
    // each broadcast until its owner has computed).
    const int root = p - 1;
    std::vector<double> beside;
    for (int i = 0; i < 3; ++i) {
      be.synchronize();
      host.barrier().wait();
      CommHandle h;
      if (comm.rank() != root) h = comm.broadcast(send.data(), 512, CommType::kBF16, root);
      const double ms = be.time_ms(1, {}, gemm);
      host.barrier().wait();  // every GEMM has ended
      if (comm.rank() == root) h = comm.broadcast(send.data(), 512, CommType::kBF16, root);
      h.wait();
      if (comm.rank() != root) beside.push_back(ms);
    }
    const double mine = beside.empty() ? 0.0 : 1.0 - gemm_ms / cli::summarize(beside).median;
    // Rank 0's (never the root): what each non-root rank sees alike.
    c.wait_share = std::clamp(mine, 0.0, 0.95);
    std::snprintf(line, sizeof(line),
                  "calibration: a GEMM beside a waiting NCCL kernel runs at %.0f %% of its rate",
                  100 * (1 - c.wait_share));
    say(line);
  }
  return c;
}

// Every rank's values of `mine` (k each), in rank order, on every rank.
std::vector<double> all_ranks(Communicator& host, const std::vector<double>& mine) {
  const size_t k = mine.size();
  std::vector<double> v(k * host.size(), 0.0);
  std::copy(mine.begin(), mine.end(), v.begin() + static_cast<std::ptrdiff_t>(k * host.rank()));
  return over_ranks(host, v, ReduceOp::kSum);
}

// `per_rank`: every rank's GEMM, copy and AdamW rates in rank order (all_ranks).
json calibration_json(const std::vector<double>& per_rank, const Calibration& c) {
  json ranks = json::array();
  double gemm_sum = 0, copy_sum = 0, gemm_min = 1e300, copy_min = 1e300, adamw_min = 1e300;
  for (size_t q = 0; q + 2 < per_rank.size(); q += 3) {
    ranks.push_back({{"gemm_tflops", per_rank[q]},
                     {"copy_gbs", per_rank[q + 1]},
                     {"adamw_gbs", per_rank[q + 2]}});
    gemm_sum += per_rank[q];
    copy_sum += per_rank[q + 1];
    gemm_min = std::min(gemm_min, per_rank[q]);
    copy_min = std::min(copy_min, per_rank[q + 1]);
    adamw_min = std::min(adamw_min, per_rank[q + 2]);
  }
  return {
      {"what",
       "bf16 8192^3 GEMM (cuBLASLt) and a 1 GiB bf16 copy by the engine's lincomb kernel (read + "
       "write bytes) on every rank at once; the engine's AdamW pass (check and update) on 64 Mi "
       "bf16 parameters with fp32 moments, counted at the bytes the simulator charges an element, "
       "likewise; NCCL bus bandwidth of a 256 MiB-per-rank bf16 "
       "all-gather, all-reduce, broadcast and reduce (root 0), and all-to-all (256 MiB / p to each "
       "other rank, none to itself, as the sharded mode sends; on the communicator's windows, "
       "where it gives them, equal blocks to every rank itself included, as the sharded mode "
       "sends there: nccl_alltoall_on_windows; bus bandwidth (p-1)/p * 256 MiB / time); each "
       "timed alone, its issue included; host time per collective of 256 "
       "back-to-back 1 KiB all-gathers; the share of the GEMM's rate a 1 KiB broadcast takes "
       "while its kernel waits for the root (rank 0 beside it)"},
      {"gemm_tflops_per_rank_min", gemm_min},
      {"gemm_tflops_total", gemm_sum},
      {"copy_gbs_per_rank_min", copy_min},
      {"copy_gbs_total", copy_sum},
      {"adamw_gbs_per_rank_min", adamw_min},
      {"nccl_allgather_busbw_gbs", c.allgather_gbs},
      {"nccl_allreduce_busbw_gbs", c.allreduce_gbs},
      {"nccl_broadcast_busbw_gbs", c.broadcast_gbs},
      {"nccl_reduce_busbw_gbs", c.reduce_gbs},
      {"nccl_alltoall_busbw_gbs", c.alltoall_gbs},
      {"nccl_alltoall_on_windows", c.alltoall_windows},
      {"nccl_collective_us", c.collective_us},
      {"nccl_wait_compute_share", c.wait_share},
      {"nccl_blocking", env::get_bool("DISTMUON_NCCL_BLOCKING")},
      {"ranks", ranks}};
}

// ---- the profiled step --------------------------------------------------------------------

constexpr int kBreakdownFields = 5;  // window, compute, comm, overlap, wait (ms)

// One more step of `run`, profiled by this process; its breakdown. Collective.
StepBreakdown profiled_step(RankSetup& r, Comparison& cmp, Comparison::Run& run, int64_t i,
                            const uint64_t& t_begin, const uint64_t& t_end) {
  r.trace->start();
  cmp.step(run, i);  // barriers of its own before and the device's end after
  const std::vector<DeviceInterval> intervals = r.trace->stop();
  return break_down(intervals, r.context, t_begin, t_end);
}

void print_and_write(const BenchOptions& o, RankSetup& r, const Comparison& cmp,
                     const std::vector<ModeResult>& results, const json* calibration,
                     const std::vector<std::vector<double>>& breakdowns) {
  const int p = r.host.size();
  print_comparison(cmp, results, p, r.be.name());
  if (calibration) {
    const json& c = *calibration;
    std::printf(
        "calibration: GEMM %.0f TFLOP/s per rank (%.0f total), copy %.0f GB/s per rank "
        "(%.0f total), NCCL all-gather %.0f GB/s, all-reduce %.0f, broadcast %.0f, reduce %.0f, "
        "all-to-all %.0f GB/s (bus), %.0f us per collective\n",
        c["gemm_tflops_per_rank_min"].get<double>(), c["gemm_tflops_total"].get<double>(),
        c["copy_gbs_per_rank_min"].get<double>(), c["copy_gbs_total"].get<double>(),
        c["nccl_allgather_busbw_gbs"].get<double>(), c["nccl_allreduce_busbw_gbs"].get<double>(),
        c["nccl_broadcast_busbw_gbs"].get<double>(), c["nccl_reduce_busbw_gbs"].get<double>(),
        c["nccl_alltoall_busbw_gbs"].get<double>(), c["nccl_collective_us"].get<double>());
  }
  json runs = comparison_runs_json(results);
  if (!breakdowns.empty()) {
    std::printf("profiled step, busiest rank (ms): compute / communication not hidden / waiting\n");
    for (size_t m = 0; m < runs.size(); ++m) {
      const std::vector<double>& all = breakdowns[m];
      json ranks = json::array();
      int busiest = 0;
      for (int q = 0; q < p; ++q) {
        const double* b = &all[static_cast<size_t>(q) * kBreakdownFields];
        ranks.push_back({{"rank", q},
                         {"window_ms", b[0]},
                         {"compute_ms", b[1]},
                         {"comm_ms", b[2]},
                         {"overlap_ms", b[3]},
                         {"wait_ms", b[4]}});
        if (b[1] > all[static_cast<size_t>(busiest) * kBreakdownFields + 1]) busiest = q;
      }
      const double* b = &all[static_cast<size_t>(busiest) * kBreakdownFields];
      runs[m]["busiest_rank"] = busiest;
      runs[m]["profiled_step_ms"] = b[0];
      runs[m]["compute_ms"] = b[1];
      runs[m]["comm_ms"] = b[2];
      runs[m]["wait_ms"] = b[4];
      runs[m]["ranks"] = ranks;
      std::printf("  %-10s rank %d: %.1f / %.1f / %.1f of %.1f\n",
                  runs[m]["mode"].get<std::string>().c_str(), busiest, b[1], b[2], b[4], b[0]);
    }
  }
  if (o.json.empty()) return;
  json j;
  j["workload"] = cmp.workload();
  j["backend"] = o.backend;
  j["device"] = r.be.name();
  j["mechanism"] = r.mechanism;
  j["device_sms"] = r.device_sms;
  j["sms_per_rank"] = r.sms_per_rank;
  j["ranks"] = p;
  j["world_size"] = p;
  j["layers"] = o.layers;
  j["dtype"] = o.dtype;
  j["matrices"] = cmp.matrices();
  j["muon_params"] = cmp.muon_params();
  j["adamw_params"] = cmp.adamw_params();
  j["steps"] = o.steps;
  j["warmup"] = o.warmup;
  j["bucket_mb"] = o.bucket_mb;
  j["batches_per_bucket"] = o.batches_per_bucket;
  j["wire_dtype"] = o.wire_dtype.empty() ? "parameters'" : o.wire_dtype;
  j["planner"] = o.planner;
  j["ranks_per_gpu"] = o.ranks_per_gpu;
  j["step_definition"] =
      "from local unreduced gradients on every rank to full updated weights on every rank; "
      "gather/sharded/adamw include the FSDP2 reduce-scatter and weight all-gather, replicated "
      "the DDP all-reduce; step_ms is the median over steps of the slowest rank";
  j["comm_bytes_definition"] =
      "bytes sent plus received per rank and step (direct point-to-point payload), max over ranks";
  if (!breakdowns.empty()) {
    j["breakdown_definition"] =
        "one extra profiled step per mode (CUPTI activity): per rank the union of its compute "
        "kernels and copies (compute_ms), of its NCCL kernels not under compute (comm_ms, "
        "including time spent inside NCCL waiting for peers) and the rest of its step window "
        "(wait_ms); the top-level figures are the rank with the most compute";
  }
  if (calibration) j["calibration"] = *calibration;
  j["runs"] = runs;
  std::ofstream f(o.json);
  DM_CHECK(f.good(), "cannot write ", o.json);
  f << j.dump(2) << "\n";
}

}  // namespace

int run_rank(const BenchOptions& o, RankSetup& r) {
  Communicator& host = r.host;
  const int rank = host.rank();
  auto progress = [&](const std::string& what) {
    if (rank == 0) std::fprintf(stderr, "distmuon-bench: %s\n", what.c_str());
  };
  std::vector<double> cal_ranks;
  Calibration cal;
  if (o.calibrate) {
    progress("calibrating (GEMM, copy, AdamW, NCCL) on every rank at once");
    cal = calibrate(host, r.be, r.comm, progress);
    cal_ranks = all_ranks(host, {cal.gemm_tflops, cal.copy_gbs, cal.adamw_gbs});
  }
  progress("allocating the workload's tensors on every rank");
  Comparison cmp(o, host, r.comm, r.be);
  uint64_t t_begin = 0, t_end = 0;
  if (r.trace)
    cmp.set_step_hook([&](const Comparison::Run&, int64_t, bool begin) {
      (begin ? t_begin : t_end) = r.trace->now();
    });
  const std::vector<std::string> algos = o.algos_given ? o.algos : std::vector<std::string>{"auto"};
  const int64_t total = o.warmup + o.steps;
  std::vector<ModeResult> results;
  std::vector<std::vector<double>> breakdowns;  // per mode: every rank's kBreakdownFields
  bool adamw_done = false;  // the AdamW baseline runs once, not once per algorithm
  for (const std::string& algo : algos) {
    std::vector<std::unique_ptr<Comparison::Run>> runs;
    for (const std::string& m : o.modes)
      if (m != "adamw" || !adamw_done) {
        progress("setting up " + m + (m == "adamw" ? "" : " (" + algo + ")"));
        runs.push_back(cmp.prepare(m, algo));
      }
    adamw_done = true;
    for (int64_t i = 0; i < total; ++i) {
      const std::string step =
          "step " + std::to_string(i + 1) + " of " + std::to_string(total) + " (every mode)";
      const Heartbeat beat(rank == 0 && o.progress_s > 0, step, o.progress_s);
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& run : runs) cmp.step(*run, i);
      // A slow first step (planning, allocation, a stall) says where the time went.
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i == 0 || s > 1.0) progress(step + " took " + std::to_string(s) + " s");
    }
    for (auto& run : runs) {
      // The result first: its bytes and FLOPs per step are counted over the timed steps, which
      // the profiled step below would join.
      results.push_back(cmp.result(*run));
      if (r.trace) {
        const StepBreakdown b = profiled_step(r, cmp, *run, total, t_begin, t_end);
        breakdowns.push_back(
            all_ranks(host, {b.window_ms, b.compute_ms, b.comm_ms, b.overlap_ms, b.wait_ms}));
      }
    }
  }
  cmp.check_weights_agree();
  if (rank == 0) {
    const json cal_json = o.calibrate ? calibration_json(cal_ranks, cal) : json();
    print_and_write(o, r, cmp, results, o.calibrate ? &cal_json : nullptr, breakdowns);
  }
  host.barrier().wait();
  return 0;
}

}  // namespace distmuon::bench
