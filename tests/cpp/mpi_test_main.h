// Shared by the MPI test executables: every rank runs every test; the world communicator is
// created once by mpi_test_main.cc.
#pragma once

#include "distmuon/comm.h"

namespace distmuon::test {

Communicator& world();

}  // namespace distmuon::test
