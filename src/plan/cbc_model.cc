#include "cbc_model.h"

#include <coin/Cbc_C_Interface.h>

#include <algorithm>
#include <ctime>
#include <string>

#include "common/log.h"
#include "distmuon/error.h"

namespace distmuon::plan_detail {
namespace {
Cbc_Model* as_cbc(void* p) { return static_cast<Cbc_Model*>(p); }
}  // namespace

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

CbcModel::CbcModel() : model_(Cbc_newModel()) {
  DM_CHECK(model_ != nullptr, "CBC: Cbc_newModel failed");
}

CbcModel::~CbcModel() {
  if (model_) Cbc_deleteModel(as_cbc(model_));
}

int CbcModel::add_var(double lower, double upper, double objective, bool integer) {
  lower_.push_back(lower);
  upper_.push_back(upper);
  objective_.push_back(objective);
  integer_.push_back(integer ? 1 : 0);
  columns_.emplace_back();
  return static_cast<int>(lower_.size()) - 1;
}

void CbcModel::add_row(std::span<const std::pair<int, double>> terms, double lower, double upper) {
  const int row = rows();
  for (const auto& [var, coef] : terms) {
    DM_CHECK(var >= 0 && var < vars(), "internal: CBC row refers to variable ", var);
    if (coef != 0.0) columns_[var].emplace_back(row, coef);
  }
  row_lower_.push_back(lower);
  row_upper_.push_back(upper);
}

void CbcModel::set_start(std::vector<std::pair<int, double>> values) { start_ = std::move(values); }

int CbcModel::integers() const {
  return static_cast<int>(std::count(integer_.begin(), integer_.end(), 1));
}

CbcResult CbcModel::solve(const CbcLimits& limits) {
  DM_CHECK(!solved_, "internal: a CBC model is solved once");
  solved_ = true;
  Cbc_Model* m = as_cbc(model_);

  // Compressed sparse columns, the layout Cbc_loadProblem takes.
  std::vector<int> start{0}, index;
  std::vector<double> value;
  for (const auto& col : columns_) {
    for (const auto& [row, coef] : col) {
      index.push_back(row);
      value.push_back(coef);
    }
    start.push_back(static_cast<int>(index.size()));
  }
  Cbc_loadProblem(m, vars(), rows(), start.data(), index.data(), value.data(), lower_.data(),
                  upper_.data(), objective_.data(), row_lower_.data(), row_upper_.data());
  for (int j = 0; j < vars(); ++j)
    if (integer_[j]) Cbc_setInteger(m, j);
  if (!start_.empty()) {
    // CBC's MIP start matches columns by name (even the index variant looks the names up), and
    // unnamed columns past a few thousand are rejected: name them all.
    for (int j = 0; j < vars(); ++j) Cbc_setColName(m, j, ("x" + std::to_string(j)).c_str());
  }
  Cbc_setObjSense(m, 1.0);  // minimise

  if (!start_.empty()) {
    std::vector<int> idx;
    std::vector<double> val;
    for (const auto& [j, v] : start_) {
      idx.push_back(j);
      val.push_back(v);
    }
    Cbc_setMIPStartI(m, static_cast<int>(idx.size()), idx.data(), val.data());
  }

  // Same inputs, same answer: fixed seeds for CLP and CBC, no threads, and a node limit that
  // stops the search at the same point on every run. The time limit counts CPU time (CBC's
  // default), like the planner's budget: a busy machine then slows the plan down but does not
  // change it.
  // CBC's own log at DISTMUON_LOG_LEVEL=debug; silent otherwise.
  Cbc_setLogLevel(m, log::level() >= log::kDebug ? 1 : 0);
  Cbc_setParameter(m, "slogLevel", "0");
  Cbc_setParameter(m, "threads", "0");
  Cbc_setParameter(m, "randomSeed", std::to_string(std::max<int64_t>(1, limits.seed)).c_str());
  Cbc_setParameter(m, "randomCbcSeed", std::to_string(std::max<int64_t>(1, limits.seed)).c_str());
  Cbc_setParameter(m, "timeMode", "cpu");
  // No CglPreProcess: when the time limit ends the search while the preprocessed model is in
  // use, CBC 2.10's postProcess can dereference a null pointer (seen under AddressSanitizer in
  // test_plan_milp: SIGSEGV in CglPreProcess::postProcess). Our models are small and already
  // tight (assignment rows, a makespan column), so preprocessing gains little.
  Cbc_setParameter(m, "preprocess", "off");
  Cbc_setMaximumSeconds(m, std::max(0.01, limits.seconds));
  Cbc_setMaximumNodes(m, static_cast<int>(std::min<int64_t>(limits.max_nodes, 2000000000)));
  Cbc_setAllowableFractionGap(m, std::max(0.0, limits.relative_gap));
  if (limits.first_solution) Cbc_setMaximumSolutions(m, 1);
  if (limits.root_cut_passes >= 0)
    Cbc_setParameter(m, "passCuts", std::to_string(limits.root_cut_passes).c_str());

  const int rc = Cbc_solve(m);
  CbcResult r;
  r.nodes = Cbc_getNodeCount(m);
  r.infeasible = Cbc_isProvenInfeasible(m) != 0;
  // Cbc_bestSolution is null when no integer-feasible solution was found (the column solution
  // would then be an LP relaxation).
  const double* x = Cbc_bestSolution(m);
  r.has_solution = !r.infeasible && x != nullptr;
  if (r.has_solution) {
    r.x.assign(x, x + vars());
    r.objective = Cbc_getObjValue(m);
  }
  r.bound = Cbc_getBestPossibleObjValue(m);
  r.optimal = Cbc_isProvenOptimal(m) != 0;
  const int secondary = Cbc_secondaryStatus(m);
  if (r.infeasible) {
    r.stopped_by = "infeasible";
  } else if (Cbc_isSecondsLimitReached(m)) {
    r.stopped_by = "time limit";
  } else if (Cbc_isNodeLimitReached(m)) {
    r.stopped_by = "node limit";
  } else if (Cbc_isSolutionLimitReached(m)) {
    r.stopped_by = "first solution";
  } else if (secondary == 2) {
    r.stopped_by = "gap";
  } else if (r.optimal) {
    r.stopped_by = "optimal";
  } else {
    r.stopped_by = "cbc status " + std::to_string(rc) + "/" + std::to_string(secondary);
  }
  return r;
}

}  // namespace distmuon::plan_detail
