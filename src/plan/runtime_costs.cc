// The costs of the engine's start-up plan: which measured table (the store, a file or none) and
// how it is completed with analytic costs for the shapes it lacks.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "distmuon/env.h"
#include "distmuon/error.h"
#include "plan/runtime_plan.h"

namespace distmuon {
namespace {

// The key a measured table of this run has (the cache of distmuon-plan --measure keys the same).
CostTable wanted_key(const std::string& device_name, const OrthoConfig& ortho) {
  CostTable t;
  t.device = device_name;
  t.version = DISTMUON_VERSION;
  t.algorithm = algorithm_name(ortho);
  t.work_dtype = dtype_name(ortho.work_dtype);
  return t;
}

std::string describe_key(const CostTable& t) {
  return t.algorithm + "/" + t.work_dtype + " on '" + t.device + "' (distmuon " + t.version + ")";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

}  // namespace

PlanCostSource plan_cost_source(const std::string& setting) {
  const std::string v = setting.empty() ? env::get("DISTMUON_PLAN_COSTS") : setting;
  DM_CHECK(!v.empty(), "DISTMUON_PLAN_COSTS is empty: use auto, analytic or a cost file");
  if (v == "analytic") return {PlanCostSource::Kind::kAnalytic, ""};
  if (v == "auto") return {PlanCostSource::Kind::kAuto, default_cost_cache_path()};
  return {PlanCostSource::Kind::kFile, v};
}

MeasuredCosts read_measured_costs(const PlanCostSource& source,
                                  const std::function<std::string()>& device_name,
                                  const OrthoConfig& ortho) {
  using Kind = PlanCostSource::Kind;
  if (source.kind == Kind::kAnalytic) return {std::nullopt, "plan costs set to analytic"};
  if (source.kind == Kind::kAuto && !std::filesystem::exists(source.path))
    return {std::nullopt, "no cost store at " + source.path + " (distmuon-plan --measure)"};
  DM_CHECK(source.kind == Kind::kAuto || std::filesystem::is_regular_file(source.path),
           "plan costs '", source.path, "' are neither auto, analytic nor a cost file");
  const std::vector<CostTable> tables = read_cost_file(source.path);
  const CostTable want = wanted_key(device_name(), ortho);
  for (const CostTable& t : tables)
    if (t.same_key(want)) return {t, "from " + source.path};
  const std::string missing = "no table for " + describe_key(want);
  if (source.kind == Kind::kAuto) return {std::nullopt, missing + " in " + source.path};
  std::string held;
  for (const CostTable& t : tables) held += "\n  " + describe_key(t);
  DM_FAIL("cost file ", source.path, " has ", missing,
          "; it holds:", held.empty() ? std::string("\n  (no tables)") : held,
          "\nmeasure this run's costs with distmuon-plan --measure");
}

RuntimeCosts runtime_costs(const std::vector<ShapeCount>& shapes, const OrthoConfig& ortho,
                           const AnalyticRates& rates, const CostTable* measured) {
  RuntimeCosts out;
  out.table = analytic_cost_table(shapes, ortho, rates);
  out.shapes = static_cast<int>(out.table.shapes().size());
  if (!measured) return out;
  std::vector<double> ratios;
  for (const auto& [key, sc] : out.table.shapes()) {
    const ShapeCost* m = measured->find(key.first, key.second);
    if (!m) continue;
    ++out.measured_shapes;
    for (const CostPoint& p : m->points)
      ratios.push_back(p.seconds / analytic_batch_seconds(ortho, rates, sc.m, sc.n, p.k));
  }
  if (out.measured_shapes == 0) return out;
  out.analytic_scale = median(ratios);
  CostTable mixed;
  mixed.source = out.measured_shapes == out.shapes ? "measured" : "measured + analytic";
  mixed.device = measured->device;
  mixed.version = measured->version;
  mixed.algorithm = measured->algorithm;
  mixed.work_dtype = measured->work_dtype;
  for (const auto& [key, sc] : out.table.shapes()) {
    std::vector<CostPoint> points;
    if (const ShapeCost* m = measured->find(key.first, key.second)) {
      points = m->points;
    } else {
      points = sc.points;
      for (CostPoint& p : points) p.seconds *= out.analytic_scale;
    }
    mixed.set(sc.m, sc.n, std::move(points));
  }
  out.table = std::move(mixed);
  return out;
}

std::string RuntimeCosts::describe() const {
  if (measured_shapes == 0) return "analytic costs for " + std::to_string(shapes) + " shapes";
  std::string s = "measured costs for " + std::to_string(measured_shapes) + " of " +
                  std::to_string(shapes) + " shapes (" + table.device + ")";
  if (measured_shapes == shapes) return s;
  char scale[96];
  std::snprintf(scale, sizeof(scale), ", analytic for the rest (scaled by %.3g to the measured)",
                analytic_scale);
  return s + scale;
}

}  // namespace distmuon
