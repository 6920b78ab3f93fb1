// One rank of distmuon-bench's distributed comparison (started by bench_dist.cc as an MPI
// process; under CUDA MPS several share one GPU at once): optionally a calibration of the ranks'
// devices, then the modes' steps (bench_compare.h), then one profiled step per mode that splits
// each rank's time into computing, communicating and waiting (device_trace.h). Rank 0 prints and
// writes the JSON record.
#pragma once

#include <cstdint>
#include <string>

#include "bench_options.h"
#include "device_trace.h"
#include "distmuon/backend.h"
#include "distmuon/comm.h"

namespace distmuon::bench {

struct RankSetup {
  RankSetup(Communicator& h, Communicator& c, Backend& b) : host(h), comm(c), be(b) {}
  Communicator& host;  // host memory (MPI): barriers and the ranks' figures
  Communicator& comm;  // moves the data (NCCL or MPI)
  Backend& be;
  // This process's device profiler (nullptr: no breakdown), and its context as the profiler
  // names it.
  DeviceTrace* trace = nullptr;
  uint32_t context = 0;
  // For the record: how ranks share the hardware ("mpi-cpu", "gpus", "mps", "time-sliced") and
  // the SMs each may use (0: unknown).
  std::string mechanism;
  int sms_per_rank = 0, device_sms = 0;
};

// Collective over the ranks. Returns the exit code.
int run_rank(const BenchOptions& o, RankSetup& r);

}  // namespace distmuon::bench
