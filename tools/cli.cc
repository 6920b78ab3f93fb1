#include "cli.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "distmuon/error.h"
#include "distmuon/ortho.h"
#include "distmuon/types.h"
#include "distmuon/workload.h"

namespace distmuon::cli {
namespace {

// Levenshtein distance, for the "did you mean" of an unknown option.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// The option of `app` nearest to the unknown argument `arg` ("--layer=3" -> "--layers"), or ""
// when none is close.
std::string nearest_option(const CLI::App& app, const std::string& arg) {
  const std::string key = arg.substr(0, arg.find('='));
  std::string best;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) {
      const size_t d = edit_distance(key, "--" + n);
      if (d < best_d) best_d = d, best = "--" + n;
    }
  }
  return best;
}

std::string usage_message(const CLI::App& app, const CLI::ParseError& e) {
  std::ostringstream os;
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    // "--layer 3": the unknown option, not also its value.
    std::vector<std::string> extras = app.remaining(), options;
    for (const std::string& arg : extras)
      if (arg.rfind("-", 0) == 0) options.push_back(arg);
    for (const std::string& arg : options.empty() ? extras : options) {
      os << (os.tellp() ? "; " : "") << "unknown argument '" << arg << "'";
      const std::string near = arg.rfind("-", 0) == 0 ? nearest_option(app, arg) : "";
      if (!near.empty()) os << " (did you mean " << near << "?)";
    }
  }
  if (!os.tellp()) os << e.what();
  os << "; see " << app.get_name() << " --help";
  return os.str();
}

// What an error says without the "distmuon: " prefix and source location meant for logs.
std::string run_message(const std::exception& e) {
  if (const auto* de = dynamic_cast<const Error*>(&e)) return de->message();
  return e.what();
}

// A validator that accepts what `parse` accepts, reporting its error message.
template <typename Parse>
CLI::Validator accepted_by(Parse parse, const std::string& desc, const std::string& name) {
  return CLI::Validator(
      [parse](std::string& v) -> std::string {
        try {
          parse(v);
          return {};
        } catch (const std::exception& e) {
          return run_message(e);
        }
      },
      desc, name);
}

// A finite number >= min (> min when strict) and <= max: inf, nan and values that would
// overflow the option's integer type are refused, not clamped.
CLI::Validator bound(double min, bool strict, double max) {
  const std::string rel = strict ? "> " : ">= ";
  const bool capped = max < std::numeric_limits<double>::infinity();
  const std::string desc =
      capped ? (strict ? "(" : "[") + format_number(min) + ", " + format_number(max) + "]"
             : rel + format_number(min);
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (v.empty() || *end != '\0' || x != x) return "'" + v + "' is not a number";
        if (!std::isfinite(x)) return "must be finite (got " + v + ")";
        if (!(strict ? x > min : x >= min) || x > max)
          return (capped ? "must be in " : "must be ") + desc + " (got " + v + ")";
        return "";
      },
      desc, "BOUND");
}

}  // namespace

CLI::Validator at_least(double min, double max) { return bound(min, false, max); }
CLI::Validator above(double min, double max) { return bound(min, true, max); }

int run(CLI::App& app, int argc, char** argv, const std::function<int()>& body) {
  const std::string tool = app.get_name();
  app.set_version_flag("--version", tool + " " + DISTMUON_VERSION);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::CallForVersion& v) {
    std::printf("%s\n", v.what());
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool.c_str(), usage_message(app, e).c_str());
    return kUsageError;
  } catch (const std::exception& e) {  // the checks of the app's callback
    std::fprintf(stderr, "%s: error: %s; see %s --help\n", tool.c_str(), run_message(e).c_str(),
                 tool.c_str());
    return kUsageError;
  }
  try {
    return body();
  } catch (const std::exception& e) {
    std::fflush(stdout);  // what was printed before the error comes first in a shared log
    std::fprintf(stderr, "%s: error: %s\n", tool.c_str(), run_message(e).c_str());
    return kRunError;
  }
}

std::string unwritable(const std::string& path, bool create_folders) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (path.empty()) return "an empty path is not a file";
  if (p.filename().empty() || fs::is_directory(p, ec)) return "'" + path + "' is a folder";
  if (fs::exists(p, ec))
    return access(path.c_str(), W_OK) == 0 ? "" : "cannot write '" + path + "' (permission denied)";
  fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  // Folders the writer would create: the nearest one that exists must take them.
  while (create_folders && !fs::exists(dir, ec) && dir.has_parent_path() &&
         dir != dir.parent_path())
    dir = dir.parent_path();
  if (!fs::exists(dir, ec)) return "folder '" + dir.string() + "' does not exist";
  if (!fs::is_directory(dir, ec)) return "'" + dir.string() + "' is not a folder";
  if (access(dir.c_str(), W_OK) != 0)
    return "cannot write in '" + dir.string() + "' (permission denied)";
  return "";
}

const CLI::Validator kWritableFile([](std::string& path) { return unwritable(path, false); },
                                   "FILE (writable)", "WRITABLE");

const CLI::Validator kAlgorithm = accepted_by(
    [](const std::string& v) { parse_algorithm(v); },
    "ALGO: ns5 | ns5-sym | gram-ns | auto [:jordan|polar-express|polar-express-1.05|you[:STEPS]]",
    "ALGORITHM");

const CLI::Validator kWorkload =
    accepted_by([](const std::string& v) { load_workload(v); }, "NAME|FILE", "WORKLOAD");

std::string workload_help() {
  std::string names;
  for (const auto& n : builtin_workloads()) names += (names.empty() ? "" : ", ") + n;
  return "built-in name (" + names + ") or JSON file";
}

const CLI::Validator kDType =
    accepted_by([](const std::string& v) { parse_dtype(v); }, "{f32, bf16, f16, f64}", "DTYPE");

Summary summarize(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  double med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return {med, v.front(), v.back()};
}

std::string format_number(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::abs(v) < 1e15)
    return std::to_string(static_cast<int64_t>(v));  // 1048576, not 1.04858e+06
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);  // shortest exact
}

}  // namespace distmuon::cli
