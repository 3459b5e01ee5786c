#include "tier/circuit_breaker.h"

#include <random>

#include "gtest/gtest.h"

namespace kvpool::tier {
namespace {

constexpr int64_t kMs = 1'000'000;

class CircuitBreakerTest : public ::testing::Test {
 protected:
  ManualClock clock_;
  CircuitBreaker breaker_{{.failure_threshold = 3,
                           .backoff = absl::Milliseconds(100),
                           .max_backoff = absl::Milliseconds(400)},
                          &clock_};
};

TEST_F(CircuitBreakerTest, OpensAfterThresholdConsecutiveFailures) {
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(breaker_.Allow());
    breaker_.OnFailure();
  }
  ASSERT_TRUE(breaker_.Allow());
  breaker_.OnSuccess();  // a success resets the count
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(breaker_.state(), BreakerState::kClosed);
    ASSERT_TRUE(breaker_.Allow());
    breaker_.OnFailure();
  }
  EXPECT_EQ(breaker_.state(), BreakerState::kOpen);
  EXPECT_EQ(breaker_.opens(), 1u);
  EXPECT_FALSE(breaker_.Allow());
}

TEST_F(CircuitBreakerTest, OneProbeAfterBackoffThenClosesOnSuccess) {
  for (int i = 0; i < 3; ++i) {
    breaker_.Allow();
    breaker_.OnFailure();
  }
  clock_.Advance(99 * kMs);
  EXPECT_FALSE(breaker_.Allow());
  clock_.Advance(1 * kMs);
  EXPECT_TRUE(breaker_.Allow());  // the probe
  EXPECT_EQ(breaker_.state(), BreakerState::kHalfOpen);
  EXPECT_FALSE(breaker_.Allow());  // only one probe at a time
  breaker_.OnSuccess();
  EXPECT_EQ(breaker_.state(), BreakerState::kClosed);
  EXPECT_TRUE(breaker_.Allow());
}

TEST_F(CircuitBreakerTest, FailedProbeDoublesTheBackoffUpToTheCap) {
  for (int i = 0; i < 3; ++i) {
    breaker_.Allow();
    breaker_.OnFailure();
  }
  int64_t backoff = 100;
  clock_.Advance(backoff * kMs);
  for (int round = 0; round < 4; ++round) {
    ASSERT_TRUE(breaker_.Allow()) << round;  // the probe, which fails
    breaker_.OnFailure();
    backoff = std::min<int64_t>(backoff * 2, 400);
    clock_.Advance((backoff - 1) * kMs);
    EXPECT_FALSE(breaker_.Allow()) << round;
    clock_.Advance(1 * kMs);
  }
  EXPECT_EQ(breaker_.opens(), 5u);
}

// Seeded random calls and outcomes against a reference model of the state machine, invariants
// checked after every step.
TEST_F(CircuitBreakerTest, RandomizedAgainstReferenceModel) {
  std::mt19937 rng(1234);
  enum class S { kClosed, kOpen, kHalfOpen } s = S::kClosed;
  int failures = 0;
  int64_t backoff = 100, probe_at = 0;
  bool outstanding = false;  // a call was allowed and has not reported
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 4);
    if (op == 0) {
      clock_.Advance(static_cast<int64_t>(rng() % 150) * kMs);
    } else if (op == 1 && !outstanding) {
      bool want = false;
      if (s == S::kClosed) {
        want = true;
      } else if (s == S::kOpen && clock_.NowNanos() >= probe_at) {
        want = true;
        s = S::kHalfOpen;
      }
      ASSERT_EQ(breaker_.Allow(), want) << step;
      outstanding = want;
    } else if (outstanding) {
      outstanding = false;
      if (rng() % 3 == 0) {
        breaker_.OnSuccess();
        s = S::kClosed;
        failures = 0;
        backoff = 100;
      } else {
        breaker_.OnFailure();
        if (s == S::kHalfOpen) backoff = std::min<int64_t>(backoff * 2, 400);
        if (s == S::kHalfOpen || ++failures >= 3) {
          s = S::kOpen;
          failures = 0;
          probe_at = clock_.NowNanos() + backoff * kMs;
        }
      }
    }
    ASSERT_EQ(static_cast<int>(breaker_.state()), static_cast<int>(s)) << step;
    ASSERT_TRUE(breaker_.CheckInvariants().ok()) << step;
  }
}

}  // namespace
}  // namespace kvpool::tier
