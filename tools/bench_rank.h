// One rank of distmuon-bench's distributed comparison (started by bench_dist.cc as an MPI
// process; under CUDA MPS several share one GPU at once): optionally a calibration of the ranks'
// devices, then the modes' steps (bench_compare.h), then one profiled step per mode that splits
// each rank's time into computing, communicating and waiting (device_trace.h). Rank 0 prints and
// writes the JSON record.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_options.h"
#include "device_trace.h"
#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "rank_sync.h"

namespace distmuon::bench {

struct RankSetup {
  RankSetup(RankSync& s, Communicator& c, Backend& b) : sync(s), comm(c), be(b) {}
  RankSync& sync;
  Communicator& comm;  // moves the data (NCCL or MPI)
  Backend& be;
  // The device profiler (nullptr: no breakdown). `trace_owner` ranks switch it on and off and
  // leave a profiled step's intervals in *intervals, which every rank then reads: every rank for
  // processes (each profiles itself), one for ranks that share one process's collector.
  DeviceTrace* trace = nullptr;
  bool trace_owner = false;
  std::vector<DeviceInterval>* intervals = nullptr;
  uint32_t context = 0;  // the rank's context as the profiler names it
  // For the record: how ranks share the hardware ("mpi-cpu", "gpus", "mps", "time-sliced") and
  // the SMs each may use.
  std::string mechanism;
  int sms_per_rank = 0, device_sms = 0;
};

// Collective over the ranks. Returns the exit code.
int run_rank(const BenchOptions& o, RankSetup& r);

}  // namespace distmuon::bench
