// The owner-indexed MILP. For every owner o and class s the count x[o][s] of matrices it runs is
// an integer, and its load g_s(x) (the best batching of x matrices, from the cost table) enters
// through a piecewise-linear "multiple choice" model: the counts 1..K are cut into segments on
// which g_s is exactly linear, a binary w picks the segment, and an integer x_j lies in it.
// Batch cost is therefore not assumed linear in the count; with analytic costs (a fixed cost per
// batch plus a per-matrix cost) there is one segment per class, i.e. a fixed-charge model, and a
// measured table gets a breakpoint at each measured batch size. No count is approximated.
//
//   min  T + w_c * C
//   s.t. sum_j w[o][s][j] <= 1                         (one segment, or none: x = 0)
//        lo_j * w[o][s][j] <= x[o][s][j] <= hi_j * w[o][s][j]
//        sum_o sum_j x[o][s][j] = count_s             (every matrix has one owner)
//        load(o) = sum_{s,j} a_j * w + b_j * x <= T    (makespan; a_j, b_j: the segment's line)
//        sum_{s,j} bytes_s * x <= C                   (busiest owner's traffic)
//        state + working memory of each class's batch <= cap   (per owner and class)
//        load(o) >= load(o + 1)                       (symmetry breaking)
//
// Owners are interchangeable, so any solution can be permuted to sort loads: the last row cuts
// the P! copies of each solution to (about) one without losing the optimum. Identical matrices
// are aggregated into one integer per (owner, class), which removes their symmetry as well.
#include <algorithm>
#include <cmath>

#include "distmuon/error.h"
#include "milp_internal.h"

namespace distmuon::plan_detail {
namespace {

struct Segment {
  int lo = 1, hi = 1;           // counts lo..hi
  double fixed = 0, slope = 0;  // g(k) = fixed + slope * k on the segment
  double work0 = 0, work1 = 0;  // working memory <= work0 + work1 * k on the segment
};

// The largest count one owner may run: within the memory cap on its own.
int max_count(const Instance& inst, const ShapeClass& cl) {
  int k = cl.count();
  while (k > 0 && inst.opts.memory_cap_bytes > 0 &&
         k * cl.state_bytes + cl.work_bytes[k] > inst.opts.memory_cap_bytes)
    --k;
  return k;
}

bool linear(const std::vector<double>& g, int lo, int hi) {
  const double tol = 1e-9 * std::max(std::abs(g[hi]), std::abs(g[lo]));
  for (int k = lo + 1; k < hi; ++k) {
    const double interp = g[lo] + (g[hi] - g[lo]) * (k - lo) / static_cast<double>(hi - lo);
    if (std::abs(g[k] - interp) > tol) return false;
  }
  return true;
}

// Greedy maximal segments on which the load is exactly linear (to 1e-9 relative).
std::vector<Segment> segments(const ShapeClass& cl, int kmax) {
  std::vector<Segment> out;
  int lo = 1;
  while (lo <= kmax) {
    int hi = lo;
    while (hi + 1 <= kmax && linear(cl.load, lo, hi + 1)) ++hi;
    Segment s;
    s.lo = lo;
    s.hi = hi;
    s.slope = hi > lo ? (cl.load[hi] - cl.load[lo]) / (hi - lo) : 0.0;
    s.fixed = cl.load[lo] - s.slope * lo;
    // Memory: the chord of the working memory, lifted to lie above every point (workspace
    // buffers are rounded, so it is linear only up to a few hundred bytes).
    s.work1 = hi > lo ? (cl.work_bytes[hi] - cl.work_bytes[lo]) / (hi - lo) : 0.0;
    s.work0 = 0;
    for (int k = lo; k <= hi; ++k) s.work0 = std::max(s.work0, cl.work_bytes[k] - s.work1 * k);
    out.push_back(s);
    lo = hi + 1;
  }
  return out;
}

}  // namespace

int64_t owner_model_binaries(const Instance& inst) {
  int64_t per_owner = 0;
  for (const auto& cl : inst.classes) per_owner += segments(cl, max_count(inst, cl)).size();
  return per_owner * inst.owners();
}

MilpOutcome solve_owners(const Instance& inst, const Counts& start, double t_ub,
                         const CbcLimits& limits) {
  const int P = inst.owners();
  const size_t S = inst.classes.size();
  const Scale sc = make_scale(inst, t_ub);
  const double cap = inst.opts.memory_cap_bytes;
  CbcModel model;
  const int T = model.add_var(inst.trivial_lower_bound() / sc.unit, CbcModel::kInf, 1.0, false);
  const int C = sc.comm_per_byte > 0 ? model.add_var(0, CbcModel::kInf, 1.0, false) : -1;

  std::vector<std::vector<Segment>> seg(S);
  for (size_t s = 0; s < S; ++s)
    seg[s] = segments(inst.classes[s], max_count(inst, inst.classes[s]));
  // w[o][s][j], x[o][s][j]: variable indices.
  using Idx = std::vector<std::vector<std::vector<int>>>;
  Idx w(P, std::vector<std::vector<int>>(S)), x = w;
  for (int o = 0; o < P; ++o)
    for (size_t s = 0; s < S; ++s)
      for (const Segment& g : seg[s]) {
        w[o][s].push_back(model.add_var(0, 1, 0, true));
        x[o][s].push_back(model.add_var(0, g.hi, 0, true));
      }

  std::vector<std::pair<int, double>> row;
  auto load_terms = [&](int o, double sign) {
    for (size_t s = 0; s < S; ++s)
      for (size_t j = 0; j < seg[s].size(); ++j) {
        row.emplace_back(w[o][s][j], sign * seg[s][j].fixed / sc.unit);
        row.emplace_back(x[o][s][j], sign * seg[s][j].slope / sc.unit);
      }
  };
  for (int o = 0; o < P; ++o) {
    for (size_t s = 0; s < S; ++s) {
      for (size_t j = 0; j < seg[s].size(); ++j) {
        row = {{w[o][s][j], static_cast<double>(seg[s][j].lo)}, {x[o][s][j], -1.0}};
        model.add_row(row, -CbcModel::kInf, 0.0);
        row = {{x[o][s][j], 1.0}, {w[o][s][j], -static_cast<double>(seg[s][j].hi)}};
        model.add_row(row, -CbcModel::kInf, 0.0);
      }
      if (seg[s].size() > 1) {
        row.clear();
        for (int v : w[o][s]) row.emplace_back(v, 1.0);
        model.add_row(row, -CbcModel::kInf, 1.0);
      }
    }
    row.clear();
    load_terms(o, 1.0);
    row.emplace_back(T, -1.0);
    model.add_row(row, -CbcModel::kInf, 0.0);
    if (C >= 0) {
      row.clear();
      for (size_t s = 0; s < S; ++s)
        for (int v : x[o][s]) row.emplace_back(v, inst.classes[s].comm_bytes * sc.comm_per_byte);
      row.emplace_back(C, -1.0);
      model.add_row(row, -CbcModel::kInf, 0.0);
    }
    if (cap > 0) {
      // In units of the cap: the state of every class plus the working memory of class b's
      // batch, for every b (batches run one at a time, so the largest one counts).
      for (size_t b = 0; b < S; ++b) {
        row.clear();
        for (size_t s = 0; s < S; ++s)
          for (size_t j = 0; j < seg[s].size(); ++j) {
            double cx = inst.classes[s].state_bytes, cw = 0;
            if (s == b) {
              cx += seg[s][j].work1;
              cw = seg[s][j].work0;
            }
            row.emplace_back(x[o][s][j], cx / cap);
            if (cw != 0) row.emplace_back(w[o][s][j], cw / cap);
          }
        model.add_row(row, -CbcModel::kInf, 1.0);
      }
    }
    if (inst.opts.symmetry_breaking && o + 1 < P) {
      row.clear();
      load_terms(o, 1.0);
      load_terms(o + 1, -1.0);
      model.add_row(row, 0.0, CbcModel::kInf);
    }
  }
  for (size_t s = 0; s < S; ++s) {
    row.clear();
    for (int o = 0; o < P; ++o)
      for (int v : x[o][s]) row.emplace_back(v, 1.0);
    const double c = inst.classes[s].count();
    model.add_row(row, c, c);
  }

  // Start from LPT, owners sorted by load to satisfy the symmetry rows.
  Counts sorted = start;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [&](const auto& a, const auto& b) { return inst.load(a) > inst.load(b); });
  std::vector<std::pair<int, double>> init;
  for (int o = 0; o < static_cast<int>(sorted.size()); ++o)
    for (size_t s = 0; s < S; ++s)
      for (size_t j = 0; j < seg[s].size(); ++j)
        if (sorted[o][s] >= seg[s][j].lo && sorted[o][s] <= seg[s][j].hi) {
          init.emplace_back(w[o][s][j], 1.0);
          init.emplace_back(x[o][s][j], sorted[o][s]);
        }
  model.set_start(std::move(init));

  MilpOutcome out;
  out.formulation = "owners";
  out.vars = model.vars();
  out.integers = model.integers();
  out.rows = model.rows();
  out.result = model.solve(limits);
  // CBC bounds makespan + w * traffic; the traffic term is at most w * (all bytes).
  double all_bytes = 0;
  for (const auto& cl : inst.classes) all_bytes += cl.count() * cl.comm_bytes;
  out.bound_seconds = (out.result.bound - all_bytes * sc.comm_per_byte) * sc.unit;
  if (!std::isfinite(out.bound_seconds)) out.bound_seconds = 0;
  if (out.result.has_solution) {
    Counts counts(P, std::vector<int>(S, 0));
    for (int o = 0; o < P; ++o)
      for (size_t s = 0; s < S; ++s)
        for (int v : x[o][s]) counts[o][s] += static_cast<int>(std::lround(out.result.x[v]));
    out.counts = std::move(counts);
  }
  return out;
}

}  // namespace distmuon::plan_detail
