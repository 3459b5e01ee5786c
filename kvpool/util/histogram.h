#pragma once

// Histogram: observations counted into fixed buckets (Prometheus's model: an upper bound per
// bucket, a +Inf bucket above them all, the sum and count of what was observed). The bounds are
// fixed at construction, so observing never allocates. Thread-compatible: the owner's lock
// guards it (the engine's, for the step histograms).

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace kvpool {

class Histogram final {
 public:
  // REQUIRES: `upper_bounds` ascending, and it outlives the histogram (a static table).
  explicit Histogram(std::span<const double> upper_bounds)
      : bounds_(upper_bounds), counts_(upper_bounds.size() + 1, 0) {}

  // Counts `value` in the first bucket whose upper bound is >= value (the +Inf one past all).
  void Observe(double value) {
    const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), value);
    ++counts_[static_cast<size_t>(it - bounds_.begin())];
    sum_ += value;
    ++count_;
  }

  std::span<const double> bounds() const { return bounds_; }
  // counts()[i]: observations in (bounds()[i-1], bounds()[i]]; the last one: above every bound.
  // Not cumulative (the exposition adds them up).
  std::span<const uint64_t> counts() const { return counts_; }
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::span<const double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

}  // namespace kvpool
