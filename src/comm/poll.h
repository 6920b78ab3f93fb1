// Waiting for a communication request: both communicators poll their requests rather than block
// in the library, so that a wait can end at a deadline (a slow, dead or mismatched member) with
// an error instead of a hang.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace distmuon::comm_detail {

// Polls done() until it is true; the sleep between polls doubles from `first` up to `cap`
// (sleeping rather than spinning leaves the cores to the ranks that still compute). Once
// `deadline` has passed, timed_out() is called; it must throw. done() is asked at least once, so
// a deadline already past still finds an operation that has completed.
template <typename Done, typename TimedOut>
void poll_until(std::chrono::steady_clock::time_point deadline, std::chrono::microseconds first,
                std::chrono::microseconds cap, Done&& done, TimedOut&& timed_out) {
  for (auto backoff = first; !done(); backoff = std::min(backoff * 2, cap)) {
    if (std::chrono::steady_clock::now() >= deadline) timed_out();
    std::this_thread::sleep_for(backoff);
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
