// Small host-side exchanges (metadata, votes, statuses) staged through backend memory, because a
// communicator may only accept device buffers (NCCL).
#include <numeric>

#include "common/log.h"
#include "distmuon/error.h"
#include "runtime/engine_impl.h"

namespace distmuon {

std::vector<int64_t> host_all_gather(Communicator& comm, Backend& be,
                                     const std::vector<int64_t>& mine) {
  const size_t n = mine.size(), p = static_cast<size_t>(comm.size());
  Buffer buf = be.alloc(std::max<size_t>(n * p, 1) * sizeof(int64_t));
  int64_t* own = buf.as<int64_t>() + n * comm.rank();
  be.copy_from_host(own, mine.data(), n * sizeof(int64_t));
  be.synchronize();
  comm.all_gather(own, buf.data(), static_cast<int64_t>(n), CommType::kI64).wait();
  std::vector<int64_t> all(n * p);
  be.synchronize();
  be.copy_to_host(all.data(), buf.data(), all.size() * sizeof(int64_t));
  return all;
}

std::vector<char> host_all_gather_v(Communicator& comm, Backend& be, const std::string& mine,
                                    const std::vector<int64_t>& lengths) {
  DM_CHECK(static_cast<int>(lengths.size()) == comm.size() &&
               lengths[comm.rank()] == static_cast<int64_t>(mine.size()),
           "host_all_gather_v: inconsistent lengths");
  std::vector<int64_t> displs(lengths.size());
  std::exclusive_scan(lengths.begin(), lengths.end(), displs.begin(), int64_t{0});
  const int64_t total = displs.back() + lengths.back();
  Buffer buf = be.alloc(static_cast<size_t>(std::max<int64_t>(total, 1)));
  char* own = buf.as<char>() + displs[comm.rank()];
  be.copy_from_host(own, mine.data(), mine.size());
  be.synchronize();
  comm.all_gather_v(own, lengths[comm.rank()], buf.data(), lengths, displs, CommType::kU8).wait();
  std::vector<char> all(static_cast<size_t>(total));
  be.synchronize();
  be.copy_to_host(all.data(), buf.data(), all.size());
  return all;
}

void host_all_reduce(Communicator& comm, Backend& be, std::vector<int32_t>& values, ReduceOp op) {
  const size_t n = values.size();
  Buffer buf = be.alloc(std::max<size_t>(n, 1) * sizeof(int32_t));
  be.copy_from_host(buf.data(), values.data(), n * sizeof(int32_t));
  DM_LOG(kDebug, "the host waits for the device (before an all_reduce of ", n, " values)");
  be.synchronize();
  comm.all_reduce(buf.data(), buf.data(), static_cast<int64_t>(n), CommType::kI32, op).wait();
  be.synchronize();
  be.copy_to_host(values.data(), buf.data(), n * sizeof(int32_t));
}

}  // namespace distmuon
