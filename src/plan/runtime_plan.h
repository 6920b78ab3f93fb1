// The planner's runtime policy (runtime_plan.cc, runtime_costs.cc): what the engine's start-up
// plan is made from (which costs) and how it is made, and the layer of a parameter from its name.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "distmuon/cost_table.h"
#include "distmuon/plan.h"

namespace distmuon {

// Analytic rates by device kind (only their ratios matter).
AnalyticRates runtime_rates(DeviceKind kind);

// Where the start-up plan's measured costs come from: DistOptions::plan_costs, or when it is
// empty DISTMUON_PLAN_COSTS. auto: the measurement store (default_cost_cache_path(), written by
// distmuon-plan --measure), where it holds this run's table; analytic: none; anything else
// names a cost file that must hold this run's table.
struct PlanCostSource {
  enum class Kind { kAuto, kAnalytic, kFile };
  Kind kind = Kind::kAuto;
  std::string path;  // the store (auto) or the file
};
PlanCostSource plan_cost_source(const std::string& setting);

// The measured table of this run: device, library version, algorithm and iteration dtype all
// equal, or none. `note` says where it came from or why there is none, for the set-up log.
struct MeasuredCosts {
  std::optional<CostTable> table;
  std::string note;
};
// device_name (Backend::name()) is asked for only when a file is read. auto tolerates a missing
// store or a store without this run's table; a file must exist and hold it. A corrupt store or
// file throws (it is not silently replaced by other costs).
MeasuredCosts read_measured_costs(const PlanCostSource& source,
                                  const std::function<std::string()>& device_name,
                                  const OrthoConfig& ortho);

// The table the start-up plan balances: the measured points of every shape `measured` holds,
// and analytic costs for the others, scaled by the median ratio of measured to analytic time
// over the measured points (one factor for how fast this device runs against the analytic
// rates, so that the two kinds of shapes compare; the analytic model keeps the ratios between
// the unmeasured shapes). `measured` null: analytic costs.
struct RuntimeCosts {
  CostTable table;
  int shapes = 0, measured_shapes = 0;
  double analytic_scale = 1;
  std::string describe() const;  // "measured costs for 5 of 7 shapes (cuda ...), analytic ..."
};
RuntimeCosts runtime_costs(const std::vector<ShapeCount>& shapes, const OrthoConfig& ortho,
                           const AnalyticRates& rates, const CostTable* measured);

// What the start-up plan is made from.
struct RuntimePlanSpec {
  std::string solver = "milp";           // milp | lpt | round-robin
  OrthoConfig ortho;                     // the algorithm costed
  DeviceKind device = DeviceKind::kCPU;  // picks the analytic rates
  std::optional<CostTable> measured;     // read_measured_costs(), the same on every rank
  std::vector<int> owners;               // fixed owners (DistOptions::owners): only batched
};
// The plan call site: the solver on runtime_costs(), with a CPU-time guard on the MILP and LPT
// for instances too large to solve at start-up. Plan::costs describes the costs.
Plan make_runtime_plan(const std::vector<PlanMatrix>& matrices, const Topology& topo,
                       const RuntimePlanSpec& spec);
// The layer rule, the one place that reads layers from names: the prefix of a dotted path up to
// its first all-digit component ("transformer.h.3.mlp.c_fc.weight" -> "transformer.h.3"), ""
// when it has none. The planner spreads layers over owners; the dedicated runtime broadcasts
// weights per layer (distmuon/dedicated.h).
std::string layer_prefix(const std::string& path);
// The layer index of a parameter name: an id per distinct layer_prefix, in first-seen order; -1
// when the name has no layer (the planner then leaves the matrix unconstrained).
int64_t layer_of(const std::string& name, std::map<std::string, int64_t>& ids);

}  // namespace distmuon
