// The distributed engine's other paths under mpirun (the fixture of dist_engine_fixture.h): the
// raise policy (every rank throws, nothing changes), a single process's checkpoint restored on the
// owners, ranks that own nothing, dedicated transfers driven by the caller with prepared
// matrices, and prepare() refusing misuse.
#include "dist_engine_fixture.h"

namespace distmuon {
namespace {

using namespace engine_fixture;  // NOLINT(google-build-using-namespace): the fixture is this test's own

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
