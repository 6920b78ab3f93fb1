// The planner's runtime policy (runtime_plan.cc): what the engine's start-up plan is made from
// and how it is made, and the layer of a parameter from its name.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "distmuon/cost_table.h"
#include "distmuon/plan.h"

namespace distmuon {

// Analytic rates by device kind (only their ratios matter).
AnalyticRates runtime_rates(DeviceKind kind);

// What the start-up plan is made from.
struct RuntimePlanSpec {
  std::string solver = "milp";           // milp | lpt | round-robin
  OrthoConfig ortho;                     // the algorithm costed
  DeviceKind device = DeviceKind::kCPU;  // picks the analytic rates
  std::string cost_file;                 // measured costs instead (distmuon-plan --measure)
  std::string device_name;               // whose table cost_file must hold (Backend::name())
  std::vector<int> owners;               // fixed owners (DistOptions::owners): only batched
};
// The plan call site: the solver on analytic (or measured) costs, with a CPU-time guard on the
// MILP and LPT for instances too large to solve at start-up.
Plan make_runtime_plan(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                       const RuntimePlanSpec& spec);
// The layer index parsed from a parameter name (see runtime_plan.cc), -1 when it has none.
int64_t layer_of(const std::string& name, std::map<std::string, int64_t>& ids);

}  // namespace distmuon
