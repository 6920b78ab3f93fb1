// Longest processing time first on the aggregated instance, batch aware: the marginal cost of one
// more matrix of a shape on an owner falls with the number it already runs (the batch amortises
// fixed costs), so the owner chosen is the one whose load ends lowest, not the least loaded one.
#include <chrono>

#include "distmuon/error.h"
#include "instance.h"

namespace distmuon {
namespace plan_detail {

Counts lpt_counts(const Instance& inst) {
  const int P = inst.owners();
  const size_t S = inst.classes.size();
  Counts counts(P, std::vector<int>(S, 0));
  std::vector<double> load(P, 0.0);
  // Classes are sorted by decreasing single-matrix cost, so this is the LPT order.
  for (size_t s = 0; s < S; ++s) {
    const ShapeClass& cl = inst.classes[s];
    for (int j = 0; j < cl.count(); ++j) {
      int best = -1;
      double best_load = 0;
      for (int o = 0; o < P; ++o) {
        const int x = counts[o][s];
        const double t = load[o] - cl.load[x] + cl.load[x + 1];
        if (best >= 0 && !(t < best_load)) continue;  // ties keep the lower owner index
        if (inst.opts.memory_cap_bytes > 0) {
          counts[o][s] += 1;
          const bool ok = inst.fits(counts[o]);
          counts[o][s] -= 1;
          if (!ok) continue;
        }
        best = o;
        best_load = t;
      }
      if (best < 0) {
        double least = -1;
        for (int o = 0; o < P; ++o)
          least = least < 0 ? inst.memory(counts[o]) : std::min(least, inst.memory(counts[o]));
        const PlanMatrix& pm = (*inst.matrices)[cl.members[j]];
        DM_FAIL("planner: no assignment meets the memory cap of ",
                inst.opts.memory_cap_bytes / (1 << 20), " MiB per owner: matrix '", pm.name, "' (",
                pm.rows, "x", pm.cols, ", momentum ", cl.state_bytes / (1 << 20),
                " MiB) does not fit on any of the ", P, " owners (the emptiest already holds ",
                least / (1 << 20), " MiB)");
      }
      counts[best][s] += 1;
      load[best] = best_load;
    }
  }
  return counts;
}

}  // namespace plan_detail

Plan plan_lpt(const std::vector<PlanMatrix>& matrices, const Topology& topo, const CostTable& costs,
              const PlanOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  plan_detail::Instance inst = plan_detail::build_instance(matrices, topo, costs, opts);
  Plan p = plan_detail::realise(inst, plan_detail::lpt_counts(inst), "lpt");
  p.status = "heuristic";
  p.solve_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

}  // namespace distmuon
