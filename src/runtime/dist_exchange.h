// Small host-side exchanges through backend memory (dist_exchange.cc): the communicator may
// require device buffers. Collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"

namespace distmuon {

std::vector<int64_t> host_all_gather(Communicator& comm, Backend& be,
                                     const std::vector<int64_t>& mine);
std::vector<char> host_all_gather_v(Communicator& comm, Backend& be, const std::string& mine,
                                    const std::vector<int64_t>& lengths);
void host_all_reduce(Communicator& comm, Backend& be, std::vector<int32_t>& values, ReduceOp op);
// Gathers every rank's `mine` (line-separated; `lengths` from a host_all_gather of the sizes)
// and describes, per rank that differs from rank 0, its first line that differs:
// "\n  rank 0 has `a` but rank q has `b`" (empty when all agree). Collective.
std::string text_differences(Communicator& comm, Backend& be, const std::string& mine,
                             const std::vector<int64_t>& lengths);

}  // namespace distmuon
