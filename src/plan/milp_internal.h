// The two MILP formulations of the owner assignment (see milp.cc for the model) and what they
// return to the driver.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cbc_model.h"
#include "instance.h"

namespace distmuon::plan_detail {

struct MilpOutcome {
  std::string formulation;  // "patterns", "columns" or "owners"
  CbcResult result;
  std::optional<Counts> counts;  // the incumbent, when CBC found one
  double bound_seconds = 0;      // a proven lower bound on the makespan, in seconds
  int vars = 0, integers = 0, rows = 0;
};

// Shared scaling: CBC sees loads in units of t_ub / 1000 so that its absolute tolerances mean
// the same thing for microsecond and second-scale instances.
struct Scale {
  double unit = 1;           // seconds per model unit
  double comm_per_byte = 0;  // objective units per byte on the busiest owner (0: no comm term)
};
Scale make_scale(const Instance& inst, double t_ub);

// Every owner pattern (a count per class) whose load is at most t_ub and which fits the memory
// cap, or nullopt when there are more than `limit`.
std::optional<std::vector<std::vector<int>>> enumerate_patterns(const Instance& inst, double t_ub,
                                                                int64_t limit);
// The pattern MILP (milp_patterns.cc): the least makespan, then the least busiest-owner
// traffic, of plans made of `patterns`. `complete`: the patterns are all there are (from
// enumerate_patterns), covers are exact and a decided search is a proof of optimality; else a
// generated pool, covered at least, with the surplus taken off afterwards. `start` is the plan
// to beat; `proven_lower` a lower bound on the makespan known beforehand.
MilpOutcome solve_patterns(const Instance& inst, const std::vector<std::vector<int>>& patterns,
                           const Counts& start, double proven_lower, const CbcLimits& limits,
                           bool complete);
// Takes matrices covered more than once off the busiest owners holding them.
void trim_surplus(const Instance& inst, Counts& counts);

// Column generation on the configuration LP (milp_columns.cc): a pool of good patterns and a
// proven lower bound on the makespan, found by bisection between t_lb and t_ub.
struct ColumnPool {
  std::vector<std::vector<int>> patterns;
  double lower_bound = 0;
  int64_t lp_solves = 0;
  std::optional<Counts> dived;  // a plan rounded from the LP, when better than the start
};
ColumnPool generate_columns(const Instance& inst, const Counts& start, double t_lb, double t_ub);
// Binaries of the owner-indexed model (to decide whether to build it).
int64_t owner_model_binaries(const Instance& inst);
MilpOutcome solve_owners(const Instance& inst, const Counts& start, double t_ub,
                         const CbcLimits& limits);

}  // namespace distmuon::plan_detail
