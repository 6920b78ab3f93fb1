// How the ranks of a distmuon-bench comparison agree on the host: a barrier before each timed
// step and element-wise reductions of their figures. Ranks are MPI processes (CommSync, over the
// MPI communicator); the interface leaves room for other launchers.
#pragma once

#include <vector>

#include "distmuon/comm.h"

namespace distmuon::bench {

class RankSync {
 public:
  virtual ~RankSync() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // Element-wise `op` of every rank's `v` (the same length on every rank).
  virtual std::vector<double> reduce(std::vector<double> v, ReduceOp op) = 0;
};

// Over a communicator of host memory (MPI).
class CommSync final : public RankSync {
 public:
  explicit CommSync(Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  void barrier() override { host_.barrier().wait(); }
  std::vector<double> reduce(std::vector<double> v, ReduceOp op) override;

 private:
  Communicator& host_;
};

}  // namespace distmuon::bench
