// The CUDA backend's answer to Backend::tuned_config: the autotuner's stored measurements for a
// shape (tune cache), filtered by the caller's policy on restart sets, measured on first use
// when the policy allows it. The selection rules are pure functions (unit-tested on the host).
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/launch/cuda_backend_impl.h"
#include "backend/cuda/tune/autotune.h"
#include "distmuon/error.h"

namespace distmuon {
namespace cuda {

const AlgoCandidate* select_candidate(const AlgoChoice& c, bool allow_restart_free) {
  const AlgoCandidate* best = nullptr;
  for (const AlgoCandidate& k : c.candidates) {
    if (!k.accepted) continue;
    const bool gram = k.algorithm.rfind("gram", 0) == 0;
    const bool has2 = std::find(k.restarts.begin(), k.restarts.end(), 2) != k.restarts.end();
    if (gram && !has2 && !allow_restart_free) continue;
    if (!best || k.ms < best->ms) best = &k;
  }
  return best;
}

const AlgoChoice* find_choice(const std::vector<AlgoChoice>& all, int64_t m, int64_t n,
                              int64_t count, const std::string& schedule) {
  const AlgoChoice* best = nullptr;
  for (const AlgoChoice& c : all) {
    if (std::min(c.rows, c.cols) != m || std::max(c.rows, c.cols) != n || c.schedule != schedule)
      continue;
    if (!best || std::llabs(c.count - count) < std::llabs(best->count - count)) best = &c;
  }
  return best;
}

}  // namespace cuda

bool CudaBackend::tuned_config(const OrthoConfig& base, int64_t m, int64_t n, int64_t count,
                               const TunePolicy& policy, OrthoConfig* out) {
  Impl& s = *impl_;
  // The candidates are half-precision iterations with the built-in schedules.
  if (!s.use_tune_cache || base.iteration != Iteration::kAuto || base.work_dtype != DType::kBF16 ||
      base.coefficients == Coefficients::kCustom || m <= 0 || count <= 0)
    return false;
  const std::string schedule = cuda::schedule_name(base);
  const cuda::AlgoChoice* c = cuda::find_choice(s.algo_choices, m, n, count, schedule);
  const cuda::AlgoCandidate* pick =
      c ? cuda::select_candidate(*c, policy.allow_restart_free) : nullptr;
  if (!pick) {  // the file may have gained entries since construction (another tuner run)
    s.algo_choices = cuda::load_algo_choices(cuda::TuneKey::current(s.name));
    c = cuda::find_choice(s.algo_choices, m, n, count, schedule);
    pick = c ? cuda::select_candidate(*c, policy.allow_restart_free) : nullptr;
  }
  if (!pick && policy.measure) {
    std::fprintf(stderr, "[tune] %lld x %lldx%lld (%s): no stored measurement, tuning now\n",
                 static_cast<long long>(count), static_cast<long long>(m),
                 static_cast<long long>(n), schedule.c_str());
    cuda::TuneOptions to;
    to.repeats = 5;
    std::vector<cuda::SymChoice> syms;
    for (DType t : {DType::kF16, DType::kBF16})  // Gram NS's products, then standard NS's
      for (int64_t k : {n, m}) syms.push_back(cuda::tune_sym(*this, m, k, count, t, to));
    OrthoConfig tb = base;
    cuda::AlgoChoice fresh = cuda::tune_algorithm(*this, m, n, count, tb, to);
    cuda::save_choices(cuda::TuneKey::current(s.name), syms, {fresh});
    auto same = [&](const cuda::AlgoChoice& o) {
      return o.rows == fresh.rows && o.cols == fresh.cols && o.count == fresh.count &&
             o.schedule == fresh.schedule;
    };
    s.algo_choices.erase(std::remove_if(s.algo_choices.begin(), s.algo_choices.end(), same),
                         s.algo_choices.end());
    s.algo_choices.push_back(fresh);
    c = &s.algo_choices.back();
    pick = cuda::select_candidate(*c, policy.allow_restart_free);
  }
  if (!pick) return false;
  *out = resolve(cuda::config_of(*pick, base), m, n);
  std::fprintf(stderr, "[tune] %lld x %lldx%lld: %s%s (measured at batch %lld, %.3f ms)\n",
               static_cast<long long>(count), static_cast<long long>(m), static_cast<long long>(n),
               pick->algorithm.c_str(),
               pick->algorithm.rfind("gram", 0) == 0
                   ? (pick->restarts.empty() ? " restarts {}" : " restarts {2}")
                   : "",
               static_cast<long long>(c->count), pick->ms);
  return true;
}

}  // namespace distmuon
