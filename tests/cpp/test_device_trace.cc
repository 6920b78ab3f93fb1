// The per-rank breakdown of distmuon-bench's profiled step: unions of a rank's compute and NCCL
// intervals inside its step window, and the idle rest.
#include <gtest/gtest.h>

#include <vector>

#include "device_trace.h"

namespace distmuon::bench {
namespace {

TEST(StepBreakdown, UnionsOfComputeAndCommunicationAndTheIdleRest) {
  // Rank context 7, window [1000, 2000) ns: compute [1100, 1300) and [1250, 1400) (one union of
  // 300), NCCL [1350, 1600) (50 under compute, 200 exposed), a copy [1900, 2100) clipped to 100;
  // another context's work is not this rank's.
  const std::vector<DeviceInterval> iv = {{1100, 1300, 7, false}, {1250, 1400, 7, false},
                                          {1350, 1600, 7, true},  {1900, 2100, 7, false},
                                          {1000, 2000, 8, false}, {500, 900, 7, false}};
  const StepBreakdown b = break_down(iv, 7, 1000, 2000);
  EXPECT_DOUBLE_EQ(b.window_ms, 1000e-6);
  EXPECT_DOUBLE_EQ(b.compute_ms, 400e-6);
  EXPECT_DOUBLE_EQ(b.comm_ms, 200e-6);
  EXPECT_DOUBLE_EQ(b.overlap_ms, 50e-6);
  EXPECT_DOUBLE_EQ(b.wait_ms, 400e-6);
  EXPECT_DOUBLE_EQ(b.compute_ms + b.comm_ms + b.wait_ms, b.window_ms);
  // Nothing recorded for a context: all waiting.
  const StepBreakdown idle = break_down(iv, 9, 1000, 2000);
  EXPECT_DOUBLE_EQ(idle.wait_ms, idle.window_ms);
  EXPECT_DOUBLE_EQ(idle.compute_ms, 0);
}

}  // namespace
}  // namespace distmuon::bench
