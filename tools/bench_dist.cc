// distmuon-bench --mode ... under mpirun: the comparison of bench_compare.h with one MPI process
// per rank (CPU ranks on MPI, CUDA ranks on NCCL with the id shared over MPI).
#include "bench_dist.h"

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_compare.h"
#include "bench_rank.h"
#include "common/fnv.h"
#include "cuda_info.h"
#include "device_trace.h"
#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"
#include "distmuon/env.h"
#include "distmuon/error.h"

namespace distmuon::bench {
namespace {

// CPU ranks share the machine: each gets cores / local ranks threads unless told otherwise,
// because oversubscribed BLAS threads spin and distort every timing.
int threads_per_rank(int world_size) {
  if (std::getenv("DISTMUON_NUM_THREADS"))  // checked as everywhere; 0: the default below
    if (const int64_t t = env::get_int("DISTMUON_NUM_THREADS"); t > 0) return static_cast<int>(t);
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks = local ? std::max(1, std::atoi(local)) : world_size;
  const int n = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
  setenv("DISTMUON_NUM_THREADS", std::to_string(n).c_str(), 1);
  return n;
}

// Every rank must run the same comparison: ranks started with other options (an MPMD launch,
// a script that passes its arguments differently) would otherwise issue collectives of other
// sizes and stop inside MPI. Compares a digest of the options that shape the run, before any.
void check_same_options(Communicator& mpi, const BenchOptions& o) {
  std::string text = o.workload + "|" + o.backend + "|" + o.dtype + "|" + o.work_dtype + "|" +
                     o.planner + "|" + std::to_string(o.steps) + "|" + std::to_string(o.warmup) +
                     "|" + std::to_string(o.layers) + "|" + std::to_string(o.seed) + "|" +
                     std::to_string(o.no_adamw) + "|" + std::to_string(o.bucket_mb) + "|" +
                     std::to_string(o.batches_per_bucket) + "|" +
                     std::to_string(o.ranks_per_gpu) + "|" + std::to_string(o.algos_given);
  for (const auto& list : {o.algos, o.modes})
    for (const std::string& v : list) text += "|" + v;
  const uint64_t d = fnv1a(text);
  // Two 32-bit halves: exact in doubles. Max and -min of each agree iff every rank's does.
  const double hi = static_cast<double>(d >> 32), lo = static_cast<double>(d & 0xffffffffu);
  const std::vector<double> m = over_ranks(mpi, {hi, lo, -hi, -lo}, ReduceOp::kMax);
  DM_CHECK(m[0] == -m[2] && m[1] == -m[3],
           "the ranks were started with different options (every rank of distmuon-bench needs "
           "the same command line)");
}

}  // namespace

int run_distributed(const BenchOptions& o) {
  std::unique_ptr<Communicator> mpi = make_mpi_world();
  const int rank = mpi->rank(), p = mpi->size();
  check_same_options(*mpi, o);
  const std::string& backend = o.backend;
  int threads = 0;
  if (backend == "cpu") {
    threads = threads_per_rank(p);
    omp_set_num_threads(threads);
  }
  auto be = make_backend(backend == "cuda" ? rank_device(rank, o.ranks_per_gpu, cuda_device_count())
                                           : backend);
  // CPU: the MPI communicator moves host memory. CUDA: an NCCL communicator whose id rank 0
  // shares over MPI.
  std::unique_ptr<Communicator> nccl;
  if (be->device().kind == DeviceKind::kCUDA) {
    NcclUniqueId id;
    if (rank == 0) id = nccl_unique_id();
    mpi->broadcast(id.bytes, sizeof(id.bytes), CommType::kU8, 0).wait();
    nccl = make_nccl_communicator(id, rank, p, be->native_stream());  // the engine's stream
  }
  Communicator& comm = nccl ? *nccl : *mpi;
  if (rank == 0)
    std::fprintf(stderr, "distmuon-bench: %s on %d ranks, %s%s\n", o.workload.c_str(), p,
                 be->name().c_str(),
                 threads ? (", " + std::to_string(threads) + " threads per rank").c_str() : "");
  // Each process profiles itself: its own collector and context.
  std::string why;
  std::unique_ptr<DeviceTrace> trace = o.profile ? DeviceTrace::open(&why) : nullptr;
  if (o.profile && !trace && rank == 0)
    std::fprintf(stderr, "distmuon-bench: no per-rank breakdown: %s\n", why.c_str());
  RankSetup r(*mpi, comm, *be);
  r.trace = trace.get();
  r.context = trace ? trace->context_id(current_context()) : 0;
  // Ranks that share a GPU run at the same time only under MPS (each then on its share of the
  // SMs, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); without it the GPU time-slices them.
  const char* mps = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  r.mechanism = backend == "cpu"       ? "mpi-cpu"
                : o.ranks_per_gpu == 1 ? "gpus"
                : mps                  ? "mps"
                                       : "time-sliced";
  if (be->device().kind == DeviceKind::kCUDA) {
    // An MPS client sees its share of the SMs as the device's; the whole stays unknown (0).
    r.sms_per_rank = device_sm_count(be->device().index);
    r.device_sms = mps ? 0 : r.sms_per_rank;
  }
  return run_rank(o, r);
}

}  // namespace distmuon::bench
