// The one error type of distmuon and the macros that raise it. Every failure is an exception
// carrying the file and line where it was detected; library code never calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace distmuon {

class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line);
  const char* file() const { return file_; }
  int line() const { return line_; }
  // The message alone, without what()'s "distmuon: " prefix and " [file:line]" suffix.
  const std::string& message() const { return message_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
};

// A collective that did not complete in time (a peer died or the ranks diverged).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(const std::string& msg, const char* file, int line);
}  // namespace detail

}  // namespace distmuon

// DM_CHECK(cond, parts...): throws distmuon::Error("parts..." + location) when cond is false.
#define DM_CHECK(cond, ...)                                                                 \
  do {                                                                                      \
    if (!(cond)) [[unlikely]]                                                               \
      ::distmuon::detail::throw_error(::distmuon::detail::concat(__VA_ARGS__), __FILE__,    \
                                      __LINE__);                                            \
  } while (0)

#define DM_FAIL(...) \
  ::distmuon::detail::throw_error(::distmuon::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
