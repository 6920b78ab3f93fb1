// Writing a file so that a crash, a full disk or a concurrent reader never sees half of it.
#pragma once

#include <string>

namespace distmuon {

// Writes `text` to a temporary file next to `path` and renames it over `path` (creating the
// parent directories). Throws naming the path when any of it fails; `path` is then untouched.
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace distmuon
