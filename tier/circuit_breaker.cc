#include "tier/circuit_breaker.h"

#include <algorithm>

namespace kvpool::tier {

const char* BreakerStateName(BreakerState state) {
  switch (state) {
    case BreakerState::kClosed:
      return "closed";
    case BreakerState::kOpen:
      return "open";
    case BreakerState::kHalfOpen:
      return "half-open";
  }
  return "?";
}

CircuitBreaker::CircuitBreaker(const Options& options, const Clock* clock)
    : options_(options), clock_(clock), backoff_(options.backoff) {}

bool CircuitBreaker::Allow() {
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case BreakerState::kClosed:
      return true;
    case BreakerState::kHalfOpen:
      return false;  // the probe is out
    case BreakerState::kOpen:
      if (clock_->NowNanos() < probe_at_nanos_) return false;
      state_ = BreakerState::kHalfOpen;
      return true;
  }
  return false;
}

void CircuitBreaker::OnSuccess() {
  absl::MutexLock lock(&mu_);
  state_ = BreakerState::kClosed;
  consecutive_failures_ = 0;
  backoff_ = options_.backoff;
}

void CircuitBreaker::OnFailure() {
  absl::MutexLock lock(&mu_);
  switch (state_) {
    case BreakerState::kClosed:
      if (++consecutive_failures_ >= options_.failure_threshold) OpenLocked();
      return;
    case BreakerState::kHalfOpen:
      backoff_ = std::min(backoff_ * 2, options_.max_backoff);
      OpenLocked();
      return;
    case BreakerState::kOpen:
      return;  // a call allowed before the breaker opened reports late: already counted
  }
}

void CircuitBreaker::OpenLocked() {
  state_ = BreakerState::kOpen;
  consecutive_failures_ = 0;
  probe_at_nanos_ = clock_->NowNanos() + absl::ToInt64Nanoseconds(backoff_);
  ++opens_;
}

BreakerState CircuitBreaker::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

uint64_t CircuitBreaker::opens() const {
  absl::MutexLock lock(&mu_);
  return opens_;
}

absl::Status CircuitBreaker::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  if (consecutive_failures_ < 0 || consecutive_failures_ >= options_.failure_threshold) {
    return absl::InternalError("breaker: consecutive failures out of range");
  }
  if (state_ != BreakerState::kClosed && consecutive_failures_ != 0) {
    return absl::InternalError("breaker: failures counted while not closed");
  }
  if (backoff_ < options_.backoff || backoff_ > options_.max_backoff) {
    return absl::InternalError("breaker: backoff out of range");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::tier
