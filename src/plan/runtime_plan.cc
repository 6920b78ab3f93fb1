// The planner's runtime policy: how the engine plans owners at start-up (the solver, its guards,
// the costs) and how it reads a layer index from a parameter name.
#include "plan/runtime_plan.h"

#include <algorithm>

#include "distmuon/error.h"

namespace distmuon {

namespace {

// Above these sizes the start-up plan is LPT: every rank solves the plan itself, and the MILP
// (well under a second up to Pi0's 420 matrices in 11 shapes) must not delay start-up.
constexpr size_t kMilpMaxMatrices = 2048;
constexpr size_t kMilpMaxShapes = 64;
// CPU seconds the MILP may take at start-up. It is a guard, not a tuning knob: the node limits
// decide the plan, and a rank that hits the time limit makes every rank fall back to LPT
// (dist_setup), so ranks never disagree because one of them was slower.
constexpr double kMilpTimeLimitS = 2.0;

}  // namespace

// Analytic rates by device kind. CUDA: the H200's measured ceilings, where a fixed cost per
// kernel launch makes batching same-shape matrices on one owner pay. CPU: one core's order of
// magnitude, where a batched call costs little beyond its arithmetic, so the plan balances
// FLOPs. Only ratios matter, and they are the same on every rank.
AnalyticRates runtime_rates(DeviceKind kind) {
  if (kind == DeviceKind::kCUDA) return AnalyticRates{};
  AnalyticRates r;
  r.flops_per_s = 50e9;
  r.bytes_per_s = 10e9;
  r.launch_s = 1e-6;
  return r;
}

Plan make_runtime_plan(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                       const RuntimePlanSpec& spec) {
  const RuntimeCosts costs =
      runtime_costs(shape_counts(matrices), spec.ortho, runtime_rates(spec.device),
                    spec.measured ? &*spec.measured : nullptr);
  PlanOptions opts;
  opts.ortho = spec.ortho;
  opts.time_limit_s = kMilpTimeLimitS;
  std::string solver = spec.solver;
  if (solver == "milp" &&
      (matrices.size() > kMilpMaxMatrices || shape_counts(matrices).size() > kMilpMaxShapes))
    solver = "lpt";
  Plan plan = spec.owners.empty() ? make_plan(solver, matrices, topo, costs.table, opts)
                                  : plan_fixed(matrices, topo, costs.table, spec.owners, opts);
  plan.costs = costs.describe();
  return plan;
}

std::string layer_prefix(const std::string& path) {
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find('.', begin);
    if (end == std::string::npos) end = path.size();
    const bool digits = end > begin && std::all_of(path.begin() + begin, path.begin() + end,
                                                   [](char c) { return c >= '0' && c <= '9'; });
    if (digits) return path.substr(0, end);
    begin = end + 1;
  }
  return "";
}

int64_t layer_of(const std::string& name, std::map<std::string, int64_t>& ids) {
  const std::string key = layer_prefix(name);
  if (key.empty()) return -1;
  return ids.emplace(key, static_cast<int64_t>(ids.size())).first->second;
}

}  // namespace distmuon
