#pragma once

// A FenceObserver a randomized test drives: it issues fences per timeline; each timeline
// completes in order, timelines in any order among themselves.

#include <array>
#include <cstdint>

#include "kvpool/fence.h"

namespace kvpool::testing {

class TimelineFences final : public FenceObserver {
 public:
  bool HasPassed(Fence fence) const override { return completed_[fence.timeline] >= fence.value; }
  Fence Issue(uint32_t timeline) { return Fence{timeline, ++issued_[timeline]}; }
  uint64_t Outstanding(uint32_t timeline) const { return issued_[timeline] - completed_[timeline]; }
  void Complete(uint32_t timeline, uint64_t value) { completed_[timeline] = value; }
  uint64_t completed(uint32_t timeline) const { return completed_[timeline]; }

 private:
  std::array<uint64_t, kMaxTimelines> issued_{};
  std::array<uint64_t, kMaxTimelines> completed_{};
};

}  // namespace kvpool::testing
