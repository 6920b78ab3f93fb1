// Owner patterns: a pattern is a count per shape class, what one owner runs. Owners are
// interchangeable, so a plan is fully described by how many owners run each pattern; the pattern
// models (milp_patterns.cc) therefore have no owner symmetry and no matrix symmetry at all.
#include <algorithm>

#include "distmuon/error.h"
#include "milp_internal.h"

namespace distmuon::plan_detail {

std::optional<std::vector<std::vector<int>>> enumerate_patterns(const Instance& inst, double t_ub,
                                                                int64_t limit) {
  const size_t S = inst.classes.size();
  std::vector<std::vector<int>> out;
  std::vector<int> cur(S, 0);
  const double cap = inst.opts.memory_cap_bytes;
  const double lim = t_ub * (1 + 1e-9);
  // Depth-first over classes; loads are non-negative, so a partial load above t_ub prunes, and
  // so does partial memory (state only grows, working memory is a max). The visit budget keeps
  // hopeless enumerations (many classes, many owners' worth of matrices each) short.
  int64_t visits = 0;
  bool overflow = false;
  auto dfs = [&](auto&& self, size_t s, double load, double state, double work) -> void {
    if (overflow) return;
    if (++visits > 50 * limit) {
      overflow = true;
      return;
    }
    if (s == S) {
      if (static_cast<int64_t>(out.size()) >= limit) {
        overflow = true;
        return;
      }
      out.push_back(cur);
      return;
    }
    const ShapeClass& cl = inst.classes[s];
    for (int k = 0; k <= cl.count() && !overflow; ++k) {
      const double l = load + cl.load[k];
      if (l > lim) continue;  // loads need not grow with k (noisy measurements): keep looking
      const double st = state + k * cl.state_bytes, wk = std::max(work, cl.work_bytes[k]);
      if (cap > 0 && st + wk > cap) continue;
      cur[s] = k;
      self(self, s + 1, l, st, wk);
    }
    cur[s] = 0;
  };
  dfs(dfs, 0, 0.0, 0.0, 0.0);
  if (overflow) return std::nullopt;
  return out;
}

void trim_surplus(const Instance& inst, Counts& counts) {
  for (size_t s = 0; s < inst.classes.size(); ++s) {
    int total = 0;
    for (const auto& c : counts) total += c[s];
    for (; total > inst.classes[s].count(); --total) {
      int best = -1;
      double best_key = 0, best_drop = 0;
      for (size_t o = 0; o < counts.size(); ++o) {
        if (counts[o][s] == 0) continue;
        const double now = inst.load(counts[o]);
        counts[o][s] -= 1;
        const double drop = now - inst.load(counts[o]);
        counts[o][s] += 1;
        if (best < 0 || now > best_key || (now == best_key && drop > best_drop)) {
          best = static_cast<int>(o);
          best_key = now;
          best_drop = drop;
        }
      }
      counts[best][s] -= 1;
    }
  }
}

}  // namespace distmuon::plan_detail
