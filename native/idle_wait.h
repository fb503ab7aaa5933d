// Pacing for a thread that progresses a UCX worker while it waits for its
// own requests (the gather, the node's pulls): spin while things move,
// yield the core after 10 us of fruitless progress, sleep 20 us after
// 100 us. By time, not by count: a TCP progress call is a system call, an
// RDMA one far cheaper, so counted polls spun for milliseconds over TCP and
// left the peer's progress thread without a core on 2 cores (slower TCP
// inserts, more node CPU per GB; docs/performance.md).
//
// Thread safety: one per waiting call, on its stack.
#pragma once

#include <sched.h>

#include <chrono>
#include <thread>

namespace distore {

class IdleWait {
 public:
  // Something moved: the next fruitless round starts a new quiet stretch.
  void reset() { idle_ = 0; }
  // One fruitless round: pauses as above (1 ms when `slow`: the caller only
  // waits for stragglers). Returns the fruitless rounds so far, this one
  // included, for callers that check a deadline every so many rounds.
  unsigned pause(bool slow) {
    const auto now = std::chrono::steady_clock::now();
    if (idle_ == 0) from_ = now;
    const auto quiet = now - from_;
    if (slow) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else if (quiet > std::chrono::microseconds(100)) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else if (quiet > std::chrono::microseconds(10)) {
      sched_yield();
    }
    return ++idle_;
  }

 private:
  unsigned idle_ = 0;
  std::chrono::steady_clock::time_point from_;
};

}  // namespace distore
