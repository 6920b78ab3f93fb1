// main() of the MPI tests: every rank runs the whole suite. Rank 0 prints the usual gtest
// output; the other ranks print only their failures, prefixed with their rank. The exit code is
// the same on every rank: non-zero when any rank failed.
#include "mpi_test_main.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "distmuon/env.h"

namespace distmuon::test {
namespace {

Communicator* g_world = nullptr;

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

}  // namespace

Communicator& world() { return *g_world; }

}  // namespace distmuon::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<distmuon::Communicator> world = distmuon::make_mpi_world();
  distmuon::test::g_world = world.get();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world->rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new distmuon::test::FailurePrinter(world->rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  std::vector<int32_t> flag = {failed};
  // Host memory: the MPI communicator works on it directly.
  world->all_reduce(flag.data(), flag.data(), 1, distmuon::CommType::kI32, distmuon::ReduceOp::kMax)
      .wait();
  if (world->rank() == 0 && flag[0] && !failed)
    std::fprintf(stderr, "another rank failed (see its [rank N] lines)\n");
  world.reset();
  return flag[0];
}
