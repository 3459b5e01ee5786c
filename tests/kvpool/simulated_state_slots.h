#pragma once

// The bytes of a state group's slots, simulated for randomized tests: a state's content is a value
// naming the exact tokens it has consumed (StateOf), and device work on the slots (a plan's zeros
// and copies, a step's writes) lands when its fence has passed, after the earlier work on the same
// slot since the slot was handed out (dependent work is ordered, as on one stream). Work that
// reads a slot checks it holds what the caller's model says, so a slot that holds another state
// than its owner believes (reused under a pending fence, copied from the wrong slot, a checkpoint
// kept before its step ran or on the wrong block) fails the test where the wrong state is read.

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/block_pool.h"
#include "tests/kvpool/timeline_fences.h"

namespace kvpool::testing {

// The state after the first `p` tokens of `t`: a value naming exactly those tokens (0 for none,
// as a zeroed slot).
inline uint64_t StateOf(const std::vector<int32_t>& t, int64_t p) {
  uint64_t h = 0;
  for (int64_t i = 0; i < p; ++i) {
    h = (h ^ static_cast<uint64_t>(t[static_cast<size_t>(i)] + 1)) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  return p == 0 ? 0 : h | 1;
}

// One piece of device work, enqueued up to `fence`: writes `value` into slot `dst`, or copies
// slot `src` into it; `src` (when set) is read and must hold `src_want`.
struct SlotOp {
  int32_t dst = -1;
  int32_t src = -1;
  bool copy = false;
  uint64_t value = 0;
  uint64_t src_want = 0;
  Fence fence;
  const char* what = "";
  uint64_t dst_epoch = 0;  // set by Enqueue
  uint64_t src_epoch = 0;
};

class SimulatedStateSlots {
 public:
  SimulatedStateSlots(int32_t slots, TimelineFences* fences, std::mt19937_64* rng,
                      uint64_t max_outstanding)
      : fences_(fences),
        rng_(rng),
        max_outstanding_(max_outstanding),
        bytes_(Size(slots)),
        marks_(Size(slots)),
        epoch_(Size(slots)),
        waited_(Size(slots)) {
    // Garbage in every slot: a state never zeroed or copied shows up at its first read.
    for (size_t s = 0; s < bytes_.size(); ++s) bytes_[s] = 0xdead0000u + s;
  }

  // Every fence `slot` was marked with since it was handed out has passed.
  bool Passed(int32_t slot) const {
    for (uint32_t t = 0; t < kMaxTimelines; ++t) {
      if (marks_[Size(slot)][t] > fences_->completed(t)) return false;
    }
    return true;
  }
  // `slot` goes to a new owner: its fences must have passed. Work enqueued from now on does not
  // wait for the previous owner's (a slot reused too early is overwritten late).
  void HandOut(int32_t slot) {
    ASSERT_TRUE(slot >= 0 && Size(slot) < bytes_.size()) << "slot " << slot;
    ASSERT_TRUE(Passed(slot)) << "slot " << slot << " handed out before its fence passed";
    if (waited_[Size(slot)]) ++reused_;
    waited_[Size(slot)] = false;
    marks_[Size(slot)].fill(0);
    ++epoch_[Size(slot)];
  }
  // A fence for work on `slots`: on the timeline of pending work it depends on, else on any, with
  // room on it (completing some of its fences first if not).
  Fence NewFence(std::initializer_list<int32_t> slots) {
    auto timeline = static_cast<uint32_t>((*rng_)() % kMaxTimelines);
    for (const SlotOp& o : ops_) {
      for (int32_t s : slots) {
        if (Touches(o, s)) timeline = o.fence.timeline;
      }
    }
    if (fences_->Outstanding(timeline) >= max_outstanding_) Complete(timeline);
    return fences_->Issue(timeline);
  }
  // Records that the manager was told `slots` are in flight up to `fence`.
  void Marked(std::span<const BlockId> slots, Fence fence) {
    for (BlockId s : slots) {
      uint64_t& mark = marks_[Size(s.value())][fence.timeline];
      mark = std::max(mark, fence.value);
      waited_[Size(s.value())] = true;
    }
  }
  void Enqueue(SlotOp op) {
    op.dst_epoch = epoch_[Size(op.dst)];
    if (op.src >= 0) op.src_epoch = epoch_[Size(op.src)];
    ops_.push_back(op);
  }
  // Work on `slot` (its current owner's) has yet to land.
  bool Pending(int32_t slot) const {
    return std::any_of(ops_.begin(), ops_.end(), [&](const SlotOp& o) { return Touches(o, slot); });
  }
  // Completes some of a timeline's fences and lands what they finish.
  void Complete(uint32_t timeline) {
    const uint64_t outstanding = fences_->Outstanding(timeline);
    if (outstanding == 0) return;
    fences_->Complete(timeline, fences_->completed(timeline) + 1 + (*rng_)() % outstanding);
    Land();
  }
  // Lands every piece of work whose fence has passed and whose slots no earlier pending work of
  // the same owners touches, in issue order.
  void Land() {
    std::set<std::pair<int32_t, uint64_t>> blocked;
    std::deque<SlotOp> kept;
    for (const SlotOp& o : ops_) {
      const std::pair dst{o.dst, o.dst_epoch};
      const std::pair src{o.src, o.src_epoch};
      if (!fences_->HasPassed(o.fence) || blocked.contains(dst) ||
          (o.src >= 0 && blocked.contains(src))) {
        blocked.insert(dst);
        if (o.src >= 0) blocked.insert(src);
        kept.push_back(o);
        continue;
      }
      if (o.src >= 0) {
        ASSERT_EQ(bytes_[Size(o.src)], o.src_want)
            << o.what << ": slot " << o.src << " does not hold the state it should (into slot "
            << o.dst << "): it holds " << Describe(bytes_[Size(o.src)]) << ", not "
            << Describe(o.src_want);
      }
      bytes_[Size(o.dst)] = o.copy ? bytes_[Size(o.src)] : o.value;
      ++landed_[o.what];
    }
    ops_ = std::move(kept);
  }

  // StateOf, remembering the tokens for failure messages.
  uint64_t State(const std::vector<int32_t>& t, int64_t p) {
    const uint64_t v = StateOf(t, p);
    if (v != 0) names_.try_emplace(v, t.begin(), t.begin() + p);
    return v;
  }
  std::string Describe(uint64_t value) const {
    auto it = names_.find(value);
    if (it == names_.end()) return value == 0 ? "the zero state" : "garbage";
    std::string out = "the state after " + std::to_string(it->second.size()) + " tokens [";
    for (int32_t t : it->second) out += std::to_string(t) + " ";
    return out + "]";
  }

  uint64_t bytes(int32_t slot) const { return bytes_[Size(slot)]; }
  // Slots handed out again after their previous owner marked them in flight.
  int64_t reused() const { return reused_; }
  // Work landed, by its `what`.
  int64_t landed(const std::string& what) const {
    auto it = landed_.find(what);
    return it == landed_.end() ? 0 : it->second;
  }

 private:
  static size_t Size(int32_t n) { return static_cast<size_t>(n); }
  bool Touches(const SlotOp& o, int32_t slot) const {
    return (o.dst == slot && o.dst_epoch == epoch_[Size(slot)]) ||
           (o.src == slot && o.src_epoch == epoch_[Size(slot)]);
  }

  TimelineFences* const fences_;
  std::mt19937_64* const rng_;
  const uint64_t max_outstanding_;
  std::vector<uint64_t> bytes_;
  std::vector<std::array<uint64_t, kMaxTimelines>> marks_;  // since hand-out
  std::vector<uint64_t> epoch_;                             // hand-outs so far
  std::vector<bool> waited_;                                // marked since hand-out
  std::deque<SlotOp> ops_;
  std::map<uint64_t, std::vector<int32_t>> names_;  // StateOf values seen: their tokens
  std::map<std::string, int64_t> landed_;
  int64_t reused_ = 0;
};

}  // namespace kvpool::testing
