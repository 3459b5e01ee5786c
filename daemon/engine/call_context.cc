#include "daemon/engine/call_context.h"

namespace kvpool::daemon {
namespace {

class Uncancellable final : public CallContext {
 public:
  absl::Status Check() const override { return absl::OkStatus(); }
};

}  // namespace

const CallContext& CallContext::Uncancellable() {
  static const class Uncancellable context;
  return context;
}

absl::Status ManualCallContext::Check() const {
  if (cancelled_.load(std::memory_order_acquire)) {
    return absl::CancelledError("the caller cancelled the call");
  }
  if (clock_->NowNanos() >= deadline_nanos_) {
    return absl::DeadlineExceededError("the call ran past its deadline");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::daemon
