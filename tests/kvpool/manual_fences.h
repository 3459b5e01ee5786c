#pragma once

// A FenceObserver the test drives: a fence has passed once Complete() moved its timeline to it.

#include <array>
#include <cstdint>

#include "kvpool/fence.h"

namespace kvpool::testing {

class ManualFences final : public FenceObserver {
 public:
  bool HasPassed(Fence fence) const override { return completed_[fence.timeline] >= fence.value; }
  void Complete(uint32_t timeline, uint64_t value) { completed_[timeline] = value; }

 private:
  std::array<uint64_t, kMaxTimelines> completed_{};
};

}  // namespace kvpool::testing
