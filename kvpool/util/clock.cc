#include "kvpool/util/clock.h"

#include <algorithm>
#include <chrono>
#include <climits>

#include "absl/time/time.h"

namespace kvpool {
namespace {

class SteadyClock final : public Clock {
 public:
  int64_t NowNanos() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool AwaitUntil(absl::Mutex& mu, const absl::Condition& condition,
                  int64_t deadline_nanos) const override {
    // absl waits against its own clock: hand it the time left on ours.
    const int64_t left = deadline_nanos - NowNanos();
    if (left <= 0) return condition.Eval();
    return mu.AwaitWithTimeout(condition, absl::Nanoseconds(left));
  }

  int PollTimeoutMs(int64_t deadline_nanos) const override {
    const int64_t left = deadline_nanos - NowNanos();
    if (left <= 0) return 0;
    // Rounded up: a poller that wakes a little early would only spin on the deadline.
    return static_cast<int>(std::min<int64_t>((left + 999'999) / 1'000'000, INT_MAX));
  }
};

}  // namespace

const Clock* Clock::Real() {
  static const SteadyClock clock;
  return &clock;
}

bool ManualClock::AwaitUntil(absl::Mutex& mu, const absl::Condition& condition,
                             int64_t deadline_nanos) const {
  for (;;) {
    if (condition.Eval()) return true;
    if (NowNanos() >= deadline_nanos) return false;
    mu.AwaitWithTimeout(condition, absl::Milliseconds(1));
  }
}

}  // namespace kvpool
