// Small host-side exchanges (metadata, votes, statuses) staged through backend memory, because a
// communicator may only accept device buffers (NCCL).
#include "runtime/dist_exchange.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "common/log.h"
#include "distmuon/error.h"

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

namespace {

std::vector<std::string> split_lines(const char* p, int64_t n) {
  std::vector<std::string> out;
  std::string cur;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] == '\n') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += p[i];
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace

std::string text_differences(Communicator& comm, Backend& be, const std::string& mine,
                             const std::vector<int64_t>& lengths) {
  const std::vector<char> texts = host_all_gather_v(comm, be, mine, lengths);
  const std::vector<std::string> ref = split_lines(texts.data(), lengths[0]);
  std::ostringstream os;
  int64_t off = lengths[0];
  for (int q = 1; q < comm.size(); ++q) {
    const std::vector<std::string> theirs = split_lines(texts.data() + off, lengths[q]);
    off += lengths[q];
    for (size_t l = 0; l < std::max(ref.size(), theirs.size()); ++l) {
      const std::string a = l < ref.size() ? ref[l] : "(nothing)";
      const std::string b = l < theirs.size() ? theirs[l] : "(nothing)";
      if (a == b) continue;
      os << "\n  rank 0 has `" << a << "` but rank " << q << " has `" << b << "`";
      break;
    }
  }
  return os.str();
}

}  // namespace distmuon
