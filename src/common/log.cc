#include "common/log.h"

#include <mutex>

#include "distmuon/env.h"

namespace distmuon::log {

Level level() {
  static const Level lvl = [] {
    std::string v = env::get("DISTMUON_LOG_LEVEL");
    if (v == "error") return kError;
    if (v == "info") return kInfo;
    if (v == "debug") return kDebug;
    return kWarn;
  }();
  return lvl;
}

void write(Level lvl, const std::string& msg) {
  static std::mutex mu;
  static const char* names[] = {"error", "warn", "info", "debug"};
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "[distmuon " << names[lvl] << "] " << msg << std::endl;
}

}  // namespace distmuon::log
