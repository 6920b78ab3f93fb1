#include "common/atomic_write.h"

#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "distmuon/error.h"

namespace distmuon {

void write_file_atomically(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (p.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(p.parent_path(), ec);
    DM_CHECK(!ec, "cannot create directory ", p.parent_path().string(), ": ", ec.message());
  }
  // The process id keeps two processes (ranks of one machine) from sharing a temporary file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp);
    DM_CHECK(f.good(), "cannot write ", tmp);
    f << text;
    f.flush();
    if (!f.good()) {
      f.close();
      std::error_code ignored;
      fs::remove(tmp, ignored);
      DM_FAIL("cannot write ", tmp);
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    DM_FAIL("cannot move ", tmp, " to ", path, ": ", ec.message());
  }
}

}  // namespace distmuon
