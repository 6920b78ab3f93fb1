// Distributed equals single process: under mpirun, for every mode (gather, replicated, sharded,
// dedicated), bucket size, HSDP layout and deferred publication, the weights and optimizer state
// after several steps equal bit for bit those of the single-process engine fed the same (mean)
// gradients. The model has wide, tall, 3D and conv matrices, two Muon groups, AdamW tensors,
// uneven and empty FSDP2-style shards, a parameter without gradient in one step, and (dedicated
// mode) gradients missing on some ranks only; a tall and a wide matrix of the same sides share
// a batch. With CacheMuon on, the cache entries (kept by the owner, or by every rank in gather
// mode) and their hit/refresh decisions equal those of the single process too. Why bit-exact is
// possible: every matrix is
// computed by the same fused passes on the same values as in one process, and the gradients are
// dyadic numbers whose sums are exact in any reduction order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "common/half.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"
#include "mpi_test_main.h"

namespace distmuon {
namespace {

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
// the staleness limit forces a refresh); group 1 (standard NS) cannot use the cache.
void add_groups(Engine& e, bool cache = false) {
  GroupOptions g0;
  g0.muon.lr = 0.05f;
  g0.muon.weight_decay = 0.1f;
  if (cache) {
    g0.muon.ortho = parse_algorithm("gram-ns");
    g0.muon.cache.enabled = true;
    g0.muon.cache.gamma = 1e9;
    g0.muon.cache.max_staleness = 2;
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

struct Snapshot {
  std::vector<std::vector<float>> weight;                 // per parameter (full)
  std::vector<std::vector<std::vector<float>>> momentum;  // per Muon parameter, per matrix
  std::vector<std::vector<float>> exp_avg, exp_avg_sq;    // AdamW (full)
  std::vector<std::vector<std::vector<uint8_t>>> cache;   // per Muon parameter, per matrix
  std::vector<int64_t> steps;
  EngineStats stats;
};

std::vector<float> read(const TensorView& v) {
  const float* p = static_cast<const float*>(v.data);
  return p ? std::vector<float>(p, p + v.numel()) : std::vector<float>();
}

// The bytes of a matrix's cache entry (transform, age, key); empty where this rank holds none or
// the parameter has no cache.
std::vector<uint8_t> cache_bytes(Engine& e, int p, int64_t m) {
  const std::vector<std::string> names = e.state_names(p);
  if (std::find(names.begin(), names.end(), "cache_q") == names.end()) return {};
  std::vector<uint8_t> out;
  for (const char* n : {"cache_q", "cache_age", "cache_key"}) {
    TensorView v = e.matrix_state(p, m, n);
    if (!v.data) return {};
    const auto* b = static_cast<const uint8_t*>(v.data);
    out.insert(out.end(), b, b + v.numel() * dtype_size(v.dtype));
  }
  return out;
}

Snapshot run_reference(const Scenario& sc, int world_size, const std::vector<int>& skip_steps) {
  CpuBackend be;
  Engine e(be);
  add_groups(e, sc.cache);
  Snapshot s;
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    e.add_param({d.name, d.group, d.shape, DType::kF32});
    std::vector<float> w(d.numel());
    for (int64_t i = 0; i < d.numel(); ++i) w[i] = dyadic(0, p, i, 7) * 8;
    s.weight.push_back(std::move(w));
  }
  for (int step = 0; step < sc.steps; ++step) {
    if (std::find(skip_steps.begin(), skip_steps.end(), step) != skip_steps.end()) continue;
    std::vector<std::vector<float>> g(model().size());
    std::vector<ParamData> data;
    for (size_t p = 0; p < model().size(); ++p) {
      g[p] = reduced_grad(sc, step, static_cast<int>(p), world_size);
      data.push_back(
          {s.weight[p].data(), has_any(step, p) ? g[p].data() : nullptr, DType::kF32, {}});
    }
    e.step(data);
  }
  s.momentum.resize(model().size());
  s.exp_avg.resize(model().size());
  s.exp_avg_sq.resize(model().size());
  s.cache.resize(model().size());
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    s.steps.push_back(e.param_step(static_cast<int>(p)));
    if (d.group == 2) {
      s.exp_avg[p] = read(e.state(p, "exp_avg"));
      s.exp_avg_sq[p] = read(e.state(p, "exp_avg_sq"));
      continue;
    }
    const int64_t count = d.shape.size() == 3 ? d.shape[0] : 1;
    for (int64_t m = 0; m < count; ++m) {
      s.momentum[p].push_back(read(e.matrix_state(p, m, "momentum_buffer")));
      s.cache[p].push_back(cache_bytes(e, static_cast<int>(p), m));
    }
  }
  s.stats = e.stats();
  return s;
}

// One distributed run; returns this rank's view: full weights in replicated/dedicated mode,
// only the local rows elsewhere (the rest left empty), and the momentum it holds.
struct DistRun {
  std::vector<std::vector<float>> weight;         // local rows (sharded/gather) or full
  std::vector<std::pair<int64_t, int64_t>> rows;  // local dim-0 rows per parameter
  std::unique_ptr<CpuBackend> be;
  std::unique_ptr<Engine> e;
};

DistRun make_dist(const Scenario& sc) {
  Communicator& c = world();
  const bool sharded = sc.mode == DistMode::kSharded || sc.mode == DistMode::kGather;
  const int R = sc.mode == DistMode::kReplicated ? 1 : sc.replicate;
  const int S = c.size() / R, pos = c.rank() % S;
  DistRun run;
  run.be = std::make_unique<CpuBackend>();
  DistOptions opt;
  opt.mode = sc.mode;
  opt.replicate = sc.replicate;
  opt.bucket_bytes = sc.bucket_bytes;
  opt.defer_publish = sc.defer;
  run.e = std::make_unique<Engine>(*run.be, c, opt, EngineOptions{sc.policy});
  add_groups(*run.e, sc.cache);
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    ParamSpec spec{d.name, d.group, d.shape, DType::kF32};
    auto rows = sharded ? chunk(d.shape[0], S, pos) : std::make_pair(int64_t{0}, d.shape[0]);
    if (sharded) spec.shard = {rows.first, rows.second};
    run.e->add_param(spec);
    run.rows.push_back(rows);
    std::vector<float> w(rows.second * d.inner());
    for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i)
      w[i] = dyadic(0, p, rows.first * d.inner() + i, 7) * 8;
    run.weight.push_back(std::move(w));
  }
  return run;
}

void dist_step(DistRun& run, const Scenario& sc, int step) {
  Communicator& c = world();
  std::vector<std::vector<float>> g(model().size());
  std::vector<ParamData> data;
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    const auto [b, n] = run.rows[p];
    g[p].resize(n * d.inner());
    if (sc.mode == DistMode::kDedicated) {
      for (int64_t i = 0; i < d.numel(); ++i) g[p][i] = grad_value(step, p, i, c.rank());
      if (step == sc.nan_step && d.name == "b" && c.rank() == c.size() - 1) g[p][3] = std::nanf("");
    } else {
      std::vector<float> full = reduced_grad(sc, step, static_cast<int>(p), c.size());
      std::copy(full.begin() + b * d.inner(), full.begin() + (b + n) * d.inner(), g[p].begin());
    }
    const bool has = has_local(sc, step, static_cast<int>(p), c.rank());
    data.push_back(
        {n ? run.weight[p].data() : nullptr, has && n ? g[p].data() : nullptr, DType::kF32, {}});
  }
  run.e->step(data);
  run.e->wait_published();
}

// Compares this rank's view with the reference, bit for bit.
void expect_equal(DistRun& run, const Snapshot& ref, const Scenario& sc) {
  Engine& e = *run.e;
  const std::vector<int64_t> steps = e.param_steps();  // the same on every rank (collective)
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    const auto [b, n] = run.rows[p];
    auto rows_of = [&](const std::vector<float>& full) {
      return std::vector<float>(full.begin() + b * d.inner(), full.begin() + (b + n) * d.inner());
    };
    EXPECT_EQ(run.weight[p], rows_of(ref.weight[p])) << "weights of '" << d.name << "'";
    EXPECT_EQ(steps[p], ref.steps[p]) << d.name;
    if (d.group == 2) {
      EXPECT_EQ(read(e.state(p, "exp_avg")), rows_of(ref.exp_avg[p])) << d.name;
      EXPECT_EQ(read(e.state(p, "exp_avg_sq")), rows_of(ref.exp_avg_sq[p])) << d.name;
      continue;
    }
    EXPECT_EQ(!ref.cache[p][0].empty(), sc.cache && d.group == 0) << d.name;
    if (sc.mode == DistMode::kGather) {
      std::vector<float> full;
      for (const auto& m : ref.momentum[p]) full.insert(full.end(), m.begin(), m.end());
      EXPECT_EQ(read(e.state(p, "momentum_buffer")), rows_of(full)) << d.name;
      // Every rank solves every matrix, so every rank holds every cache entry.
      for (size_t m = 0; m < ref.cache[p].size(); ++m)
        EXPECT_EQ(cache_bytes(e, static_cast<int>(p), m), ref.cache[p][m])
            << "cache of '" << d.name << "' matrix " << m;
      continue;
    }
    for (size_t m = 0; m < ref.momentum[p].size(); ++m) {
      std::vector<float> mine = read(e.matrix_state(p, m, "momentum_buffer"));
      std::vector<uint8_t> cache = cache_bytes(e, static_cast<int>(p), m);
      if (e.owner(p, m) == world().rank()) {
        EXPECT_EQ(mine, ref.momentum[p][m]) << "momentum of '" << d.name << "' matrix " << m;
        EXPECT_EQ(cache, ref.cache[p][m]) << "cache of '" << d.name << "' matrix " << m;
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
         (sc.nan_step >= 0 ? " nan" : "") + (sc.cache ? " cache" : "");
}

void check_scenario(const Scenario& sc) {
  SCOPED_TRACE(describe(sc));
  Communicator& c = world();
  const Snapshot ref = run_reference(sc, c.size(), {});
  DistRun run = make_dist(sc);
  for (int step = 0; step < sc.steps; ++step) dist_step(run, sc, step);
  expect_equal(run, ref, sc);
  // Each matrix is orthogonalized exactly once per step in the owner modes, everywhere in
  // gather mode; skips are counted where the matrix is computed.
  EngineStats st = run.e->stats();
  std::vector<double> f = {st.ortho.flops,
                           static_cast<double>(st.owned_matrices),
                           static_cast<double>(st.nonfinite_skips),
                           static_cast<double>(st.cache.hits),
                           static_cast<double>(st.cache.refreshes),
                           static_cast<double>(st.cache.forced_refreshes),
                           static_cast<double>(st.cache.skips)};
  c.all_reduce(f.data(), f.data(), static_cast<int64_t>(f.size()), CommType::kF64, ReduceOp::kSum)
      .wait();
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

std::vector<Scenario> scenarios() {
  std::vector<Scenario> out;
  const int p = world().size();
  for (DistMode m :
       {DistMode::kGather, DistMode::kReplicated, DistMode::kSharded, DistMode::kDedicated}) {
    out.push_back({m});
    out.push_back({m, 1, 600});  // many small buckets: the pipeline runs several deep
    out.push_back({m, 1, 32ll << 20, false, 1});  // a NaN gradient is skipped everywhere
    if (p % 2 == 0 && m != DistMode::kReplicated) {
      out.push_back({m, 2, 600});         // HSDP (2 x 2 at four ranks)
      out.push_back({m, 2, 1200, true});  // HSDP with the publication left in flight
    }
    // CacheMuon: hits, staleness refreshes, a skipped entry, small buckets, HSDP.
    out.push_back({m, 1, 32ll << 20, false, -1, NonFinitePolicy::kSkip, 5, true});
    out.push_back({m, 1, 600, false, 1, NonFinitePolicy::kSkip, 5, true});
    if (p % 2 == 0 && m != DistMode::kReplicated)
      out.push_back({m, 2, 1200, true, 2, NonFinitePolicy::kSkip, 5, true});
  }
  return out;
}

TEST(MpiEngine, EveryModeEqualsTheSingleProcessEngine) {
  for (const Scenario& sc : scenarios()) check_scenario(sc);
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
    CpuBackend be;
    Engine ref(be);
    DistOptions opt;
    opt.mode = m;
    Engine e(be, c, opt);
    for (Engine* x : {&ref, &e}) add_groups(*x);
    std::vector<std::vector<uint16_t>> wr(defs.size()), w(defs.size());
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
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<float>> gr(defs.size()), g(defs.size());
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
        dr.push_back({wr[i].data(), gr[i].data(), DType::kF32, {}});
        dd.push_back(rows[i].second ? ParamData{w[i].data(), g[i].data(), DType::kF32, {}}
                                    : ParamData{nullptr, nullptr, DType::kF32, {}});
      }
      ref.step(dr);
      e.step(dd);
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

// Writes bytes saved by cache_bytes() back through matrix_state (where this rank holds them).
void load_cache(Engine& e, int p, int64_t m, const std::vector<uint8_t>& bytes) {
  size_t off = 0;
  for (const char* n : {"cache_q", "cache_age", "cache_key"}) {
    TensorView v = e.matrix_state(p, m, n);
    const size_t len = static_cast<size_t>(v.numel()) * dtype_size(v.dtype);
    if (v.data) std::memcpy(v.data, bytes.data() + off, len);
    off += len;
  }
  EXPECT_EQ(off, bytes.size());
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
      auto put = [](const TensorView& v, const std::vector<float>& x) {
        if (v.data) std::memcpy(v.data, x.data(), x.size() * sizeof(float));
      };
      run.weight[p] = rows_of(saved.weight[p]);
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
    std::vector<double> hits = {static_cast<double>(e.stats().cache.hits)};
    c.all_reduce(hits.data(), hits.data(), 1, CommType::kF64, ReduceOp::kSum).wait();
    const int copies = m == DistMode::kGather ? c.size() : 1;
    EXPECT_EQ(hits[0],
              static_cast<double>((ref.stats.cache.hits - saved.stats.cache.hits) * copies));
  }
}

TEST(MpiEngine, RanksThatOwnNothingWork) {
  // Two Muon matrices over up to four ranks: the others own nothing but still hold shards.
  Communicator& c = world();
  for (DistMode m : {DistMode::kSharded, DistMode::kDedicated, DistMode::kReplicated}) {
    CpuBackend be;
    DistOptions opt;
    opt.mode = m;
    Engine e(be, c, opt);
    Engine ref(be);
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
    std::vector<ParamData> d;
    for (int p = 0; p < 2; ++p)  // an empty shard passes no buffers
      d.push_back(rows.second ? ParamData{w[p].data(), gr[p].data(), DType::kF32, {}}
                              : ParamData{nullptr, nullptr, DType::kF32, {}});
    std::vector<ParamData> dr = {{wr[0].data(), grr[0].data(), DType::kF32, {}},
                                 {wr[1].data(), grr[1].data(), DType::kF32, {}}};
    e.step(d);
    ref.step(dr);
    EngineStats st = e.stats();
    const int mine = (e.owner(0) == c.rank()) + (e.owner(1) == c.rank());
    EXPECT_EQ(st.owned_matrices, mine) << dist_mode_name(m);
    if (c.size() > 2 && c.rank() >= 2) {  // these ranks own nothing and computed nothing
      EXPECT_EQ(mine, 0);
      EXPECT_EQ(st.ortho.flops, 0.0);
    }
    for (int p = 0; p < 2; ++p)
      EXPECT_EQ(w[p], std::vector<float>(wr[p].begin() + rows.first * 6,
                                         wr[p].begin() + (rows.first + rows.second) * 6))
          << dist_mode_name(m) << " w" << p;
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
  const Plan plan = plan_owners(pm, Topology{c.size(), 8, replicate}, opt, parse_algorithm("auto"),
                                DeviceKind::kCPU);
  ASSERT_EQ(plan.owner.size(), pm.size());
  opt.owners = plan.owner;
  opt.caller_transfers = true;
  CpuBackend be;
  Engine e(be, c, opt);
  add_groups(e, cache);
  std::vector<std::vector<float>> w(model().size());
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    e.add_param({d.name, d.group, d.shape, DType::kF32});
    w[p].resize(d.numel());
    for (int64_t i = 0; i < d.numel(); ++i) w[p][i] = dyadic(0, p, i, 7) * 8;
  }
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
    std::vector<std::vector<float>> g(model().size());
    std::vector<ParamData> data(model().size());
    std::vector<int> early;
    std::vector<ParamData> early_data;
    for (size_t p = 0; p < model().size(); ++p) {
      const bool adamw = model()[p].group == 2;
      if (!has_any(step, static_cast<int>(p)) || (!adamw && !owns(p))) {
        data[p] = {adamw || owns(p) ? w[p].data() : nullptr, nullptr, DType::kF32, {}};
        continue;
      }
      g[p] = reduced_grad(sc, step, static_cast<int>(p), c.size());
      data[p] = {w[p].data(), g[p].data(), DType::kF32, {}};
      if (!adamw && p % 2 == step % 2) {  // half of them early, alternating
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
  }
  for (size_t p = 0; p < model().size(); ++p) {
    const PDef& d = model()[p];
    EXPECT_EQ(w[p], ref.weight[p]) << "weights of '" << d.name << "'";
    EXPECT_EQ(e.param_step(static_cast<int>(p)), ref.steps[p]) << d.name;
    for (size_t m = 0; m < ref.momentum[p].size(); ++m) {
      if (e.owner(static_cast<int>(p), m) != c.rank()) continue;
      EXPECT_EQ(read(e.matrix_state(p, m, "momentum_buffer")), ref.momentum[p][m]) << d.name;
      EXPECT_EQ(cache_bytes(e, static_cast<int>(p), m), ref.cache[p][m]) << d.name;
    }
  }
  EngineStats st = e.stats();
  std::vector<double> f = {st.ortho.flops, static_cast<double>(st.cache.hits)};
  c.all_reduce(f.data(), f.data(), 2, CommType::kF64, ReduceOp::kSum).wait();
  EXPECT_DOUBLE_EQ(f[0], ref.stats.ortho.flops);
  EXPECT_EQ(f[1], static_cast<double>(ref.stats.cache.hits));
  if (cache) EXPECT_GT(ref.stats.cache.hits, 0);
}

TEST(MpiEngine, DedicatedCallerTransfersWithPreparedMatricesEqualTheSingleProcessEngine) {
  check_caller_transfers(1, false);
  check_caller_transfers(1, true);
  if (world().size() % 2 == 0) check_caller_transfers(2, true);
}

TEST(MpiEngine, PrepareRefusesMisuse) {
  Communicator& c = world();
  CpuBackend be;
  DistOptions opt;
  opt.mode = DistMode::kDedicated;
  Engine plain(be, c, opt);
  GroupOptions g;
  plain.add_group(g);
  plain.add_param({"w", 0, {8, 6}, DType::kF32});
  std::vector<float> w(48, 0.5f), gr(48, 0.25f);
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
