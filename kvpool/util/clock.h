#pragma once

// Time source, injectable for tests. Thread-safe.

#include <atomic>
#include <cstdint>

namespace kvpool {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic time in nanoseconds since an arbitrary origin.
  virtual int64_t NowNanos() const = 0;

  // The process-wide steady clock. Never null; lives forever.
  static const Clock* Real();
};

// A clock that moves only when told to. For deterministic tests.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_nanos = 0) : now_(start_nanos) {}

  int64_t NowNanos() const override { return now_.load(std::memory_order_relaxed); }
  void Advance(int64_t nanos) { now_.fetch_add(nanos, std::memory_order_relaxed); }
  void Set(int64_t nanos) { now_.store(nanos, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace kvpool
