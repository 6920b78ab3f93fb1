// CacheMuon parts of distmuon-bench.
#include "bench_cache.h"

#include <cstdio>

namespace distmuon::bench {

CacheOptions cache_options(const BenchOptions& o, double gamma) {
  CacheOptions c;
  c.enabled = true;
  c.gamma = gamma;
  c.residual = parse_cache_residual(o.cache_residual);
  c.probes = o.cache_probes;
  c.max_staleness = o.cache_staleness;
  c.check_backoff = o.cache_backoff;
  c.gate = parse_cache_gate(o.cache_gate);
  if (o.cache_dtype != "work") c.dtype = parse_dtype(o.cache_dtype);
  c.layout = parse_cache_layout(o.cache_layout);
  c.shadow = o.cache_shadow;
  c.per_matrix_stats = o.cache_per_matrix;
  return c;
}

void print_cache_table(const std::vector<RunResult>& results) {
  std::printf("\nCacheMuon (all steps, warm-up included; residual = ||DD^T - I||_F / sqrt(m))\n");
  std::printf("%-22s %7s %8s %8s %9s %8s %8s %8s %8s %11s %11s %10s\n", "algo", "gamma", "hits",
              "hit rate", "saved", "res mean", "res p50", "res p90", "res max", "upd err avg",
              "upd err max", "cache MiB");
  for (const RunResult& r : results) {
    if (!r.gamma) continue;
    const CacheStats& c = r.cache;
    std::printf("%-22s %7s %8lld %8.3f %8.1f%% %8.3f %8.3f %8.3f %8.3f %11.2e %11.2e %10.2f\n",
                r.algo.c_str(), cli::format_number(*r.gamma).c_str(),
                static_cast<long long>(c.hits), c.hit_rate(), 100 * c.flops_saved_fraction(),
                c.residual.mean, c.residual.p50, c.residual.p90, c.residual.max,
                c.update_error_mean, c.update_error_max, c.memory_bytes / 1048576.0);
    if (c.probe_compared)
      std::printf("%-22s probe/exact residual over %lld accepted: min %.3f mean %.3f max %.3f\n",
                  "", static_cast<long long>(c.probe_compared), c.probe_ratio_min,
                  c.probe_ratio_mean, c.probe_ratio_max);
    for (const CacheMatrixStats& m : c.per_matrix)
      std::printf(
          "    %-28s hits %4lld refresh %4lld (forced %lld, untested %lld, batch %lld) age %3.0f "
          "res mean %.3f max %.3f last %.3f upd err max %.2e\n",
          m.name.c_str(), static_cast<long long>(m.hits), static_cast<long long>(m.refreshes),
          static_cast<long long>(m.forced), static_cast<long long>(m.unchecked),
          static_cast<long long>(m.batch), m.age,
          m.mean_residual, m.max_residual, m.last_residual, m.max_update_error);
  }
}

nlohmann::json cache_json(const RunResult& r, const BenchOptions& o) {
  const CacheStats& c = r.cache;
  nlohmann::json j = {{"gamma", *r.gamma},
                      {"hit_rate", c.hit_rate()},
                      {"flops_saved_fraction", c.flops_saved_fraction()},
                      {"mean_residual", c.residual.mean},
                      {"residual",
                       {{"min", c.residual.min},
                        {"p50", c.residual.p50},
                        {"p90", c.residual.p90},
                        {"max", c.residual.max},
                        {"count", c.residual.count}}},
                      {"hits", c.hits},
                      {"refreshes", c.refreshes},
                      {"forced_refreshes", c.forced_refreshes},
                      {"unchecked_refreshes", c.unchecked_refreshes},
                      {"batch_refreshes", c.batch_refreshes},
                      {"skips", c.skips},
                      {"flops", c.flops},
                      {"fresh_flops", c.fresh_flops},
                      {"memory_bytes", c.memory_bytes},
                      {"residual_mode", o.cache_residual},
                      {"probes", o.cache_probes},
                      {"max_staleness", o.cache_staleness},
                      {"check_backoff", o.cache_backoff},
                      {"gate", o.cache_gate},
                      {"dtype", o.cache_dtype},
                      {"layout", o.cache_layout},
                      {"drift", o.drift}};
  if (c.compared) {
    j["update_error"] = {
        {"mean", c.update_error_mean}, {"max", c.update_error_max}, {"compared", c.compared}};
  }
  if (c.probe_compared) {
    j["probe_over_exact"] = {{"min", c.probe_ratio_min},
                             {"mean", c.probe_ratio_mean},
                             {"max", c.probe_ratio_max},
                             {"compared", c.probe_compared}};
  }
  return j;
}

}  // namespace distmuon::bench
