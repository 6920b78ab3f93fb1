// The measurement store's file (see store.h).
#include "measure/store.h"

#include <filesystem>
#include <fstream>

#include "common/atomic_write.h"
#include "common/log.h"
#include "distmuon/env.h"
#include "distmuon/error.h"
#include "plan/cost_json.h"

namespace distmuon::measure {

using nlohmann::json;

std::string store_path() { return default_cost_cache_path(); }

StoreContents read_store(const std::string& path) {
  StoreContents s;
  if (!std::filesystem::exists(path)) return s;
  const json j = parse_cost_json(read_text_file(path), path);
  s.tables = cost_tables_from_json(j, path);
  if (j.contains("tuner")) {
    DM_CHECK(j["tuner"].is_object(), "cost file ", path,
             " is corrupt (\"tuner\" is not an object); remove it or its \"tuner\" member");
    s.tuner = j["tuner"];
  }
  return s;
}

void write_store(const std::string& path, const StoreContents& contents) {
  json j = cost_tables_to_json(contents.tables);
  if (!contents.tuner.empty()) j["tuner"] = contents.tuner;
  write_file_atomically(path, j.dump(1) + "\n");
}

void update_store(const std::string& path, const std::function<void(StoreContents&)>& change) {
  StoreContents s = read_store(path);
  change(s);
  write_store(path, s);
}

namespace {

// The old autotuner cache: {"<key>": {"sym": [...], "algo": [...]}, ...}; nothing when it is
// missing, unreadable or lacks the key.
json legacy_tuner_entry(const std::string& legacy, const std::string& key) {
  std::ifstream f(legacy);
  if (!f.good()) return json::object();
  try {
    const json all = json::parse(f);
    if (all.is_object() && all.contains(key) && all[key].is_object()) return all[key];
  } catch (const std::exception& e) {
    DM_LOG(kWarn, "old tune cache ", legacy, " is not valid JSON (", e.what(), "); ignored");
  }
  return json::object();
}

}  // namespace

json tuner_section(const std::string& path, const std::string& key) {
  StoreContents s = read_store(path);
  if (s.tuner.contains(key)) return s.tuner[key];
  const std::string legacy = env::cache_file("DISTMUON_TUNE_CACHE", "tune.json");
  if (legacy == path) return json::object();
  json old = legacy_tuner_entry(legacy, key);
  if (old.empty()) return old;
  DM_LOG(kWarn, "measurement store ", path, ": took the tuner's choices for '", key,
         "' from the old tune cache ", legacy, " (", old.value("algo", json::array()).size(),
         " algorithm and ", old.value("sym", json::array()).size(), " kernel choices)");
  s.tuner[key] = old;
  write_store(path, s);
  return old;
}

}  // namespace distmuon::measure
