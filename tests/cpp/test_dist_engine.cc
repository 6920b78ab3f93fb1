// Distributed equals single process: under mpirun, for every mode (gather, replicated, sharded,
// dedicated), bucket size, HSDP layout and deferred publication, the weights and optimizer state
// after several steps equal those of the single-process engine fed the same (mean) gradients: bit
// for bit on the MPI rig (CPU), within the NCCL rig's tolerance on CUDA (dist_rig.h). The model has
// wide, tall, 3D and conv matrices, two Muon groups, AdamW tensors, uneven and empty FSDP2-style
// shards, a parameter without gradient in one step, and (dedicated mode) gradients missing on some
// ranks only; a tall and a wide matrix of the same sides share a batch. With CacheMuon on, the
// cache entries (kept by the owner, or by every rank in gather mode) and their hit/refresh
// decisions equal those of the single process too. Why bit-exact is possible: every matrix is
// computed by the same fused passes on the same values as in one process, and the gradients are
// dyadic numbers whose sums are exact in any reduction order.
#include "dist_engine_fixture.h"

namespace distmuon {
namespace {

using namespace engine_fixture;  // NOLINT(google-build-using-namespace): the fixture is this test's own

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

// The sharded mode's all-to-alls in equal blocks (DISTMUON_UNIFORM_ALL_TO_ALL=1, the layout it
// takes on NCCL's windows, where the copy engines move them) still equal one process, every
// scenario with and without replicas; a step issues as many collectives as with packed blocks
// and moves at least as many bytes (each pair's block is its bucket's largest).
TEST(MpiEngine, ShardedEqualBlocksEqualTheSingleProcessEngine) {
  struct Env {  // unset however the test ends: the later tests of this process see the default
    explicit Env(const char* v) { setenv("DISTMUON_UNIFORM_ALL_TO_ALL", v, 1); }
    ~Env() { unsetenv("DISTMUON_UNIFORM_ALL_TO_ALL"); }
  };
  {
    Env env("1");
    for (int replicate : {1, 2})
      for (const Scenario& sc : scenarios(DistMode::kSharded, replicate)) check_scenario(sc);
  }
  if (world().size() < 2) return;
  auto step_comm = [](const char* uniform) {
    Env env(uniform);
    Scenario sc;
    sc.mode = DistMode::kSharded;
    sc.bucket_bytes = 600;
    DistRun run = make_dist(sc);
    dist_step(run, sc, 0);
    const CommStats before = run.e->stats().comm;
    dist_step(run, sc, 2);  // every matrix has a gradient in steps 0 and 2
    return run.e->stats().comm - before;
  };
  const CommStats packed = step_comm("0"), equal = step_comm("1");
  EXPECT_EQ(equal.ops, packed.ops);
  EXPECT_EQ(equal.launches, packed.launches);
  EXPECT_GT(equal.bytes_sent, packed.bytes_sent);  // the shards are uneven: the pairs differ
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

}  // namespace
}  // namespace distmuon
