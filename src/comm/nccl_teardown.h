// NCCL communicators let go are torn down on threads of their own (nccl_teardown.cc): a member
// must not wait for the other members to let go too.
#pragma once

#include <nccl.h>

#include <string>

namespace distmuon::comm_detail {

// Hands `comm` (on CUDA device `device`) over to its teardown: finalized once every member has
// let go, aborted past `timeout_s`. Waits for it about a second, so that when every member lets
// go at once its memory is back before the caller builds the next communicators.
void start_nccl_teardown(ncclComm_t comm, int device, double timeout_s, std::string name);

}  // namespace distmuon::comm_detail
