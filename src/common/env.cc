#include "distmuon/env.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "distmuon/error.h"

extern char** environ;

namespace distmuon::env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {"DISTMUON_LOG_LEVEL", "warn",
       "error | warn | info | debug (debug adds a timeline: each collective issued, each host wait "
       "for the device, in seconds since start)"},
      {"DISTMUON_NUM_THREADS", "0", "BLAS threads of the CPU backend (0: library default)"},
      {"DISTMUON_COMM_TIMEOUT_S", "300",
       "seconds a collective may take from its issue before it fails with a timeout naming the operation"},
      {"DISTMUON_NCCL_BLOCKING", "0",
       "1: blocking NCCL communicators, whose launches run on the caller's thread instead of a "
       "thread NCCL starts per launch (about 0.1 ms of host time each, measured), but whose "
       "initialisation, split, teardown and first use of each path are no longer bounded by "
       "DISTMUON_COMM_TIMEOUT_S: a member that never arrives hangs them (for measuring)"},
      {"DISTMUON_NCCL_CTA_POLICY", "",
       "default | efficiency | zero: the SMs the engine's NCCL kernels take (NCCL >= 2.28; unset: "
       "NCCL's choice). zero: the sharded mode's all-to-alls run on symmetric windows, which NCCL "
       "moves with the copy engines, taking none of the SMs the owners compute on"},
      {"DISTMUON_UNIFORM_ALL_TO_ALL", "",
       "1: the sharded mode's all-to-alls send equal blocks (each pair's the largest of its "
       "bucket) on any communicator; 0: packed blocks; unset: equal blocks where the communicator "
       "gives windows (DISTMUON_NCCL_CTA_POLICY=zero)"},
      {"DISTMUON_DEDICATED_EARLY_BROADCAST", "0",
       "1: the dedicated mode (flat) broadcasts a bucket's weights right after its owners' compute "
       "instead of one slot later; the waiting NCCL kernels then sit on the peers' SMs beside their "
       "own owner batches (for measuring one against the other)"},
      {"DISTMUON_MPI_PROGRESS_THREAD", "1",
       "drive non-blocking MPI operations from a background thread so they overlap compute"},
      {"DISTMUON_MPI_PROGRESS_US", "200", "microseconds between two sweeps of the MPI progress thread"},
      {"DISTMUON_COST_CACHE", "",
       "the measurement store: the planner's costs (distmuon-plan --measure) and the tuner's "
       "algorithm and kernel choices (default: $XDG_CACHE_HOME or ~/.cache, distmuon/costs.json)"},
      {"DISTMUON_TUNE_CACHE", "",
       "the autotuner cache of earlier builds, taken over into the measurement store once "
       "(default: $XDG_CACHE_HOME or ~/.cache, distmuon/tune.json)"},
      {"DISTMUON_PLAN_COSTS", "auto",
       "costs of the engine's start-up plan when DistOptions::plan_costs is empty: auto "
       "(measured where the store holds the shapes, analytic elsewhere) | analytic | <cost file>; "
       "read on rank 0 only"},
      {"DISTMUON_PLAN_MEASURE", "auto",
       "auto | on | off: with DISTMUON_PLAN_COSTS=auto, rank 0 times the shape classes its store "
       "lacks at start-up (batches of 1 and 4, three runs each) and keeps them in the store for "
       "the next runs (auto: on CUDA, unless ranks take turns on one GPU: several ranks per GPU "
       "without MPS)"},
      {"DISTMUON_GRAPHS", "",
       "0 | 1: capture the single-process step into a graph and replay it while its buffers stay "
       "the same (CUDA; unset: EngineOptions::graphs, on by default)"},
      {"DISTMUON_AUTOTUNE", "",
       "off | cached | on: how `auto` picks per-shape algorithms on CUDA (unset: EngineOptions)"},
      {"DISTMUON_AUTOTUNE_RESTART_FREE", "",
       "1: a tuned `auto` may pick Gram NS without restarts (unset: EngineOptions)"},
      {"DISTMUON_WORKLOAD_DIR", "", "extra directory searched for workload JSON files"},
      {"DISTMUON_SYM_EPILOGUE_MIRROR", "1",
       "0: the CUDA symmetric kernels leave the whole upper triangle to a separate mirror pass "
       "instead of storing it transposed in their epilogue (for measuring one against the other)"},
      {"DISTMUON_GROUPED_PRODUCTS", "auto",
       "auto | off | all: which shape classes run their products as grouped launches shared with "
       "the other classes that iterate alike (auto: where the backend has a grouped kernel and "
       "the class's products are too small to fill the device; all: every class, for tests)"},
      {"DISTMUON_GRAPH_CONDITIONALS", "1",
       "0: a captured CacheMuon call records its refresh path as plain kernels that find no work "
       "when no matrix refreshes, instead of a conditional graph node the device skips"},
  };
  return table;
}

namespace {
const Knob& find(const char* name) {
  for (const Knob& k : knobs())
    if (std::strcmp(k.name, name) == 0) return k;
  DM_FAIL("environment knob ", name, " is not declared in src/common/env.cc");
}
}  // namespace

std::string get(const char* name) {
  const Knob& k = find(name);
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string(k.default_value);
}

std::string cache_file(const char* knob, const char* file_name) {
  if (std::string path = get(knob); !path.empty()) return path;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/distmuon/" + file_name;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/distmuon/" + file_name;
}

int64_t get_int(const char* name) {
  std::string v = get(name);
  try {
    size_t used = 0;
    int64_t r = std::stoll(v, &used);
    DM_CHECK(used == v.size(), "trailing characters");
    return r;
  } catch (const std::exception&) {
    DM_FAIL(name, "='", v, "' is not an integer");
  }
}

double get_double(const char* name) {
  std::string v = get(name);
  try {
    size_t used = 0;
    double r = std::stod(v, &used);
    DM_CHECK(used == v.size(), "trailing characters");
    return r;
  } catch (const std::exception&) {
    DM_FAIL(name, "='", v, "' is not a number");
  }
}

bool get_bool(const char* name) {
  std::string v = get(name);
  std::transform(v.begin(), v.end(), v.begin(), ::tolower);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  DM_FAIL(name, "='", v, "' is not a boolean (use 0 or 1)");
}

std::vector<std::string> unknown_variables() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    if (kv.rfind("DISTMUON_", 0) != 0) continue;
    std::string key = kv.substr(0, kv.find('='));
    bool known = std::any_of(knobs().begin(), knobs().end(),
                             [&](const Knob& k) { return key == k.name; });
    if (!known) out.push_back(key);
  }
  return out;
}

}  // namespace distmuon::env
