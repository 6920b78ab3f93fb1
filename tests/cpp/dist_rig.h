// The ranks of a distributed test and where their data lives. The distributed test sources
// (test_dist_*.cc) are built twice: on the MPI rig (CPU backend, MPI communicator: test_mpi_*,
// run by ctest in CI at 1 to 4 ranks) and on the NCCL rig (CUDA backend, NCCL communicator:
// test_nccl_dist_*, run by the GPU verification, several ranks per GPU where NCCL allows it). Both rigs are launched by mpirun; the
// NCCL rig uses MPI only to start and to share NCCL's unique id.
//
// Every rank runs every test. Rank 0 prints the usual gtest output; the other ranks print only
// their failures, prefixed with their rank. The exit code is the same on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/comm.h"
#include "distmuon/engine.h"

namespace distmuon::test {

// The communicator the engines under test use (MPI, or NCCL over this rank's CUDA device).
Communicator& world();
// A host-memory communicator over the same ranks (MPI), for the tests' own bookkeeping.
Communicator& host_world();
// A fresh communicator like world(), for tests that break it (timeouts abort NCCL).
std::unique_ptr<Communicator> make_world();
// A backend where world()'s buffers live: CPU, or CUDA on this rank's device.
std::unique_ptr<Backend> make_backend();
// Bytes of device memory in use on this rank's GPU by every process (-1 on the MPI rig).
int64_t device_bytes_in_use();
// "mpi" or "nccl".
const char* rig_name();
bool on_cuda();
// CPU results of distributed runs equal the single process's bit for bit; on CUDA the kernels
// may differ with the batch (cuBLAS picks its kernel by the batch count), so results agree within
// tolerance() (absolute, on values of order 1).
bool bit_exact();
double tolerance();

// Equal bit for bit on the MPI rig, within tolerance() on the NCCL rig; the largest difference
// seen is reported at the end of the run ("[rig] max_abs_diff").
void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
                  const std::string& what);
double max_abs_diff_seen();

// Host values over backend memory: the tests write and read host vectors, the engine and the
// communicators see the backend's (device) memory.
template <typename T>
class Mirror {
 public:
  Mirror() = default;
  Mirror(Backend& be, const std::vector<T>& host) : be_(&be), n_(host.size()) {
    if (n_) {
      buf_ = be.alloc(n_ * sizeof(T));
      set(host);
    }
  }
  T* data() const { return n_ ? static_cast<T*>(buf_.data()) : nullptr; }
  size_t size() const { return n_; }
  void set(const std::vector<T>& host) {
    if (n_) be_->copy_from_host(buf_.data(), host.data(), n_ * sizeof(T));
    be_->synchronize();
  }
  std::vector<T> get() const {
    std::vector<T> out(n_);
    if (!n_) return out;
    be_->synchronize();
    be_->copy_to_host(out.data(), buf_.data(), n_ * sizeof(T));
    return out;
  }

 private:
  Backend* be_ = nullptr;
  size_t n_ = 0;
  Buffer buf_;
};

// The values of an engine state view (empty where this rank holds none).
std::vector<float> read(Backend& be, const TensorView& v);
std::vector<uint8_t> read_bytes(Backend& be, const TensorView& v);
// Writes host values into a state view (nothing where this rank holds none).
void write(Backend& be, const TensorView& v, const void* host, size_t bytes);

// Sum / max over the ranks of host values (host_world()).
std::vector<double> sum_over_ranks(std::vector<double> v);
double max_over_ranks(double v);

}  // namespace distmuon::test
