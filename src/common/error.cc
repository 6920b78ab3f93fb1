#include "distmuon/error.h"

#include <cstring>

namespace distmuon {

namespace {
const char* basename_of(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(const std::string& what, const char* file, int line)
    : std::runtime_error("distmuon: " + what + " [" + basename_of(file) + ":" +
                         std::to_string(line) + "]"),
      message_(what),
      file_(file),
      line_(line) {}

namespace detail {
void throw_error(const std::string& msg, const char* file, int line) {
  throw Error(msg, file, line);
}
}  // namespace detail

}  // namespace distmuon
