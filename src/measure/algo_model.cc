// The cost model of untuned shapes (see algo_model.h).
#include "measure/algo_model.h"

#include <algorithm>
#include <cmath>

#include "distmuon/cost_table.h"

namespace distmuon::measure {
namespace {

double log_ratio(double a, double b) { return std::log(a / b); }

// The analytic milliseconds of a candidate's batch (the model's shape-to-shape scaling).
double analytic_ms(const AlgoCandidate& c, const OrthoConfig& base, int64_t m, int64_t n,
                   int64_t count) {
  return analytic_batch_seconds(config_of(c, base), AnalyticRates{}, m, n, count) * 1e3;
}

bool same_candidate(const AlgoCandidate& a, const AlgoCandidate& b) {
  return a.algorithm == b.algorithm && a.restarts == b.restarts && a.work_dtype == b.work_dtype;
}

struct Point {
  double distance;
  double log_ratio;  // log(measured / analytic)
  bool accepted;
  double rel_err;
};

}  // namespace

double shape_distance(int64_t m1, int64_t n1, int64_t k1, int64_t m2, int64_t n2, int64_t k2) {
  const double a1 = static_cast<double>(n1) / static_cast<double>(m1);
  const double a2 = static_cast<double>(n2) / static_cast<double>(m2);
  return std::abs(log_ratio(static_cast<double>(m1), static_cast<double>(m2))) +
         std::abs(log_ratio(a1, a2)) +
         0.5 * std::abs(log_ratio(static_cast<double>(k1), static_cast<double>(k2)));
}

std::optional<AlgoChoice> predict_choice(const std::vector<AlgoChoice>& measured, int64_t m,
                                         int64_t n, int64_t count, const OrthoConfig& base,
                                         const ModelOptions& opt) {
  const std::string schedule = schedule_name(base);
  AlgoChoice out;
  out.rows = m;
  out.cols = n;
  out.count = count;
  out.schedule = schedule;
  out.ms = INFINITY;
  for (AlgoCandidate cand : tuner_candidates()) {
    std::vector<Point> pts;
    for (const AlgoChoice& e : measured) {
      if (e.schedule != schedule || e.count <= 0) continue;
      const int64_t em = std::min(e.rows, e.cols), en = std::max(e.rows, e.cols);
      for (const AlgoCandidate& k : e.candidates)
        if (same_candidate(k, cand) && k.ms > 0 && std::isfinite(k.ms))
          pts.push_back({shape_distance(em, en, e.count, m, n, count),
                         log_ratio(k.ms, analytic_ms(k, base, em, en, e.count)), k.accepted,
                         k.rel_err});
    }
    if (pts.empty()) continue;
    std::sort(pts.begin(), pts.end(),
              [](const Point& a, const Point& b) { return a.distance < b.distance; });
    pts.resize(std::min(pts.size(), static_cast<size_t>(std::max(1, opt.neighbours))));
    double sum_w = 0, sum = 0, sum_err = 0;
    for (const Point& p : pts) {
      const double w = 1.0 / (p.distance + 0.1);  // an exact match weighs 11x one at distance 1
      sum_w += w;
      sum += w * p.log_ratio;
      // An error that is not a positive number (NaN for a diverged candidate, 0 in entries
      // written before errors were kept) counts by its verdict: half the bar, or twice it.
      const double err = std::isfinite(p.rel_err) && p.rel_err > 0
                             ? p.rel_err
                             : (p.accepted ? 0.5 : 2.0) * opt.tolerance;
      sum_err += w * std::log(err);
    }
    cand.ms = analytic_ms(cand, base, m, n, count) * std::exp(sum / sum_w);
    cand.rel_err = std::exp(sum_err / sum_w);
    cand.accepted = cand.rel_err <= opt.tolerance;
    add_candidate(out, cand);
  }
  if (out.candidates.empty()) return std::nullopt;
  return out;
}

}  // namespace distmuon::measure
