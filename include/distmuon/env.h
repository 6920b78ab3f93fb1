// The one registry of DISTMUON_* environment knobs (in the manner of NCCL_PARAM): each knob is
// declared once in src/common/env.cc with its default and a line of documentation. Reading a
// knob that is not declared is a programming error and throws.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace distmuon::env {

struct Knob {
  const char* name;
  const char* default_value;
  const char* doc;
};

const std::vector<Knob>& knobs();
std::string get(const char* name);  // the environment's value, else the default
int64_t get_int(const char* name);
double get_double(const char* name);
bool get_bool(const char* name);  // 1/true/yes/on
// Where a measurement cache (the autotuner's, the cost profile's) keeps its file: the knob's
// value, else $XDG_CACHE_HOME/distmuon/<file_name>, else $HOME/.cache/distmuon/<file_name>,
// else ./.cache/distmuon/<file_name>.
std::string cache_file(const char* knob, const char* file_name);
// DISTMUON_* variables set in the environment that no knob declares (typos), for a warning.
std::vector<std::string> unknown_variables();

}  // namespace distmuon::env
