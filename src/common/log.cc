#include "common/log.h"

#include <chrono>
#include <iomanip>
#include <mutex>

#include "distmuon/env.h"

namespace distmuon::log {

Level level() {
  static const Level lvl = [] {
    std::string v = env::get("DISTMUON_LOG_LEVEL");
    if (v == "error") return kError;
    if (v == "info") return kInfo;
    if (v == "debug") return kDebug;
    // A typo is said once rather than silently taken as the default (the logger cannot throw).
    if (v != "warn")
      std::cerr << "[distmuon warn] DISTMUON_LOG_LEVEL='" << v
                << "' is not one of error, warn, info, debug; using warn" << std::endl;
    return kWarn;
  }();
  return lvl;
}

namespace {
// Debug lines carry the seconds since the library was loaded: a timeline across ranks.
const auto t_load = std::chrono::steady_clock::now();
}  // namespace

void write(Level lvl, const std::string& msg) {
  static std::mutex mu;
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "[distmuon " << names[lvl];
  if (lvl == kDebug)
    std::cerr << " " << std::fixed << std::setprecision(3)
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  std::cerr << "] " << msg << std::endl;
}

}  // namespace distmuon::log
