// The command lines of the distmuon-* tools, on CLI11: every option has a type and a range or a
// set of choices (shown by -h / --help), a bad value or an unknown option is refused before any
// work (the nearest known option is suggested), and every error is printed once, as
// "<tool>: error: <message>".
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace distmuon::cli {

// Exit codes of the tools: a refused command line, an error while running.
constexpr int kUsageError = 2;
constexpr int kRunError = 1;

// Parses argv into `app` (whose options are bound to the tool's settings; checks that involve
// several options belong in app.callback(), which runs at the end of parsing), then runs `body`
// and returns its exit code; --help prints the options and returns 0. Errors of the command
// line give kUsageError, errors of `body` kRunError, each printed as above.
int run(CLI::App& app, int argc, char** argv, const std::function<int()>& body);

// Why `path` cannot be written ("" when it can): it is a folder, its folder does not exist
// (with create_folders, the nearest existing ancestor is the one that must be writable), or
// permissions forbid it.
std::string unwritable(const std::string& path, bool create_folders);

// Validators shared by the tools (each also describes its values in --help).
// A path a file can be written to: its folder exists and is writable, and so is the file if it
// exists (checked before the run, so that results are not lost after it).
extern const CLI::Validator kWritableFile;
// An algorithm name distmuon::parse_algorithm accepts (ns5, gram-ns:polar-express, ...).
extern const CLI::Validator kAlgorithm;
// A workload distmuon::load_workload accepts (a built-in name or a valid JSON file).
extern const CLI::Validator kWorkload;
// The --workload option's help: the built-in names (workloads/*.json, embedded) or a JSON file.
std::string workload_help();
// A dtype name distmuon::parse_dtype accepts.
extern const CLI::Validator kDType;
// Upper bounds of the tools' integer options: far above any real use, and low enough that no
// sum or product of them overflows or exhausts memory (a world of 10^8 ranks used to run the
// planners out of memory; 2^63 steps wrapped warm-up + steps to a negative count).
constexpr double kMaxRepeats = 1e6;    // steps, warm-up steps, repetitions, layers
constexpr double kMaxRanks = 1 << 20;  // world sizes, replicas, GPUs per node
// A finite number >= min (at_least) or > min (above), and <= max.
CLI::Validator at_least(double min, double max = std::numeric_limits<double>::infinity());
CLI::Validator above(double min, double max = std::numeric_limits<double>::infinity());

// Median, min and max of a list of timings.
struct Summary {
  double median = 0, min = 0, max = 0;
};
Summary summarize(std::vector<double> v);
// Shortest decimal form of a number ("2", "0.5", "1e-06").
std::string format_number(double v);

}  // namespace distmuon::cli
