// Helpers of the CPU tests that read and write files and the environment: a fresh path per test,
// whole-file text, the message of an expected distmuon::Error, an environment variable restored.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "distmuon/error.h"

namespace distmuon::test {

// <tmp>/distmuon_<suite>_<pid>/<test>_<name>, absent on return (a rerun starts clean; the pid
// keeps concurrent ctest processes apart).
inline std::string temp_path(const std::string& suite, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("distmuon_" + suite + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string path = (dir / (std::string(info->name()) + "_" + name)).string();
  fs::remove(path);
  return path;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

// The message of the distmuon::Error that f throws; "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class EnvGuard {  // restores an environment variable at the end of a test
 public:
  explicit EnvGuard(const char* name) : name_(name) {
    if (const char* v = std::getenv(name)) saved_ = v;
  }
  ~EnvGuard() {
    if (saved_)
      setenv(name_, saved_->c_str(), 1);
    else
      unsetenv(name_);
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

}  // namespace distmuon::test
