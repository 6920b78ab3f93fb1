// Column generation for the pattern model when its patterns are too many to enumerate (few
// owners and many classes: Pi0 on 8 ranks has far more than 20000 patterns within the LPT
// makespan).
//
// For a trial makespan T the configuration LP  min sum_p l[p]  s.t.  sum_p p_s l[p] >= count_s,
// l >= 0, over patterns p with load(p) <= T, is the tightest classical relaxation of the
// assignment: if its optimum exceeds P, no plan with makespan T exists. Its columns are priced
// by a knapsack over classes (value: the duals, weight: the class's batched load), solved by
// dynamic programming on T cut into kResolution units, weights rounded down so that no pattern
// that fits is missed (the bound stays valid; a priced pattern may overshoot T by a few units).
// Farley's bound z / max(1, best price) is valid at every iteration, so infeasibility can be
// declared before the LP converges. A bisection on T between the trivial bound and the LPT
// makespan yields a proven lower bound, and every column priced on the way goes into the pool
// from which the pattern MILP then picks the plan (price-and-branch). Its start is the best of
// LPT and a few "dives": round the LP by giving one owner its most used column, re-solve for the
// rest, repeat, at makespans stepped up from the LP-feasible one.
#include <coin/Clp_C_Interface.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include "common/log.h"
#include "distmuon/error.h"
#include "milp_internal.h"

namespace distmuon::plan_detail {
namespace {

constexpr int kResolution = 4000;  // pricing grid: T / 4000; the bound loses at most S / 4000
constexpr int kMaxPricingRounds = 300;
constexpr int kMaxBisections = 14;
constexpr int kMaxDives = 8;
constexpr int kRefineDives = 3;

// The configuration LP in CLP, owned (RAII). Rows: one covering row per class.
class CoverLp {
 public:
  explicit CoverLp(const std::vector<int>& demand) : model_(Clp_newModel()) {
    DM_CHECK(model_ != nullptr, "CLP: Clp_newModel failed");
    Clp_setLogLevel(model_, 0);
    const int S = static_cast<int>(demand.size());
    std::vector<double> lo(demand.begin(), demand.end()), hi(S, DBL_MAX);
    const int start = 0;
    Clp_loadProblem(model_, 0, S, &start, nullptr, nullptr, nullptr, nullptr, nullptr, lo.data(),
                    hi.data());
  }
  ~CoverLp() { Clp_deleteModel(model_); }
  CoverLp(const CoverLp&) = delete;
  CoverLp& operator=(const CoverLp&) = delete;

  void add(const std::vector<int>& p) {
    std::vector<int> rows;
    std::vector<double> vals;
    for (size_t s = 0; s < p.size(); ++s)
      if (p[s] > 0) {
        rows.push_back(static_cast<int>(s));
        vals.push_back(p[s]);
      }
    const int starts[2] = {0, static_cast<int>(rows.size())};
    const double lo = 0, hi = DBL_MAX, cost = 1;
    Clp_addColumns(model_, 1, &lo, &hi, &cost, starts, rows.data(), vals.data());
  }
  bool solve() {
    Clp_primal(model_, 0);
    return Clp_status(model_) == 0;
  }
  double objective() { return Clp_objectiveValue(model_); }
  std::vector<double> primal(size_t n) {
    const double* x = Clp_primalColumnSolution(model_);
    return std::vector<double>(x, x + n);
  }
  std::vector<double> duals(size_t n) {
    const double* d = Clp_dualRowSolution(model_);
    return std::vector<double>(d, d + n);
  }

 private:
  Clp_Simplex* model_;
};

// The pattern of largest dual value whose (rounded-down) load fits T.
std::pair<std::vector<int>, double> price(const Instance& inst, const std::vector<double>& pi,
                                          const std::vector<int>& cap, double T) {
  const size_t S = inst.classes.size();
  const double unit = T / kResolution;
  std::vector<double> best(kResolution + 1, -1.0), next;
  best[0] = 0;
  std::vector<std::vector<int>> pick(S, std::vector<int>(kResolution + 1, 0));
  for (size_t s = 0; s < S; ++s) {
    const ShapeClass& cl = inst.classes[s];
    next = best;  // k = 0
    if (pi[s] > 1e-12) {
      for (int k = 1; k <= cap[s]; ++k) {
        const double w = std::floor(cl.load[k] / unit);
        if (w > kResolution) continue;  // loads need not grow with k: keep scanning
        const int wi = static_cast<int>(w);
        for (int r = wi; r <= kResolution; ++r) {
          if (best[r - wi] < 0) continue;
          const double v = best[r - wi] + pi[s] * k;
          if (v > next[r] + 1e-12) {
            next[r] = v;
            pick[s][r] = k;
          }
        }
      }
    }
    best.swap(next);
  }
  int r = static_cast<int>(std::max_element(best.begin(), best.end()) - best.begin());
  const double value = best[r];
  std::vector<int> p(S, 0);
  for (size_t s = S; s-- > 0;) {
    const int k = pick[s][r];
    p[s] = k;
    if (k > 0) r -= static_cast<int>(std::floor(inst.classes[s].load[k] / unit));
  }
  return {p, value};
}

// The pattern of each class alone with as many matrices as fit T: keeps the LP feasible.
std::vector<int> singleton(const Instance& inst, size_t s, int cap, double T) {
  std::vector<int> p(inst.classes.size(), 0);
  const ShapeClass& cl = inst.classes[s];
  for (int k = cap; k >= 1; --k)
    if (cl.load[k] <= T || k == 1) {
      p[s] = k;
      break;
    }
  return p;
}

}  // namespace

namespace {

// Column generation for the residual demand at makespan T. Returns the LP solution (columns and
// their values) or nothing when the LP proves that `owners` owners cannot cover the demand.
struct LpResult {
  std::vector<std::vector<int>> columns;
  std::vector<double> values;
};

class Generator {
 public:
  Generator(const Instance& inst, double t_ub, ColumnPool& pool)
      : inst_(inst), t_ub_(t_ub), pool_(pool) {
    for (const auto& p : pool_.patterns) seen_.insert(p);
  }

  void keep(const std::vector<int>& p) {
    if (inst_.load(p) <= t_ub_ * (1 + 1e-9) && seen_.insert(p).second) pool_.patterns.push_back(p);
  }

  std::optional<LpResult> solve(const std::vector<int>& demand, int owners, double T) {
    const size_t S = demand.size();
    CoverLp lp(demand);
    LpResult r;
    std::set<std::vector<int>> in_lp;
    auto add = [&](std::vector<int> p) {
      for (size_t s = 0; s < S; ++s) p[s] = std::min(p[s], demand[s]);
      if (std::all_of(p.begin(), p.end(), [](int v) { return v == 0; })) return;
      if (in_lp.insert(p).second) {
        lp.add(p);
        r.columns.push_back(p);
      }
    };
    for (size_t s = 0; s < S; ++s)
      if (demand[s] > 0) add(singleton(inst_, s, demand[s], T));
    for (const auto& p : pool_.patterns)
      if (inst_.load(p) <= T) add(p);
    for (int round = 0; round < kMaxPricingRounds; ++round) {
      if (!lp.solve()) return std::nullopt;  // numerical trouble: treat as not coverable
      pool_.lp_solves += 1;
      const double z = lp.objective();
      auto [p, value] = price(inst_, lp.duals(S), demand, T);
      if (z / std::max(1.0, value) > owners * (1 + 1e-9)) return std::nullopt;  // Farley
      if (value <= 1 + 1e-9 || in_lp.count(p)) {
        r.values = lp.primal(r.columns.size());
        return r;
      }
      add(p);
      keep(p);
    }
    return std::nullopt;
  }

  // Sequential rounding: give one owner the column the LP uses most, take its matrices off the
  // demand, re-solve the LP for the rest, until every matrix is placed.
  std::optional<Counts> dive(double T) {
    const size_t S = inst_.classes.size();
    std::vector<int> demand(S);
    for (size_t s = 0; s < S; ++s) demand[s] = inst_.classes[s].count();
    Counts fixed;
    for (int left = inst_.owners(); left > 0; --left) {
      if (std::all_of(demand.begin(), demand.end(), [](int v) { return v == 0; })) break;
      auto lp = solve(demand, left, T);
      if (!lp) return std::nullopt;
      size_t best = 0;
      for (size_t j = 1; j < lp->values.size(); ++j)
        if (lp->values[j] > lp->values[best] + 1e-9) best = j;
      const std::vector<int>& p = lp->columns[best];
      for (size_t s = 0; s < S; ++s) demand[s] -= p[s];
      fixed.push_back(p);
      keep(p);
    }
    if (std::any_of(demand.begin(), demand.end(), [](int v) { return v > 0; })) return std::nullopt;
    while (static_cast<int>(fixed.size()) < inst_.owners()) fixed.emplace_back(S, 0);
    return fixed;
  }

 private:
  const Instance& inst_;
  double t_ub_;
  ColumnPool& pool_;
  std::set<std::vector<int>> seen_;
};

}  // namespace

ColumnPool generate_columns(const Instance& inst, const Counts& start, double t_lb, double t_ub) {
  const size_t S = inst.classes.size();
  ColumnPool pool;
  Generator gen(inst, t_ub, pool);
  for (const auto& c : start) gen.keep(c);
  std::vector<int> all(S);
  for (size_t s = 0; s < S; ++s) all[s] = inst.classes[s].count();

  // Bisection: lo is proven infeasible (or the trivial bound), hi is LP-feasible.
  double lo = t_lb, hi = t_ub;
  for (int i = 0; i < kMaxBisections && hi - lo > 1e-4 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (gen.solve(all, inst.owners(), mid) ? hi : lo) = mid;
  }
  pool.lower_bound = lo;
  DM_LOG(kDebug, "planner: configuration LP bound ", lo * 1e3, " ms, LP-feasible at ", hi * 1e3,
         " ms, ", pool.patterns.size(), " columns, ", pool.lp_solves, " LP solves");

  // Round at makespans from the LP-feasible one up towards the start's: a dive at a tight T
  // may fail to place everything, one at a looser T places it with a worse makespan.
  double best = inst.makespan(start);
  double fail = hi, ok = -1;
  auto try_dive = [&](double T) {
    auto d = gen.dive(T);
    DM_LOG(kDebug, "planner: dive at ", T * 1e3, " ms: ",
           d ? "placed, makespan " + std::to_string(inst.makespan(*d) * 1e3) + " ms" : "failed");
    if (!d) {
      fail = std::max(fail, T);
      return;
    }
    ok = ok < 0 ? T : std::min(ok, T);
    if (inst.makespan(*d) < best) {
      best = inst.makespan(*d);
      pool.dived = std::move(d);
    }
  };
  // Step up from the LP-feasible makespan until a dive succeeds, then bisect between the last
  // failure and the first success.
  for (int i = 0; i < kMaxDives && ok < 0; ++i) {
    const double T = hi + (best - hi) * i / kMaxDives;
    if (T >= best) break;
    try_dive(T);
  }
  for (int i = 0; i < kRefineDives && ok > 0; ++i) try_dive(0.5 * (fail + ok));
  return pool;
}

}  // namespace distmuon::plan_detail
