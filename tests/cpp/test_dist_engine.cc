// Distributed equals single process: under mpirun, for every mode (gather, replicated, sharded,
// dedicated), bucket size, HSDP layout and deferred publication, the weights and optimizer state
// after several steps equal those of the single-process engine fed the same (mean) gradients:
// bit for bit on the MPI rig (CPU), within the NCCL rig's tolerance on CUDA (dist_rig.h). The model has wide, tall, 3D and conv matrices, two Muon groups, AdamW tensors,
// uneven and empty FSDP2-style shards, a parameter without gradient in one step, and (dedicated
// mode) gradients missing on some ranks only; a tall and a wide matrix of the same sides share
// a batch. With CacheMuon on, the cache entries (kept by the owner, or by every rank in gather
// mode) and their hit/refresh decisions equal those of the single process too. Why bit-exact is
// possible: every matrix is
// computed by the same fused passes on the same values as in one process, and the gradients are
// dyadic numbers whose sums are exact in any reduction order.
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

namespace distmuon {
namespace {

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

const std::vector<PDef>& model() {
  static const std::vector<PDef> defs = {
      {"a", 0, {12, 20}},   {"a2", 0, {12, 20}}, {"b", 0, {30, 8}},      {"c", 0, {5, 16}},
      {"e", 0, {3, 6, 10}}, {"at", 0, {20, 12}}, {"k", 0, {6, 2, 3, 3}}, {"d", 1, {16, 16}},
      {"bias", 2, {7}},     {"emb", 2, {9, 4}}};
  return defs;
}
// cache: group 0 runs Gram NS with CacheMuon (every residual passes, so the entries serve until
// the staleness limit forces a refresh; the check back-off's plan pass runs, and its miss counts
// travel with the entries); group 1 (standard NS) cannot use the cache.
void add_groups(Engine& e, bool cache = false) {
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
float dyadic(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
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
bool has_any(int step, int p) { return !(step == 1 && model()[p].name == "a2"); }
bool has_local(const Scenario& sc, int step, int p, int rank) {
  if (!has_any(step, p)) return false;
  if (sc.mode != DistMode::kDedicated || rank == 0) return true;
  return !((step == 2 && model()[p].name == "d") || (step == 1 && model()[p].name == "bias"));
}
// Rank r's local gradient (dedicated), or the reduced gradient every rank sees (r = 0).
float grad_value(int step, int p, int64_t i, int r) { return dyadic(1 + step, p, i, r); }

// The mean gradient the engine works from.
std::vector<float> reduced_grad(const Scenario& sc, int step, int p, int world_size) {
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

std::pair<int64_t, int64_t> chunk(int64_t dim0, int parts, int pos) {  // torch.chunk / FSDP2
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

std::vector<float> read(Engine& e, const TensorView& v) { return test::read(e.backend(), v); }

CacheEntry cache_entry(Engine& e, int p, int64_t m) {
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
void expect_same_cache(const CacheEntry& a, const CacheEntry& b, const std::string& what) {
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
std::vector<Mirror<float>> initial_weights(Backend& be,
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

std::vector<std::pair<int64_t, int64_t>> whole_rows() {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (const PDef& d : model()) rows.emplace_back(0, d.shape[0]);
  return rows;
}

Snapshot run_reference(const Scenario& sc, int world_size, const std::vector<int>& skip_steps) {
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

DistRun make_dist(const Scenario& sc) {
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

void dist_step(DistRun& run, const Scenario& sc, int step) {
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
void expect_equal(DistRun& run, const Snapshot& ref, const Scenario& sc) {
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

std::string describe(const Scenario& sc) {
  return std::string(dist_mode_name(sc.mode)) + " replicate " + std::to_string(sc.replicate) +
         " bucket " + std::to_string(sc.bucket_bytes) + (sc.defer ? " deferred" : "") +
         (sc.nan_step >= 0 ? " nan" : "") + (sc.cache ? " cache" : "") +
         (sc.per_bucket ? " batches per bucket" : "");
}

void check_scenario(const Scenario& sc) {
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
std::vector<Scenario> scenarios(DistMode m, int replicate) {
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

class EveryMode : public ::testing::TestWithParam<std::tuple<DistMode, int>> {};

TEST_P(EveryMode, EqualsTheSingleProcessEngine) {
  const auto [mode, replicate] = GetParam();
  const std::vector<Scenario> all = scenarios(mode, replicate);
  if (all.empty()) GTEST_SKIP() << "no HSDP layout at this world size or in this mode";
  for (const Scenario& sc : all) check_scenario(sc);
}

INSTANTIATE_TEST_SUITE_P(
    MpiEngine, EveryMode,
    ::testing::Combine(::testing::Values(DistMode::kGather, DistMode::kReplicated,
                                         DistMode::kSharded, DistMode::kDedicated),
                       ::testing::Values(1, 2)),
    [](const ::testing::TestParamInfo<EveryMode::ParamType>& info) {
      return std::string(dist_mode_name(std::get<0>(info.param))) +
             (std::get<1>(info.param) == 2 ? "_hsdp" : "");
    });

// The dedicated mode's broadcasts in the slot of the compute that completes their bucket (the
// order before 2026-12-06, kept for measuring) still equal one process, every flat scenario.
TEST(MpiEngine, DedicatedEarlyBroadcastsEqualTheSingleProcessEngine) {
  struct Env {  // unset however the test ends: the later tests of this process see the default
    Env() { setenv("DISTMUON_DEDICATED_EARLY_BROADCAST", "1", 1); }
    ~Env() { unsetenv("DISTMUON_DEDICATED_EARLY_BROADCAST"); }
  } env;
  for (const Scenario& sc : scenarios(DistMode::kDedicated, 1)) check_scenario(sc);
}

// The Muon matrices in registration order (the plan's indices), their shapes and the bucket each
// lies in, as the engine cuts buckets: consecutive matrices up to bucket_bytes (f32).
struct MatInBucket {
  int group;
  int64_t m, n, bucket;
};
std::vector<MatInBucket> matrices_in_buckets(int64_t bucket_bytes) {
  std::vector<MatInBucket> mats;
  int64_t bucket = 0, bytes = 0;
  for (const PDef& d : model()) {
    if (d.group == 2) continue;
    const int64_t count = d.shape.size() == 3 ? d.shape[0] : 1;
    const int64_t rows = d.shape.size() == 3 ? d.shape[1] : d.shape[0];
    const int64_t cols = d.numel() / count / rows;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t mb = rows * cols * static_cast<int64_t>(sizeof(float));
      if (!mats.empty() && bytes + mb > bucket_bytes) {
        bucket += 1;
        bytes = 0;
      }
      bytes += mb;
      mats.push_back({d.group, std::min(rows, cols), std::max(rows, cols), bucket});
    }
  }
  return mats;
}

// An owner orthogonalizes each plan batch of one group and shape once per step, however many
// buckets its members lie in (buckets of one or two matrices here, as the engine cuts them:
// consecutive matrices up to bucket_bytes), as with one bucket; with batches_across_buckets off,
// once per bucket it spans. Counted by the orthogonalizer's calls (one per batch without
// CacheMuon); the results equal one process either way (EveryMode's scenarios).
TEST(MpiEngine, OwnerBatchesSpanBuckets) {
  Communicator& c = world();
  for (DistMode mode : {DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated}) {
    int64_t spanning = 0;  // summed over the ranks: batches that span buckets
    for (bool per_bucket : {false, true}) {
      SCOPED_TRACE(std::string(dist_mode_name(mode)) + (per_bucket ? " per bucket" : ""));
      Scenario sc;
      sc.mode = mode;
      sc.bucket_bytes = 600;
      sc.per_bucket = per_bucket;
      DistRun run = make_dist(sc);
      dist_step(run, sc, 0);  // every parameter has a gradient in step 0
      const std::vector<MatInBucket> mats = matrices_in_buckets(sc.bucket_bytes);
      const Plan* plan = run.e->plan();
      ASSERT_NE(plan, nullptr);
      std::set<std::tuple<size_t, int, int64_t, int64_t>> batches;
      std::set<std::tuple<size_t, int, int64_t, int64_t, int64_t>> runs;
      const auto& mine = plan->batches.at(static_cast<size_t>(c.rank()));
      for (size_t k = 0; k < mine.size(); ++k)
        for (int j : mine[k]) {
          const MatInBucket& m = mats.at(static_cast<size_t>(j));
          batches.emplace(k, m.group, m.m, m.n);
          runs.emplace(k, m.group, m.m, m.n, c.size() > 1 ? m.bucket : 0);
        }
      const int64_t calls = run.e->stats().ortho.calls;
      EXPECT_EQ(calls, static_cast<int64_t>(per_bucket ? runs.size() : batches.size()));
      if (!per_bucket) spanning = static_cast<int64_t>(runs.size() - batches.size());
    }
    // The layout does cut some plan batch at a bucket border (else this test proves nothing).
    if (c.size() > 1) {
      EXPECT_GT(test::sum_over_ranks({static_cast<double>(spanning)})[0], 0);
    }
  }
}

// Sharded without replicas: a bucket's statuses are agreed by an all-reduce launched with its
// update rows' all-to-all, one launch where the communicator launches groups (NCCL). A step
// issues the vote, then three collectives per bucket: rows out, statuses, rows back.
TEST(MpiEngine, ShardedStatusesTravelWithTheUpdateRows) {
  Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
  // A step's collectives, with one bucket and with many.
  auto step_comm = [](int64_t bucket_bytes) {
    Scenario sc;
    sc.bucket_bytes = bucket_bytes;
    DistRun run = make_dist(sc);
    dist_step(run, sc, 0);
    const CommStats before = run.e->stats().comm;
    dist_step(run, sc, 2);  // every matrix has a gradient in steps 0 and 2
    return run.e->stats().comm - before;
  };
  const int64_t buckets = matrices_in_buckets(600).back().bucket + 1;
  ASSERT_GT(buckets, 2);
  const CommStats one = step_comm(32ll << 20), many = step_comm(600);
  EXPECT_EQ(many.ops - one.ops, 3 * (buckets - 1));  // rows out, statuses, rows back
  EXPECT_EQ(one.launches, test::on_cuda() ? one.ops - 1 : one.ops);
  EXPECT_EQ(many.launches, test::on_cuda() ? many.ops - buckets : many.ops);
}

// DistOptions::wire_dtype bf16 for f32 parameters: the sharded and gather modes move about half
// the bytes, every rank's weights stay within bf16's rounding of the f32 wire's (the gradient
// rows and the updates are rounded once), AdamW's parameters do not change at all; the modes
// that move weights refuse it on every rank.
TEST(MpiEngine, ANarrowWireHalvesTheBytesAndRoundsOnce) {
  Communicator& c = world();
  for (DistMode mode : {DistMode::kSharded, DistMode::kGather}) {
    SCOPED_TRACE(dist_mode_name(mode));
    Scenario f32, bf16;
    f32.mode = bf16.mode = mode;
    f32.bucket_bytes = bf16.bucket_bytes = 600;
    bf16.wire = DType::kBF16;
    DistRun a = make_dist(f32), b = make_dist(bf16);
    for (int step = 0; step < f32.steps; ++step) {
      dist_step(a, f32, step);
      dist_step(b, bf16, step);
    }
    const CommStats ca = a.e->stats().comm, cb = b.e->stats().comm;
    const double bytes_a = static_cast<double>(ca.bytes_sent + ca.bytes_received);
    const double bytes_b = static_cast<double>(cb.bytes_sent + cb.bytes_received);
    if (c.size() > 1) {
      EXPECT_LT(bytes_b, 0.6 * bytes_a);  // the statuses and the vote keep their width
      EXPECT_GT(bytes_b, 0.4 * bytes_a);
    }
    std::vector<Mirror<float>> w0 = initial_weights(*a.be, a.rows);
    double worst = 0;  // the largest difference, relative to the largest change of the weights
    for (size_t p = 0; p < model().size(); ++p) {
      const std::vector<float> wa = a.weight[p].get(), wb = b.weight[p].get(), init = w0[p].get();
      if (model()[p].group == 2) {
        EXPECT_EQ(wa, wb) << model()[p].name;  // AdamW's parameters never travel
        continue;
      }
      double moved = 0, diff = 0;
      for (size_t i = 0; i < wa.size(); ++i) {
        moved = std::max(moved, static_cast<double>(std::abs(wa[i] - init[i])));
        diff = std::max(diff, static_cast<double>(std::abs(wa[i] - wb[i])));
      }
      if (moved > 0) worst = std::max(worst, diff / moved);
    }
    worst = test::max_over_ranks(worst);
    if (c.rank() == 0)
      std::printf("[wire] %s, bf16 for f32 parameters, %d steps: %.3g of the f32 wire's bytes, "
                  "weights within %.3g of their change\n",
                  dist_mode_name(mode), f32.steps, bytes_a > 0 ? bytes_b / bytes_a : 1.0, worst);
    EXPECT_GT(worst, 0);     // the rounding is there
    EXPECT_LT(worst, 0.05);  // and small: bf16 keeps 8 bits
  }
  {
    Scenario sc;
    sc.mode = DistMode::kSharded;
    sc.wire = DType::kF16;
    try {
      DistRun r = make_dist(sc);
      dist_step(r, sc, 0);
      ADD_FAILURE() << "an f16 wire was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("wire_dtype f16 is refused"), std::string::npos)
          << e.what();
    }
  }
  for (DistMode mode : {DistMode::kDedicated, DistMode::kReplicated}) {
    Scenario sc;
    sc.mode = mode;
    sc.wire = DType::kBF16;
    try {
      DistRun r = make_dist(sc);
      dist_step(r, sc, 0);
      ADD_FAILURE() << dist_mode_name(mode) << " accepted a narrower wire";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("wire_dtype bf16 applies to the sharded and gather"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(MpiEngine, HalfPrecisionParametersTravelInTheirDtype) {
  // bf16 parameters with fp32 gradients. What travels is in bf16: gradients (dedicated,
  // sharded), U (gather) and the update (sharded); the reference keeps them in fp32. So the
  // results follow the reference within two bf16 units of the value plus the effect of one
  // bf16 rounding of the update direction over three steps (lr * scale * 2^-8 * 3 < 2e-4);
  // replicated mode moves only finished weights and is bit-exact.
  Communicator& c = world();
  const int p = c.size();
  const std::vector<PDef> defs = {{"p", 0, {12, 20}}, {"q", 0, {30, 8}}, {"bias", 2, {7}}};
  for (DistMode m :
       {DistMode::kGather, DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated}) {
    SCOPED_TRACE(dist_mode_name(m));
    const bool sharded = m == DistMode::kSharded || m == DistMode::kGather;
    auto be = test::make_backend();
    Engine ref(*be);
    DistOptions opt;
    opt.mode = m;
    Engine e(*be, c, opt);
    for (Engine* x : {&ref, &e}) add_groups(*x);
    std::vector<std::vector<uint16_t>> wr(defs.size()), w(defs.size());
    std::vector<Mirror<uint16_t>> wr_dev, w_dev;
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (size_t i = 0; i < defs.size(); ++i) {
      const PDef& d = defs[i];
      ref.add_param({d.name, d.group, d.shape, DType::kBF16});
      rows.push_back(sharded ? chunk(d.shape[0], p, c.rank())
                             : std::make_pair(int64_t{0}, d.shape[0]));
      ParamSpec spec{d.name, d.group, d.shape, DType::kBF16};
      if (sharded) spec.shard = {rows[i].first, rows[i].second};
      e.add_param(spec);
      for (int64_t k = 0; k < d.numel(); ++k)
        wr[i].push_back(float_to_bf16(dyadic(9, i, k, 0) * 4));
      w[i].assign(wr[i].begin() + rows[i].first * d.inner(),
                  wr[i].begin() + (rows[i].first + rows[i].second) * d.inner());
      wr_dev.emplace_back(*be, wr[i]);
      w_dev.emplace_back(*be, w[i]);
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<float>> gr(defs.size()), g(defs.size());
      std::vector<Mirror<float>> gr_dev, g_dev;
      std::vector<ParamData> dr, dd;
      for (size_t i = 0; i < defs.size(); ++i) {
        const PDef& d = defs[i];
        gr[i].resize(d.numel());
        for (int64_t k = 0; k < d.numel(); ++k) {
          if (m != DistMode::kDedicated) {
            gr[i][k] = dyadic(10 + step, i, k, 0);
            continue;
          }
          float sum = 0;
          for (int r = 0; r < p; ++r) sum += dyadic(10 + step, i, k, r);
          gr[i][k] = p > 1 ? static_cast<float>(1.0 / p) * sum : sum;
        }
        if (m == DistMode::kDedicated) {
          for (int64_t k = 0; k < d.numel(); ++k) g[i].push_back(dyadic(10 + step, i, k, c.rank()));
        } else {
          g[i].assign(gr[i].begin() + rows[i].first * d.inner(),
                      gr[i].begin() + (rows[i].first + rows[i].second) * d.inner());
        }
        gr_dev.emplace_back(*be, gr[i]);
        g_dev.emplace_back(*be, g[i]);
        dr.push_back({wr_dev[i].data(), gr_dev[i].data(), DType::kF32, {}});
        dd.push_back({w_dev[i].data(), g_dev[i].data(), DType::kF32, {}});
      }
      ref.step(dr);
      e.step(dd);
      be->synchronize();
    }
    for (size_t i = 0; i < defs.size(); ++i) {
      wr[i] = wr_dev[i].get();
      w[i] = w_dev[i].get();
    }
    int64_t differ = 0;
    for (size_t i = 0; i < defs.size(); ++i)
      for (size_t k = 0; k < w[i].size(); ++k) {
        const float a = bf16_to_float(w[i][k]);
        const float b = bf16_to_float(wr[i][rows[i].first * defs[i].inner() + k]);
        const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(b), 1e-3f)) - 7);
        EXPECT_LE(std::fabs(a - b), 2 * ulp + 2e-4f) << defs[i].name << "[" << k << "]";
        differ += a != b;
      }
    if (m == DistMode::kReplicated) {
      EXPECT_EQ(differ, 0) << "same values and the same arithmetic as the reference";
    }
  }
}

TEST(MpiEngine, RaisePolicyThrowsOnEveryRankAndChangesNothing) {
  Communicator& c = world();
  for (DistMode m :
       {DistMode::kGather, DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated})
    for (bool cache : {false, true}) {  // the cache entries are untouched by the raising step
      Scenario sc{m};
      sc.policy = NonFinitePolicy::kRaise;
      sc.nan_step = 1;
      sc.cache = cache;
      SCOPED_TRACE(describe(sc));
      const Snapshot ref = run_reference(sc, c.size(), {1});  // step 1 never happened
      DistRun run = make_dist(sc);
      for (int step = 0; step < sc.steps; ++step) {
        if (step != 1) {
          dist_step(run, sc, step);
          continue;
        }
        try {
          dist_step(run, sc, step);
          ADD_FAILURE() << "expected a non-finite error";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
        }
      }
      expect_equal(run, ref, sc);
    }
}

// Writes an entry saved by cache_entry() back through matrix_state (where this rank holds it).
void load_cache(Engine& e, int p, int64_t m, const CacheEntry& entry) {
  for (auto [name, bytes] : {std::pair{"cache_q", &entry.q}, std::pair{"cache_age", &entry.age},
                             std::pair{"cache_key", &entry.key},
                             std::pair{"cache_misses", &entry.misses}}) {
    TensorView v = e.matrix_state(p, m, name);
    if (!v.data) continue;
    ASSERT_EQ(static_cast<size_t>(v.numel()) * dtype_size(v.dtype), bytes->size()) << name;
    test::write(e.backend(), v, bytes->data(), bytes->size());
  }
}

TEST(MpiEngine, CheckpointOfOneProcessRestoresOnTheOwners) {
  // State saved by a single process after two steps (weights, momentum and cache entries per
  // matrix, AdamW moments, step counts) is loaded into a distributed engine before its first
  // step, each piece on the rank that holds it; two more steps then equal four steps of the
  // single process, cache decisions included (the restored entries are reused, not refilled).
  Communicator& c = world();
  for (DistMode m :
       {DistMode::kGather, DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated}) {
    Scenario sc{m, 1, 600, false, -1, NonFinitePolicy::kSkip, 4, true};
    SCOPED_TRACE(describe(sc));
    const Snapshot ref = run_reference(sc, c.size(), {});
    Scenario half = sc;
    half.steps = 2;
    const Snapshot saved = run_reference(half, c.size(), {});
    DistRun run = make_dist(sc);
    Engine& e = *run.e;
    e.setup();
    for (size_t p = 0; p < model().size(); ++p) {
      const PDef& d = model()[p];
      const auto [b, n] = run.rows[p];
      auto rows_of = [&](const std::vector<float>& full) {
        return std::vector<float>(full.begin() + b * d.inner(), full.begin() + (b + n) * d.inner());
      };
      auto put = [&](const TensorView& v, const std::vector<float>& x) {
        test::write(*run.be, v, x.data(), x.size() * sizeof(float));
      };
      run.weight[p].set(rows_of(saved.weight[p]));
      e.set_param_step(static_cast<int>(p), saved.steps[p]);
      if (d.group == 2) {
        put(e.state(p, "exp_avg"), rows_of(saved.exp_avg[p]));
        put(e.state(p, "exp_avg_sq"), rows_of(saved.exp_avg_sq[p]));
        continue;
      }
      std::vector<float> full;
      for (const auto& mm : saved.momentum[p]) full.insert(full.end(), mm.begin(), mm.end());
      if (m == DistMode::kGather) put(e.state(p, "momentum_buffer"), rows_of(full));
      for (size_t k = 0; k < saved.momentum[p].size(); ++k) {
        if (m != DistMode::kGather)
          put(e.matrix_state(p, k, "momentum_buffer"), saved.momentum[p][k]);
        if (!saved.cache[p][k].empty()) load_cache(e, static_cast<int>(p), k, saved.cache[p][k]);
      }
    }
    for (int step = 2; step < sc.steps; ++step) dist_step(run, sc, step);
    expect_equal(run, ref, sc);
    // The restored entries served: as many hits over the last two steps as in the reference's.
    const std::vector<double> hits = test::sum_over_ranks({static_cast<double>(e.stats().cache.hits)});
    const int copies = m == DistMode::kGather ? c.size() : 1;
    EXPECT_EQ(hits[0],
              static_cast<double>((ref.stats.cache.hits - saved.stats.cache.hits) * copies));
  }
}

TEST(MpiEngine, RanksThatOwnNothingWork) {
  // Two Muon matrices over up to four ranks: the others own nothing but still hold shards.
  Communicator& c = world();
  for (DistMode m : {DistMode::kSharded, DistMode::kDedicated, DistMode::kReplicated}) {
    auto be = test::make_backend();
    DistOptions opt;
    opt.mode = m;
    Engine e(*be, c, opt);
    Engine ref(*be);
    GroupOptions g;
    for (Engine* x : {&e, &ref}) x->add_group(g);
    const bool sharded = m == DistMode::kSharded;
    const auto rows =
        sharded ? chunk(8, c.size(), c.rank()) : std::make_pair(int64_t{0}, int64_t{8});
    std::vector<std::vector<float>> w(2), gr(2), wr(2), grr(2);
    for (int p = 0; p < 2; ++p) {
      ParamSpec spec{"w" + std::to_string(p), 0, {8, 6}, DType::kF32};
      ref.add_param(spec);
      if (sharded) spec.shard = {rows.first, rows.second};
      e.add_param(spec);
      wr[p].resize(48);
      grr[p].resize(48);
      for (int i = 0; i < 48; ++i) {
        wr[p][i] = dyadic(3, p, i, 0);
        grr[p][i] = dyadic(4, p, i, 0);
      }
      w[p].assign(wr[p].begin() + rows.first * 6, wr[p].begin() + (rows.first + rows.second) * 6);
      gr[p].assign(grr[p].begin() + rows.first * 6,
                   grr[p].begin() + (rows.first + rows.second) * 6);
      // Dedicated: rank 0 holds the whole gradient, the others zeros (the mean is exact
      // when P is a power of two; other sizes get the same float multiplication below).
      if (m == DistMode::kDedicated) {
        for (float& x : gr[p]) x = c.rank() == 0 ? x * c.size() : 0.0f;
        if (c.size() > 1)
          for (float& x : grr[p]) x = static_cast<float>(1.0 / c.size()) * (x * c.size());
      }
    }
    std::vector<Mirror<float>> w_dev, gr_dev, wr_dev, grr_dev;
    std::vector<ParamData> d, dr;
    for (int p = 0; p < 2; ++p) {  // an empty shard passes no buffers
      w_dev.emplace_back(*be, w[p]);
      gr_dev.emplace_back(*be, gr[p]);
      wr_dev.emplace_back(*be, wr[p]);
      grr_dev.emplace_back(*be, grr[p]);
      d.push_back({w_dev[p].data(), gr_dev[p].data(), DType::kF32, {}});
      dr.push_back({wr_dev[p].data(), grr_dev[p].data(), DType::kF32, {}});
    }
    e.step(d);
    ref.step(dr);
    EngineStats st = e.stats();
    const int mine = (e.owner(0) == c.rank()) + (e.owner(1) == c.rank());
    EXPECT_EQ(st.owned_matrices, mine) << dist_mode_name(m);
    if (c.size() > 2 && c.rank() >= 2) {  // these ranks own nothing and computed nothing
      EXPECT_EQ(mine, 0);
      EXPECT_EQ(st.ortho.flops, 0.0);
    }
    for (int p = 0; p < 2; ++p) {
      const std::vector<float> full = wr_dev[p].get();
      expect_close(w_dev[p].get(),
                   std::vector<float>(full.begin() + rows.first * 6,
                                      full.begin() + (rows.first + rows.second) * 6),
                   std::string(dist_mode_name(m)) + " w" + std::to_string(p));
    }
  }
}

// Dedicated mode with caller transfers (distmuon.torch.dedicate): the caller hands each owner the
// mean gradient and publishes the weights itself; owners come from plan_owners() through
// DistOptions::owners; some parameters are prepared (momentum + orthogonalization) before step(),
// in separate calls. Weights (after the caller's broadcast), momentum, cache entries, step counts
// and statistics equal the single-process engine bit for bit.
void check_caller_transfers(int replicate, bool cache) {
  SCOPED_TRACE(std::string("caller transfers, replicate ") + std::to_string(replicate) +
               (cache ? " cache" : ""));
  Communicator& c = world();
  Scenario sc;
  sc.mode = DistMode::kDedicated;
  sc.replicate = replicate;
  sc.cache = cache;
  sc.steps = cache ? 5 : 3;
  const Snapshot ref = run_reference(sc, c.size(), {});

  // Owners planned before any engine exists, as dedicate() does.
  std::vector<PlanMatrix> pm;
  for (const PDef& d : model()) {
    if (d.group == 2) continue;
    const int64_t count = d.shape.size() == 3 ? d.shape[0] : 1;
    const int64_t rows = d.shape[d.shape.size() == 3 ? 1 : 0];
    for (int64_t m = 0; m < count; ++m) pm.push_back({d.name, rows, d.numel() / count / rows});
  }
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  opt.replicate = replicate;
  auto be = test::make_backend();
  const Plan plan = plan_owners(pm, Topology{c.size(), 8, replicate}, opt, parse_algorithm("auto"),
                                be->device().kind);
  ASSERT_EQ(plan.owner.size(), pm.size());
  opt.owners = plan.owner;
  opt.caller_transfers = true;
  Engine e(*be, c, opt);
  add_groups(e, cache);
  for (const PDef& d : model()) e.add_param({d.name, d.group, d.shape, DType::kF32});
  std::vector<Mirror<float>> w = initial_weights(*be, whole_rows());
  e.setup();
  for (size_t p = 0, j = 0; p < model().size(); ++p) {
    if (model()[p].group == 2) continue;
    for (int64_t m = 0; m < static_cast<int64_t>(ref.momentum[p].size()); ++m)
      EXPECT_EQ(e.owner(static_cast<int>(p), m), plan.owner[j++]) << model()[p].name;
  }
  auto owns = [&](size_t p) {  // this rank owns at least one matrix of parameter p
    const int64_t count = model()[p].shape.size() == 3 ? model()[p].shape[0] : 1;
    for (int64_t m = 0; m < count; ++m)
      if (e.owner(static_cast<int>(p), m) == c.rank()) return true;
    return false;
  };
  for (int step = 0; step < sc.steps; ++step) {
    std::vector<Mirror<float>> g(model().size());
    std::vector<ParamData> data(model().size());
    std::vector<int> early;
    std::vector<ParamData> early_data;
    for (size_t p = 0; p < model().size(); ++p) {
      const bool adamw = model()[p].group == 2;
      if (!has_any(step, static_cast<int>(p)) || (!adamw && !owns(p))) {
        data[p] = {adamw || owns(p) ? w[p].data() : nullptr, nullptr, DType::kF32, {}};
        continue;
      }
      g[p] = Mirror<float>(*be, reduced_grad(sc, step, static_cast<int>(p), c.size()));
      data[p] = {w[p].data(), g[p].data(), DType::kF32, {}};
      if (!adamw && static_cast<int>(p % 2) == step % 2) {  // half of them early, alternating
        early.push_back(static_cast<int>(p));
        early_data.push_back(data[p]);
      }
    }
    // Two prepare() calls: the engine batches what each one gives it.
    const size_t half = early.size() / 2;
    e.prepare(std::span(early).first(half), std::span(early_data).first(half));
    e.prepare(std::span(early).subspan(half), std::span(early_data).subspan(half));
    e.step(data);
    EXPECT_EQ(e.prepared_matrices(), 0);
    // The caller publishes: every Muon matrix from its owner.
    for (size_t p = 0; p < model().size(); ++p) {
      const PDef& d = model()[p];
      if (d.group == 2) continue;
      const int64_t count = d.shape.size() == 3 ? d.shape[0] : 1, n = d.numel() / count;
      for (int64_t m = 0; m < count; ++m)
        c.broadcast(w[p].data() + m * n, n, CommType::kF32, e.owner(static_cast<int>(p), m)).wait();
    }
    be->synchronize();  // the gradients' memory goes with g
  }
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    expect_close(w[p].get(), ref.weight[p], "weights of '" + d.name + "'");
    EXPECT_EQ(e.param_step(static_cast<int>(p)), ref.steps[p]) << d.name;
    for (size_t m = 0; m < ref.momentum[p].size(); ++m) {
      if (e.owner(static_cast<int>(p), m) != c.rank()) continue;
      expect_close(read(e, e.matrix_state(p, m, "momentum_buffer")), ref.momentum[p][m], d.name);
      expect_same_cache(cache_entry(e, static_cast<int>(p), m), ref.cache[p][m], d.name);
    }
  }
  EngineStats st = e.stats();
  const std::vector<double> f =
      test::sum_over_ranks({st.ortho.flops, static_cast<double>(st.cache.hits)});
  EXPECT_DOUBLE_EQ(f[0], ref.stats.ortho.flops);
  EXPECT_EQ(f[1], static_cast<double>(ref.stats.cache.hits));
  if (cache) {
    EXPECT_GT(ref.stats.cache.hits, 0);
  }
}

TEST(MpiEngine, DedicatedCallerTransfersWithPreparedMatricesEqualTheSingleProcessEngine) {
  check_caller_transfers(1, false);
  check_caller_transfers(1, true);
  if (world().size() % 2 == 0) check_caller_transfers(2, true);
}

TEST(MpiEngine, PrepareRefusesMisuse) {
  Communicator& c = world();
  auto be_owner = test::make_backend();
  Backend& be = *be_owner;
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  Engine plain(be, c, opt);
  GroupOptions g;
  plain.add_group(g);
  plain.add_param({"w", 0, {8, 6}, DType::kF32});
  Mirror<float> w(be, std::vector<float>(48, 0.5f)), gr(be, std::vector<float>(48, 0.25f));
  ParamData d{w.data(), gr.data(), DType::kF32, {}};
  const int zero = 0;
  EXPECT_THROW(plain.prepare({&zero, 1}, {&d, 1}), Error);  // needs caller_transfers
  opt.caller_transfers = true;
  opt.owners = {0};
  Engine e(be, c, opt);
  e.add_group(g);
  e.add_param({"w", 0, {8, 6}, DType::kF32});
  e.prepare({&zero, 1}, {&d, 1});
  if (c.rank() == 0) {
    EXPECT_EQ(e.prepared_matrices(), 1);
    EXPECT_THROW(e.prepare({&zero, 1}, {&d, 1}), Error);  // twice in one step
  }
  e.step({&d, 1});
  EXPECT_EQ(e.prepared_matrices(), 0);
  e.prepare({&zero, 1}, {&d, 1});
  e.discard_prepared();  // an abandoned step: the matrix may be prepared again
  EXPECT_EQ(e.prepared_matrices(), 0);
  e.prepare({&zero, 1}, {&d, 1});
  e.step({&d, 1});
  opt.owners = {0, 1};  // more owners than matrices: every rank fails at set-up
  Engine bad(be, c, opt);
  bad.add_group(g);
  bad.add_param({"w", 0, {8, 6}, DType::kF32});
  EXPECT_THROW(bad.setup(), Error);
}

}  // namespace
}  // namespace distmuon
