// Waiting for a communication request: both communicators poll their requests rather than block
// in the library, so that a wait can end at a deadline (a slow, dead or mismatched member) with
// an error instead of a hang.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace distmuon::comm_detail {

// Polls done() until it is true; the sleep between polls doubles from `first` up to `cap`
// (sleeping rather than spinning leaves the cores to the ranks that still compute). At
// `timeout_s`, timed_out() is called; it must throw.
template <typename Done, typename TimedOut>
void poll_until_done(double timeout_s, std::chrono::microseconds first, std::chrono::microseconds cap,
                     Done&& done, TimedOut&& timed_out) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (auto backoff = first; !done(); backoff = std::min(backoff * 2, cap)) {
    if (Clock::now() >= deadline) timed_out();
    std::this_thread::sleep_for(backoff);
  }
}

}  // namespace distmuon::comm_detail
