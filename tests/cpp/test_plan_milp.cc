// The planners: MILP optimal against brute force, MILP never worse than LPT, plans identical on
// every run, valid plans (every matrix once, batches of one shape, loads as the table says),
// memory caps, layer spreading and the errors for bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "distmuon/workload.h"

namespace distmuon {
namespace {

struct Instance {
  std::vector<PlanMatrix> matrices;
  CostTable costs;
};

// Independent of the library: the load of k same-shape matrices on one owner is the best split
// of k into batches, each batch costing what the table says.
double best_split(const CostTable& t, int64_t rows, int64_t cols, int k) {
  std::vector<double> g(k + 1, 0.0);
  for (int j = 1; j <= k; ++j) {
    g[j] = 1e300;
    for (int b = 1; b <= j; ++b) g[j] = std::min(g[j], t.batch_seconds(rows, cols, b) + g[j - b]);
  }
  return g[k];
}

std::vector<double> loads_of(const Instance& in, const std::vector<int>& owner, int P) {
  std::vector<std::map<std::pair<int64_t, int64_t>, int>> held(P);
  for (size_t i = 0; i < owner.size(); ++i) {
    const auto& m = in.matrices[i];
    held[owner[i]][{std::min(m.rows, m.cols), std::max(m.rows, m.cols)}] += 1;
  }
  std::vector<double> load(P, 0.0);
  for (int o = 0; o < P; ++o)
    for (const auto& [shape, k] : held[o])
      load[o] += best_split(in.costs, shape.first, shape.second, k);
  return load;
}

double brute_force_makespan(const Instance& in, int P) {
  const size_t n = in.matrices.size();
  std::vector<int> owner(n, 0);
  double best = 1e300;
  std::function<void(size_t)> rec = [&](size_t i) {
    if (i == n) {
      auto l = loads_of(in, owner, P);
      best = std::min(best, *std::max_element(l.begin(), l.end()));
      return;
    }
    for (int o = 0; o < P; ++o) {
      owner[i] = o;
      rec(i + 1);
    }
  };
  rec(0);
  return best;
}

// Small random instances: up to 3 shapes, 7 matrices; batch costs with a fixed part and
// per-matrix parts that shrink or (sometimes) grow with k, so splitting can pay.
Instance random_instance(std::mt19937_64& rng) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 16}, {16, 16}, {4, 32}};
  std::uniform_int_distribution<int> nshapes(1, 3), count(1, 3);
  std::uniform_real_distribution<double> u(0.1, 1.0);
  Instance in;
  in.costs.source = "test";
  in.costs.device = "test";
  in.costs.version = DISTMUON_VERSION;
  const int S = nshapes(rng);
  for (int s = 0; s < S; ++s) {
    const int c = count(rng);
    std::vector<CostPoint> pts;
    double t = u(rng);
    const double step = u(rng);
    const bool super_linear = u(rng) > 0.8;
    for (int k = 1; k <= c; ++k) {
      pts.push_back({k, t});
      t += super_linear ? step * k : step * u(rng);
    }
    in.costs.set(shapes[s].first, shapes[s].second, pts);
    for (int k = 0; k < c; ++k) {
      PlanMatrix m;
      m.name = "s" + std::to_string(s) + "." + std::to_string(k);
      m.rows = (k % 2) ? shapes[s].second : shapes[s].first;  // both orientations batch together
      m.cols = (k % 2) ? shapes[s].first : shapes[s].second;
      m.layer = k;
      in.matrices.push_back(m);
    }
  }
  return in;
}

// Every matrix owned once, batches hold one shape each and cover the owner's matrices exactly,
// loads equal an independent evaluation.
void expect_valid(const Instance& in, const Plan& p, int P) {
  ASSERT_EQ(p.owner.size(), in.matrices.size());
  ASSERT_EQ(p.batches.size(), static_cast<size_t>(P));
  std::vector<int> seen(in.matrices.size(), 0);
  for (int o = 0; o < P; ++o) {
    for (const auto& b : p.batches[o]) {
      ASSERT_FALSE(b.empty());
      const auto& f = in.matrices[b[0]];
      for (int i : b) {
        EXPECT_EQ(p.owner[i], o);
        EXPECT_EQ(std::min(in.matrices[i].rows, in.matrices[i].cols), std::min(f.rows, f.cols));
        EXPECT_EQ(std::max(in.matrices[i].rows, in.matrices[i].cols), std::max(f.rows, f.cols));
        seen[i] += 1;
      }
    }
  }
  for (int s : seen) EXPECT_EQ(s, 1);
  const auto want = loads_of(in, p.owner, P);
  for (int o = 0; o < P; ++o) EXPECT_NEAR(p.owner_load[o], want[o], 1e-12 * (1 + want[o]));
  EXPECT_NEAR(p.makespan, *std::max_element(want.begin(), want.end()), 1e-12);
  EXPECT_EQ(p.hash, plan_hash(p));
}

PlanOptions exact() {
  PlanOptions o;
  o.comm_weight = 0;
  o.relative_gap = 0;
  o.time_limit_s = 60;
  return o;
}

TEST(PlanMilp, OptimalAgainstBruteForce) {
  std::mt19937_64 rng(12345);
  int checked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    Instance in = random_instance(rng);
    for (int P : {2, 3}) {
      Topology topo;
      topo.world_size = P;
      const double opt = brute_force_makespan(in, P);
      for (const char* form : {"auto", "patterns", "owners"}) {
        PlanOptions o = exact();
        o.formulation = form;
        Plan p = plan_milp(in.matrices, topo, in.costs, o);
        SCOPED_TRACE(std::string(form) + " trial " + std::to_string(trial) + " P " +
                     std::to_string(P));
        expect_valid(in, p, P);
        EXPECT_NEAR(p.makespan, opt, 1e-9 * opt) << p.status;
        EXPECT_LE(p.lower_bound, opt * (1 + 1e-9));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 240);
}

std::vector<std::pair<std::string, Instance>> workload_instances() {
  std::vector<std::pair<std::string, Instance>> out;
  for (auto [name, layers] : std::vector<std::pair<std::string, int>>{
           {"gpt2-small", 0}, {"gpt2-large", 4}, {"qwen2.5-7b", 4}, {"pi0", 2}}) {
    Workload w = load_workload(name);
    if (layers > 0) w = w.first_layers(layers);
    Instance in;
    in.matrices = plan_matrices(w);
    in.costs = analytic_cost_table(shape_counts(in.matrices), parse_algorithm("auto"), {});
    out.push_back({name, std::move(in)});
  }
  return out;
}

TEST(PlanMilp, NeverWorseThanLptOnAnyInstance) {
  std::mt19937_64 rng(777);
  int checked = 0;
  for (int trial = 0; trial < 30; ++trial) {
    Instance in = random_instance(rng);
    for (int P : {2, 3, 4}) {
      Topology topo;
      topo.world_size = P;
      const Plan lpt = plan_lpt(in.matrices, topo, in.costs);
      const Plan milp = plan_milp(in.matrices, topo, in.costs);
      expect_valid(in, lpt, P);
      expect_valid(in, milp, P);
      EXPECT_LE(milp.makespan, lpt.makespan * (1 + 1e-12));
      ++checked;
    }
  }
  for (const auto& [name, in] : workload_instances()) {
    for (int P : {2, 8, 32, 128}) {
      Topology topo;
      topo.world_size = P;
      for (const char* form : {"auto", "columns", "owners"}) {
        PlanOptions o;
        o.formulation = form;
        if (std::string(form) == "owners") {  // it only has to beat LPT here: keep it short
          o.max_nodes = 50;
          o.time_limit_s = 1;
        }
        SCOPED_TRACE(name + " P " + std::to_string(P) + " " + form);
        const Plan lpt = plan_lpt(in.matrices, topo, in.costs, o);
        const Plan milp = plan_milp(in.matrices, topo, in.costs, o);
        expect_valid(in, milp, P);
        EXPECT_LE(milp.makespan, lpt.makespan * (1 + 1e-12)) << milp.status;
        EXPECT_GE(milp.makespan, milp.lower_bound * (1 - 1e-12));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 90 + 48);
}

TEST(PlanMilp, IdenticalPlansOnRepeatedRuns) {
  for (const auto& [name, in] : workload_instances()) {
    for (int P : {4, 8, 64}) {
      Topology topo;
      topo.world_size = P;
      for (const std::string solver : {"milp", "lpt", "round-robin"}) {
        const Plan a = make_plan(solver, in.matrices, topo, in.costs);
        const Plan b = make_plan(solver, in.matrices, topo, in.costs);
        const Plan c = make_plan(solver, in.matrices, topo, in.costs);
        SCOPED_TRACE(name + " " + solver + " P " + std::to_string(P));
        EXPECT_EQ(a.owner, b.owner);
        EXPECT_EQ(a.batches, b.batches);
        EXPECT_EQ(a.hash, b.hash);
        EXPECT_EQ(a.hash, c.hash);
        EXPECT_DOUBLE_EQ(a.makespan, c.makespan);
      }
    }
  }
}

TEST(PlanMilp, HashSeesAssignmentAndBatching) {
  const auto in = workload_instances()[0].second;
  Topology topo;
  topo.world_size = 4;
  Plan p = plan_lpt(in.matrices, topo, in.costs);
  const uint64_t h = p.hash;
  std::swap(p.owner[0], p.owner[1]);
  EXPECT_NE(plan_hash(p), h);
  std::swap(p.owner[0], p.owner[1]);
  p.owner_load[0] *= 2;  // timings are not part of the hash
  EXPECT_EQ(plan_hash(p), h);
}

TEST(PlanMilp, RoundRobinIsRegistrationOrderWithTableLoads) {
  const auto in = workload_instances()[0].second;
  Topology topo;
  topo.world_size = 5;
  const Plan p = plan_round_robin(in.matrices, topo, in.costs);
  for (size_t i = 0; i < in.matrices.size(); ++i) EXPECT_EQ(p.owner[i], static_cast<int>(i % 5));
  expect_valid(in, p, 5);
}

TEST(PlanMilp, MemoryCapIsRespectedOrNamesTheMatrix) {
  // A bin-packing trap for a greedy: two X (3 MB of momentum each, 10 s) and three Y (2 MB,
  // 9 s) on two owners with 6 MB each. LPT puts an X and a Y on each owner and has no room for
  // the last Y; the MILP finds {X, X} and {Y, Y, Y} (makespan 27 s).
  Instance in;
  in.costs.source = "test";
  in.costs.set(4, 4, {{1, 10.0}, {2, 20.0}});
  in.costs.set(4, 8, {{1, 9.0}, {2, 18.0}, {3, 27.0}});
  for (int i = 0; i < 2; ++i) in.matrices.push_back({"x." + std::to_string(i), 4, 4, 0, 187500});
  for (int i = 0; i < 3; ++i) in.matrices.push_back({"y." + std::to_string(i), 4, 8, i, 62500});
  Topology topo;
  topo.world_size = 2;
  PlanOptions o;
  o.memory_cap_bytes = 6.1e6;  // 6 MB of momentum plus room for one small batch's workspace
  std::string msg;
  try {
    plan_lpt(in.matrices, topo, in.costs, o);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("no assignment meets the memory cap"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'y.2'"), std::string::npos) << msg;
  for (const char* form : {"auto", "owners"}) {
    o.formulation = form;
    const Plan p = plan_milp(in.matrices, topo, in.costs, o);
    SCOPED_TRACE(form);
    expect_valid(in, p, 2);
    EXPECT_DOUBLE_EQ(p.makespan, 27.0);
    for (double m : p.owner_memory_bytes) EXPECT_LE(m, o.memory_cap_bytes);
  }

  // A cap below one matrix: that matrix is named.
  const Instance gpt = workload_instances()[0].second;
  topo.world_size = 4;
  o = PlanOptions{};
  o.memory_cap_bytes = 4.0 * 768 * 768;
  msg.clear();
  try {
    plan_milp(gpt.matrices, topo, gpt.costs, o);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("cannot hold matrix 'attn.c_attn.0'"), std::string::npos) << msg;
  // Every matrix fits alone (the need of the largest one, from a plan with one matrix per
  // owner), but not all of them on four owners.
  Topology wide;
  wide.world_size = 48;
  const Plan single = plan_lpt(gpt.matrices, wide, gpt.costs);
  o.memory_cap_bytes =
      1.05 * *std::max_element(single.owner_memory_bytes.begin(), single.owner_memory_bytes.end());
  for (const std::string solver : {"milp", "lpt"}) {
    msg.clear();
    try {
      make_plan(solver, gpt.matrices, topo, gpt.costs, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("no assignment meets the memory cap"), std::string::npos) << msg;
    EXPECT_NE(msg.find("matrix '"), std::string::npos) << msg;
  }
}

TEST(PlanMilp, SpreadsTheMatricesOfALayer) {
  Workload w = load_workload("gpt2-small");
  Instance in;
  in.matrices = plan_matrices(w);
  in.costs = analytic_cost_table(shape_counts(in.matrices), parse_algorithm("auto"), {});
  Topology topo;
  topo.world_size = 4;  // 4 matrices per layer, 4 owners
  PlanOptions spread, packed;
  packed.spread_layers = false;
  const Plan a = plan_lpt(in.matrices, topo, in.costs, spread);
  const Plan b = plan_lpt(in.matrices, topo, in.costs, packed);
  EXPECT_EQ(a.layer_collisions, 0);
  EXPECT_GT(b.layer_collisions, 0);
  EXPECT_DOUBLE_EQ(a.makespan, b.makespan);  // the same counts, other matrices
}

TEST(PlanMilp, WorkloadMatricesAndLayers) {
  const auto pi0 = plan_matrices(load_workload("pi0"));
  EXPECT_EQ(pi0.size(), 420u);
  std::map<std::string, int64_t> layer;
  for (const auto& m : pi0) layer[m.name] = m.layer;
  EXPECT_EQ(layer.at("lm.q_proj.3"), layer.at("expert.q_proj.3"));  // shared depth
  EXPECT_EQ(layer.at("lm.q_proj.3"), layer.at("lm.down_proj.3"));
  EXPECT_NE(layer.at("lm.q_proj.3"), layer.at("vision.q_proj.3"));
  EXPECT_NE(layer.at("lm.q_proj.3"), layer.at("lm.q_proj.4"));
  const auto qwen = plan_matrices(load_workload("qwen2.5-7b"));
  EXPECT_EQ(qwen.size(), 196u);
  std::set<int64_t> layers;
  for (const auto& m : qwen) layers.insert(m.layer);
  EXPECT_EQ(layers.size(), 28u);
}

TEST(PlanMilp, BadInputIsAClearError) {
  const auto in = workload_instances()[0].second;
  Topology topo;
  topo.world_size = 0;
  EXPECT_THROW(plan_milp(in.matrices, topo, in.costs), Error);
  topo.world_size = 4;
  EXPECT_THROW(plan_milp({}, topo, in.costs), Error);
  EXPECT_THROW(plan_lpt({}, topo, in.costs), Error);
  EXPECT_THROW(make_plan("greedy", in.matrices, topo, in.costs), Error);
  topo.replicate = 3;  // does not divide 4
  EXPECT_THROW(plan_lpt(in.matrices, topo, in.costs), Error);
  topo.replicate = 1;
  topo.world_size = 12;  // not a whole number of 8-GPU nodes
  EXPECT_THROW(plan_lpt(in.matrices, topo, in.costs), Error);
  CostTable empty;
  std::string msg;
  topo.world_size = 4;
  try {
    plan_lpt(in.matrices, topo, empty);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("2304"), std::string::npos) << msg;
  EXPECT_NE(msg.find("attn.c_attn.0"), std::string::npos) << msg;
}

TEST(PlanMilp, HsdpSlotsSpanReplicateAndShard) {
  Topology topo;
  topo.world_size = 16;
  topo.gpus_per_node = 8;
  topo.replicate = 2;
  topo.validate();
  EXPECT_EQ(topo.shard(), 8);
  EXPECT_EQ(topo.nodes(), 2);
  EXPECT_EQ(topo.slot_of(11), std::make_pair(1, 3));
  const auto in = workload_instances()[0].second;
  const Plan p = plan_milp(in.matrices, topo, in.costs);
  std::set<int> replicas;
  for (int o : p.owner) replicas.insert(topo.slot_of(o).first);
  EXPECT_EQ(replicas.size(), 2u);  // owner slots in both replicas
}

}  // namespace
}  // namespace distmuon
