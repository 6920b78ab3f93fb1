#include "rank_sync.h"

#include "distmuon/error.h"

namespace distmuon::bench {

std::vector<double> CommSync::reduce(std::vector<double> v, ReduceOp op) {
  host_.all_reduce(v.data(), v.data(), static_cast<int64_t>(v.size()), CommType::kF64, op).wait();
  return v;
}

}  // namespace distmuon::bench
