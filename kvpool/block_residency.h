#pragma once

// BlockResidency: how long KV blocks live in the pool, from a sample of them, as vLLM's
// KVCacheMetricsCollector measures it (vllm/v1/core/kv_cache_metrics.py, exported as
// vllm:kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds):
//   - a share `sample_rate` of the blocks handed out from the free list is followed, from that
//     hand-out ("birth");
//   - each prefix-cache hit on a followed block is an access (its last four are remembered);
//   - when the prefix cache lets a followed block go and nothing else holds it (an eviction),
//     three things are observed: lifetime (birth to eviction), idle time (last access, or birth,
//     to eviction) and the gaps between its remembered accesses; the block stops being followed.
// A followed block that leaves without being evicted (released uncached, or evicted while a
// sequence still holds it) is observed by nothing; the hand-out that next reuses it forgets it.
//
// Cost: a hand-out of n blocks none of which is sampled is one compare and one subtraction for
// the whole call (the sampler counts down to its next pick, drawn from a geometric distribution,
// so exactly a `sample_rate` share is picked in expectation); an access or eviction is one byte
// load unless the block is followed. With sample_rate 0 nothing is allocated per block and the
// owner calls none of the On* hooks (BlockPool tests a cached flag instead: one predictable
// branch per call, nothing touched). Deterministic for a given seed. Times come from the
// caller's injected Clock (TraceContext::time_ns).
//
// Thread-compatible: BlockPool owns it, under the owner's lock.

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/container/flat_hash_map.h"
#include "kvpool/util/histogram.h"
#include "kvpool/util/strong_id.h"

namespace kvpool {

// vLLM's residency buckets (seconds; loggers.py, kv_cache_residency_buckets).
inline constexpr double kResidencyBucketsSeconds[] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                      0.2,   0.5,   1,     2,    5,    10,   20,
                                                      30,    60,    120,   300,  600,  1200, 1800};

struct BlockResidencyStats {
  Histogram lifetime{kResidencyBucketsSeconds};           // hand-out to eviction, seconds
  Histogram idle_before_evict{kResidencyBucketsSeconds};  // last access to eviction, seconds
  Histogram reuse_gap{kResidencyBucketsSeconds};          // between consecutive accesses, seconds
  uint64_t sampled = 0;    // hand-outs picked to be followed (counter)
  double sample_rate = 0;  // the configured share (0: not measured)
};

class BlockResidency final {
 public:
  // `sample_rate` in [0, 1]: the share of hand-outs followed (0: none, and no cost beyond the
  // countdown compare). `seed` makes the picks reproducible.
  BlockResidency(int32_t num_blocks, double sample_rate, uint64_t seed);

  // `blocks` were handed out at `now_ns`; block b's generation (already bumped) is
  // generations[b * stride] (the pool keeps it in a per-block record).
  void OnHandOut(std::span<const BlockId> blocks, const uint32_t* generations, size_t stride,
                 int64_t now_ns) {
    const auto n = static_cast<int64_t>(blocks.size());
    if (ABSL_PREDICT_TRUE(n < countdown_)) {
      countdown_ -= n;
      return;
    }
    Pick(blocks, generations, stride, now_ns);
  }
  // Whether any share is followed (sample_rate > 0).
  bool sampling() const { return sample_rate_ > 0; }

  // The prefix cache served `block` (of `generation`) to a new holder at `now_ns`.
  // REQUIRES (this and OnEvict): sampling().
  void OnAccess(BlockId block, uint32_t generation, int64_t now_ns) {
    if (ABSL_PREDICT_FALSE(followed_[static_cast<size_t>(block.value())] != 0)) {
      Access(block, generation, now_ns);
    }
  }
  // The prefix cache let `block` go and nothing holds it any more, at `now_ns`.
  void OnEvict(BlockId block, uint32_t generation, int64_t now_ns) {
    if (ABSL_PREDICT_FALSE(followed_[static_cast<size_t>(block.value())] != 0)) {
      Evict(block, generation, now_ns);
    }
  }

  const BlockResidencyStats& stats() const { return stats_; }
  // Blocks followed now (tests).
  size_t followed() const { return samples_.size(); }

 private:
  static constexpr size_t kHistory = 4;  // accesses remembered per block, as vLLM's deque
  struct Sample {
    uint32_t generation = 0;
    int64_t born_ns = 0;
    int64_t last_access_ns = 0;
    std::array<int64_t, kHistory> accesses{};  // oldest first
    uint8_t num_accesses = 0;
  };

  // Hand-outs until the next pick: >= 1, or "never" when sample_rate is 0.
  int64_t NextGap();
  void Pick(std::span<const BlockId> blocks, const uint32_t* generations, size_t stride,
            int64_t now_ns);
  void Access(BlockId block, uint32_t generation, int64_t now_ns);
  void Evict(BlockId block, uint32_t generation, int64_t now_ns);
  // The sample of `block` if it is of `generation`; a stale one (the block was handed out again
  // unpicked) is forgotten and null returned.
  Sample* Current(BlockId block, uint32_t generation);

  const double sample_rate_;
  uint64_t rng_;
  int64_t countdown_;
  std::vector<uint8_t> followed_;  // per block: 1 when samples_ has an entry for it
  absl::flat_hash_map<int32_t, Sample> samples_;
  BlockResidencyStats stats_;
};

}  // namespace kvpool
