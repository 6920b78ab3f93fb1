// The command lines of distmuon-bench and distmuon-plan: every bad argument is refused before any
// work with one clear error, unknown options suggest the nearest one, -h works, and the real
// executables exit with code 2 (command line) or 1 (run) and never by a signal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench_model.h"
#include "bench_options.h"
#include "common/half.h"
#include "distmuon/error.h"
#include "subprocess.h"
#include "tool_runner.h"

namespace distmuon::test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One refused command line: exit code 2, the body never reached, the message once.
void expect_refused(const std::string& tool, const std::vector<std::string>& args,
                    const std::string& message) {
  const Parsed p = parse_tool(tool, args);
  EXPECT_EQ(p.code, 2) << p.err;
  EXPECT_FALSE(p.ran);
  EXPECT_THAT(p.err, HasSubstr(message));
  EXPECT_EQ(p.err.rfind(tool + ": error: ", 0), 0u) << p.err;  // one prefix, at the start
  EXPECT_THAT(p.err, Not(HasSubstr("distmuon: "))) << p.err;
}

// The synthetic model's values: every parameter dtype gets Gaussian values of the asked scale
// (distmuon-bench's distributed modes once filled f64 tensors with zeros), across several of
// the filler's 2^20-value chunks.
TEST(Tools, GaussianFillerFillsEveryDtype) {
  auto be = make_backend("cpu");
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t n = (int64_t{5} << 19) + 7;  // 2.5 chunks
    const double scale = 0.02;
    Buffer buf = be->alloc(static_cast<size_t>(n) * dtype_size(t));
    bench::GaussianFiller filler(*be, t, 11);
    filler.fill(buf.data(), n, scale);
    std::vector<uint8_t> host(static_cast<size_t>(n) * dtype_size(t));
    be->copy_to_host(host.data(), buf.data(), host.size());
    double sum = 0, sum_sq = 0;
    int64_t zeros = 0;
    for (int64_t i = 0; i < n; ++i) {
      double v = 0;
      switch (t) {
        case DType::kF32:
          v = reinterpret_cast<const float*>(host.data())[i];
          break;
        case DType::kF64:
          v = reinterpret_cast<const double*>(host.data())[i];
          break;
        case DType::kBF16:
          v = bf16_to_float(reinterpret_cast<const uint16_t*>(host.data())[i]);
          break;
        case DType::kF16:
          v = f16_to_float(reinterpret_cast<const uint16_t*>(host.data())[i]);
          break;
      }
      ASSERT_TRUE(std::isfinite(v)) << "element " << i;
      sum += v;
      sum_sq += v * v;
      zeros += v == 0;
    }
    const double mean = sum / n, std = std::sqrt(sum_sq / n - mean * mean);
    EXPECT_LT(std::abs(mean), 0.01 * scale);
    EXPECT_NEAR(std, scale, 0.02 * scale);
    EXPECT_LT(zeros, n / 1000);
  }
}

TEST(Tools, NumbersOutOfRangeAreRefused) {
  expect_refused("distmuon-bench", {"--layers", "-2"},
                 "--layers: must be in [0, 1000000] (got -2)");
  expect_refused("distmuon-bench", {"--steps", "0"}, "--steps: must be in [1, 1000000] (got 0)");
  // Refused, not clamped: 2^63 - 1 steps wrapped warm-up + steps negative and timed nothing;
  // --cache inf failed only after the fresh runs; a world of 10^8 ran the planner out of memory.
  expect_refused("distmuon-bench", {"--steps", "9223372036854775807"},
                 "--steps: must be in [1, 1000000]");
  expect_refused("distmuon-bench", {"--warmup", "1e30"}, "--warmup: must be in [0, 1000000]");
  expect_refused("distmuon-bench", {"--cache", "2,inf"}, "--cache: must be finite (got inf)");
  expect_refused("distmuon-bench", {"--drift", "1e300"}, "--drift: must be in [0, 10]");
  expect_refused("distmuon-plan", {"--world-size", "100000000"},
                 "--world-size: must be in [1, 1048576]");
  expect_refused("distmuon-bench", {"--steps", "1.5"}, "--steps");
  expect_refused("distmuon-bench", {"--bucket-mb=0"},
                 "--bucket-mb: must be in (0, 1048576] (got 0)");
  expect_refused("distmuon-plan", {"--time-limit", "-1"}, "--time-limit: must be > 0 (got -1)");
  expect_refused("distmuon-plan", {"--world-size", "99999999999"}, "--world-size");
  expect_refused("distmuon-plan", {"--gap", "nan"}, "--gap");
}

TEST(Tools, ChoicesAndNamesAreCheckedBeforeTheRun) {
  expect_refused("distmuon-bench", {"--cache", "0.1,abc"}, "--cache: 'abc' is not a number");
  expect_refused("distmuon-bench", {"--algo", "ns5,newton"}, "unknown algorithm 'newton'");
  expect_refused("distmuon-bench", {"--algo", "ns99999999999"}, "bad step count");
  expect_refused("distmuon-bench", {"--mode", "gather,ring"}, "--mode");
  expect_refused("distmuon-bench", {"--dtype", "int8"}, "--dtype");
  expect_refused("distmuon-bench", {"--workload", "no-such-model"}, "no workload 'no-such-model'");
  expect_refused("distmuon-plan", {"--solver", "milp,greedy"}, "--solver");
  expect_refused("distmuon-plan", {"--formulation", "best"}, "--formulation");
  // An option of a mode not chosen would do nothing: refused.
  expect_refused("distmuon-plan", {"--profile-ks", "2"}, "--profile-ks applies to --measure");
  expect_refused("distmuon-plan", {"--intra-gbs", "5"}, "--intra-gbs applies to --simulate");
  expect_refused("distmuon-plan", {"--intra-alltoall-gbs", "5"},
                 "--intra-alltoall-gbs applies to --simulate");
  expect_refused("distmuon-plan", {"--adamw-tbs", "1"}, "--adamw-tbs applies to --simulate");
  expect_refused("distmuon-plan", {"--grouped-hop-share", "0.5"},
                 "--grouped-hop-share applies to --simulate");
  expect_refused("distmuon-plan", {"--measure", "--tflops", "500"}, "--tflops applies to analytic");
  expect_refused("distmuon-plan", {"--simulate", "--sim-plan-analytic"},
                 "--sim-plan-analytic places the owners on analytic costs");
  // An unwritable --json path used to fail only after the whole benchmark had run.
  expect_refused("distmuon-bench", {"--json", "/no/such/folder/out.json"},
                 "folder '/no/such/folder' does not exist");
  expect_refused("distmuon-plan", {"--json", "/etc/hostname/out.json"},
                 "'/etc/hostname' is not a folder");
  expect_refused("distmuon-bench", {"--json", ""}, "--json: an empty path is not a file");
  expect_refused("distmuon-bench", {"--seed", "-1"}, "--seed: must be in [0, ");
  expect_refused("distmuon-bench", {"--workload", "/tmp"}, "workload '/tmp' is a folder");
  // --measure's cost cache, checked before measuring (it used to fail after, naming a temporary
  // file); folders it would create are fine.
  expect_refused("distmuon-plan", {"--measure", "--cache", "/etc/hostname/x/costs.json"},
                 "the cost cache of --measure: '/etc/hostname' is not a folder");
  EXPECT_TRUE(
      parse_tool("distmuon-plan", {"--measure", "--cache", "/tmp/distmuon-new/a/costs.json"}).ran);
}

TEST(Tools, OptionsThatConflictAreRefused) {
  expect_refused("distmuon-bench", {"--mode", "single,gather"}, "cannot be combined");
  expect_refused("distmuon-bench", {"--drift", "0.1", "--dtype", "bf16"}, "--drift needs f32");
  expect_refused("distmuon-bench", {"--ranks-per-gpu", "2"},
                 "--ranks-per-gpu applies to distributed runs with --backend cuda");
  expect_refused("distmuon-bench", {"--ranks-per-gpu", "0"}, "--ranks-per-gpu: must be in [1, ");
  // Options of a part of distmuon-bench that does not run: refused, not ignored.
  expect_refused("distmuon-bench", {"--planner", "lpt"},
                 "--planner applies to the distributed modes");
  expect_refused("distmuon-bench", {"--bucket-mb", "8"},
                 "--bucket-mb applies to the distributed modes");
  expect_refused("distmuon-bench", {"--mode", "gather", "--cache", "2"},
                 "--cache applies to --mode single");
  expect_refused("distmuon-bench", {"--mode", "sharded", "--drift", "0.1"},
                 "--drift applies to --mode single");
  expect_refused("distmuon-bench", {"--cache-probes", "4"}, "--cache-probes needs --cache");
  expect_refused("distmuon-bench", {"--cache-shadow"}, "--cache-shadow needs --cache");
  // The calibration and the profiled steps: distributed ranks on CUDA only.
  expect_refused("distmuon-bench", {"--mode", "gather", "--calibrate"},
                 "--calibrate applies to the distributed modes on CUDA");
  expect_refused("distmuon-bench", {"--profile"},
                 "--profile applies to the distributed modes on CUDA");
  expect_refused("distmuon-plan", {"--costs-scale", "0"}, "--costs-scale: must be");
  expect_refused("distmuon-plan", {"--measure", "--analytic"}, "choose one of");
  expect_refused("distmuon-plan", {"--replicate", "3"}, "does not divide the world size 8");
}

TEST(Tools, UnknownOptionsSuggestTheNearestOne) {
  expect_refused("distmuon-bench", {"--layer", "3"},
                 "unknown argument '--layer' (did you mean --layers?)");
  expect_refused("distmuon-plan", {"--timelimit=3"}, "(did you mean --time-limit?)");
  expect_refused("distmuon-bench", {"positional"}, "unknown argument 'positional'");
  const Parsed far = parse_tool("distmuon-bench", {"--zzzzzzzz"});
  EXPECT_EQ(far.code, 2);
  EXPECT_THAT(far.err, Not(HasSubstr("did you mean")));
}

TEST(Tools, ValidCommandLinesReachTheTool) {
  EXPECT_TRUE(parse_tool("distmuon-bench", {}).ran);
  const Parsed p =
      parse_tool("distmuon-bench", {"--layers=2", "--algo", "ns5,gram-ns:polar-express", "--cache",
                                    "0.05,0.1", "--json", "out.json"});
  EXPECT_EQ(p.code, 0) << p.err;
  EXPECT_TRUE(p.ran);
  EXPECT_TRUE(parse_tool("distmuon-plan", {"--solver", "lpt", "--simulate", "-h"}).code == 0);
  EXPECT_TRUE(
      parse_tool("distmuon-bench", {"--cache", "2", "--cache-probes", "4", "--steps", "1000000"})
          .ran);
  EXPECT_TRUE(
      parse_tool("distmuon-bench", {"--mode", "gather", "--planner", "lpt", "--bucket-mb", "8"})
          .ran);
  EXPECT_TRUE(parse_tool("distmuon-bench", {"--mode", "sharded,adamw"}).ran);
  EXPECT_TRUE(parse_tool("distmuon-bench", {"--mode", "gather,adamw", "--backend", "cuda",
                                            "--ranks-per-gpu", "4", "--calibrate", "--profile"})
                  .ran);
  EXPECT_TRUE(parse_tool("distmuon-plan", {"--costs-scale", "3.5", "--simulate"}).ran);
}

TEST(Tools, HelpShowsTypesRangesAndChoices) {
  for (const char* flag : {"-h", "--help"}) {
    CLI::App app("test", "distmuon-bench");
    bench::BenchOptions o;
    bench::add_bench_options(app, o);
    const std::string help = app.help();
    EXPECT_THAT(help, HasSubstr("-h,--help"));
    EXPECT_THAT(help, HasSubstr("--layers INT:[0, 1000000]=0"));
    EXPECT_THAT(help, HasSubstr("{cpu, cuda, cuda:N}"));
    EXPECT_THAT(help, HasSubstr("--ranks-per-gpu INT:[1, 1048576]=1"));
    EXPECT_THAT(help, HasSubstr("local_rank / K"));
    const Parsed p = parse_tool("distmuon-bench", {flag});
    EXPECT_EQ(p.code, 0);
    EXPECT_FALSE(p.ran);
  }
}

TEST(Tools, RanksPerGpuMapsLocalRanksToDevices) {
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5", 1);
  EXPECT_EQ(bench::rank_device(13, 1, 8), "cuda:5");
  EXPECT_EQ(bench::rank_device(13, 2, 8), "cuda:2");
  EXPECT_EQ(bench::rank_device(13, 4, 2), "cuda:1");
  try {
    bench::rank_device(13, 2, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("would use CUDA device 2 with --ranks-per-gpu 2, but 2 "
                                       "devices are visible; run at most 4 ranks per node or "
                                       "raise --ranks-per-gpu"));
  }
  try {
    bench::rank_device(13, 2, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("rank 13: no CUDA device is visible"));
  }
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
}

// The executables themselves: exit codes, one error line, no signal, nothing run before a
// command line is refused.
TEST(Tools, ExecutablesExitWithCodesNotSignals) {
  const char* json = "/tmp/distmuon-test-tools.json";
  std::remove(json);
  Exit e = run_process(DISTMUON_BENCH_EXE,
                       {"--layers", "1", "--steps", "1", "--cache", "abc", "--json", json});
  EXPECT_TRUE(e.exited);
  EXPECT_EQ(e.code, 2);
  EXPECT_EQ(e.err,
            "distmuon-bench: error: --cache: 'abc' is not a number; see distmuon-bench "
            "--help\n");
  EXPECT_FALSE(std::ifstream(json).good());

  e = run_process(DISTMUON_PLAN_EXE, {"--version"});
  EXPECT_EQ(e.code, 0);
  EXPECT_EQ(e.out, std::string("distmuon-plan ") + DISTMUON_VERSION + "\n");

  e = run_process(DISTMUON_PLAN_EXE, {"-h"});
  EXPECT_EQ(e.code, 0);
  EXPECT_THAT(e.out, HasSubstr("--time-limit FLOAT:> 0=4"));

  // A workload whose sizes overflow: refused at parse time (it used to print a negative
  // parameter count and die of SIGSEGV, or wrap to 0 elements and "succeed").
  const char* big = "/tmp/distmuon-test-big.json";
  for (const char* shape : {"[3037000500, 3037000500]", "[4294967296, 4294967296]"}) {
    std::ofstream(big) << R"({"name": "big", "muon": [{"name": "w", "shape": )" << shape << "}]}";
    for (const char* exe : {DISTMUON_BENCH_EXE, DISTMUON_PLAN_EXE}) {
      e = run_process(exe, {"--workload", big});
      EXPECT_TRUE(e.exited) << exe << " signal " << e.signal;
      EXPECT_EQ(e.code, 2) << e.err;
      EXPECT_THAT(e.err, HasSubstr("has more elements than a 64-bit size holds"));
    }
  }
  std::remove(big);

  // A convolution kernel (4-D Muon entry) is one (o, i*kh*kw) matrix to the planner, as to the
  // engine and distmuon-bench (distmuon-plan used to refuse what the workload check accepts).
  const char* conv = "/tmp/distmuon-test-conv.json";
  std::ofstream(conv)
      << R"({"name": "conv", "muon": [{"name": "c", "shape": [64, 32, 3, 3], "count": 4}]})";
  e = run_process(DISTMUON_PLAN_EXE, {"--workload", conv, "--world-size", "2", "--solver", "lpt"});
  EXPECT_EQ(e.code, 0) << e.err;
  EXPECT_THAT(e.out, HasSubstr("4 Muon matrices"));
  std::remove(conv);
}

#ifdef MPIEXEC_EXE
// The distributed comparison on 2 MPI ranks with every mode and the AdamW baseline: it runs, ends
// with the same weights on both ranks (checked by the tool itself, which fails otherwise) and
// records every mode with its ratios against gather.
TEST(Tools, DistributedComparisonRunsEveryMode) {
  const char* json = "/tmp/distmuon-test-modes.json";
  std::remove(json);
  const Exit e = run_process(
      MPIEXEC_EXE,
      {"--allow-run-as-root",
       "--oversubscribe",
       "--bind-to",
       "none",
       "-np",
       "2",
       DISTMUON_BENCH_EXE,
       "--workload",
       "gpt2-small",
       "--layers",
       "1",
       "--steps",
       "1",
       "--warmup",
       "0",
       "--no-adamw",
       "--mode",
       "gather,sharded,dedicated,replicated,adamw",
       "--progress-s",
       "0.001",
       "--json",
       json},
      {"OMP_NUM_THREADS=1", "DISTMUON_NUM_THREADS=1", "DISTMUON_COMM_TIMEOUT_S=60"}, 300);
  ASSERT_EQ(e.code, 0) << e.err;
  // A step running longer than --progress-s says so (rank 0).
  EXPECT_NE(e.err.find("step 1 of 1 (every mode): still running after"), std::string::npos)
      << e.err;
  std::ifstream f(json);
  ASSERT_TRUE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  std::vector<std::string> modes;
  for (const auto& r : j["runs"]) {
    modes.push_back(r["mode"]);
    EXPECT_GT(r["step_ms"]["median"].get<double>(), 0);
    EXPECT_GT(r["speedup_vs_gather"].get<double>(), 0);
    // The host's share of the engine's time: on the CPU backend step() computes on the host, so
    // it is the engine's time itself (but never more).
    EXPECT_GT(r["host_ms"]["median"].get<double>(), 0);
    EXPECT_LE(r["host_ms"]["median"].get<double>(), r["engine_ms"]["median"].get<double>());
  }
  EXPECT_EQ(modes,
            (std::vector<std::string>{"gather", "sharded", "dedicated", "replicated", "adamw"}));
  // The AdamW baseline orthogonalizes nothing; the owner modes half of what gather does.
  EXPECT_EQ(j["runs"][4]["ortho_flops_max_rank"].get<double>(), 0);
  EXPECT_LT(j["runs"][1]["ortho_flops_max_rank"].get<double>(),
            0.75 * j["runs"][0]["ortho_flops_max_rank"].get<double>());
  std::remove(json);
}
#endif

}  // namespace
}  // namespace distmuon::test
