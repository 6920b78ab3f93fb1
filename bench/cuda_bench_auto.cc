// distmuon-cuda-bench --auto-check: is `auto` within 3 % of the fastest single algorithm on every
// shape class? For each class of each workload (built-in names or JSON files):
//  1. the tuner measures it as the engine's default (autotune on, whole-step graphs) does: the
//     backend's kernel variants, then every candidate as graph replays (measure/tuner.h) -> the
//     engine's pick;
//  2. ns5, ns5-sym and Gram NS {2} are timed again (graph replays), independently of the tuner: fresh inputs,
//     `rounds` interleaved rounds, the median of each -> the fastest of those that passed the
//     tuner's numerical check (bf16 ns5 fails it at m = 32), and the pick's time;
//  3. the cost model (measure/algo_model.h) predicts the class from the tuned classes of the
//     *other* workloads only (the workload left out, as a user's new one is before tuning) ->
//     its pick's time; and resolve()'s aspect-ratio heuristic's.
// A class shared by several workloads is measured once.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "cuda_bench.h"
#include "measure/algo_model.h"
#include "measure/time_ortho.h"
#include "measure/tuner.h"

namespace distmuon::bench {

using nlohmann::json;

namespace {

using Key = std::tuple<int64_t, int64_t, int64_t>;  // m, n, count

struct ClassResult {
  measure::AlgoChoice tuned;         // step 1
  std::map<std::string, double> ms;  // step 2: "ns5", "ns5-sym", "gram-ns{2}"
};

const std::vector<std::pair<std::string, measure::AlgoCandidate>>& singles() {
  static const std::vector<std::pair<std::string, measure::AlgoCandidate>> s = {
      {"ns5", {"ns5", {}, DType::kBF16}},
      {"ns5-sym", {"ns5-sym", {}, DType::kBF16}},
      {"gram-ns{2}", {"gram-ns", {2}, DType::kF16}}};
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

json auto_check(CudaBackend& be, const std::vector<std::string>& specs, int rounds) {
  DM_CHECK(rounds >= 1, "--rounds must be at least 1 (got ", rounds, ")");
  OrthoConfig base;
  base.iteration = Iteration::kAuto;
  base.work_dtype = DType::kBF16;
  std::vector<std::pair<std::string, std::vector<ShapeClass>>> wls;
  std::vector<Key> order;
  for (const std::string& s : specs) {
    wls.emplace_back(s, classes_of(workload_of(parse_workload_spec(s))));
    for (const ShapeClass& c : wls.back().second) {
      const Key k{c.rows, c.cols, c.count};
      if (std::find(order.begin(), order.end(), k) == order.end()) order.push_back(k);
    }
  }
  std::map<Key, ClassResult> res;
  int done = 0;
  for (const Key& k : order) {
    const auto [m, n, count] = k;
    std::fprintf(stderr, "[auto-check %d/%zu] %lld x %lldx%lld\n", ++done, order.size(),
                 (long long)count, (long long)m, (long long)n);
    ClassResult& r = res[k];
    be.tune_kernels(m, n, count);  // as backend_tuner() does for the engine
    measure::TuneOptions to;  // the engine's tuner's rounds and repeats
    to.graph = true;
    r.tuned = measure::tune_algorithm(be, m, n, count, base, to);
    const measure::OrthoInput in = measure::make_ortho_input(be, m, n, count, base, 0x5eed + m + n);
    std::map<std::string, std::vector<double>> t;
    for (int round = 0; round < rounds; ++round)
      for (const auto& [name, cand] : singles())
        t[name].push_back(measure::time_orthogonalizer(
            be, resolve(measure::config_of(cand, base), m, n), in.batch, {1, 10, true}));
    for (auto& [name, v] : t) r.ms[name] = median(v);
  }

  json out = json::array();
  double worst_auto = 1, worst_model = 1, worst_heuristic = 1;
  int over_auto = 0, over_model = 0, classes = 0;
  std::fprintf(stderr, "%-22s %-16s %9s %9s %9s  %-24s %-24s %s\n", "workload", "class", "ns5",
               "ns5-sym", "gram{2}", "auto (tuned)", "model (left out)", "heuristic");
  for (const auto& [spec, cls] : wls) {
    std::set<std::pair<int64_t, int64_t>> own;
    for (const ShapeClass& c : cls) own.insert({c.rows, c.cols});
    std::vector<measure::AlgoChoice> others;  // the tuned classes of the other workloads
    for (const auto& [k, r] : res)
      if (!own.count({std::get<0>(k), std::get<1>(k)})) others.push_back(r.tuned);
    json jw = {{"workload", spec}, {"classes", json::array()}};
    for (const ShapeClass& c : cls) {
      const ClassResult& r = res.at({c.rows, c.cols, c.count});
      double best = INFINITY, best_any = INFINITY;
      std::string best_name;
      for (const auto& [name, ms] : r.ms) {
        best_any = std::min(best_any, ms);
        bool accepted = false;
        for (const measure::AlgoCandidate& k : r.tuned.candidates)
          if (measure::candidate_name(k) == name) accepted = k.accepted;
        if (accepted && ms < best) best = ms, best_name = name;
      }
      const measure::AlgoCandidate* pick = measure::select_candidate(r.tuned, false);
      const std::string auto_name = pick ? measure::candidate_name(*pick) : "none";
      const double auto_ratio = pick ? r.ms.at(auto_name) / best : INFINITY;
      const std::optional<measure::AlgoChoice> pred =
          measure::predict_choice(others, c.rows, c.cols, c.count, base);
      const measure::AlgoCandidate* mp = pred ? measure::select_candidate(*pred, false) : nullptr;
      const std::string model_name = mp ? measure::candidate_name(*mp) : "none";
      const double model_ratio = mp ? r.ms.at(model_name) / best : INFINITY;
      const Iteration h = resolve(base, c.rows, c.cols).iteration;
      const std::string heur_name = h == Iteration::kGram ? "gram-ns{2}" : "ns5-sym";
      const double heur_ratio = r.ms.at(heur_name) / best;
      worst_auto = std::max(worst_auto, auto_ratio);
      worst_model = std::max(worst_model, model_ratio);
      worst_heuristic = std::max(worst_heuristic, heur_ratio);
      over_auto += auto_ratio > 1.03;
      over_model += model_ratio > 1.03;
      ++classes;
      char cl[40], a[40], mo[40];
      std::snprintf(cl, sizeof cl, "%lldx%lldx%lld", (long long)c.count, (long long)c.rows,
                    (long long)c.cols);
      std::snprintf(a, sizeof a, "%s %.3f", auto_name.c_str(), auto_ratio);
      std::snprintf(mo, sizeof mo, "%s %.3f", model_name.c_str(), model_ratio);
      std::fprintf(stderr, "%-22s %-16s %9.3f %9.3f %9.3f  %-24s %-24s %s %.3f\n", spec.c_str(), cl,
                   r.ms.at("ns5"), r.ms.at("ns5-sym"), r.ms.at("gram-ns{2}"), a, mo,
                   heur_name.c_str(), heur_ratio);
      json tuner = json::object();
      for (const measure::AlgoCandidate& k : r.tuned.candidates)
        tuner[measure::candidate_name(k)] = {{"ms", k.ms}, {"rel_err", k.rel_err}, {"accepted", k.accepted}};
      json model = json::object();
      if (pred)
        for (const measure::AlgoCandidate& k : pred->candidates)
          model[measure::candidate_name(k)] = {{"ms", k.ms}, {"accepted", k.accepted}};
      jw["classes"].push_back({{"rows", c.rows}, {"cols", c.cols}, {"count", c.count},
                               {"ms", r.ms}, {"fastest", best_name},
                               {"fastest_any_over_accepted", best_any / best},
                               {"auto", auto_name}, {"auto_ratio", auto_ratio},
                               {"model", model_name}, {"model_ratio", model_ratio},
                               {"heuristic", heur_name}, {"heuristic_ratio", heur_ratio},
                               {"tuner", tuner}, {"model_predicted", model}});
    }
    out.push_back(jw);
  }
  std::fprintf(stderr,
               "[auto-check] %d classes: auto (tuned) worst %.3f, %d over 1.03; cost model "
               "(workload left out) worst %.3f, %d over 1.03; heuristic worst %.3f\n",
               classes, worst_auto, over_auto, worst_model, over_model, worst_heuristic);
  return {{"rounds", rounds}, {"workloads", out}, {"classes", classes},
          {"worst_auto_ratio", worst_auto}, {"worst_model_ratio", worst_model},
          {"worst_heuristic_ratio", worst_heuristic}, {"auto_over_3pct", over_auto},
          {"model_over_3pct", over_model}, {"pass", over_auto == 0},
          {"model_pass", over_model == 0}};
}

}  // namespace distmuon::bench
