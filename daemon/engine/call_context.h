#pragma once

// CallContext: what the engine knows of a call's caller while the call runs, namely whether the
// caller still waits for the answer. The engine asks before it changes anything, at every wait
// (the step queue, before each step's planning, between prefill chunks) and before it answers: a
// call whose caller gave up is refused, or, if it already created something (a sequence the
// caller never learns of), that is released before the call returns (DESIGN.md §4.7).
//
// The gRPC edge implements it over the server context; tests and in-process callers cancel by
// hand. Thread-safe: the engine asks from any thread.

#include <atomic>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "kvpool/util/clock.h"

namespace kvpool::daemon {

class CallContext {
 public:
  virtual ~CallContext() = default;
  // OK while the caller waits for the answer; CANCELLED once it cancelled or went away;
  // DEADLINE_EXCEEDED once its deadline passed. Never OK again after that.
  virtual absl::Status Check() const = 0;

  // Never cancelled, no deadline (in-process callers, the daemon's own work).
  static const CallContext& Uncancellable();
};

// Cancelled by hand, with an optional deadline on `clock` (not owned; outlives this).
class ManualCallContext final : public CallContext {
 public:
  explicit ManualCallContext(const Clock* clock = Clock::Real(),
                             int64_t deadline_nanos = std::numeric_limits<int64_t>::max())
      : clock_(clock), deadline_nanos_(deadline_nanos) {}

  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  absl::Status Check() const override;

 private:
  const Clock* const clock_;
  const int64_t deadline_nanos_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace kvpool::daemon
