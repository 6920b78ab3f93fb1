// Helpers of the tools' tests: a tool's command line parsed in-process, as its main() does.
#pragma once

#include <string>
#include <vector>

#include "subprocess.h"

namespace distmuon::test {

// What cli::run gave for an argument list: the exit code, stderr, and whether the tool's body
// (the work after parsing) was reached.
struct Parsed {
  int code = -1;
  std::string err;
  bool ran = false;
};
// `tool` is "distmuon-bench" or "distmuon-plan"; args exclude the program name. The body is
// replaced by a stub that only records that it was reached.
Parsed parse_tool(const std::string& tool, const std::vector<std::string>& args);

}  // namespace distmuon::test
