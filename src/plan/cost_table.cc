// The cost table: lookup with interpolation, and its JSON file format.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/atomic_write.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "plan/cost_json.h"

namespace distmuon {
namespace {

constexpr const char* kFormat = "distmuon-cost-table";
constexpr int kFormatVersion = 1;

std::pair<int64_t, int64_t> wide(int64_t rows, int64_t cols) {
  return {std::min(rows, cols), std::max(rows, cols)};
}

}  // namespace

void CostTable::set(int64_t rows, int64_t cols, std::vector<CostPoint> points) {
  DM_CHECK(rows >= 1 && cols >= 1, "cost table: shape ", rows, "x", cols, " is not a matrix");
  DM_CHECK(!points.empty(), "cost table: shape ", rows, "x", cols, " has no points");
  std::sort(points.begin(), points.end(),
            [](const CostPoint& a, const CostPoint& b) { return a.k < b.k; });
  for (size_t i = 0; i < points.size(); ++i) {
    DM_CHECK(points[i].k >= 1, "cost table: shape ", rows, "x", cols, " has batch size ",
             points[i].k);
    DM_CHECK(points[i].seconds > 0 && std::isfinite(points[i].seconds), "cost table: shape ", rows,
             "x", cols, " k=", points[i].k, " has time ", points[i].seconds);
    DM_CHECK(i == 0 || points[i].k != points[i - 1].k, "cost table: shape ", rows, "x", cols,
             " has batch size ", points[i].k, " twice");
  }
  auto key = wide(rows, cols);
  shapes_[key] = ShapeCost{key.first, key.second, std::move(points)};
}

const ShapeCost* CostTable::find(int64_t rows, int64_t cols) const {
  auto it = shapes_.find(wide(rows, cols));
  return it == shapes_.end() ? nullptr : &it->second;
}

double CostTable::batch_seconds(int64_t rows, int64_t cols, int64_t k) const {
  const ShapeCost* sc = find(rows, cols);
  DM_CHECK(sc != nullptr, "cost table (", describe(), ") has no entry for shape ",
           wide(rows, cols).first, "x", wide(rows, cols).second);
  DM_CHECK(k >= 1, "cost table: batch size must be >= 1 (got ", k, ")");
  const auto& p = sc->points;
  if (p.size() == 1 || k <= p.front().k) {
    // Below the first point, or a single point: proportional to k (no overhead is assumed that
    // was not measured).
    return p.front().seconds * static_cast<double>(k) / static_cast<double>(p.front().k);
  }
  for (size_t i = 1; i < p.size(); ++i) {
    if (k <= p[i].k) {
      const double f =
          static_cast<double>(k - p[i - 1].k) / static_cast<double>(p[i].k - p[i - 1].k);
      return p[i - 1].seconds + f * (p[i].seconds - p[i - 1].seconds);
    }
  }
  // Past the last point: the last segment's per-matrix slope, never below zero growth (a
  // measured dip must not make huge batches free).
  const CostPoint& a = p[p.size() - 2];
  const CostPoint& b = p.back();
  double slope = (b.seconds - a.seconds) / static_cast<double>(b.k - a.k);
  slope = std::max(slope, 0.0);
  if (slope == 0.0) slope = b.seconds / static_cast<double>(b.k);
  return b.seconds + slope * static_cast<double>(k - b.k);
}

CostTable CostTable::empty(std::string source, std::string device, const OrthoConfig& cfg) {
  CostTable t;
  t.source = std::move(source);
  t.device = std::move(device);
  t.version = DISTMUON_VERSION;
  t.algorithm = algorithm_name(cfg);
  t.work_dtype = dtype_name(cfg.work_dtype);
  return t;
}

bool CostTable::same_key(const CostTable& o) const {
  return device == o.device && version == o.version && algorithm == o.algorithm &&
         work_dtype == o.work_dtype;
}

std::string CostTable::describe() const {
  std::ostringstream os;
  os << (source.empty() ? "unnamed" : source) << " costs of " << algorithm << "/" << work_dtype
     << " on " << device << " (distmuon " << version << ", " << shapes_.size() << " shapes)";
  return os.str();
}

nlohmann::json cost_tables_to_json(const std::vector<CostTable>& tables) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["format_version"] = kFormatVersion;
  j["tables"] = nlohmann::json::array();
  for (const CostTable& t : tables) {
    nlohmann::json jt = {{"source", t.source},         {"device", t.device},
                         {"version", t.version},       {"algorithm", t.algorithm},
                         {"work_dtype", t.work_dtype}, {"shapes", nlohmann::json::array()}};
    for (const auto& [key, sc] : t.shapes()) {
      nlohmann::json pts = nlohmann::json::array();
      for (const CostPoint& p : sc.points) pts.push_back({p.k, p.seconds});
      jt["shapes"].push_back({{"m", sc.m}, {"n", sc.n}, {"points", pts}});
    }
    j["tables"].push_back(std::move(jt));
  }
  return j;
}

nlohmann::json parse_cost_json(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    DM_FAIL("cost file ", origin, " is corrupt (not JSON: ", e.what(),
            "); re-create it with distmuon-plan --measure or use another file");
  }
  DM_CHECK(j.is_object() && j.contains("format") && j["format"] == kFormat, "cost file ", origin,
           " is not a distmuon cost table (no \"format\": \"", kFormat, "\")");
  DM_CHECK(j.contains("format_version") && j["format_version"].is_number_integer(), "cost file ",
           origin, " has no integer format_version");
  const int fv = j["format_version"].get<int>();
  DM_CHECK(fv == kFormatVersion, "cost file ", origin, " has format version ", fv,
           "; this build reads version ", kFormatVersion);
  return j;
}

std::vector<CostTable> cost_tables_from_json(const nlohmann::json& j, const std::string& origin) {
  std::vector<CostTable> out;
  try {
    for (const auto& jt : j.at("tables")) {
      CostTable t;
      t.source = jt.at("source").get<std::string>();
      t.device = jt.at("device").get<std::string>();
      t.version = jt.at("version").get<std::string>();
      t.algorithm = jt.at("algorithm").get<std::string>();
      t.work_dtype = jt.at("work_dtype").get<std::string>();
      for (const auto& js : jt.at("shapes")) {
        std::vector<CostPoint> pts;
        for (const auto& jp : js.at("points"))
          pts.push_back({jp.at(0).get<int64_t>(), jp.at(1).get<double>()});
        t.set(js.at("m").get<int64_t>(), js.at("n").get<int64_t>(), std::move(pts));
      }
      out.push_back(std::move(t));
    }
  } catch (const Error& e) {
    DM_FAIL("cost file ", origin, " is corrupt: ", e.what());
  } catch (const std::exception& e) {
    DM_FAIL("cost file ", origin, " is corrupt (missing or mistyped field: ", e.what(), ")");
  }
  return out;
}

std::string read_text_file(const std::string& path) {
  std::ifstream f(path);
  DM_CHECK(f.good(), "cannot read cost file ", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string cost_table_json(const std::vector<CostTable>& tables) {
  return cost_tables_to_json(tables).dump(1);
}

std::vector<CostTable> parse_cost_tables(const std::string& text, const std::string& origin) {
  return cost_tables_from_json(parse_cost_json(text, origin), origin);
}

std::vector<CostTable> read_cost_file(const std::string& path) {
  return parse_cost_tables(read_text_file(path), path);
}

void write_cost_file(const std::string& path, const std::vector<CostTable>& tables) {
  write_file_atomically(path, cost_table_json(tables) + "\n");
}

CostTable select_cost_table(const std::vector<CostTable>& tables, const std::string& device,
                            const std::string& origin) {
  DM_CHECK(!tables.empty(), "cost file ", origin, " holds no tables");
  std::set<std::string> devices;
  for (const auto& t : tables) devices.insert(t.device);
  std::string want = device;
  if (want.empty()) {
    if (devices.size() != 1) {
      std::string list;
      for (const auto& d : devices) list += "\n  " + d;
      DM_FAIL("cost file ", origin, " holds tables of ", devices.size(),
              " devices; choose one with --device:", list);
    }
    want = *devices.begin();
  }
  std::string versions;
  for (const auto& t : tables) {
    if (t.device != want) continue;
    if (t.version == DISTMUON_VERSION) return t;
    versions += " " + t.version;
  }
  DM_CHECK(!versions.empty(), "cost file ", origin, " has no table for device '", want, "'");
  DM_FAIL("cost file ", origin, " has tables for '", want, "' from distmuon", versions,
          " only; this is distmuon ", DISTMUON_VERSION,
          ": re-measure (kernels change between "
          "versions)");
}

namespace {

// The fixed part of a shape's batch times: the intercept at k = 0 of the line through its first
// two points, between 0 and the first point (0 for a shape with one point).
double fixed_seconds(const std::vector<CostPoint>& pts) {
  if (pts.size() < 2) return 0;
  const double slope = (pts[1].seconds - pts[0].seconds) / static_cast<double>(pts[1].k - pts[0].k);
  return std::clamp(pts[0].seconds - slope * static_cast<double>(pts[0].k), 0.0, pts[0].seconds);
}

}  // namespace

CostTable scale_costs(const CostTable& t, double f, int parts) {
  DM_CHECK(f > 0, "cost scale must be > 0 (got ", f, ")");
  DM_CHECK(parts >= 0, "the number of parts must be >= 0 (got ", parts, ")");
  if (f == 1 && parts <= 1) return t;
  // With parts: each point's rate (counted FLOPs per second of its work) against the table's
  // best, over points with at least a millisecond of work (the rate the kernels reach where they
  // fill the GPU).
  const OrthoConfig cfg =
      parts > 1 ? parse_algorithm(t.algorithm.empty() ? "auto" : t.algorithm) : OrthoConfig{};
  auto rate = [&](const ShapeCost& shape, const CostPoint& p, double fixed) {
    const double work = p.seconds - fixed;
    return work > 0 ? static_cast<double>(p.k) * ortho_flops(cfg, shape.m, shape.n) / work : 0.0;
  };
  double best = 0;
  if (parts > 1)
    for (const auto& [key, shape] : t.shapes()) {
      const double fixed = fixed_seconds(shape.points);
      for (const CostPoint& p : shape.points)
        if (p.seconds - fixed >= 1e-3) best = std::max(best, rate(shape, p, fixed));
    }
  CostTable out = t;
  for (const auto& [key, shape] : t.shapes()) {
    std::vector<CostPoint> pts = shape.points;
    const double fixed = fixed_seconds(pts);
    for (CostPoint& p : pts) {
      double g = f;
      // Never faster than on the whole GPU (f below the parts: a caller's inconsistent pair).
      if (best > 0)
        g = std::max({1.0, f / parts, f * std::min(1.0, rate(shape, p, fixed) / best)});
      p.seconds = fixed + g * (p.seconds - fixed);
    }
    out.set(shape.m, shape.n, std::move(pts));
  }
  char buf[64];
  if (parts > 1)
    std::snprintf(buf, sizeof(buf), "%g, a part of 1/%d of its SMs", f, parts);
  else
    std::snprintf(buf, sizeof(buf), "%g", f);
  out.device = t.device + " x " + buf + " (launches kept)";
  return out;
}

std::string default_cost_cache_path() {
  return env::cache_file("DISTMUON_COST_CACHE", "costs.json");
}

}  // namespace distmuon
