#include "tool_runner.h"

#include <gtest/gtest.h>

#include "bench_options.h"
#include "cli.h"
#include "plan_options.h"

namespace distmuon::test {

Parsed parse_tool(const std::string& tool, const std::vector<std::string>& args) {
  CLI::App app("test", tool);
  bench::BenchOptions bo;
  plan_tool::PlanArgs po;
  if (tool == "distmuon-bench")
    bench::add_bench_options(app, bo);
  else
    plan_tool::add_plan_options(app, po);
  std::vector<std::string> argv_s = {tool};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv = c_strings(argv_s);
  Parsed p;
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  p.code = cli::run(app, static_cast<int>(argv_s.size()), argv.data(), [&] {
    p.ran = true;
    return 0;
  });
  testing::internal::GetCapturedStdout();
  p.err = testing::internal::GetCapturedStderr();
  return p;
}

}  // namespace distmuon::test
