#pragma once

// StepTimeline: the fences of model steps, which run on the host (the StepRunner's thread), not
// on a device stream. It is the pool's FenceObserver: fences on kTimeline are model steps and
// pass when the step has finished; every other timeline is a device stream and is asked of the
// device. So a block a running step reads stays RETIRING, if released meanwhile, until the step
// is done, without routing the step through a stream thread.
//
// Thread-safe. Steps complete in the order their fences were issued (one runner thread).

#include <atomic>
#include <cstdint>

#include "kvpool/fence.h"

namespace kvpool::daemon {

class StepTimeline final : public FenceObserver {
 public:
  // The spare timeline (DESIGN.md §6: compute, transfer, client writes, spare).
  static constexpr uint32_t kTimeline = 3;

  // `device` answers for the other timelines; not owned, outlives this.
  explicit StepTimeline(const FenceObserver* device) : device_(device) {}

  // The fence of the next step.
  Fence Issue() { return Fence{kTimeline, issued_.fetch_add(1) + 1}; }
  // The step of `fence` (and every one issued before it) has finished.
  void Complete(Fence fence) { completed_.store(fence.value, std::memory_order_release); }

  bool HasPassed(Fence fence) const override {
    if (fence.timeline != kTimeline) return device_->HasPassed(fence);
    return completed_.load(std::memory_order_acquire) >= fence.value;
  }

 private:
  const FenceObserver* const device_;
  std::atomic<uint64_t> issued_{0};
  std::atomic<uint64_t> completed_{0};
};

}  // namespace kvpool::daemon
