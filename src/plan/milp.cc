// The MILP planner: LPT first (an upper bound and a starting solution), then CBC on the
// formulation that fits the instance, then the better of the two.
//
// Both formulations work on counts of identical matrices (shape classes), not on one binary per
// matrix, and both remove the symmetry between owners: the pattern model has no owner index at
// all, the owner-indexed model orders owners by load. The pattern model is tried first when the
// patterns within the LPT makespan are few; the owner-indexed model otherwise, unless it is
// too large, in which case LPT is the answer.
#include <chrono>
#include <climits>
#include <optional>

#include "distmuon/error.h"
#include "milp_internal.h"

namespace distmuon {
namespace plan_detail {

Scale make_scale(const Instance& inst, double t_ub) {
  Scale sc;
  sc.unit = t_ub > 0 ? t_ub / 1000.0 : 1.0;
  if (inst.opts.comm_weight > 0 && inst.opts.comm_bytes_per_s > 0)
    sc.comm_per_byte = inst.opts.comm_weight / inst.opts.comm_bytes_per_s / sc.unit;
  return sc;
}

namespace {

// Counts a solver returned are checked before use: CBC works in floating point.
bool valid(const Instance& inst, const Counts& counts) {
  if (static_cast<int>(counts.size()) != inst.owners()) return false;
  for (size_t s = 0; s < inst.classes.size(); ++s) {
    int total = 0;
    for (const auto& c : counts) total += c[s];
    if (total != inst.classes[s].count()) return false;
  }
  for (const auto& c : counts)
    if (!inst.fits(c)) return false;
  return true;
}

double objective(const Instance& inst, const Counts& counts) {
  double comm = 0;
  for (const auto& c : counts) comm = std::max(comm, inst.comm(c));
  const double w = inst.opts.comm_bytes_per_s > 0 ? inst.opts.comm_weight : 0.0;
  return inst.makespan(counts) + (w > 0 ? w * comm / inst.opts.comm_bytes_per_s : 0.0);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace
}  // namespace plan_detail

Plan plan_milp(const std::vector<PlanMatrix>& matrices, const Topology& topo,
               const CostTable& costs, const PlanOptions& opts) {
  using namespace plan_detail;
  const auto t0 = std::chrono::steady_clock::now();
  const Instance inst = build_instance(matrices, topo, costs, opts);
  const int P = inst.owners();
  const double lower = inst.trivial_lower_bound();

  if (P == 1) {
    Counts all(1);
    for (const auto& cl : inst.classes) all[0].push_back(cl.count());
    DM_CHECK(inst.fits(all[0]), "planner: no assignment meets the memory cap of ",
             opts.memory_cap_bytes / (1 << 20), " MiB: the only owner needs ",
             inst.memory(all[0]) / (1 << 20), " MiB");
    Plan p = realise(inst, all, "milp");
    p.status = "optimal";
    p.lower_bound = p.makespan;
    p.solve_seconds = seconds_since(t0);
    return p;
  }

  // LPT: the incumbent to beat. Under a memory cap it may fail where an assignment exists; the
  // MILP then searches without a start, and LPT's error (naming the matrix) is what the caller
  // sees if the MILP finds nothing either.
  std::optional<Counts> lpt;
  std::optional<Error> lpt_error;
  try {
    lpt = lpt_counts(inst);
  } catch (const Error& e) {
    lpt_error = e;
  }
  double t_ub = 0;
  if (lpt) {
    t_ub = inst.makespan(*lpt);
  } else {
    for (const auto& cl : inst.classes) t_ub += *std::max_element(cl.load.begin(), cl.load.end());
  }
  const Counts start = lpt ? *lpt : Counts{};

  const std::string& form = opts.formulation;
  DM_CHECK(form == "auto" || form == "patterns" || form == "columns" || form == "owners",
           "planner: unknown MILP formulation '", form, "' (auto, patterns, columns, owners)");
  CbcLimits limits;
  limits.max_nodes = opts.max_nodes;
  limits.relative_gap = opts.relative_gap;
  limits.seed = opts.seed;
  const double cpu0 = cpu_seconds();
  auto budget = [&] { return opts.time_limit_s - (cpu_seconds() - cpu0); };
  double proven = lower;  // a lower bound on the makespan
  std::optional<MilpOutcome> outcome;
  std::string skipped;
  std::optional<std::vector<std::vector<int>>> patterns;
  if (form == "patterns" || form == "auto")
    patterns =
        enumerate_patterns(inst, t_ub, form == "patterns" ? INT64_MAX / 64 : opts.pattern_limit);
  if (form == "auto" && lpt && opts.comm_weight <= 0 && t_ub <= lower * (1 + 1e-12)) {
    skipped = "optimal (lpt meets the lower bound)";
    proven = t_ub;
  } else if (patterns) {
    limits.seconds = budget();
    outcome = solve_patterns(inst, *patterns, start, lower, limits, /*complete=*/true);
  } else if (form == "columns" || (form == "auto" && lpt && opts.memory_cap_bytes <= 0)) {
    // Pricing does not see memory, and the pool needs a start to beat.
    DM_CHECK(lpt && opts.memory_cap_bytes <= 0,
             "planner: the column formulation needs an LPT start and no memory cap");
    ColumnPool pool = generate_columns(inst, *lpt, lower, t_ub);
    proven = std::max(proven, pool.lower_bound);
    limits.seconds = budget();
    outcome = solve_patterns(inst, pool.patterns, pool.dived ? *pool.dived : start, proven, limits,
                             /*complete=*/false);
  } else if (form == "owners" || owner_model_binaries(inst) <= opts.max_binaries) {
    limits.seconds = budget();
    outcome = solve_owners(inst, start, t_ub, limits);
  } else {
    skipped =
        "lpt (instance too large for the milp: " + std::to_string(owner_model_binaries(inst)) +
        " binaries)";
  }

  const bool milp_ok = outcome && outcome->counts && valid(inst, *outcome->counts);
  // Neither found an assignment: LPT's error names the matrix that did not fit.
  if (!lpt && !milp_ok) throw *lpt_error;
  // The better of the MILP incumbent and LPT: by makespan, then by the full objective.
  bool use_milp = milp_ok;
  if (milp_ok && lpt) {
    const double tm = inst.makespan(*outcome->counts);
    use_milp = tm < t_ub * (1 - 1e-12) ||
               (tm <= t_ub * (1 + 1e-12) &&
                objective(inst, *outcome->counts) <= objective(inst, *lpt) * (1 + 1e-12));
  }
  Plan p = realise(inst, use_milp ? *outcome->counts : *lpt, "milp");
  if (outcome) {
    p.formulation = outcome->formulation;
    proven = std::max(proven, outcome->bound_seconds);
    const std::string& by = outcome->result.stopped_by;
    p.status = use_milp ? by : "lpt (milp: " + by + ")";
  } else {
    p.status = skipped;
  }
  p.lower_bound = std::min(proven, p.makespan);
  p.solve_seconds = seconds_since(t0);
  return p;
}

Plan make_plan(const std::string& solver, const std::vector<PlanMatrix>& matrices,
               const Topology& topo, const CostTable& costs, const PlanOptions& opts) {
  if (solver == "milp") return plan_milp(matrices, topo, costs, opts);
  if (solver == "lpt") return plan_lpt(matrices, topo, costs, opts);
  if (solver == "round-robin") return plan_round_robin(matrices, topo, costs, opts);
  DM_FAIL("planner: unknown solver '", solver, "' (milp, lpt, round-robin)");
}

}  // namespace distmuon
