#include "kvpool/util/clock.h"

#include <chrono>

namespace kvpool {
namespace {

class SteadyClock final : public Clock {
 public:
  int64_t NowNanos() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

}  // namespace

const Clock* Clock::Real() {
  static const SteadyClock clock;
  return &clock;
}

}  // namespace kvpool
