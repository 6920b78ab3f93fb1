// The algorithm tuner (see tuner.h).
#include "measure/tuner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "distmuon/error.h"
#include "measure/algo_model.h"
#include "measure/store.h"
#include "backend/relative_error.h"
#include "measure/time_ortho.h"

namespace distmuon::measure {

using nlohmann::json;

std::string tuner_key(const std::string& fingerprint, bool graph) {
  return fingerprint + "|tuner " + std::to_string(kTunerVersion) + (graph ? "|graph replay" : "");
}

void add_candidate(AlgoChoice& choice, const AlgoCandidate& c) {
  choice.candidates.push_back(c);
  if (c.accepted && c.ms < choice.ms) {
    choice.algorithm = c.algorithm;
    choice.restarts = c.restarts;
    choice.work_dtype = c.work_dtype;
    choice.ms = c.ms;
    choice.rel_err = c.rel_err;
  }
}

std::vector<AlgoCandidate> tuner_candidates() {
  // Dense ns5 too: on small, launch-bound shapes (ResNet-18's convolutions, 64 x 147 to
  // 512 x 4608) cuBLAS's dense products beat the one-triangle kernels and the Gram iteration's
  // extra launches (a ResNet-18 step on an H200: ns5 1.77 ms, the pick without it 2.14).
  return {{"ns5", {}, DType::kBF16},
          {"ns5-sym", {}, DType::kBF16},
          {"gram-ns", {2}, DType::kF16},
          {"gram-ns", {}, DType::kF16}};
}

OrthoConfig config_of(const AlgoCandidate& c, const OrthoConfig& base) {
  OrthoConfig cfg = parse_algorithm(c.algorithm, base);
  cfg.restarts = c.restarts;
  cfg.work_dtype = DType::kBF16;
  if (cfg.iteration == Iteration::kGram) cfg.gram_work_dtype = c.work_dtype;
  return cfg;
}

std::string schedule_name(const OrthoConfig& base) {
  return coefficients_name(base.coefficients) + ":" + std::to_string(base.steps);
}

namespace {

bool is_gram(const AlgoCandidate& c) { return c.algorithm.rfind("gram", 0) == 0; }

}  // namespace

std::string candidate_name(const AlgoCandidate& c) {
  return c.algorithm + (is_gram(c) ? (c.restarts.empty() ? "{}" : "{2}") : "");
}

const AlgoCandidate* select_candidate(const AlgoChoice& c, bool allow_restart_free) {
  const AlgoCandidate* best = nullptr;
  for (const AlgoCandidate& k : c.candidates) {
    if (!k.accepted) continue;
    const bool has2 = std::find(k.restarts.begin(), k.restarts.end(), 2) != k.restarts.end();
    if (is_gram(k) && !has2 && !allow_restart_free) continue;
    if (!best || k.ms < best->ms) best = &k;
  }
  return best;
}

const AlgoChoice* find_choice(const std::vector<AlgoChoice>& all, int64_t m, int64_t n,
                              int64_t count, const std::string& schedule) {
  for (const AlgoChoice& c : all)
    if (std::min(c.rows, c.cols) == m && std::max(c.rows, c.cols) == n && c.count == count &&
        c.schedule == schedule)
      return &c;
  return nullptr;
}

const char* tune_source_name(TuneSource s) {
  switch (s) {
    case TuneSource::kStored: return "stored";
    case TuneSource::kMeasured: return "measured";
    case TuneSource::kPredicted: return "predicted";
  }
  return "?";
}

AlgoChoice choose_algorithm(int64_t rows, int64_t cols, int64_t count, const OrthoConfig& base,
                            const TuneOptions& opt, const MeasureCandidate& measure) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  AlgoChoice best;
  best.rows = rows;
  best.cols = cols;
  best.count = count;
  best.ms = INFINITY;
  best.schedule = schedule_name(base);
  std::string line;
  char buf[160];
  DM_CHECK(opt.rounds >= 1 && opt.repeats >= 1, "autotune: need rounds >= 1 and repeats >= 1 (got ",
           opt.rounds, ", ", opt.repeats, ")");
  std::vector<AlgoCandidate> cands = tuner_candidates();
  std::vector<std::vector<double>> times(cands.size());
  for (int round = 0; round < opt.rounds; ++round)
    for (size_t i = 0; i < cands.size(); ++i) {
      const CandidateResult r = measure(resolve(config_of(cands[i], base), m, n), round);
      times[i].push_back(r.ms);
      if (round == 0) cands[i].rel_err = r.rel_err;
    }
  for (size_t i = 0; i < cands.size(); ++i) {
    AlgoCandidate& c = cands[i];
    std::vector<double>& t = times[i];
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    c.ms = t[t.size() / 2];  // the median round (the upper one of an even count)
    c.accepted = c.rel_err <= opt.tolerance;  // false for NaN
    std::snprintf(buf, sizeof(buf), "%s%s %.3f ms err %.2e%s", line.empty() ? "" : ", ",
                  candidate_name(c).c_str(), c.ms, c.rel_err, c.accepted ? "" : " (rejected)");
    line += buf;
    add_candidate(best, c);
  }
  DM_CHECK(std::isfinite(best.ms), "autotune: no algorithm passed the numerical check for ", rows,
           "x", cols, " (", line, ")");
  if (opt.verbose)
    std::fprintf(stderr, "[tune] algo %lldx%lldx%lld: %s -> %s\n", (long long)count,
                 (long long)rows, (long long)cols, line.c_str(), best.algorithm.c_str());
  return best;
}

AlgoChoice tune_algorithm(Backend& be, int64_t rows, int64_t cols, int64_t count,
                          const OrthoConfig& base, const TuneOptions& opt) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const int64_t nchk = std::max<int64_t>(1, std::min<int64_t>(count, opt.check_matrices));
  const OrthoInput input = make_ortho_input(be, m, n, count, base, 0xa1c0 + m * 7 + n);
  // Reference: the fp32 dense iteration on the first nchk matrices.
  OrthoConfig ref_cfg = base;
  ref_cfg.iteration = Iteration::kStandardDense;
  ref_cfg.work_dtype = DType::kF32;
  ref_cfg.gram_work_dtype.reset();
  BatchRef ref = BatchRef::packed(nullptr, DType::kF32, nchk, m, n), out = ref;
  Buffer rb = be.alloc(ref.bytes()), ob = be.alloc(out.bytes());
  ref.data = rb.data();
  out.data = ob.data();
  time_orthogonalizer(be, ref_cfg, input.batch.slice(0, nchk), {0, 0}, &ref);
  return choose_algorithm(rows, cols, count, base, opt, [&](const OrthoConfig& cfg, int round) {
    CandidateResult r;
    r.ms = time_orthogonalizer(be, cfg, input.batch, {1, opt.repeats, opt.graph},
                               round == 0 ? &out : nullptr);
    if (round == 0) r.rel_err = relative_error(be, out, ref);
    return r;
  });
}

// ---- the store -------------------------------------------------------------------------------

namespace {

json to_json(const AlgoChoice& c) {
  json cands = json::array();
  for (const AlgoCandidate& a : c.candidates)
    cands.push_back({{"algorithm", a.algorithm}, {"restarts", a.restarts},
                     {"work_dtype", dtype_name(a.work_dtype)}, {"ms", a.ms},
                     {"rel_err", a.rel_err}, {"accepted", a.accepted}});
  return {{"rows", c.rows},     {"cols", c.cols},         {"count", c.count},
          {"algorithm", c.algorithm}, {"restarts", c.restarts},
          {"work_dtype", dtype_name(c.work_dtype)}, {"ms", c.ms}, {"rel_err", c.rel_err},
          {"schedule", c.schedule}, {"candidates", cands}};
}

// A measured number; JSON has no NaN or infinity, so the store writes them as null: read back
// as NaN (a diverged candidate stays rejected instead of making the whole store unreadable).
double number_of(const json& e, const char* key) {
  const auto it = e.find(key);
  return it == e.end() || it->is_null() ? NAN : it->get<double>();
}

AlgoChoice algo_from_json(const json& e) {
  AlgoChoice c;
  c.rows = e.at("rows");
  c.cols = e.at("cols");
  c.count = e.at("count");
  c.algorithm = e.at("algorithm");
  c.restarts = e.at("restarts").get<std::vector<int>>();
  c.work_dtype = parse_dtype(e.at("work_dtype"));
  c.ms = number_of(e, "ms");
  c.rel_err = number_of(e, "rel_err");
  c.schedule = e.value("schedule", std::string("jordan:5"));
  for (const json& k : e.value("candidates", json::array())) {
    AlgoCandidate a;
    a.algorithm = k.at("algorithm");
    a.restarts = k.at("restarts").get<std::vector<int>>();
    a.work_dtype = parse_dtype(k.at("work_dtype"));
    a.ms = number_of(k, "ms");
    a.rel_err = number_of(k, "rel_err");
    a.accepted = k.value("accepted", false);
    c.candidates.push_back(a);
  }
  if (c.candidates.empty())
    c.candidates.push_back({c.algorithm, c.restarts, c.work_dtype, c.ms, c.rel_err, true});
  return c;
}

bool same_entry(const AlgoChoice& a, const AlgoChoice& b) {
  return a.rows == b.rows && a.cols == b.cols && a.count == b.count && a.schedule == b.schedule;
}

}  // namespace

std::vector<AlgoChoice> load_algo_choices(const std::string& store, const std::string& key) {
  const json section = tuner_section(store, key);
  std::vector<AlgoChoice> out;
  try {
    for (const json& e : section.value("algo", json::array())) out.push_back(algo_from_json(e));
  } catch (const std::exception& e) {
    DM_FAIL("measurement store ", store, " has a bad algorithm choice under '", key, "' (",
            e.what(), "); remove the file or that entry");
  }
  return out;
}

void save_tuning(const std::string& store, const std::string& key,
                 const std::vector<AlgoChoice>& algo, const std::string& kernel_choices_json) {
  json kernels;
  try {
    kernels = json::parse(kernel_choices_json);
  } catch (const std::exception& e) {
    DM_FAIL("internal: kernel choices are not JSON (", e.what(), ")");
  }
  DM_CHECK(kernels.is_array(), "internal: kernel choices are not a JSON array");
  std::vector<AlgoChoice> merged = load_algo_choices(store, key);  // migrates an old cache
  for (const AlgoChoice& c : algo) {
    merged.erase(std::remove_if(merged.begin(), merged.end(),
                                [&](const AlgoChoice& o) { return same_entry(o, c); }),
                 merged.end());
    merged.push_back(c);
  }
  update_store(store, [&](StoreContents& s) {
    json& mine = s.tuner[key];
    if (!mine.is_object()) mine = json::object();
    json ja = json::array();
    for (const AlgoChoice& c : merged) ja.push_back(to_json(c));
    mine["algo"] = ja;
    if (!kernels.empty()) mine["sym"] = kernels;
  });
}

AlgorithmTuner::AlgorithmTuner(std::string store, std::string key, MeasureShape measure,
                               KernelChoices kernels, std::string kernel_key)
    : store_(std::move(store)), key_(std::move(key)),
      kernel_key_(kernel_key.empty() ? key_ : std::move(kernel_key)),
      measure_(std::move(measure)), kernels_(std::move(kernels)) {}

std::optional<TunedConfig> AlgorithmTuner::config_for(const OrthoConfig& base, int64_t m,
                                                      int64_t n, int64_t count,
                                                      const TunePolicy& policy,
                                                      const std::string& progress) {
  // The candidates are half-precision iterations with the built-in schedules.
  if (base.iteration != Iteration::kAuto || base.work_dtype != DType::kBF16 ||
      base.coefficients == Coefficients::kCustom || m <= 0 || count <= 0)
    return std::nullopt;
  const std::string schedule = schedule_name(base);
  const std::string tag = progress.empty() ? "[tune]" : "[tune " + progress + "]";
  if (!stored_) stored_ = load_algo_choices(store_, key_);
  const AlgoChoice* c = find_choice(*stored_, m, n, count, schedule);
  if (!c) {  // the store may have gained entries since (another tuner run)
    stored_ = load_algo_choices(store_, key_);
    c = find_choice(*stored_, m, n, count, schedule);
  }
  TuneSource source = TuneSource::kStored;
  std::optional<AlgoChoice> predicted;
  if (!c && policy.measure) {
    std::fprintf(stderr, "%s %lld x %lldx%lld (%s): not in the store, measuring\n", tag.c_str(),
                 static_cast<long long>(count), static_cast<long long>(m),
                 static_cast<long long>(n), schedule.c_str());
    AlgoChoice fresh;
    try {
      fresh = measure_(m, n, count, base);
    } catch (const std::exception& e) {  // e.g. no candidate passed the check: not fatal here
      DM_LOG(kWarn, "autotune: measuring ", count, " x ", m, "x", n, " failed (", e.what(),
             "); the heuristic decides this shape");
      return std::nullopt;
    }
    save_tuning(store_, key_, {fresh}, "[]");
    if (kernels_) save_tuning(store_, kernel_key_, {}, kernels_());
    std::erase_if(*stored_, [&](const AlgoChoice& o) { return same_entry(o, fresh); });
    stored_->push_back(fresh);
    c = &stored_->back();
    source = TuneSource::kMeasured;
  } else if (!c) {
    predicted = predict_choice(*stored_, m, n, count, base);
    c = predicted ? &*predicted : nullptr;
    source = TuneSource::kPredicted;
  }
  const AlgoCandidate* pick = c ? select_candidate(*c, policy.allow_restart_free) : nullptr;
  if (!pick) return std::nullopt;
  std::fprintf(stderr, "%s %lld x %lldx%lld: %s%s (%s, %.3f ms)\n", tag.c_str(),
               static_cast<long long>(count), static_cast<long long>(m), static_cast<long long>(n),
               pick->algorithm.c_str(),
               is_gram(*pick) ? (pick->restarts.empty() ? " restarts {}" : " restarts {2}") : "",
               source == TuneSource::kPredicted ? "predicted by the cost model"
                                                : tune_source_name(source),
               pick->ms);
  return TunedConfig{resolve(config_of(*pick, base), m, n), source, pick->ms};
}

std::optional<AlgorithmTuner> backend_tuner(Backend& be, bool graph) {
  const std::string fingerprint = be.tuning_fingerprint();
  if (fingerprint.empty()) return std::nullopt;
  auto measure = [&be, graph](int64_t m, int64_t n, int64_t count, const OrthoConfig& base) {
    be.tune_kernels(m, n, count);
    TuneOptions to;
    to.graph = graph;
    return tune_algorithm(be, m, n, count, base, to);
  };
  return AlgorithmTuner(store_path(), tuner_key(fingerprint, graph), measure,
                        [&be] { return be.kernel_choices_json(); }, tuner_key(fingerprint));
}

void install_kernel_choices(Backend& be) {
  const std::string fingerprint = be.tuning_fingerprint();
  if (fingerprint.empty()) return;
  const std::string path = store_path();
  try {
    const json section = tuner_section(path, tuner_key(fingerprint));
    if (section.contains("sym")) be.load_kernel_choices_json(section["sym"].dump());
  } catch (const Error& e) {
    DM_LOG(kWarn, "kernel choices of the measurement store ", path, " not used: ", e.what());
  }
}

}  // namespace distmuon::measure
