// The communicator object Python holds (distmuon._C.Communicator): owned here, lent to engines,
// which keep the Python object alive for as long as they exist.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>

#include "distmuon/comm.h"

namespace distmuon::py {

struct PyComm {
  std::unique_ptr<Communicator> comm;
};

// {'ops', 'bytes_sent', 'bytes_received'} of a communicator's (or several's) traffic.
nanobind::dict comm_stats_dict(const CommStats& s);

}  // namespace distmuon::py
