// The analytic cost model: counted FLOPs over a GEMM rate and counted bytes over a memory
// bandwidth (a roofline per matrix), plus a fixed cost per kernel launch that a batch pays once.
// It is what the planner uses before anything was measured, and for sizing clusters one does
// not have (the rates default to an H200's measured ceilings).
#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "distmuon/cost_table.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

// Walks the iteration of docs/algorithms.md (sections 2 and 4) as the Orthogonalizer runs it and
// counts, per product, the elements read (each distinct input once) and written, and the
// launches. The resolved config decides standard versus Gram.
struct Traffic {
  double elems = 0;
  int launches = 0;
};

Traffic walk(const OrthoConfig& cfg, int64_t rows, int64_t cols) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  const OrthoConfig r = resolve(cfg, static_cast<int64_t>(m), static_cast<int64_t>(n));
  const double mm = m * m, mn = m * n;
  Traffic t;
  auto product = [&](double read, double write) {
    t.elems += read + write;
    t.launches += 1;
  };
  if (r.iteration != Iteration::kGram) {
    for (int i = 0; i < r.steps; ++i) {
      product(mn, mm);       // A = X X^T
      product(mm, mm);       // B = b A + c A A
      product(mm + mn, mn);  // X = a X + B X
    }
    return t;
  }
  auto restarts_at = [&](int i) {
    return i > 0 && std::find(r.restarts.begin(), r.restarts.end(), i) != r.restarts.end();
  };
  bool have_q = false;
  product(mn, mm);  // R = X X^T
  for (int i = 0; i < r.steps; ++i) {
    if (restarts_at(i) && have_q) {
      product(mm + mn, mn);  // X = Q X
      product(mn, mm);       // R = X X^T
      have_q = false;
    }
    product(mm, mm);                    // Z = b R + c R R
    product(have_q ? 2 * mm : mm, mm);  // Q = Z + a I, or Q Z + a Q
    have_q = true;
    if (i + 1 < r.steps && !restarts_at(i + 1)) {
      product(2 * mm, mm);  // T = R Z + a R
      product(2 * mm, mm);  // R = Z T + a T
    }
  }
  product(mm + mn, mn);  // out = Q X
  return t;
}

}  // namespace

std::string AnalyticRates::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "analytic (%.0f TFLOP/s, %.2f TB/s, %.1f us per kernel)",
                flops_per_s / 1e12, bytes_per_s / 1e12, launch_s * 1e6);
  return buf;
}

double ortho_bytes(const OrthoConfig& cfg, int64_t rows, int64_t cols, int64_t elem_bytes) {
  return walk(cfg, rows, cols).elems * static_cast<double>(elem_bytes);
}

int ortho_launches(const OrthoConfig& cfg, int64_t rows, int64_t cols) {
  return walk(cfg, rows, cols).launches;
}

double analytic_batch_seconds(const OrthoConfig& cfg, const AnalyticRates& rates, int64_t rows,
                              int64_t cols, int64_t k) {
  DM_CHECK(rates.flops_per_s > 0 && rates.bytes_per_s > 0 && rates.launch_s >= 0,
           "analytic costs: rates must be positive (", rates.describe(), ")");
  DM_CHECK(k >= 1, "analytic costs: batch size must be >= 1 (got ", k, ")");
  const OrthoConfig r = resolve(cfg, std::min(rows, cols), std::max(rows, cols));
  const int64_t elem = static_cast<int64_t>(dtype_size(iteration_dtype(r)));
  const Traffic t = walk(cfg, rows, cols);
  const double per_matrix = std::max(ortho_flops(cfg, rows, cols) / rates.flops_per_s,
                                     t.elems * static_cast<double>(elem) / rates.bytes_per_s);
  return t.launches * rates.launch_s + static_cast<double>(k) * per_matrix;
}

CostTable analytic_cost_table(const std::vector<ShapeCount>& shapes, const OrthoConfig& cfg,
                              const AnalyticRates& rates) {
  CostTable t = CostTable::empty("analytic", rates.describe(), cfg);
  // Both orientations of a shape batch together, so a wide shape needs points up to the sum.
  std::map<std::pair<int64_t, int64_t>, int64_t> total;
  for (const ShapeCount& s : shapes) {
    DM_CHECK(s.count >= 1, "analytic costs: shape ", s.rows, "x", s.cols, " has count ", s.count);
    total[{std::min(s.rows, s.cols), std::max(s.rows, s.cols)}] += s.count;
  }
  for (const auto& [shape, count] : total) {
    std::vector<CostPoint> pts;
    for (int64_t k = 1; k <= count; ++k)
      pts.push_back({k, analytic_batch_seconds(cfg, rates, shape.first, shape.second, k)});
    t.set(shape.first, shape.second, std::move(pts));
  }
  return t;
}

}  // namespace distmuon
