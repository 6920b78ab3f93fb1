// One rank of a fault test of the distributed engine over NCCL, started without a launcher (a
// launcher such as mpirun ends every rank when one dies, which is the case under test):
//
//   nccl_fault_probe DIR RANK SIZE FAULT MODE
//
// The ranks meet through files in DIR (rank 0 writes NCCL's unique id there), build a CUDA
// engine in MODE (gather | replicated | sharded | dedicated) over one NCCL communicator, and step
// a small model in a loop. The last rank is faulty after two steps: FAULT=stop keeps the process
// alive but stops stepping; FAULT=kill raises SIGKILL on itself during its next step. Every other
// rank must raise (distmuon::Error) within DISTMUON_COMM_TIMEOUT_S plus the engine's slack; it
// prints one line "raised <seconds since its last step completed> <message>" and exits 0, or
// exits 1 if it was still stepping after 4 timeouts. tests/gpu/nccl_faults.py runs it.
#include <cuda_runtime_api.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"

namespace {

using namespace distmuon;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

NcclUniqueId meet(const std::string& dir, int rank, double timeout_s) {
  NcclUniqueId id;
  const std::string path = dir + "/nccl_id";
  if (rank == 0) {
    id = nccl_unique_id();
    std::ofstream(path + ".tmp", std::ios::binary).write(id.bytes, sizeof(id.bytes));
    std::rename((path + ".tmp").c_str(), path.c_str());  // readers never see half a file
    return id;
  }
  const auto start = Clock::now();
  while (seconds_since(start) < timeout_s) {
    std::ifstream in(path, std::ios::binary);
    if (in && in.read(id.bytes, sizeof(id.bytes))) return id;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  DM_FAIL("rank ", rank, " found no NCCL id in ", dir, " within ", timeout_s, " s");
}

// The stopped rank stays alive until every other rank has raised (or `limit_s` passed).
void wait_for_raised(const std::string& dir, int others, double limit_s) {
  const auto start = Clock::now();
  while (seconds_since(start) < limit_s) {
    int n = 0;
    for (int r = 0; r < others; ++r) n += std::ifstream(dir + "/raised." + std::to_string(r)).good();
    if (n == others) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

int run(int argc, char** argv) {
  DM_CHECK(argc == 6, "usage: nccl_fault_probe DIR RANK SIZE stop|kill MODE");
  const std::string dir = argv[1], fault = argv[4];
  const int rank = std::atoi(argv[2]), size = std::atoi(argv[3]);
  DM_CHECK(fault == "stop" || fault == "kill", "FAULT must be stop or kill, not ", fault);
  int devices = 0;
  DM_CHECK(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, "no CUDA device");
  const int device = rank / ((size + devices - 1) / devices);  // ranks share GPUs in blocks
  DM_CHECK(cudaSetDevice(device) == cudaSuccess, "cannot use device ", device);

  auto be = make_backend("cuda:" + std::to_string(device));
  std::unique_ptr<Communicator> comm = make_nccl_communicator(
      meet(dir, rank, 60), rank, size, be->native_stream());
  DistOptions opt;
  opt.mode = parse_dist_mode(argv[5]);
  const bool sharded = opt.mode == DistMode::kSharded || opt.mode == DistMode::kGather;
  Engine e(*be, *comm, opt);
  e.add_group(GroupOptions{});
  const int64_t rows = 16 * size, cols = 24;
  std::vector<Buffer> w, g;
  std::vector<ParamData> data;
  for (int p = 0; p < 4; ++p) {
    ParamSpec spec{"layers." + std::to_string(p) + ".w", 0, {rows, cols}, DType::kF32};
    const int64_t local = sharded ? 16 : rows;
    if (sharded) spec.shard = {16 * rank, 16};
    e.add_param(spec);
    std::vector<float> host(local * cols);
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>((i * 7 + p) % 11) / 11;
    w.push_back(be->alloc(host.size() * sizeof(float)));
    g.push_back(be->alloc(host.size() * sizeof(float)));
    be->copy_from_host(w.back().data(), host.data(), host.size() * sizeof(float));
    be->copy_from_host(g.back().data(), host.data(), host.size() * sizeof(float));
    data.push_back({w.back().data(), g.back().data(), DType::kF32, {}});
  }
  const double timeout = comm->timeout_s();
  const bool faulty = rank == size - 1;
  auto last = Clock::now();
  for (int step = 0; seconds_since(last) < 4 * timeout; ++step) {
    if (faulty && step == 2) {
      if (fault == "stop") {  // alive, but never steps again: the others must not wait forever
        wait_for_raised(dir, size - 1, 3 * timeout);
        std::printf("stopped rank %d exits\n", rank);
        std::_Exit(0);  // its communicator's peers are gone; nothing to tear down
      }
      std::thread([] {  // dies in the middle of its step
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::raise(SIGKILL);
      }).detach();
    }
    try {
      e.step(data);
      // The dedicated mode's broadcasts are still in flight here: wait for them under the
      // communicator's deadline first. A host synchronize on a stream that waits for an NCCL
      // kernel has no deadline of its own (it ends only when NCCL notices the dead peer).
      e.wait_published();
      be->synchronize();
    } catch (const Error& err) {
      std::printf("raised %.2f %s\n", seconds_since(last), err.what());
      std::fflush(stdout);
      std::ofstream(dir + "/raised." + std::to_string(rank)) << "1";
      std::_Exit(0);  // the communicator was aborted; its destructor has nothing left to do
    }
    last = Clock::now();
    std::printf("step %d done\n", step);
    std::fflush(stdout);
  }
  std::printf("still stepping after %.0f s without a fault being seen\n", 4 * timeout);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
    return 2;
  }
}
