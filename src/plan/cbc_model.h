// A small owning wrapper around a COIN-OR CBC model (C API): variables and rows are collected
// here, loaded in one call, solved with fixed seeds and limits, and the model is freed with the
// wrapper (RAII; a CBC model cannot be solved twice).
#pragma once

#include <cfloat>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace distmuon::plan_detail {

struct CbcLimits {
  double seconds = 4.0;        // CPU seconds of this process
  int64_t max_nodes = 20000;   // deterministic effort limit
  double relative_gap = 1e-4;  // stop when (incumbent - bound) / incumbent is below this
  int64_t seed = 7;
  bool first_solution = false;  // feasibility problems: stop at the first integer solution
  int root_cut_passes = -1;     // rounds of cuts at the root (-1: CBC's default, up to 100)
};

struct CbcResult {
  bool has_solution = false;
  bool optimal = false;     // search completed (within the gap)
  bool infeasible = false;  // proven: no solution exists
  std::string stopped_by;   // "optimal", "gap", "time limit", "node limit", "infeasible", ...
  std::vector<double> x;    // the incumbent, one value per variable
  double objective = 0;
  double bound = 0;  // best possible objective
  int64_t nodes = 0;
};

// CPU seconds this process has used (all threads): the planner's time budget counts these.
double cpu_seconds();

class CbcModel {
 public:
  CbcModel();
  ~CbcModel();
  CbcModel(const CbcModel&) = delete;
  CbcModel& operator=(const CbcModel&) = delete;

  // Returns the variable's index.
  int add_var(double lower, double upper, double objective, bool integer);
  // lower <= sum(coef * x[var]) <= upper; use kInf for a side without a bound.
  void add_row(std::span<const std::pair<int, double>> terms, double lower, double upper);
  // A feasible starting solution (the integer variables; CBC completes the rest).
  void set_start(std::vector<std::pair<int, double>> values);

  int vars() const { return static_cast<int>(lower_.size()); }
  int rows() const { return static_cast<int>(row_lower_.size()); }
  int integers() const;

  CbcResult solve(const CbcLimits& limits);

  static constexpr double kInf = DBL_MAX;  // COIN treats DBL_MAX as "no bound"

 private:
  void* model_ = nullptr;  // Cbc_Model*
  std::vector<double> lower_, upper_, objective_;
  std::vector<char> integer_;
  std::vector<double> row_lower_, row_upper_;
  std::vector<std::vector<std::pair<int, double>>> columns_;  // per variable: (row, coef)
  std::vector<std::pair<int, double>> start_;
  bool solved_ = false;
};

}  // namespace distmuon::plan_detail
