// A program run as a child process, with how it ended (for tests of executables and of
// launchers such as mpirun).
#pragma once

#include <string>
#include <vector>

namespace distmuon::test {

// A child process: exited normally (else `signal` is set), its code and output.
struct Exit {
  bool exited = false;
  int code = -1, signal = 0;
  std::string out, err;
};
// argv / envp of `v`: pointers into its strings, then a null pointer.
std::vector<char*> c_strings(std::vector<std::string>& v);

// `exe` is the path of the executable; `env` entries are added as NAME=VALUE.
Exit run_process(const std::string& exe, const std::vector<std::string>& args,
                 const std::vector<std::string>& env = {}, double timeout_s = 120);

}  // namespace distmuon::test
