// The fixture of the distributed engine's equality tests (test_dist_engine.cc,
// test_dist_engine_paths.cc): a small model with every kind of matrix, scenarios of modes, buckets
// and HSDP layouts, the single-process reference run, the distributed run on the rig of
// dist_rig.h, and the comparisons of weights, optimizer state and CacheMuon entries.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>

#include "common/half.h"
#include "dist_rig.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"

namespace distmuon::engine_fixture {

using test::expect_close;
using test::Mirror;
using test::world;

struct PDef {
  std::string name;
  int group;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t inner() const { return numel() / shape[0]; }
};

inline const std::vector<PDef>& model() {
  static const std::vector<PDef> defs = {
      {"a", 0, {12, 20}},   {"a2", 0, {12, 20}}, {"b", 0, {30, 8}},      {"c", 0, {5, 16}},
      {"e", 0, {3, 6, 10}}, {"at", 0, {20, 12}}, {"k", 0, {6, 2, 3, 3}}, {"d", 1, {16, 16}},
      {"bias", 2, {7}},     {"emb", 2, {9, 4}}};
  return defs;
}
// cache: group 0 runs Gram NS with CacheMuon (every residual passes, so the entries serve until
// the staleness limit forces a refresh; the check back-off's plan pass runs, and its miss counts
// travel with the entries); group 1 (standard NS) cannot use the cache.
inline void add_groups(Engine& e, bool cache = false) {
  GroupOptions g0;
  g0.muon.lr = 0.05f;
  g0.muon.weight_decay = 0.1f;
  if (cache) {
    g0.muon.ortho = parse_algorithm("gram-ns");
    g0.muon.cache.enabled = true;
    g0.muon.cache.gamma = 1e9;
    g0.muon.cache.max_staleness = 2;
    g0.muon.cache.check_backoff = 4;
  }
  GroupOptions g1;
  g1.muon.lr = 0.02f;
  g1.muon.nesterov = false;
  g1.muon.scale = ScaleMode::kSpectral;
  g1.muon.ortho = parse_algorithm("ns5-sym");
  GroupOptions g2;
  g2.kind = ParamKind::kAdamW;
  g2.adamw.lr = 0.01f;
  for (const GroupOptions& g : {g0, g1, g2}) e.add_group(g);
}

// Dyadic values k/64, |k| <= 32: sums of a few of them are exact in fp32 in any order.
inline float dyadic(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 17) * 0x94D049BB133111EBull ^ (d + 101) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 31;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int>(x % 65) - 32) / 64.0f;
}

struct Scenario {
  DistMode mode = DistMode::kSharded;
  int replicate = 1;
  int64_t bucket_bytes = 32ll << 20;
  bool defer = false;
  int nan_step = -1;  // a NaN in one gradient element of "b" in this step
  NonFinitePolicy policy = NonFinitePolicy::kSkip;
  int steps = 3;
  bool cache = false;  // CacheMuon in group 0 (add_groups)
  bool per_bucket = false;  // DistOptions::batches_across_buckets off: owner batches per bucket
  std::optional<DType> wire = std::nullopt;  // DistOptions::wire_dtype
};

// Which parameters have a gradient: "a2" has none in step 1 (on every rank); in dedicated mode
// "d" (step 2) and "bias" (step 1) have one on rank 0 only.
inline bool has_any(int step, int p) { return !(step == 1 && model()[p].name == "a2"); }
inline bool has_local(const Scenario& sc, int step, int p, int rank) {
  if (!has_any(step, p)) return false;
  if (sc.mode != DistMode::kDedicated || rank == 0) return true;
  return !((step == 2 && model()[p].name == "d") || (step == 1 && model()[p].name == "bias"));
}
// Rank r's local gradient (dedicated), or the reduced gradient every rank sees (r = 0).
inline float grad_value(int step, int p, int64_t i, int r) { return dyadic(1 + step, p, i, r); }

// The mean gradient the engine works from.
inline std::vector<float> reduced_grad(const Scenario& sc, int step, int p, int world_size) {
  std::vector<float> g(model()[p].numel());
  for (int64_t i = 0; i < static_cast<int64_t>(g.size()); ++i) {
    if (sc.mode != DistMode::kDedicated) {
      g[i] = grad_value(step, p, i, 0);
      continue;
    }
    float sum = 0;
    for (int r = 0; r < world_size; ++r)
      if (has_local(sc, step, p, r)) sum += grad_value(step, p, i, r);
    // As the engine: sum, then one multiplication by the float of 1/P.
    g[i] = world_size > 1 ? static_cast<float>(1.0 / world_size) * sum : sum;
  }
  if (step == sc.nan_step && model()[p].name == "b") g[3] = std::nanf("");
  return g;
}

inline std::pair<int64_t, int64_t> chunk(int64_t dim0, int parts, int pos) {  // torch.chunk / FSDP2
  const int64_t cs = (dim0 + parts - 1) / parts;
  const int64_t b = std::min<int64_t>(pos * cs, dim0), e = std::min<int64_t>(b + cs, dim0);
  return {b, e - b};
}

// A matrix's CacheMuon entry as bytes (empty where this rank holds none or the parameter has no
// cache): the transform, its age, its key and its miss count.
struct CacheEntry {
  std::vector<uint8_t> q, age, key, misses;
  DType q_dtype = DType::kF32;
  bool empty() const { return q.empty(); }
};

struct Snapshot {
  std::vector<std::vector<float>> weight;                 // per parameter (full)
  std::vector<std::vector<std::vector<float>>> momentum;  // per Muon parameter, per matrix
  std::vector<std::vector<float>> exp_avg, exp_avg_sq;    // AdamW (full)
  std::vector<std::vector<CacheEntry>> cache;             // per Muon parameter, per matrix
  std::vector<int64_t> steps;
  EngineStats stats;
};

inline std::vector<float> read(Engine& e, const TensorView& v) { return test::read(e.backend(), v); }

inline CacheEntry cache_entry(Engine& e, int p, int64_t m) {
  const std::vector<std::string> names = e.state_names(p);
  if (std::find(names.begin(), names.end(), "cache_q") == names.end()) return {};
  TensorView q = e.matrix_state(p, m, "cache_q");
  if (!q.data) return {};
  return {test::read_bytes(e.backend(), q),
          test::read_bytes(e.backend(), e.matrix_state(p, m, "cache_age")),
          test::read_bytes(e.backend(), e.matrix_state(p, m, "cache_key")),
          test::read_bytes(e.backend(), e.matrix_state(p, m, "cache_misses")), q.dtype};
}

// Ages and keys (the decisions) exactly; the transforms bit for bit on the CPU, within the
// rig's tolerance on CUDA.
inline void expect_same_cache(const CacheEntry& a, const CacheEntry& b, const std::string& what) {
  EXPECT_EQ(a.empty(), b.empty()) << what;
  if (a.empty() || b.empty()) return;
  EXPECT_EQ(a.age, b.age) << what << " (age)";
  EXPECT_EQ(a.key, b.key) << what << " (key)";
  EXPECT_EQ(a.misses, b.misses) << what << " (misses)";
  if (test::bit_exact() || a.q_dtype != DType::kF32) {
    EXPECT_EQ(a.q, b.q) << what << " (transform)";
    return;
  }
  auto floats = [](const std::vector<uint8_t>& x) {
    std::vector<float> f(x.size() / sizeof(float));
    std::memcpy(f.data(), x.data(), f.size() * sizeof(float));
    return f;
  };
  expect_close(floats(a.q), floats(b.q), what + " (transform)");
}

// Weights of the model, in backend memory.
inline std::vector<Mirror<float>> initial_weights(Backend& be,
                                           const std::vector<std::pair<int64_t, int64_t>>& rows) {
  std::vector<Mirror<float>> w;
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    std::vector<float> host(rows[p].second * d.inner());
    for (int64_t i = 0; i < static_cast<int64_t>(host.size()); ++i)
      host[i] = dyadic(0, p, rows[p].first * d.inner() + i, 7) * 8;
    w.emplace_back(be, host);
  }
  return w;
}

inline std::vector<std::pair<int64_t, int64_t>> whole_rows() {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (const PDef& d : model()) rows.emplace_back(0, d.shape[0]);
  return rows;
}

inline Snapshot run_reference(const Scenario& sc, int world_size, const std::vector<int>& skip_steps) {
  auto be = test::make_backend();
  Engine e(*be);
  add_groups(e, sc.cache);
  Snapshot s;
  for (const PDef& d : model()) e.add_param({d.name, d.group, d.shape, DType::kF32});
  std::vector<Mirror<float>> w = initial_weights(*be, whole_rows());
  for (int step = 0; step < sc.steps; ++step) {
    if (std::find(skip_steps.begin(), skip_steps.end(), step) != skip_steps.end()) continue;
    std::vector<Mirror<float>> g;
    std::vector<ParamData> data;
    for (size_t p = 0; p < model().size(); ++p) {
      g.emplace_back(*be, reduced_grad(sc, step, static_cast<int>(p), world_size));
      data.push_back({w[p].data(), has_any(step, p) ? g[p].data() : nullptr, DType::kF32, {}});
    }
    e.step(data);
  }
  s.momentum.resize(model().size());
  s.exp_avg.resize(model().size());
  s.exp_avg_sq.resize(model().size());
  s.cache.resize(model().size());
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    s.weight.push_back(w[p].get());
    s.steps.push_back(e.param_step(static_cast<int>(p)));
    if (d.group == 2) {
      s.exp_avg[p] = read(e, e.state(p, "exp_avg"));
      s.exp_avg_sq[p] = read(e, e.state(p, "exp_avg_sq"));
      continue;
    }
    const int64_t count = d.shape.size() == 3 ? d.shape[0] : 1;
    for (int64_t m = 0; m < count; ++m) {
      s.momentum[p].push_back(read(e, e.matrix_state(p, m, "momentum_buffer")));
      s.cache[p].push_back(cache_entry(e, static_cast<int>(p), m));
    }
  }
  s.stats = e.stats();
  return s;
}

// One distributed run; returns this rank's view: full weights in replicated/dedicated mode,
// only the local rows elsewhere (the rest left empty), and the momentum it holds.
struct DistRun {
  std::vector<std::pair<int64_t, int64_t>> rows;  // local dim-0 rows per parameter
  std::unique_ptr<Backend> be;
  std::vector<Mirror<float>> weight;  // local rows (sharded/gather) or full
  std::unique_ptr<Engine> e;
};

inline DistRun make_dist(const Scenario& sc) {
  Communicator& c = world();
  const bool sharded = sc.mode == DistMode::kSharded || sc.mode == DistMode::kGather;
  const int R = sc.mode == DistMode::kReplicated ? 1 : sc.replicate;
  const int S = c.size() / R, pos = c.rank() % S;
  DistRun run;
  run.be = test::make_backend();
  DistOptions opt;
  opt.mode = sc.mode;
  opt.replicate = sc.replicate;
  opt.bucket_bytes = sc.bucket_bytes;
  opt.defer_publish = sc.defer;
  opt.batches_across_buckets = !sc.per_bucket;
  opt.wire_dtype = sc.wire;
  run.e = std::make_unique<Engine>(*run.be, c, opt, EngineOptions{sc.policy});
  add_groups(*run.e, sc.cache);
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    ParamSpec spec{d.name, d.group, d.shape, DType::kF32};
    auto rows = sharded ? chunk(d.shape[0], S, pos) : std::make_pair(int64_t{0}, d.shape[0]);
    if (sharded) spec.shard = {rows.first, rows.second};
    run.e->add_param(spec);
    run.rows.push_back(rows);
  }
  run.weight = initial_weights(*run.be, run.rows);
  return run;
}

inline void dist_step(DistRun& run, const Scenario& sc, int step) {
  Communicator& c = world();
  std::vector<Mirror<float>> g;
  std::vector<ParamData> data;
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    const auto [b, n] = run.rows[p];
    std::vector<float> local(n * d.inner());
    if (sc.mode == DistMode::kDedicated) {
      for (int64_t i = 0; i < d.numel(); ++i) local[i] = grad_value(step, p, i, c.rank());
      if (step == sc.nan_step && d.name == "b" && c.rank() == c.size() - 1)
        local[3] = std::nanf("");
    } else {
      std::vector<float> full = reduced_grad(sc, step, static_cast<int>(p), c.size());
      std::copy(full.begin() + b * d.inner(), full.begin() + (b + n) * d.inner(), local.begin());
    }
    g.emplace_back(*run.be, local);
    const bool has = has_local(sc, step, static_cast<int>(p), c.rank());
    data.push_back({run.weight[p].data(), has && n ? g[p].data() : nullptr, DType::kF32, {}});
  }
  run.e->step(data);
  run.e->wait_published();
  run.be->synchronize();  // the gradients' memory goes with g
}

// Compares this rank's view with the reference (bit for bit on the CPU).
inline void expect_equal(DistRun& run, const Snapshot& ref, const Scenario& sc) {
  Engine& e = *run.e;
  const std::vector<int64_t> steps = e.param_steps();  // the same on every rank (collective)
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    const auto [b, n] = run.rows[p];
    auto rows_of = [&](const std::vector<float>& full) {
      return std::vector<float>(full.begin() + b * d.inner(), full.begin() + (b + n) * d.inner());
    };
    expect_close(run.weight[p].get(), rows_of(ref.weight[p]), "weights of '" + d.name + "'");
    EXPECT_EQ(steps[p], ref.steps[p]) << d.name;
    if (d.group == 2) {
      expect_close(read(e, e.state(p, "exp_avg")), rows_of(ref.exp_avg[p]), d.name);
      expect_close(read(e, e.state(p, "exp_avg_sq")), rows_of(ref.exp_avg_sq[p]), d.name);
      continue;
    }
    EXPECT_EQ(!ref.cache[p][0].empty(), sc.cache && d.group == 0) << d.name;
    if (sc.mode == DistMode::kGather) {
      std::vector<float> full;
      for (const auto& m : ref.momentum[p]) full.insert(full.end(), m.begin(), m.end());
      expect_close(read(e, e.state(p, "momentum_buffer")), rows_of(full), d.name);
      // Every rank solves every matrix, so every rank holds every cache entry.
      for (size_t m = 0; m < ref.cache[p].size(); ++m)
        expect_same_cache(cache_entry(e, static_cast<int>(p), m), ref.cache[p][m],
                          "cache of '" + d.name + "' matrix " + std::to_string(m));
      continue;
    }
    for (size_t m = 0; m < ref.momentum[p].size(); ++m) {
      std::vector<float> mine = read(e, e.matrix_state(p, m, "momentum_buffer"));
      CacheEntry cache = cache_entry(e, static_cast<int>(p), m);
      const std::string what = "'" + d.name + "' matrix " + std::to_string(m);
      if (e.owner(p, m) == world().rank()) {
        expect_close(mine, ref.momentum[p][m], "momentum of " + what);
        expect_same_cache(cache, ref.cache[p][m], "cache of " + what);
      } else {
        EXPECT_TRUE(mine.empty()) << "rank " << world().rank() << " keeps momentum it does not own";
        EXPECT_TRUE(cache.empty()) << "rank " << world().rank() << " keeps a cache it does not own";
      }
    }
  }
}

inline std::string describe(const Scenario& sc) {
  return std::string(dist_mode_name(sc.mode)) + " replicate " + std::to_string(sc.replicate) +
         " bucket " + std::to_string(sc.bucket_bytes) + (sc.defer ? " deferred" : "") +
         (sc.nan_step >= 0 ? " nan" : "") + (sc.cache ? " cache" : "") +
         (sc.per_bucket ? " batches per bucket" : "");
}

inline void check_scenario(const Scenario& sc) {
  SCOPED_TRACE(describe(sc));
  Communicator& c = world();
  const Snapshot ref = run_reference(sc, c.size(), {});
  DistRun run = make_dist(sc);
  double longest_ms = 0;  // of the steps' calls: the last step's issue time is within it
  for (int step = 0; step < sc.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    dist_step(run, sc, step);
    longest_ms = std::max(longest_ms, std::chrono::duration<double, std::milli>(
                                          std::chrono::steady_clock::now() - t0).count());
  }
  expect_equal(run, ref, sc);
  if (sc.steps > 0) {
    EXPECT_GT(run.e->stats().issue_ms, 0.0);
    EXPECT_LE(run.e->stats().issue_ms, longest_ms);
  }
  // Each matrix is orthogonalized exactly once per step in the owner modes, everywhere in
  // gather mode; skips are counted where the matrix is computed.
  EngineStats st = run.e->stats();
  const std::vector<double> f = test::sum_over_ranks({st.ortho.flops,
                                                       static_cast<double>(st.owned_matrices),
                                                       static_cast<double>(st.nonfinite_skips),
                                                       static_cast<double>(st.cache.hits),
                                                       static_cast<double>(st.cache.refreshes),
                                                       static_cast<double>(st.cache.forced_refreshes),
                                                       static_cast<double>(st.cache.skips)});
  const int copies = sc.mode == DistMode::kGather ? c.size() : 1;
  EXPECT_DOUBLE_EQ(f[0], ref.stats.ortho.flops * copies);
  EXPECT_EQ(f[1], static_cast<double>(ref.stats.muon_matrices * copies));
  EXPECT_EQ(f[2], static_cast<double>(ref.stats.nonfinite_skips * copies));
  EXPECT_EQ(f[3], static_cast<double>(ref.stats.cache.hits * copies));
  EXPECT_EQ(f[4], static_cast<double>(ref.stats.cache.refreshes * copies));
  EXPECT_EQ(f[5], static_cast<double>(ref.stats.cache.forced_refreshes * copies));
  EXPECT_EQ(f[6], static_cast<double>(ref.stats.cache.skips * copies));
  if (sc.cache) {  // the scenario exercises hits and staleness refreshes
    EXPECT_GT(ref.stats.cache.hits, 0);
    EXPECT_GT(ref.stats.cache.forced_refreshes, ref.stats.cache.refreshes / 2);
  }
  EXPECT_GT(st.comm.ops, 0);
}

// The scenarios of one mode, flat (replicate 1) or HSDP (replicate 2: 2 x 2 at four ranks; none
// where the world size is odd, and none in replicated mode, whose world is always flat).
inline std::vector<Scenario> scenarios(DistMode m, int replicate) {
  // Small buckets make the pipeline run several deep: 11 buckets of the model's 6.4 KB of
  // matrices on the CPU, 4 on the NCCL rig, where ranks sharing a GPU are time-sliced and each
  // collective costs milliseconds.
  const int64_t small = test::on_cuda() ? 2000 : 600;
  std::vector<Scenario> out;
  if (replicate == 1) {
    out.push_back({m});
    out.push_back({m, 1, small});
    out.push_back({m, 1, 32ll << 20, false, 1});  // a NaN gradient is skipped everywhere
    // CacheMuon: hits, staleness refreshes, a skipped entry, small buckets.
    out.push_back({m, 1, 32ll << 20, false, -1, NonFinitePolicy::kSkip, 5, true});
    out.push_back({m, 1, small, false, 1, NonFinitePolicy::kSkip, 5, true});
    // Owner batches cut at the buckets' borders (the engine before batches spanned buckets).
    out.push_back({m, 1, small, false, 1, NonFinitePolicy::kSkip, 3, false, true});
    // The publication left in flight, with a NaN: the last buckets' statuses (sharded: agreed
    // with the rows back) are waited for by wait_published().
    out.push_back({m, 1, small, true, 1, NonFinitePolicy::kSkip, 3});
  } else if (world().size() % 2 == 0 && m != DistMode::kReplicated) {
    out.push_back({m, 2, small});
    out.push_back({m, 2, 2 * small, true});  // the publication left in flight
    out.push_back({m, 2, 2 * small, true, 2, NonFinitePolicy::kSkip, 5, true});  // with CacheMuon
  }
  return out;
}

}  // namespace distmuon::engine_fixture
