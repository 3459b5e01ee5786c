#include "kvpool/block_residency.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvpool {
namespace {

// splitmix64: a small, well-mixed generator; the picks need no more.
uint64_t NextRandom(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

}  // namespace

BlockResidency::BlockResidency(int32_t num_blocks, double sample_rate, uint64_t seed)
    : sample_rate_(std::clamp(sample_rate, 0.0, 1.0)),
      rng_(seed),
      countdown_(0),
      // Nothing to follow when nothing is sampled: no per-block array either.
      followed_(sample_rate_ > 0 ? static_cast<size_t>(num_blocks) : 0, 0) {
  countdown_ = NextGap();
  stats_.sample_rate = sample_rate_;
}

int64_t BlockResidency::NextGap() {
  if (sample_rate_ <= 0) return kNever;
  if (sample_rate_ >= 1) return 1;
  // Geometric: the number of hand-outs up to and including the next pick, each picked with
  // probability sample_rate_. u in (0, 1].
  const double u = static_cast<double>((NextRandom(&rng_) >> 11) + 1) * 0x1.0p-53;
  const double gap = std::floor(std::log(u) / std::log1p(-sample_rate_)) + 1;
  return gap >= 0x1.0p62 ? kNever : static_cast<int64_t>(gap);
}

void BlockResidency::Pick(std::span<const BlockId> blocks, const uint32_t* generations,
                          size_t stride, int64_t now_ns) {
  const auto n = static_cast<int64_t>(blocks.size());
  int64_t k = countdown_ - 1;  // index in this call of the next pick
  while (k < n) {
    const BlockId block = blocks[static_cast<size_t>(k)];
    const auto i = static_cast<size_t>(block.value());
    samples_[block.value()] =
        Sample{.generation = generations[i * stride], .born_ns = now_ns, .last_access_ns = now_ns};
    followed_[i] = 1;
    ++stats_.sampled;
    const int64_t gap = NextGap();
    if (gap == kNever) {
      countdown_ = kNever;
      return;
    }
    k += gap;  // k < n and gap < 2^62: no overflow
  }
  countdown_ = k - n + 1;
}

BlockResidency::Sample* BlockResidency::Current(BlockId block, uint32_t generation) {
  auto it = samples_.find(block.value());
  if (it == samples_.end()) return nullptr;
  if (it->second.generation != generation) {
    samples_.erase(it);
    followed_[static_cast<size_t>(block.value())] = 0;
    return nullptr;
  }
  return &it->second;
}

void BlockResidency::Access(BlockId block, uint32_t generation, int64_t now_ns) {
  Sample* s = Current(block, generation);
  if (s == nullptr) return;
  s->last_access_ns = now_ns;
  if (s->num_accesses == kHistory) {
    std::copy(s->accesses.begin() + 1, s->accesses.end(), s->accesses.begin());
    s->accesses[kHistory - 1] = now_ns;
  } else {
    s->accesses[s->num_accesses++] = now_ns;
  }
}

void BlockResidency::Evict(BlockId block, uint32_t generation, int64_t now_ns) {
  Sample* s = Current(block, generation);
  if (s == nullptr) return;
  stats_.lifetime.Observe(Seconds(now_ns - s->born_ns));
  stats_.idle_before_evict.Observe(Seconds(now_ns - s->last_access_ns));
  for (size_t k = 1; k < s->num_accesses; ++k) {
    stats_.reuse_gap.Observe(Seconds(s->accesses[k] - s->accesses[k - 1]));
  }
  samples_.erase(block.value());
  followed_[static_cast<size_t>(block.value())] = 0;
}

}  // namespace kvpool
