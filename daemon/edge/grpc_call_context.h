#pragma once

// GrpcCallContext: the engine's CallContext over a gRPC callback call. The caller gave up when
// gRPC says the call is cancelled (the client cancelled or went away), or its deadline, carried
// over onto the engine's clock at the call's start, has passed.
//
// Thread-safe (ServerContextBase::IsCancelled() is, on the callback API). Valid until the call's
// reactor has finished.

#include <chrono>
#include <cstdint>
#include <limits>

#include "daemon/engine/call_context.h"
#include "grpcpp/grpcpp.h"
#include "kvpool/util/clock.h"

namespace kvpool::daemon {

class GrpcCallContext final : public CallContext {
 public:
  GrpcCallContext(const grpc::ServerContextBase* context, const Clock* clock)
      : context_(context), clock_(clock), deadline_ns_(Deadline(*context, *clock)) {}

  absl::Status Check() const override {
    const bool late = clock_->NowNanos() >= deadline_ns_;
    if (late) return absl::DeadlineExceededError("the call ran past its deadline");
    if (context_->IsCancelled()) return absl::CancelledError("the client cancelled the call");
    return absl::OkStatus();
  }

 private:
  static int64_t Deadline(const grpc::ServerContextBase& context, const Clock& clock) {
    const auto deadline = context.deadline();
    if (deadline == std::chrono::system_clock::time_point::max()) {
      return std::numeric_limits<int64_t>::max();
    }
    const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             deadline - std::chrono::system_clock::now())
                             .count();
    return clock.NowNanos() + left;
  }

  const grpc::ServerContextBase* const context_;
  const Clock* const clock_;
  const int64_t deadline_ns_;
};

}  // namespace kvpool::daemon
