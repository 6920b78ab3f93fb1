// The communicator object Python holds (distmuon._C.Communicator): owned here, lent to engines,
// which keep the Python object alive for as long as they exist.
#pragma once

#include <memory>

#include "distmuon/comm.h"

namespace distmuon::py {

struct PyComm {
  std::unique_ptr<Communicator> comm;
};

}  // namespace distmuon::py
