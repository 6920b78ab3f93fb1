// CacheMuon on the H200 (issue 6 target "a cache hit on the qwen2.5-7b MLP shapes costs at most
// 0.35x a fresh solve", issue 3 "decided on the device").
//  - cache_hit_cost: 24 wide 3584 x 18944 matrices (8 layers of gate, up and down, batched
//    together as the engine does), fp16 Gram NS with restart {2}. Fresh solve vs a call whose
//    entries all pass the gate (candidate Q X + residual + gate; the fresh-solve products are
//    issued masked and skip every matrix on the device), exact and probe residuals, and a call
//    whose entries all refresh (gamma 0: what the gate adds to a fresh solve); each issued
//    eagerly and replayed from a capture, where the solve is skipped whole when no matrix
//    refreshes and runs unmasked when all do; and, replayed, a call of half hits, half refreshes.
//    cache_hit_cost_small / _medium: the same on the MLP shapes of the 6 x 384 and 12 x 768
//    study models (launch-bound).
//  - masked_dense_order: the masked dense product Q X of hits and refreshes (our CUTLASS kernel,
//    every matrix selected) with its tiles row by row and column by column, and with 128 x 256
//    tiles in 2 x 1 clusters, beside cuBLASLt.
//  - cache_engine_drift: gpt2-small engine steps, cache off and on at gamma 2 and 15, the gradient
//    drifting by 1% of its scale per step: device time per step, the host's issue time per step
//    (no synchronisation: the host runs ahead of the device), hit rate, and a captured step.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>

#include "backend/cuda/launch/sym_gemm.h"
#include "cuda_bench.h"
#include "distmuon/cache.h"
#include "distmuon/engine.h"
#include "distmuon/workload.h"

namespace distmuon::bench {

using cuda::time_ms;
using nlohmann::json;

namespace {

// A capture with conditional graph nodes on or off (DISTMUON_GRAPH_CONDITIONALS, read at each
// capture), so that both are measured in one process.
std::unique_ptr<BackendGraph> capture_with_conditionals(CudaBackend& be, bool on,
                                                         const std::function<void()>& issue) {
  setenv("DISTMUON_GRAPH_CONDITIONALS", on ? "1" : "0", 1);
  auto graph = be.capture(issue);
  unsetenv("DISTMUON_GRAPH_CONDITIONALS");
  DM_CHECK(graph, "capture failed (see the log)");
  return graph;
}

// Time of a replay of the call's capture, minus the copy that restores the input.
double replay_ms(CudaBackend& be, double copy_ms, bool conditionals,
                 const std::function<void()>& call) {
  auto graph = capture_with_conditionals(be, conditionals, call);
  return time_ms(be, 5, [&] { graph->replay(); }) - copy_ms;
}

// Time of one call issued eagerly and as a replay of its capture (CacheMuon's refresh path a
// conditional block there, skipped on the device when no matrix refreshes).
std::pair<double, double> eager_and_replay_ms(CudaBackend& be, double copy_ms,
                                              const std::function<void()>& call) {
  return {time_ms(be, 5, call) - copy_ms, replay_ms(be, copy_ms, true, call)};
}

// Fresh Gram NS against CacheMuon calls whose entries all refresh (gamma 0: what the cache adds
// to a fresh solve) and all hit (the same input again), c matrices m x n, each residual.
json cache_call_cost(CudaBackend& be, int64_t c, int64_t m, int64_t n, const char* label) {
  OrthoConfig cfg;
  cfg.iteration = Iteration::kGram;
  cfg.work_dtype = DType::kBF16;
  const OrthoConfig r = resolve(cfg, m, n);  // fp16, restart {2}
  const DType t = iteration_dtype(r);
  std::vector<Buffer> keep;
  BatchRef x0 = BatchRef::packed(nullptr, t, c, m, n), x = x0, out = x0;
  keep.push_back(be.alloc(x0.bytes()));
  x0.data = keep.back().data();
  {  // normalised random input, built in fp32 one matrix at a time
    Buffer u = be.alloc(static_cast<size_t>(m * n) * 4), nrm = be.alloc(sizeof(double));
    for (int64_t i = 0; i < c; ++i) {
      BatchRef ui = BatchRef::packed(u.data(), DType::kF32, 1, m, n);
      be.fill_normal(ui, 0xcace, static_cast<uint64_t>(i * m * n));
      be.frob_norm(ui, nrm.as<double>());
      be.scale_copy(ui, false, ScaleSpec{nrm.as<double>(), 1.0, 1e-7, 1.0}, x0.slice(i, 1));
    }
    be.synchronize();
  }
  keep.push_back(be.alloc(x.bytes()));
  x.data = keep.back().data();
  keep.push_back(be.alloc(out.bytes()));
  out.data = keep.back().data();
  Orthogonalizer ortho(be);
  const double copy_ms = time_ms(be, 5, [&] { be.copy(x.data, x0.data, x.bytes()); });
  json j = {{"count", c}, {"m", m}, {"n", n}, {"algorithm", "gram-ns fp16 restart {2}"}};
  double fresh_ms = 0, fresh_replay_ms = 0;
  {
    const size_t wb = Orthogonalizer::workspace_bytes(r, c, m, n);
    Buffer ws = be.alloc(wb);
    std::tie(fresh_ms, fresh_replay_ms) = eager_and_replay_ms(be, copy_ms, [&] {
      be.copy(x.data, x0.data, x.bytes());
      ortho.run(r, x, out, ws.data(), wb);
    });
  }
  j["fresh_ms"] = fresh_ms;
  j["fresh_replay_ms"] = fresh_replay_ms;
  for (CacheResidual res : {CacheResidual::kExact, CacheResidual::kProbe}) {
    CacheOptions opt;
    opt.enabled = true;
    opt.residual = res;
    opt.gamma = 0.0;  // first: every call refreshes
    TransformCache cache(be, opt);
    cache.prepare(r, c, m, n);
    const size_t wb = Orthogonalizer::cached_workspace_bytes(r, opt, c, m, n);
    Buffer ws = be.alloc(wb);
    auto call = [&] {
      be.copy(x.data, x0.data, x.bytes());
      ortho.run_cached(r, cache, 0, x, out, nullptr, ws.data(), wb);
    };
    const auto [refresh_ms, refresh_replay_ms] = eager_and_replay_ms(be, copy_ms, call);
    const double refresh_plain_ms = replay_ms(be, copy_ms, false, call);
    // A refresh whose test the check back-off leaves out: after a forced refresh and three
    // failed tests, an entry is tested at 4 and 8 misses in a row, then every 8th call, so the
    // median replay is an untested one.
    double refresh_untested_ms = 0;
    {
      CacheOptions backoff = opt;
      backoff.check_backoff = 8;
      TransformCache failing(be, backoff);
      failing.prepare(r, c, m, n);
      auto failing_call = [&] {
        be.copy(x.data, x0.data, x.bytes());
        ortho.run_cached(r, failing, 0, x, out, nullptr, ws.data(), wb);
      };
      for (int i = 0; i < 4; ++i) failing_call();
      refresh_untested_ms = replay_ms(be, copy_ms, true, failing_call);
      DM_CHECK(failing.stats().unchecked_refreshes > 0, "the back-off left no test out");
    }
    opt.gamma = 2.0;  // then: the same input again, every entry passes the gate
    cache.set_options(opt);
    call();
    cache.reset_stats();
    const auto [hit_ms, hit_replay_ms] = eager_and_replay_ms(be, copy_ms, call);
    const double hit_plain_ms = replay_ms(be, copy_ms, false, call);
    const CacheStats st = cache.stats();
    // Half the entries hit and half refresh (the call empties the second half first): both
    // paths run, the solve masked to the refreshed half.
    const double mixed_replay_ms = replay_ms(be, copy_ms, true, [&] {
      be.copy(x.data, x0.data, x.bytes());
      cache.invalidate(c / 2);
      ortho.run_cached(r, cache, 0, x, out, nullptr, ws.data(), wb);
    });
    json e = {{"hit_ms", hit_ms},
              {"refresh_ms", refresh_ms},
              {"hit_over_fresh", hit_ms / fresh_ms},
              {"refresh_over_fresh", refresh_ms / fresh_ms},
              {"hit_replay_ms", hit_replay_ms},
              {"refresh_replay_ms", refresh_replay_ms},
              {"hit_over_fresh_replayed", hit_replay_ms / fresh_replay_ms},
              {"refresh_over_fresh_replayed", refresh_replay_ms / fresh_replay_ms},
              {"hit_replay_unconditional_ms", hit_plain_ms},
              {"refresh_replay_unconditional_ms", refresh_plain_ms},
              {"refresh_untested_replay_ms", refresh_untested_ms},
              {"refresh_untested_over_fresh_replayed", refresh_untested_ms / fresh_replay_ms},
              {"mixed_replay_ms", mixed_replay_ms},
              {"mixed_over_fresh_replayed", mixed_replay_ms / fresh_replay_ms},
              {"hits", st.hits},
              {"refreshes", st.refreshes},
              {"mean_residual", st.residual.mean},
              {"counted_flops_hit_over_fresh", st.fresh_flops > 0 ? st.flops / st.fresh_flops : 0}};
    DM_CHECK(st.refreshes == 0 && st.hits > 0, "the hit timing refreshed ", st.refreshes,
             " entries: the measurement is not of hits");
    std::fprintf(stderr,
                 "[cache] %s %lldx%lldx%lld %s: fresh %.3f ms (replayed %.3f); hit %.3f ms "
                 "(%.3f of fresh; replayed %.3f, %.3f without conditional nodes); all-refresh "
                 "%.3f ms (%.3f; replayed %.3f, %.3f without, %.3f untested by the back-off); "
                 "half hit, half refresh replayed %.3f\n",
                 label, static_cast<long long>(c), static_cast<long long>(m),
                 static_cast<long long>(n), cache_residual_name(res), fresh_ms, fresh_replay_ms,
                 hit_ms, hit_ms / fresh_ms, hit_replay_ms / fresh_replay_ms,
                 hit_plain_ms / fresh_replay_ms, refresh_ms, refresh_ms / fresh_ms,
                 refresh_replay_ms / fresh_replay_ms, refresh_plain_ms / fresh_replay_ms,
                 refresh_untested_ms / fresh_replay_ms, mixed_replay_ms / fresh_replay_ms);
    j[cache_residual_name(res)] = e;
  }
  j["cache_hit_over_fresh"] = j["exact"]["hit_over_fresh"];
  return j;
}

}  // namespace

json conditional_overhead(CudaBackend& be) {
  // 20 small kernels (a lincomb of 64 KB each) replayed plainly, inside one conditional block
  // whose condition is false, and inside one whose condition is true.
  const int kernels = 20;
  std::vector<Buffer> keep;
  const BatchRef a = dev_batch(be, keep, DType::kF32, 1, 128, 128, 3, 1.0f);
  const BatchRef b = dev_batch(be, keep, DType::kF32, 1, 128, 128, 4, 0.0f);
  Buffer flags = be.alloc(sizeof(int32_t));
  auto work = [&] {
    for (int i = 0; i < kernels; ++i) be.lincomb(1.0, a, 0.0, nullptr, 0.0, b);
  };
  auto plain = capture_with_conditionals(be, false, work);
  auto cond = capture_with_conditionals(be, true, [&] {
    const bool opened = be.begin_if_selected(BatchMask{flags.as<int32_t>(), 1}, 1);
    work();
    if (opened) be.end_if_selected();
  });
  auto set_flag = [&](int32_t v) { be.copy_from_host(flags.data(), &v, sizeof v); };
  const double plain_ms = time_ms(be, 20, [&] { plain->replay(); });
  set_flag(0);
  const double skipped_ms = time_ms(be, 20, [&] { cond->replay(); });
  set_flag(1);
  const double taken_ms = time_ms(be, 20, [&] { cond->replay(); });
  std::fprintf(stderr,
               "[cache] conditional node: %d small kernels replayed %.1f us, in a block skipped "
               "%.1f us, in a block taken %.1f us\n",
               kernels, 1e3 * plain_ms, 1e3 * skipped_ms, 1e3 * taken_ms);
  return {{"kernels", kernels},
          {"plain_us", 1e3 * plain_ms},
          {"skipped_us", 1e3 * skipped_ms},
          {"taken_us", 1e3 * taken_ms}};
}

json cache_hit_cost(CudaBackend& be) { return cache_call_cost(be, 24, 3584, 18944, "qwen MLP"); }

json cache_hit_cost_small(CudaBackend& be) {
  return cache_call_cost(be, 12, 384, 1536, "6 x 384 GPT MLP");
}

json cache_hit_cost_medium(CudaBackend& be) {
  return cache_call_cost(be, 24, 768, 3072, "12 x 768 GPT MLP");
}

json masked_dense_order(CudaBackend& be) {
  const int64_t c = 24, m = 3584, n = 18944;
  const DType t = DType::kF16;
  std::vector<Buffer> keep;
  const BatchRef q = dev_batch(be, keep, t, c, m, m, 11, 0.02f);
  const BatchRef x = dev_batch(be, keep, t, c, m, n, 12, 0.02f);
  const BatchRef y = dev_batch(be, keep, t, c, m, n, 13, 0.0f);
  Buffer flags = be.alloc(c * sizeof(int32_t)), ws = be.alloc(size_t(64) << 20);
  std::vector<int32_t> ones(c, 1);
  be.copy_from_host(flags.data(), ones.data(), c * sizeof(int32_t));
  int sms = 0;
  DM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double flops = 2.0 * m * m * n * c;
  json j = {{"count", c}, {"m", m}, {"n", n}, {"k", m}, {"dtype", "f16"}};
  auto record = [&](const char* name, double ms) {
    j[name] = {{"ms", ms}, {"tflops", flops / ms * 1e-9}};
    std::fprintf(stderr, "[cache] masked Q X 24x3584x3584 @ 3584x18944, %s: %.2f ms (%.0f TFLOP/s)\n",
                 name, ms, flops / ms * 1e-9);
  };
  record("cublaslt_unmasked",
         time_ms(be, 5, [&] { be.gemm(Op::kN, q, Op::kN, x, 1.0, 0.0, nullptr, y); }));
  struct Variant {
    const char* name;
    cuda::TileOrder order;
    cuda::DenseTile tile;
  };
  for (const Variant& v :
       {Variant{"masked_rows", cuda::TileOrder::kRows, cuda::DenseTile::k256x128},
        Variant{"masked_columns", cuda::TileOrder::kColumns, cuda::DenseTile::k256x128},
        Variant{"masked_columns_128x256_c2", cuda::TileOrder::kColumns,
                cuda::DenseTile::k128x256Cluster2}}) {
    cuda::SymGemmArgs g = cuda::make_sym_args(q, x, nullptr, y, m, 1.0, 0.0);
    g.lower = false;
    g.flags = flags.as<int32_t>();
    g.order = v.order;
    g.tile = v.tile;
    record(v.name, time_ms(be, 5, [&] {
             DM_CHECK(cuda::run_dense_nn_sm90_f16(g, sms, ws.data(), size_t(64) << 20, be.stream()),
                      "the masked dense kernel cannot run this shape");
           }));
  }
  return j;
}

json cache_engine_drift(CudaBackend& be, int steps) {
  const Workload w = load_workload("gpt2-small");
  const float sigma = 1e-3f, eps = 0.01f;
  json j = {{"workload", "gpt2-small"}, {"drift", eps}, {"steps", steps}};
  for (double gamma : {0.0, 2.0, 15.0}) {  // 0: cache off
    const bool on = gamma > 0;
    EngineOptions eo;
    eo.autotune = AutoTune::kOff;  // the heuristic: Gram NS (restart {2}) where alpha >= 1.5
    Engine engine(be, eo);
    GroupOptions g;
    g.muon.ortho.work_dtype = DType::kBF16;
    g.muon.cache.enabled = on;
    if (on) g.muon.cache.gamma = gamma;
    engine.add_group(g);
    std::vector<Buffer> keep;
    std::vector<ParamData> data;
    std::vector<BatchRef> grads;
    uint64_t seed = 500;
    int64_t max_numel = 0;
    for (const WorkloadEntry& e : w.muon)
      for (int64_t l = 0; l < e.count; ++l) {
        int64_t numel = 1;
        for (int64_t d : e.shape) numel *= d;
        max_numel = std::max(max_numel, numel);
        engine.add_param({e.name + "." + std::to_string(l), 0, e.shape, DType::kF32});
        BatchRef wt = dev_batch(be, keep, DType::kF32, 1, 1, numel, seed++, 0.02f);
        grads.push_back(dev_batch(be, keep, DType::kF32, 1, 1, numel, seed++, sigma));
        data.push_back({wt.data, grads.back().data, DType::kF32, {}});
      }
    BatchRef noise = dev_batch(be, keep, DType::kF32, 1, 1, max_numel, 1, 1.0f);
    uint64_t counter = 0;
    auto drift = [&] {  // G <- G + eps * sigma * N(0, 1), fresh noise every step
      for (const BatchRef& gr : grads) {
        BatchRef nz = noise;
        nz.cols = nz.ld = nz.stride = gr.cols;
        be.fill_normal(nz, 0xd1f7, counter);
        counter += static_cast<uint64_t>(gr.cols);
        be.lincomb(1.0, gr, eps * sigma, &nz, 0.0, gr);
      }
    };
    for (int s = 0; s < 3; ++s) {  // warm-up: buffers, plans, the first refreshes
      drift();
      engine.step(data);
    }
    be.synchronize();
    std::vector<cuda::Event> ev;
    for (int s = 0; s < 2 * steps; ++s) ev.push_back(cuda::make_event());
    double host_ms = 0;
    for (int s = 0; s < steps; ++s) {
      drift();
      const auto t0 = std::chrono::steady_clock::now();
      DM_CHECK_CUDA(cudaEventRecord(ev[2 * s].get(), be.stream()));
      engine.step(data);
      DM_CHECK_CUDA(cudaEventRecord(ev[2 * s + 1].get(), be.stream()));
      host_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    be.synchronize();
    std::vector<double> dev;
    for (int s = 0; s < steps; ++s) {
      float ms = 0;
      DM_CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * s].get(), ev[2 * s + 1].get()));
      dev.push_back(ms);
    }
    const double graph = graph_ms(be, 5, [&] { engine.step(data); });  // capture: no host sync
    const EngineStats st = engine.stats();
    json e = {{"device_ms_median", cuda::median_of(dev)},
              {"host_issue_ms_mean", host_ms / steps},
              {"graph_ms", graph},
              {"captured", true}};
    if (on)
      e.update({{"hit_rate", st.cache.hit_rate()},
                {"flops_saved_fraction", st.cache.flops_saved_fraction()},
                {"mean_residual", st.cache.residual.mean},
                {"hits", st.cache.hits},
                {"refreshes", st.cache.refreshes}});
    std::fprintf(
        stderr,
        "[cache] gpt2-small engine, cache %s: device %.3f ms/step, host issue %.3f ms/step, "
        "graph %.3f ms%s\n",
        on ? ("on (gamma " + std::to_string(gamma) + ", drift 0.01)").c_str() : "off",
        e["device_ms_median"].get<double>(),
        host_ms / steps, graph,
        on ? (", hit rate " + std::to_string(st.cache.hit_rate()) + ", FLOPs saved " +
              std::to_string(st.cache.flops_saved_fraction()))
                 .c_str()
           : "");
    j[!on ? "cache_off" : gamma == 2.0 ? "cache_on" : "cache_gamma15"] = e;
  }
  return j;
}

}  // namespace distmuon::bench
