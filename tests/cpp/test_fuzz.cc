// Fuzz tests of the C++ inputs: mutated workload files and mutated argument lists of the tools.
// Every case must end with a result or a clear error (distmuon::Error in-process; exit code 1 or
// 2 from an executable), never another exception, a crash or a signal. The mutations are random
// but seeded, so a failure names the case and reproduces. Under `make sanitize` the same cases
// run with AddressSanitizer and UndefinedBehaviorSanitizer.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "distmuon/cost_table.h"
#include "distmuon/error.h"
#include "distmuon/plan.h"
#include "distmuon/workload.h"
#include "tool_runner.h"

namespace distmuon::test {
namespace {

using json = nlohmann::json;

constexpr int kCases = 1000;

std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The seeds: every built-in workload file and a small one with AdamW entries.
// The built-in workloads without their stated totals (muon_params, adamw_params): a file that
// states them must match its entries, so with them nearly every mutation of a size would be
// refused for the totals alone and the sizes' own checks would go unexercised.
std::vector<std::string> workload_seeds() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(DISTMUON_WORKLOAD_DIR)) {
    if (e.path().extension() != ".json") continue;
    json j = json::parse(read_text(e.path()));
    j.erase("muon_params");
    j.erase("adamw_params");
    out.push_back(j.dump());
  }
  out.push_back(R"({"name": "tiny", "layers": 2, "muon": [{"name": "w", "shape": [8, 16],
    "count": 2}, {"name": "e", "shape": [2, 4, 8]}], "adamw": [{"name": "b", "shape": [16]}]})");
  return out;
}

// Values that break sizes, types and ranges.
json odd_value(std::mt19937_64& rng) {
  static const std::vector<json> pool = {-1,
                                         0,
                                         1,
                                         3,
                                         int64_t{1} << 31,
                                         int64_t{1} << 32,
                                         int64_t{1} << 62,
                                         INT64_MAX,
                                         std::numeric_limits<uint64_t>::max(),
                                         3037000500,
                                         1e30,
                                         -1e30,
                                         3.5,
                                         "text",
                                         nullptr,
                                         true,
                                         json::array(),
                                         json::object(),
                                         json::array({1, 2}),
                                         json::array({0, 4}),
                                         json::array({3037000500, 3037000500}),
                                         json::array({4294967296, 4294967296}),
                                         json::array({-4, 8}),
                                         json::array({json::array({1})}),
                                         json::array({1, 2, 3, 4, 5})};
  return pool[rng() % pool.size()];
}

// Every value of a JSON document, as pointers, for picking one to mutate.
void values_of(json& j, std::vector<json*>& out) {
  out.push_back(&j);
  if (j.is_object() || j.is_array())
    for (auto& v : j) values_of(v, out);
}

std::string mutate_workload(const std::string& seed, std::mt19937_64& rng) {
  const int kind = static_cast<int>(rng() % 6);
  if (kind == 0) return seed.substr(0, rng() % (seed.size() + 1));  // a truncated file
  if (kind == 1) {                                                  // a corrupted byte
    std::string s = seed;
    s[rng() % s.size()] = static_cast<char>(rng() % 256);
    return s;
  }
  json j = json::parse(seed);
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int k = 0; k < edits; ++k) {
    std::vector<json*> vals;
    values_of(j, vals);
    json* v = vals[rng() % vals.size()];
    if (kind == 2 && v->is_object() && !v->empty()) {  // a missing key
      auto it = v->begin();
      std::advance(it, rng() % v->size());
      v->erase(it.key());
    } else if (kind == 3 && v->is_array() && !v->empty()) {  // a duplicated or dropped element
      if (rng() % 2)
        v->push_back((*v)[rng() % v->size()]);
      else
        v->erase(v->begin() + static_cast<std::ptrdiff_t>(rng() % v->size()));
    } else {
      *v = odd_value(rng);  // a wrong type, a huge or non-positive size
    }
  }
  return j.dump();
}

// What a parsed workload must survive: its sizes, fewer layers and a plan.
void use_workload(const Workload& w) {
  w.muon_params();
  w.adamw_params();
  Workload one = w.first_layers(1);
  const std::vector<PlanMatrix> mats = plan_matrices(one, 4);
  if (mats.size() > 256) return;  // the plan's cost grows with the matrices, not their sizes
  Topology topo;
  topo.world_size = 4;
  topo.gpus_per_node = 4;
  OrthoConfig cfg;
  const CostTable costs = analytic_cost_table(shape_counts(mats), cfg, AnalyticRates{});
  make_plan("lpt", mats, topo, costs);
}

TEST(Fuzz, MutatedWorkloadFilesGiveAResultOrAClearError) {
  std::mt19937_64 rng(20261216);
  const std::vector<std::string> seeds = workload_seeds();
  int parsed = 0, refused = 0;
  for (int c = 0; c < kCases; ++c) {
    const std::string text = mutate_workload(seeds[c % seeds.size()], rng);
    try {
      use_workload(parse_workload(text, "case " + std::to_string(c)));
      ++parsed;
    } catch (const Error& e) {
      ++refused;
      EXPECT_FALSE(e.message().empty());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << c << ": " << typeid(e).name() << ": " << e.what() << "\n" << text;
    }
  }
  EXPECT_EQ(parsed + refused, kCases);
  EXPECT_GT(parsed, 50);  // the mutations are not all fatal
  EXPECT_GT(refused, 300);
  std::printf("[fuzz] %d workload files: %d used, %d refused\n", kCases, parsed, refused);
}

// Tokens an argument list is mutated with.
std::string odd_token(std::mt19937_64& rng) {
  static const std::vector<std::string> pool = {"-1",
                                                "0",
                                                "1",
                                                "2",
                                                "1.5",
                                                "1e999",
                                                "-1e999",
                                                "nan",
                                                "inf",
                                                "",
                                                "-",
                                                "--",
                                                "---",
                                                "9223372036854775808",
                                                "99999999999999999999",
                                                "0x10",
                                                "abc",
                                                "=",
                                                "--=",
                                                "-h3",
                                                "ns5,,auto",
                                                "gram-ns:you:999999",
                                                "cuda:",
                                                "cuda:99999999",
                                                "cpu,cuda",
                                                "\xff\xfe",
                                                "--layer",
                                                "--step",
                                                "--cache=0.1,",
                                                "--json=",
                                                "--json=/",
                                                "--mode=single,gather",
                                                "--workload=/dev/null",
                                                "--no-adamw=maybe",
                                                "--solver=",
                                                "--world-size=0"};
  return pool[rng() % pool.size()];
}

std::vector<std::string> mutate_args(std::vector<std::string> args,
                                     const std::vector<std::string>& options,
                                     std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int k = 0; k < edits; ++k) {
    const size_t n = args.size();
    switch (rng() % 5) {
      case 0:  // a known option with an odd value
        args.push_back(options[rng() % options.size()]);
        args.push_back(odd_token(rng));
        break;
      case 1:  // a token replaced
        if (n) args[rng() % n] = odd_token(rng);
        break;
      case 2:  // a token dropped (an option loses its value)
        if (n) args.erase(args.begin() + static_cast<std::ptrdiff_t>(rng() % n));
        break;
      case 3:  // a token repeated
        if (n) args.push_back(args[rng() % n]);
        break;
      default:  // a known option without its value, or with "=" and the odd token
        args.push_back(rng() % 2 ? options[rng() % options.size()]
                                 : options[rng() % options.size()] + "=" + odd_token(rng));
    }
  }
  return args;
}

void fuzz_arguments(const std::string& tool, const std::vector<std::string>& base,
                    const std::vector<std::string>& options, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int accepted = 0, refused = 0;
  for (int c = 0; c < kCases; ++c) {
    const std::vector<std::string> args = mutate_args(base, options, rng);
    std::string line;
    for (const auto& a : args) line += " '" + a + "'";
    const Parsed p = parse_tool(tool, args);
    if (p.code == 0) {
      ++accepted;
      continue;
    }
    ++refused;
    EXPECT_EQ(p.code, 2) << tool << line;
    EXPECT_FALSE(p.ran) << tool << line;
    EXPECT_EQ(p.err.rfind(tool + ": error: ", 0), 0u) << tool << line << "\n" << p.err;
    EXPECT_EQ(p.err.find('\n'), p.err.size() - 1) << "one line: " << p.err;
  }
  EXPECT_GT(refused, kCases / 2);
  std::printf("[fuzz] %d %s argument lists: %d accepted, %d refused\n", kCases, tool.c_str(),
              accepted, refused);
}

TEST(Fuzz, MutatedArgumentListsOfTheBenchAreAcceptedOrRefusedCleanly) {
  fuzz_arguments("distmuon-bench", {"--workload", "gpt2-small", "--layers", "1", "--steps", "1"},
                 {"--workload",    "--backend",        "--algo",         "--steps",
                  "--warmup",      "--layers",         "--seed",         "--dtype",
                  "--work-dtype",  "--no-adamw",       "--json",         "--drift",
                  "--mode",        "--bucket-mb",      "--planner",      "--ranks-per-gpu",
                  "--cache",       "--cache-residual", "--cache-probes", "--cache-staleness",
                  "--cache-dtype", "--cache-layout"},
                 7);
}

TEST(Fuzz, MutatedArgumentListsOfThePlannerAreAcceptedOrRefusedCleanly) {
  fuzz_arguments(
      "distmuon-plan", {"--workload", "pi0", "--solver", "lpt"},
      {"--workload",    "--layers",         "--world-size", "--gpus-per-node", "--replicate",
       "--solver",      "--time-limit",     "--max-nodes",  "--gap",           "--formulation",
       "--comm-weight", "--memory-cap-gib", "--max-batch",  "--state-bytes",   "--costs",
       "--device",      "--analytic",       "--measure",    "--profile-ks",    "--algo",
       "--tflops",      "--hbm-tbs",        "--simulate",   "--sim-max-world", "--wire-bytes",
       "--json"},
      8);
}

// The executables end to end on mutated inputs: a small workload (fast runs) and mutated
// argument lists or workload files. Each must exit with 0, 1 or 2, never by a signal.
TEST(Fuzz, ExecutablesEndWithAnExitCodeNeverASignal) {
  const std::string dir = testing::TempDir();
  const std::string tiny = dir + "/fuzz-tiny.json", mutated = dir + "/fuzz-mutated.json";
  std::ofstream(tiny) << workload_seeds().back();
  std::mt19937_64 rng(9);
  const std::vector<std::string> options = {"--layers", "--steps", "--warmup", "--algo",
                                            "--dtype",  "--cache", "--drift",  "--seed"};
  int runs = 0;
  for (int c = 0; c < 40; ++c) {
    // The workload stays the small one (the first two tokens are not mutated), so that every
    // accepted run is short.
    std::vector<std::string> args = {"--workload", tiny};
    for (const std::string& a : mutate_args({"--steps", "1", "--warmup", "0"}, options, rng))
      args.push_back(a);
    for (const auto& [exe, extra] :
         {std::pair{DISTMUON_BENCH_EXE, std::vector<std::string>{}},
          std::pair{DISTMUON_PLAN_EXE, std::vector<std::string>{"--solver", "lpt"}}}) {
      std::vector<std::string> a = extra;
      if (exe == std::string(DISTMUON_PLAN_EXE)) {  // the planner: a mutated workload file
        std::ofstream(mutated) << mutate_workload(workload_seeds().back(), rng);
        a.insert(a.end(), {"--workload", mutated});
      } else {
        a.insert(a.end(), args.begin(), args.end());
      }
      const Exit e = run_process(exe, a, {"OMP_NUM_THREADS=1", "DISTMUON_NUM_THREADS=1"}, 60);
      ++runs;
      EXPECT_TRUE(e.exited) << exe << " ended by signal " << e.signal << "\n" << e.err;
      EXPECT_TRUE(e.code == 0 || e.code == 1 || e.code == 2) << e.code << "\n" << e.err;
    }
  }
  std::printf("[fuzz] %d executable runs\n", runs);
}

}  // namespace
}  // namespace distmuon::test
