// Waiting for a communication request: both communicators poll their requests rather than block
// in the library, so that a wait can end at a deadline (a slow, dead or mismatched member) with
// an error instead of a hang.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace distmuon::comm_detail {

// How long a wait polls without sleeping: most requests (an NCCL launch accepted by its thread, a
// small collective) finish within tens of microseconds, and the shortest sleep the kernel grants
// is about 50 us (its timer slack), which every collective of a step (several per bucket) would
// pay on top of its own time.
inline constexpr std::chrono::microseconds kSpinBeforeSleep{100};

// Polls done() until it is true: for kSpinBeforeSleep yielding the core between polls, then
// sleeping, the sleep doubling from `first` up to `cap` (sleeping rather than spinning leaves the
// cores to the ranks that still compute). Once `deadline` has passed, timed_out() is called; it
// must throw. done() is asked at least once, so a deadline already past still finds an operation
// that has completed.
template <typename Done, typename TimedOut>
void poll_until(std::chrono::steady_clock::time_point deadline, std::chrono::microseconds first,
                std::chrono::microseconds cap, Done&& done, TimedOut&& timed_out) {
  const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  for (auto backoff = first; !done();) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) timed_out();
    if (now < spin_until) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, cap);
  }
}

// The same with a deadline `timeout_s` from now.
template <typename Done, typename TimedOut>
void poll_until_done(double timeout_s, std::chrono::microseconds first,
                     std::chrono::microseconds cap, Done&& done, TimedOut&& timed_out) {
  poll_until(std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(timeout_s)),
             first, cap, done, timed_out);
}

}  // namespace distmuon::comm_detail
