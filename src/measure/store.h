// The measurement store: one JSON file per machine holding everything distmuon measured there,
// so that a measurement is taken once and every reader (the planner's costs, the algorithm
// tuner, the backend's kernel choices) finds it in the same place.
//
//   {"format": "distmuon-cost-table", "format_version": 1,
//    "tables": [...],                        // the planner's measured cost tables (cost_table.h)
//    "tuner": {"<fingerprint>|tuner 2": {    // Backend::tuning_fingerprint() + the tuner version
//        "sym": [...],                       // the backend's kernel choices (opaque here)
//        "algo": [...]}}}                    // algorithm choices (tuner.h)
//
// It is a cost file: `--costs` and DISTMUON_PLAN_COSTS read it as one. Path: DISTMUON_COST_CACHE,
// else $XDG_CACHE_HOME/distmuon/costs.json, else ~/.cache/distmuon/costs.json.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "distmuon/cost_table.h"

namespace distmuon::measure {

std::string store_path();

struct StoreContents {
  std::vector<CostTable> tables;
  nlohmann::json tuner = nlohmann::json::object();
};

// A missing file is an empty store. A file that is not a store (not JSON, another format or a
// newer version, a mistyped field) throws naming the path and how to recover: it is never
// overwritten, so nothing measured is lost to a bad read.
StoreContents read_store(const std::string& path);
// Written atomically (common/atomic_write.h).
void write_store(const std::string& path, const StoreContents& contents);
// Read, change, write back: the one way measurements enter the store, so that a writer of one
// section keeps the others.
void update_store(const std::string& path, const std::function<void(StoreContents&)>& change);

// The tuner's section for `key` ("<fingerprint>|tuner N"), an empty object when absent. When
// the store lacks it, the autotuner cache of earlier versions (DISTMUON_TUNE_CACHE, else
// tune.json beside the default store) is read once: its entries of `key` are copied into the
// store with a log line. An unreadable old cache is ignored with a log line.
nlohmann::json tuner_section(const std::string& path, const std::string& key);

}  // namespace distmuon::measure
