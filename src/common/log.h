// Minimal leveled logging to stderr, controlled by DISTMUON_LOG_LEVEL.
#pragma once

#include <iostream>

#include "distmuon/error.h"

namespace distmuon::log {

enum Level : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
Level level();  // read once from DISTMUON_LOG_LEVEL
void write(Level lvl, const std::string& msg);

}  // namespace distmuon::log

#define DM_LOG(lvl, ...)                                                               \
  do {                                                                                 \
    if (::distmuon::log::lvl <= ::distmuon::log::level())                              \
      ::distmuon::log::write(::distmuon::log::lvl, ::distmuon::detail::concat(__VA_ARGS__)); \
  } while (0)
