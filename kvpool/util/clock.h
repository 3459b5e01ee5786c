#pragma once

// Time source, injectable for tests: everything that reads the time or waits for it takes a
// Clock. Thread-safe.

#include <atomic>
#include <cstdint>

#include "absl/synchronization/mutex.h"

namespace kvpool {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic time in nanoseconds since an arbitrary origin.
  virtual int64_t NowNanos() const = 0;

  // Waits until `condition` holds or this clock reads `deadline_nanos` or later, releasing `mu`
  // while it waits (as absl::Mutex::AwaitWithDeadline). Returns whether `condition` holds.
  // REQUIRES: `mu` is held; `condition` reads only state guarded by `mu`.
  virtual bool AwaitUntil(absl::Mutex& mu, const absl::Condition& condition,
                          int64_t deadline_nanos) const = 0;

  // For a thread that waits in poll()/epoll_wait() (a descriptor can wake it, this clock cannot):
  // how many real milliseconds it may sleep before it must read this clock again to notice
  // `deadline_nanos`. 0 once the deadline has passed; never negative (the caller passes -1 itself
  // when it has no deadline).
  virtual int PollTimeoutMs(int64_t deadline_nanos) const = 0;

  // The process-wide steady clock. Never null; lives forever.
  static const Clock* Real();
};

// A clock that moves only when told to. For deterministic tests: a waiter whose deadline lies
// ahead waits (however long that takes in real time) until its condition holds or the test
// advances the clock past the deadline.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_nanos = 0) : now_(start_nanos) {}

  int64_t NowNanos() const override { return now_.load(std::memory_order_acquire); }
  void Advance(int64_t nanos) { now_.fetch_add(nanos, std::memory_order_acq_rel); }
  void Set(int64_t nanos) { now_.store(nanos, std::memory_order_release); }

  // Re-reads the manual time every millisecond of real time while it waits: the time only
  // changes by Advance()/Set(), which cannot wake a waiter blocked on someone else's mutex.
  bool AwaitUntil(absl::Mutex& mu, const absl::Condition& condition,
                  int64_t deadline_nanos) const override;
  // 1 while the deadline lies ahead: a poller re-reads the manual time every millisecond, as
  // AwaitUntil does, so an Advance() past its deadline wakes it within about a millisecond.
  int PollTimeoutMs(int64_t deadline_nanos) const override {
    return NowNanos() >= deadline_nanos ? 0 : 1;
  }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace kvpool
