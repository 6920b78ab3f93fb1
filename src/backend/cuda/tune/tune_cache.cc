// JSON persistence of the autotuner's choices (see tune_cache.h).
#include "backend/cuda/tune/tune_cache.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/log.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon::cuda {

using nlohmann::json;

std::string TuneKey::str() const {
  std::ostringstream os;
  os << gpu << "|driver " << driver << "|runtime " << runtime << "|cublasLt " << cublaslt
     << "|tuner " << kTunerVersion;
  return os.str();
}

TuneKey TuneKey::current(const std::string& gpu_name) {
  TuneKey k;
  k.gpu = gpu_name;
  cudaDriverGetVersion(&k.driver);
  cudaRuntimeGetVersion(&k.runtime);
  k.cublaslt = cublasLtGetVersion();
  return k;
}

std::string tune_cache_path() { return env::cache_file("DISTMUON_TUNE_CACHE", "tune.json"); }

namespace {

json read_all() {
  std::ifstream f(tune_cache_path());
  if (!f.good()) return json::object();
  try {
    json j = json::parse(f);
    return j.is_object() ? j : json::object();
  } catch (const std::exception& e) {
    DM_LOG(kWarn, "tune cache ", tune_cache_path(), " is not valid JSON (", e.what(), "); ignored");
    return json::object();
  }
}

}  // namespace

std::vector<SymChoice> load_sym_choices(const TuneKey& key) {
  std::vector<SymChoice> out;
  json all = read_all();
  if (!all.contains(key.str())) return out;
  try {
    for (const json& e : all[key.str()].value("sym", json::array())) {
      SymChoice c;
      c.m = e.at("m");
      c.k = e.at("k");
      c.count = e.at("count");
      c.dtype = parse_dtype(e.at("dtype"));
      c.kernel = parse_sym_kernel(e.at("kernel"));
      c.ms = e.value("ms", 0.0);
      c.dense_ms = e.value("dense_ms", 0.0);
      out.push_back(c);
    }
  } catch (const std::exception& e) {
    DM_LOG(kWarn, "tune cache: bad symmetric entry (", e.what(), "); ignored");
  }
  return out;
}

std::vector<AlgoChoice> load_algo_choices(const TuneKey& key) {
  std::vector<AlgoChoice> out;
  json all = read_all();
  if (!all.contains(key.str())) return out;
  try {
    for (const json& e : all[key.str()].value("algo", json::array())) {
      AlgoChoice c;
      c.rows = e.at("rows");
      c.cols = e.at("cols");
      c.count = e.at("count");
      c.algorithm = e.at("algorithm");
      c.restarts = e.at("restarts").get<std::vector<int>>();
      c.work_dtype = parse_dtype(e.at("work_dtype"));
      c.ms = e.value("ms", 0.0);
      c.rel_err = e.value("rel_err", 0.0);
      c.schedule = e.value("schedule", std::string("jordan:5"));
      for (const json& k : e.value("candidates", json::array())) {
        AlgoCandidate a;
        a.algorithm = k.at("algorithm");
        a.restarts = k.at("restarts").get<std::vector<int>>();
        a.work_dtype = parse_dtype(k.at("work_dtype"));
        a.ms = k.value("ms", 0.0);
        a.rel_err = k.value("rel_err", 0.0);
        a.accepted = k.value("accepted", false);
        c.candidates.push_back(a);
      }
      if (c.candidates.empty())
        c.candidates.push_back({c.algorithm, c.restarts, c.work_dtype, c.ms, c.rel_err, true});
      out.push_back(c);
    }
  } catch (const std::exception& e) {
    DM_LOG(kWarn, "tune cache: bad algorithm entry (", e.what(), "); ignored");
  }
  return out;
}

void save_choices(const TuneKey& key, const std::vector<SymChoice>& sym,
                  const std::vector<AlgoChoice>& algo) {
  json all = read_all();
  json& mine = all[key.str()];
  if (!mine.is_object()) mine = json::object();
  json& js = mine["sym"];
  if (!js.is_array()) js = json::array();
  for (const SymChoice& c : sym) {
    json e = {{"m", c.m}, {"k", c.k}, {"count", c.count}, {"dtype", dtype_name(c.dtype)},
              {"kernel", sym_kernel_name(c.kernel)}, {"ms", c.ms}, {"dense_ms", c.dense_ms}};
    bool replaced = false;
    for (json& old : js)
      if (old.value("m", -1) == c.m && old.value("k", -1) == c.k && old.value("count", -1) == c.count &&
          old.value("dtype", "") == dtype_name(c.dtype)) {
        old = e;
        replaced = true;
      }
    if (!replaced) js.push_back(e);
  }
  json& ja = mine["algo"];
  if (!ja.is_array()) ja = json::array();
  for (const AlgoChoice& c : algo) {
    json cands = json::array();
    for (const AlgoCandidate& a : c.candidates)
      cands.push_back({{"algorithm", a.algorithm}, {"restarts", a.restarts},
                       {"work_dtype", dtype_name(a.work_dtype)}, {"ms", a.ms},
                       {"rel_err", a.rel_err}, {"accepted", a.accepted}});
    json e = {{"rows", c.rows}, {"cols", c.cols}, {"count", c.count}, {"algorithm", c.algorithm},
              {"restarts", c.restarts}, {"work_dtype", dtype_name(c.work_dtype)}, {"ms", c.ms},
              {"rel_err", c.rel_err}, {"schedule", c.schedule}, {"candidates", cands}};
    bool replaced = false;
    for (json& old : ja)
      if (old.value("rows", -1) == c.rows && old.value("cols", -1) == c.cols &&
          old.value("count", -1) == c.count &&
          old.value("schedule", std::string("jordan:5")) == c.schedule) {
        old = e;
        replaced = true;
      }
    if (!replaced) ja.push_back(e);
  }
  const std::filesystem::path path(tune_cache_path());
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream f(path);
  DM_CHECK(f.good(), "cannot write the tune cache ", path.string());
  f << all.dump(1) << "\n";
}

}  // namespace distmuon::cuda
