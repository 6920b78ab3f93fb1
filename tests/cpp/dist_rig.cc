// main() of the distributed tests and the two rigs of dist_rig.h. DM_TEST_RIG_NCCL selects the
// NCCL rig at compile time.
#include "dist_rig.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "distmuon/error.h"

#ifdef DM_TEST_RIG_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace distmuon::test {
namespace {

std::unique_ptr<Communicator> g_mpi, g_nccl;
[[maybe_unused]] int g_device = 0;  // the NCCL rig's CUDA device
double g_max_diff = 0;   // over the run
double g_test_diff = 0;  // over the current test

// Resets the current test's largest difference when it starts.
class DiffTracker : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo&) override { g_test_diff = 0; }
};

// At each test's end on the NCCL rig, every rank waits for the teardowns of the communicators its
// test let go (they run on threads of their own), so that the next test starts with their memory
// back: the verification's lanes share one GPU. Rank 0 prints the device memory then in use (by
// every process on the GPU, the other lanes included).
class MemoryReporter : public ::testing::EmptyTestEventListener {
 public:
  explicit MemoryReporter(int rank) : rank_(rank) {}
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (!wait_for_nccl_teardowns(30.0))
      std::printf("[rig] rank %d: NCCL teardowns still in flight 30 s after %s\n", rank_, t.name());
    const int64_t used = device_bytes_in_use();
    if (used >= 0 && rank_ == 0)
      std::printf("[rig] device memory in use after %s: %lld MiB\n", t.name(),
                  static_cast<long long>(used >> 20));
  }

 private:
  int rank_;
};

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // gtest holds its lock while reporting a result, so the test's name is kept from its start.
  void OnTestStart(const ::testing::TestInfo& t) override {
    test_ = std::string(t.test_suite_name()) + "." + t.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
  std::string test_;
};

[[maybe_unused]] int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n)) return std::atoi(v);
  return fallback;
}

#ifdef DM_TEST_RIG_NCCL
// Ranks of this node share its GPUs in blocks: local rank l of L uses device l / ceil(L / n).
// Returns a reason to skip the whole run, or "".
std::string choose_device(int rank) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return "no CUDA device";
  if (!cuda_available()) return "this build has no CUDA backend";
  const int local = env_int({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"}, rank);
  const int local_size = env_int({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                  "LOCAL_WORLD_SIZE"}, 1);
  const int per_gpu = (local_size + n - 1) / n;
  int version = 0;
  ncclGetVersion(&version);
  if (per_gpu > 1 && version < 23000)
    return "several ranks per GPU need NCCL >= 2.30 (this one is " + std::to_string(version) +
           ")";
  if (per_gpu > 1 && !std::getenv("NCCL_MULTI_RANK_GPU_ENABLE"))
    return "several ranks per GPU need NCCL_MULTI_RANK_GPU_ENABLE=1";
  g_device = local / per_gpu;
  if (cudaSetDevice(g_device) != cudaSuccess) return "cannot use device " + std::to_string(g_device);
  return "";
}
#endif

}  // namespace

Communicator& world() { return g_nccl ? *g_nccl : *g_mpi; }
Communicator& host_world() { return *g_mpi; }

std::unique_ptr<Communicator> make_world() {
#ifdef DM_TEST_RIG_NCCL
  NcclUniqueId id;
  if (g_mpi->rank() == 0) id = nccl_unique_id();
  g_mpi->broadcast(id.bytes, sizeof(id.bytes), CommType::kU8, 0).wait();
  return make_nccl_communicator(id, g_mpi->rank(), g_mpi->size());
#else
  return make_mpi_world();
#endif
}

std::unique_ptr<Backend> make_backend() {
#ifdef DM_TEST_RIG_NCCL
  return distmuon::make_backend("cuda:" + std::to_string(g_device));
#else
  return distmuon::make_backend("cpu");
#endif
}

int64_t device_bytes_in_use() {
#ifdef DM_TEST_RIG_NCCL
  size_t free = 0, total = 0;
  DM_CHECK(cudaMemGetInfo(&free, &total) == cudaSuccess, "cudaMemGetInfo failed");
  return static_cast<int64_t>(total - free);
#else
  return -1;
#endif
}

const char* rig_name() { return g_nccl ? "nccl" : "mpi"; }
bool on_cuda() { return g_nccl != nullptr; }
bool bit_exact() { return !on_cuda(); }

double tolerance() {
  if (bit_exact()) return 0.0;
  const char* t = std::getenv("DISTMUON_TEST_TOL");
  return t ? std::atof(t) : 2e-5;
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
                  const std::string& what) {
  if (bit_exact()) {
    EXPECT_EQ(actual, expected) << what;
    return;
  }
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    if (!(d <= worst)) worst = d, at = i;  // NaN counts as the worst
  }
  if (!(worst <= g_max_diff)) g_max_diff = worst;
  if (!(worst <= g_test_diff)) {
    g_test_diff = worst;
    // In the JSON report (DISTMUON_TEST_JSON_DIR): the verification takes the maximum over ranks.
    ::testing::Test::RecordProperty("max_abs_diff", std::to_string(worst));
  }
  EXPECT_LE(worst, tolerance()) << what << ": element " << at << " is " << actual[at]
                                << ", the single process has " << expected[at];
}

double max_abs_diff_seen() { return g_max_diff; }

std::vector<uint8_t> read_bytes(Backend& be, const TensorView& v) {
  if (!v.data) return {};
  std::vector<uint8_t> out(static_cast<size_t>(v.numel()) * dtype_size(v.dtype));
  be.synchronize();
  be.copy_to_host(out.data(), v.data, out.size());
  return out;
}

std::vector<float> read(Backend& be, const TensorView& v) {
  const std::vector<uint8_t> b = read_bytes(be, v);
  std::vector<float> out(b.size() / sizeof(float));
  if (!out.empty()) std::memcpy(out.data(), b.data(), out.size() * sizeof(float));  // never null
  return out;
}

void write(Backend& be, const TensorView& v, const void* host, size_t bytes) {
  if (!v.data) return;
  be.copy_from_host(v.data, host, bytes);
  be.synchronize();
}

std::vector<double> sum_over_ranks(std::vector<double> v) {
  host_world()
      .all_reduce(v.data(), v.data(), static_cast<int64_t>(v.size()), CommType::kF64,
                  ReduceOp::kSum)
      .wait();
  return v;
}

double max_over_ranks(double v) {
  host_world().all_reduce(&v, &v, 1, CommType::kF64, ReduceOp::kMax).wait();
  return v;
}

}  // namespace distmuon::test

int main(int argc, char** argv) {
  using namespace distmuon;
  test::g_mpi = make_mpi_world();
  const int rank = test::g_mpi->rank();
  // One JSON report per rank, for tests/gpu/summarize.py (set before gtest configures output).
  if (const char* dir = std::getenv("DISTMUON_TEST_JSON_DIR"))
    GTEST_FLAG_SET(output, std::string("json:") + dir + "/rank" + std::to_string(rank) + ".json");
  ::testing::InitGoogleTest(&argc, argv);
#ifdef DM_TEST_RIG_NCCL
  const std::string skip = test::choose_device(rank);
  if (!skip.empty()) {
    if (rank == 0) std::printf("[rig] SKIPPED: %s\n", skip.c_str());
    test::g_mpi.reset();
    return 0;
  }
  // The engines compare owners' batches with the single process's, whose batch counts differ:
  // algorithms tuned per batch count could differ too, so the tests use the shape heuristic.
  setenv("DISTMUON_AUTOTUNE", "off", 0);
  test::g_nccl = test::make_world();
  if (rank == 0)
    std::printf("[rig] nccl: %d ranks, rank 0 on cuda:%d\n", test::g_mpi->size(), test::g_device);
#endif
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  listeners.Append(new test::DiffTracker);
  if (test::on_cuda()) listeners.Append(new test::MemoryReporter(rank));
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new test::FailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  std::vector<double> worst = {test::g_max_diff};
  std::vector<int32_t> flag = {failed};
  try {
    test::g_mpi->all_reduce(worst.data(), worst.data(), 1, CommType::kF64, ReduceOp::kMax).wait();
    test::g_mpi->all_reduce(flag.data(), flag.data(), 1, CommType::kI32, ReduceOp::kMax).wait();
  } catch (const Error& e) {  // a rank that never finished its tests
    std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
    return 1;
  }
  if (rank == 0) {
    if (flag[0] && !failed) std::fprintf(stderr, "another rank failed (see its [rank N] lines)\n");
    if (!test::bit_exact()) std::printf("[rig] max_abs_diff %.3e\n", worst[0]);
  }
  test::g_nccl.reset();
  test::g_mpi.reset();
  return flag[0];
}
