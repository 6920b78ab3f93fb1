// Faults on MPI ranks: two ranks under mpirun (fault_rank.cc), one of which stalls before its
// step or is killed with SIGKILL in the middle of it. The other raises a TimeoutError within
// DISTMUON_COMM_TIMEOUT_S plus kSlackS, once (the pending collectives it abandons do not each
// wait the timeout again), naming the collective, the ranks and the variable.
//
// MPI cannot tell a dead peer from a slow one: the survivor learns of the death from the
// timeout. mpirun runs with --enable-recovery so that the survivor lives to report; without it
// Open MPI's launcher kills the whole job as soon as a rank dies (also no hang).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

#include "subprocess.h"

namespace distmuon::test {
namespace {

using ::testing::HasSubstr;

constexpr double kTimeoutS = 3, kSlackS = 2;

struct Reported {
  std::string kind, message;
  double seconds = -1;
};

Reported run_fault(const std::string& scenario, bool recovery) {
  std::vector<std::string> args = {"--allow-run-as-root", "--oversubscribe", "--bind-to", "none"};
  if (recovery) args.push_back("--enable-recovery");
  args.insert(args.end(), {"-np", "2", FAULT_RANK_EXE, scenario, std::to_string(kTimeoutS)});
  const Exit e = run_process(MPIEXEC_EXE, args, {"OMP_NUM_THREADS=1", "DISTMUON_NUM_THREADS=1"},
                             kTimeoutS + 60);
  EXPECT_TRUE(e.exited) << "mpirun did not end by itself: " << e.err;
  Reported r;
  std::istringstream out(e.out);
  for (std::string line; std::getline(out, line);) {
    if (line.rfind("RESULT ", 0) != 0) continue;
    std::istringstream fields(line.substr(7));
    fields >> r.kind >> r.seconds;
    std::getline(fields >> std::ws, r.message);
  }
  return r;
}

void expect_timeout_error(const Reported& r) {
  std::printf("[measure] error after %.2f s (DISTMUON_COMM_TIMEOUT_S=%g): %s\n", r.seconds,
              kTimeoutS, r.message.c_str());
  EXPECT_EQ(r.kind, "TimeoutError") << r.message;
  EXPECT_GE(r.seconds, kTimeoutS);
  EXPECT_LT(r.seconds, kTimeoutS + kSlackS);
  EXPECT_THAT(r.message, HasSubstr("on mpi:world (rank 0 of 2, world ranks 0,1)"));
  EXPECT_THAT(r.message, HasSubstr("did not complete within 3 s"));
  EXPECT_THAT(r.message, HasSubstr("DISTMUON_COMM_TIMEOUT_S"));
}

TEST(MpiFaults, AStalledPeerGivesATimeoutWithinTheTimeout) {
  const Reported r = run_fault("stall", true);
  expect_timeout_error(r);
  EXPECT_THAT(r.message, HasSubstr("all_reduce"));  // the vote of the step
}

TEST(MpiFaults, APeerKilledMidStepGivesATimeoutWithinTheTimeout) {
  expect_timeout_error(run_fault("kill", true));
}

TEST(MpiFaults, WithoutRecoveryTheLauncherEndsTheJob) {
  const Reported r = run_fault("kill", false);
  EXPECT_EQ(r.seconds, -1) << "rank 0 outlived its peer: " << r.message;
}

#ifdef DISTMUON_BENCH_EXE
// distmuon-bench ranks started with other options (an MPMD launch) used to stop inside MPI
// ("MPI Error in NBC subrequest", exit 15); now every rank names the cause before any work.
TEST(MpiFaults, BenchRanksStartedWithOtherOptionsSayWhy) {
  const std::vector<std::string> rank_args = {DISTMUON_BENCH_EXE, "--mode", "gather", "--layers",
                                              "1"};
  std::vector<std::string> args = {
      "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "1"};
  args.insert(args.end(), rank_args.begin(), rank_args.end());
  args.insert(args.end(), {"--steps", "1", ":", "-np", "1"});
  args.insert(args.end(), rank_args.begin(), rank_args.end());
  args.insert(args.end(), {"--steps", "2"});
  const Exit e =
      run_process(MPIEXEC_EXE, args, {"OMP_NUM_THREADS=1", "DISTMUON_NUM_THREADS=1"}, 120);
  EXPECT_TRUE(e.exited) << "signal " << e.signal;
  EXPECT_NE(e.code, 0);
  EXPECT_NE(e.err.find("distmuon-bench: error: the ranks were started with different options"),
            std::string::npos)
      << e.err;
  EXPECT_EQ(e.out.find("step ms"), std::string::npos) << "a comparison ran: " << e.out;
}
#endif

}  // namespace
}  // namespace distmuon::test
