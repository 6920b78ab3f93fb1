// What each rank of the MPI fault tests runs (test_mpi_faults.cc launches it under mpirun):
// two ranks step a small sharded model once; then rank 1 either stalls (stays alive, never
// steps) or is killed with SIGKILL at its second collective of the next step. Rank 0 steps and
// prints one line: "RESULT <error type or none> <seconds> <message>".
//
//   fault_rank stall|kill TIMEOUT_S
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"
#include "distmuon/error.h"

namespace distmuon {
namespace {

// A handle of the wrapped communicator, seen as a request of the wrapper.
class HandleRequest final : public CommRequest {
 public:
  explicit HandleRequest(CommHandle h) : h_(std::move(h)) {}
  bool test() override { return h_.test(); }
  void wait(double timeout_s) override { h_.wait(timeout_s); }

 private:
  CommHandle h_;
};

// Forwards every collective to `inner`; once armed, the process kills itself (SIGKILL, no
// cleanup) when it reaches its `at`-th collective.
class Tripwire final : public Communicator {
 public:
  explicit Tripwire(Communicator& inner)
      : Communicator(inner.rank(), inner.size(), "tripwire(" + inner.name() + ")",
                     inner.world_ranks()),
        inner_(inner) {}
  Device device() const override { return inner_.device(); }
  void arm(int at) { countdown_ = at; }

 protected:
  std::unique_ptr<CommRequest> do_all_reduce(const void* s, void* r, int64_t n, CommType t,
                                             ReduceOp op) override {
    trip();
    return wrap(inner_.all_reduce(s, r, n, t, op));
  }
  std::unique_ptr<CommRequest> do_reduce(const void* s, void* r, int64_t n, CommType t, ReduceOp op,
                                         int root) override {
    trip();
    return wrap(inner_.reduce(s, r, n, t, op, root));
  }
  std::unique_ptr<CommRequest> do_broadcast(void* b, int64_t n, CommType t, int root) override {
    trip();
    return wrap(inner_.broadcast(b, n, t, root));
  }
  std::unique_ptr<CommRequest> do_all_gather_v(const void* s, int64_t n, void* r,
                                               std::span<const int64_t> rc,
                                               std::span<const int64_t> rd, CommType t) override {
    trip();
    return wrap(inner_.all_gather_v(s, n, r, rc, rd, t));
  }
  std::unique_ptr<CommRequest> do_all_to_all_v(const void* s, std::span<const int64_t> sc,
                                               std::span<const int64_t> sd, void* r,
                                               std::span<const int64_t> rc,
                                               std::span<const int64_t> rd, CommType t) override {
    trip();
    return wrap(inner_.all_to_all_v(s, sc, sd, r, rc, rd, t));
  }
  std::unique_ptr<CommRequest> do_barrier() override {
    trip();
    return wrap(inner_.barrier());
  }
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  static std::unique_ptr<CommRequest> wrap(CommHandle h) {
    return std::make_unique<HandleRequest>(std::move(h));
  }
  void trip() {
    if (countdown_ > 0 && --countdown_ == 0) kill(getpid(), SIGKILL);
  }
  Communicator& inner_;
  int countdown_ = 0;
};

int run(const std::string& scenario, double timeout_s) {
  std::unique_ptr<Communicator> mpi = make_mpi_world();
  mpi->set_timeout(timeout_s);
  Tripwire comm(*mpi);
  comm.set_timeout(timeout_s);
  const int rank = comm.rank(), p = comm.size();
  CpuBackend be;
  DistOptions opt;
  opt.mode = DistMode::kSharded;
  opt.planner = "round-robin";
  Engine engine(be, comm, opt);
  engine.add_group(GroupOptions{});
  const int64_t rows = 16, cols = 24, mine = (rows + p - 1) / p;
  const int64_t begin = std::min<int64_t>(rank * mine, rows);
  const int64_t count = std::min<int64_t>(begin + mine, rows) - begin;
  std::vector<std::vector<float>> w(3), g(3);
  std::vector<ParamData> data;
  for (int i = 0; i < 3; ++i) {
    engine.add_param({"w" + std::to_string(i), 0, {rows, cols}, DType::kF32, {begin, count}});
    w[i].assign(count * cols, 0.5f);
    g[i].assign(count * cols, 0.25f * (i + 1));
    data.push_back({w[i].data(), g[i].data(), DType::kF32, {}});
  }
  engine.step(data);
  if (rank == 1 && scenario == "stall") {
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 3));
    _exit(0);
  }
  if (rank == 1 && scenario == "kill") comm.arm(2);  // the vote completes, the exchange not
  const auto t0 = std::chrono::steady_clock::now();
  std::string kind = "none", message;
  try {
    engine.step(data);
  } catch (const TimeoutError& e) {
    kind = "TimeoutError";
    message = e.message();
  } catch (const Error& e) {
    kind = "Error";
    message = e.message();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("RESULT %s %.3f %s\n", kind.c_str(), s, message.c_str());
  std::fflush(stdout);
  _exit(0);  // a collective is abandoned: MPI_Finalize could wait for it
}

}  // namespace
}  // namespace distmuon

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fault_rank stall|kill TIMEOUT_S\n");
    return 2;
  }
  return distmuon::run(argv[1], std::atof(argv[2]));
}
