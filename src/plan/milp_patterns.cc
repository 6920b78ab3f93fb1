// The pattern MILP: how many owners run each pattern. Posed directly ("minimise T with
// T >= load(p) whenever p is used") the model ties T to the pattern choices through big-M rows,
// its relaxation is weak and CBC spends seconds at the root even on 200 patterns. Posed as a
// sequence of covering problems at fixed makespans it is strong: with n[p] integer,
//
//   cover(T, C):  sum_p n[p] <= P,   sum_p p_s * n[p] = count_s  (>= for a generated pool),
//                 n[p] = 0 for every p with load(p) > T or bytes(p) > C,
//
// is a cutting-stock problem whose LP relaxation is the configuration LP, and CBC settles most
// of them at the root. The optimal makespan is one of the pattern loads, so bisection over the
// sorted loads finds it; then, at that makespan, bisection over the sorted byte counts finds the
// smallest busiest-owner traffic (the secondary objective, lexicographic). Every cover(...)
// stops at its first integer solution: any cover with at most P owners answers the question.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/log.h"
#include "distmuon/error.h"
#include "milp_internal.h"

namespace distmuon::plan_detail {
namespace {

constexpr int64_t kCoverNodes = 1000;

struct Cover {
  bool decided = false;  // CBC finished: found a cover or proved there is none
  std::optional<Counts> counts;
  CbcResult result;
};

Cover cover(const Instance& inst, const std::vector<std::vector<int>>& patterns,
            const std::vector<double>& load, const std::vector<double>& comm, double T, double C,
            bool complete, const CbcLimits& limits) {
  const int P = inst.owners();
  const size_t S = inst.classes.size();
  CbcModel model;
  std::vector<int> var(patterns.size(), -1);
  for (size_t p = 0; p < patterns.size(); ++p)
    if (load[p] <= T && comm[p] <= C) var[p] = model.add_var(0, P, 1.0, true);
  std::vector<std::pair<int, double>> row;
  for (size_t s = 0; s < S; ++s) {
    row.clear();
    for (size_t p = 0; p < patterns.size(); ++p)
      if (var[p] >= 0 && patterns[p][s] > 0) row.emplace_back(var[p], patterns[p][s]);
    if (row.empty()) return {true, std::nullopt, {}};  // no allowed pattern holds this class
    const double c = inst.classes[s].count();
    model.add_row(row, c, complete ? c : CbcModel::kInf);
  }
  row.clear();
  for (int v : var)
    if (v >= 0) row.emplace_back(v, 1.0);
  model.add_row(row, 0, P);
  Cover out;
  out.result = model.solve(limits);
  out.decided = out.result.has_solution || out.result.infeasible;
  if (out.result.has_solution) {
    Counts counts;
    for (size_t p = 0; p < patterns.size(); ++p) {
      if (var[p] < 0) continue;
      const int used = static_cast<int>(out.result.x[var[p]] + 0.5);
      for (int i = 0; i < used; ++i) counts.push_back(patterns[p]);
    }
    while (static_cast<int>(counts.size()) < P) counts.emplace_back(S, 0);
    if (!complete) trim_surplus(inst, counts);
    out.counts = std::move(counts);
  }
  return out;
}

double max_comm(const Instance& inst, const Counts& counts) {
  double c = 0;
  for (const auto& x : counts) c = std::max(c, inst.comm(x));
  return c;
}

}  // namespace

MilpOutcome solve_patterns(const Instance& inst, const std::vector<std::vector<int>>& patterns,
                           const Counts& start, double proven_lower, const CbcLimits& limits,
                           bool complete) {
  const double cpu0 = cpu_seconds();
  auto left = [&] { return limits.seconds - (cpu_seconds() - cpu0); };
  CbcLimits lim = limits;
  lim.first_solution = true;
  lim.root_cut_passes = 5;  // the LP is the configuration LP already; cuts barely move it
  // A cover CBC cannot settle in this many nodes counts as "no": the bisection moves up, and
  // does so identically on every run (a time limit would not).
  lim.max_nodes = std::min<int64_t>(limits.max_nodes, kCoverNodes);

  std::vector<double> load(patterns.size()), comm(patterns.size());
  for (size_t p = 0; p < patterns.size(); ++p) {
    load[p] = inst.load(patterns[p]);
    comm[p] = inst.comm(patterns[p]);
  }
  MilpOutcome out;
  out.formulation = complete ? "patterns" : "columns";
  out.vars = out.integers = static_cast<int>(patterns.size());
  out.rows = static_cast<int>(inst.classes.size()) + 1;
  out.bound_seconds = proven_lower;
  // Without a start (LPT failed under a memory cap) every load is a candidate.
  double best = start.empty() ? std::numeric_limits<double>::infinity() : inst.makespan(start);
  if (!start.empty()) out.counts = start;
  bool decided = true;
  std::string stopped;

  // Bisection over sorted distinct values below the current best: values[..lo) are proven
  // infeasible, values[hi..) feasible. Stops when the best is within the relative gap of the
  // smallest open value, which it returns (a lower bound when the search was decided).
  auto bisect = [&](std::vector<double> values, double floor, auto&& current, auto&& feasible_at) {
    std::sort(values.begin(), values.end());
    values.erase(std::unique(values.begin(), values.end()), values.end());
    size_t lo = 0, hi = values.size();
    auto open_floor = [&] { return lo < values.size() ? std::max(values[lo], floor) : current(); };
    auto open = [&] {
      return !std::isfinite(current()) ||
             current() - open_floor() > limits.relative_gap * current();
    };
    while (lo < hi && open()) {
      const size_t mid = lo + (hi - lo) / 2;
      lim.seconds = left();
      if (lim.seconds <= 0.05) {
        decided = false;
        stopped = "time limit";
        break;
      }
      Cover c = feasible_at(values[mid]);
      out.result.nodes += c.result.nodes;
      DM_LOG(kDebug, "planner: cover at ", values[mid], ": ",
             c.counts ? "yes" : (c.decided ? "no" : c.result.stopped_by), " (", c.result.nodes,
             " nodes, ", limits.seconds - left(), " s)");
      if (c.counts) {
        hi = mid;
      } else {
        lo = mid + 1;
        if (!c.decided) {
          decided = false;
          stopped = c.result.stopped_by;
        }
      }
    }
    return std::min(open_floor(), current());
  };

  std::vector<double> below;
  for (size_t p = 0; p < patterns.size(); ++p)
    if (load[p] < best && load[p] >= proven_lower * (1 - 1e-12)) below.push_back(load[p]);
  const double makespan_floor = bisect(
      below, proven_lower, [&] { return best; },
      [&](double T) {
        Cover c = cover(inst, patterns, load, comm, T, CbcModel::kInf, complete, lim);
        if (c.counts && inst.makespan(*c.counts) < best) {
          best = inst.makespan(*c.counts);
          out.counts = c.counts;
        }
        return c;
      });
  const bool makespan_decided = decided;

  if (inst.opts.comm_weight > 0 && out.counts) {
    // Secondary: the least busiest-owner traffic among plans of makespan `best`.
    double best_comm = max_comm(inst, *out.counts);
    std::vector<double> lower;
    for (size_t p = 0; p < patterns.size(); ++p)
      if (load[p] <= best && comm[p] < best_comm) lower.push_back(comm[p]);
    bisect(
        lower, 0.0, [&] { return best_comm; },
        [&](double C) {
          Cover c = cover(inst, patterns, load, comm, best, C, complete, lim);
          if (c.counts && inst.makespan(*c.counts) <= best &&
              max_comm(inst, *c.counts) < best_comm) {
            best_comm = max_comm(inst, *c.counts);
            out.counts = c.counts;
          }
          return c;
        });
  }
  out.result.has_solution = out.counts.has_value();
  out.result.objective = best;
  // With every pattern present a decided bisection is a proof of optimality (within the gap);
  // over a generated pool it only says that no combination of its patterns does better.
  out.result.optimal = makespan_decided;
  out.result.stopped_by = makespan_decided ? (complete ? "optimal" : "pool optimal")
                                           : (stopped.empty() ? "time limit" : stopped);
  if (makespan_decided && complete) out.bound_seconds = std::max(proven_lower, makespan_floor);
  return out;
}

}  // namespace distmuon::plan_detail
