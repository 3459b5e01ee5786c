#pragma once

// CircuitBreaker: stops calling a remote that keeps failing, and tries it again later.
//
//   kClosed ──(failure_threshold consecutive failures)──> kOpen
//   kOpen ──(backoff elapsed; the next Allow() is the one probe)──> kHalfOpen
//   kHalfOpen ──success──> kClosed (backoff reset)
//   kHalfOpen ──failure──> kOpen (backoff doubled, at most max_backoff)
//
// While open, and while the probe is out, Allow() refuses everything else. Every allowed call
// must report exactly one OnSuccess() or OnFailure(). Thread-safe; time comes from the Clock.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/util/clock.h"

namespace kvpool::tier {

enum class BreakerState : uint8_t { kClosed, kOpen, kHalfOpen };
const char* BreakerStateName(BreakerState state);

class CircuitBreaker final {
 public:
  struct Options {
    int failure_threshold = 3;                       // consecutive failures that open it
    absl::Duration backoff = absl::Seconds(1);       // first wait before a probe
    absl::Duration max_backoff = absl::Seconds(30);  // cap of the doubling backoff
  };

  // REQUIRES: clock outlives the breaker; failure_threshold >= 1; 0 < backoff <= max_backoff.
  CircuitBreaker(const Options& options, const Clock* clock);

  // Whether a call may go to the remote now. May move kOpen to kHalfOpen (this caller probes).
  bool Allow();
  void OnSuccess();
  void OnFailure();

  BreakerState state() const;
  uint64_t opens() const;  // transitions into kOpen so far

  // consecutive failures < threshold while closed; a probe is out exactly when half-open.
  absl::Status CheckInvariants() const;

 private:
  void OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  BreakerState state_ ABSL_GUARDED_BY(mu_) = BreakerState::kClosed;
  int consecutive_failures_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_);
  int64_t probe_at_nanos_ ABSL_GUARDED_BY(mu_) = 0;  // when open: earliest probe time
  uint64_t opens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvpool::tier
