#pragma once

// How the core sees device ordering (DESIGN.md §6): a Fence names a point on a timeline (one
// device stream). The device layer implements FenceObserver; the core only asks whether a fence
// has passed, so it never includes device headers and tests can drive fences by hand.

#include <cstdint>

namespace kvpool {

// Timelines per pool (compute, transfer, client writes, spare). A fence's timeline is < this.
inline constexpr uint32_t kMaxTimelines = 4;

// All work submitted to `timeline` up to and including `value` (values start at 1 and grow by
// one per submission). Value 0 means "no work" and has always passed.
struct Fence {
  uint32_t timeline = 0;
  uint64_t value = 0;
};

class FenceObserver {
 public:
  virtual ~FenceObserver() = default;
  // True once every piece of work up to `fence` has completed. Thread-safe, never blocks.
  virtual bool HasPassed(Fence fence) const = 0;
};

}  // namespace kvpool
