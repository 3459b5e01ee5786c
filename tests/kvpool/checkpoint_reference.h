#pragma once

// What the state checkpoints of a KvCacheManager (docs/hybrid-groups.md §4) should be, worked out
// from the outside, for randomized tests: the checkpoints it keeps (what its DebugString lists,
// read through KvCacheManagerTestPeer: formatting the whole manager after every operation was
// most of the test's time), the deepest one a prompt reaches, the positions a step is to
// checkpoint, the eviction order and its priorities, and where a step may write.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvpool/kv_cache_manager.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"

namespace kvpool::testing {

struct CachedCheckpoint {
  int32_t offset = 0;  // the state after this many of its block's tokens
  int32_t slot = -1;
  uint64_t stamp = 0;     // when it was last kept or used (the order among equal priorities)
  uint64_t priority = 0;  // its place in the eviction order (lowest first)
};

// The checkpoints the tree keeps, by tree block. With `in_order`, also whether the manager lists
// them in eviction order: by priority, then stamp.
inline std::map<int32_t, CachedCheckpoint> CachedCheckpoints(const KvCacheManager& manager,
                                                             bool* in_order = nullptr) {
  std::map<int32_t, CachedCheckpoint> out;
  std::pair<uint64_t, uint64_t> last{0, 0};
  if (in_order != nullptr) *in_order = true;
  for (const auto& c : KvCacheManagerTestPeer::CachedCheckpoints(manager)) {
    out[c.block] = {c.offset, c.slot, c.stamp, c.priority};
    const std::pair<uint64_t, uint64_t> key{c.priority, c.stamp};
    if (in_order != nullptr && key < last) *in_order = false;
    last = key;
  }
  return out;
}

// The floor of the checkpoints' eviction order (GreedyDualOrder::floor).
inline uint64_t CheckpointFloor(const KvCacheManager& manager) {
  return KvCacheManagerTestPeer::CheckpointFloor(manager);
}

// Whether the manager's DebugString lists exactly those checkpoints, in that order, and that
// floor (what an operator reads). REQUIRES: a manager with checkpoint slots.
inline bool DebugStringListsTheCheckpoints(const KvCacheManager& manager) {
  std::vector<KvCacheManagerTestPeer::ListedCheckpoint> listed;
  unsigned long long floor = 0;
  bool floor_seen = false;
  std::istringstream in(manager.DebugString());
  for (std::string line; std::getline(in, line);) {
    int slot = 0, block = 0, offset = 0;
    unsigned long long stamp = 0, priority = 0;
    if (std::sscanf(line.c_str(), "checkpoint slot=%d block=%d offset=%d stamp=%llu priority=%llu",
                    &slot, &block, &offset, &stamp, &priority) == 5) {
      listed.push_back({slot, block, offset, stamp, priority});
    } else if (std::sscanf(line.c_str(), "checkpoint floor=%llu", &floor) == 1) {
      floor_seen = true;
    }
  }
  return floor_seen && floor == KvCacheManagerTestPeer::CheckpointFloor(manager) &&
         listed == KvCacheManagerTestPeer::CachedCheckpoints(manager);
}

// The checkpoints (of `cached`, what CachedCheckpoints says now) `prompt`'s attention match in
// `ns` reaches, one per block at most, by depth: (tokens, slot).
inline std::vector<std::pair<int64_t, int32_t>> CheckpointsOnPath(
    const KvCacheManager& manager, const std::map<int32_t, CachedCheckpoint>& cached,
    NamespaceId ns, std::span<const int32_t> prompt) {
  const PrefixMatch m = manager.cache()->Match(ns, prompt);
  const int64_t bs = manager.block_size();
  std::vector<std::pair<int64_t, int32_t>> out;
  const auto consider = [&](BlockId block, int64_t base, int64_t limit) {
    auto it = cached.find(block.value());
    if (it != cached.end() && it->second.offset <= limit) {
      out.emplace_back(base + it->second.offset, it->second.slot);
    }
  };
  for (size_t i = 0; i < m.full.size(); ++i) consider(m.full[i], static_cast<int64_t>(i) * bs, bs);
  if (m.partial != kInvalidBlock) {
    consider(m.partial, static_cast<int64_t>(m.full.size()) * bs, m.partial_tokens);
  }
  return out;
}

// The deepest checkpoint `prompt` reaches (CheckpointsOnPath): (tokens, slot), or (0, -1).
inline std::pair<int64_t, int32_t> DeepestCheckpoint(
    const KvCacheManager& manager, const std::map<int32_t, CachedCheckpoint>& cached,
    NamespaceId ns, std::span<const int32_t> prompt) {
  const auto on_path = CheckpointsOnPath(manager, cached, ns, prompt);
  return on_path.empty() ? std::pair<int64_t, int32_t>{0, -1} : on_path.back();
}

// What resuming from the deepest checkpoint `prompt` reaches saves over resuming from the one
// before it on the path (all its tokens where there is none): its worth in kByTokensSaved order
// (KvCacheManager::TokensSaved), computed from the prompt's path rather than the tree's parents.
inline int64_t TokensOverTheNextCheckpointUp(const KvCacheManager& manager,
                                             const std::map<int32_t, CachedCheckpoint>& cached,
                                             NamespaceId ns, std::span<const int32_t> prompt) {
  const auto on_path = CheckpointsOnPath(manager, cached, ns, prompt);
  if (on_path.empty()) return 0;
  return on_path.back().first - (on_path.size() > 1 ? on_path[on_path.size() - 2].first : 0);
}

// The positions a step from `from` to `to` tokens is to checkpoint, by position: every `interval`
// blocks, the branch point, a prefill's last block boundary.
inline std::vector<int64_t> WantedCheckpoints(int64_t from, int64_t to, bool prefill,
                                              int64_t branch_at, int32_t interval, int32_t bs) {
  std::vector<int64_t> want;
  if (interval > 0) {
    const int64_t every = int64_t{interval} * bs;
    for (int64_t p = (from / every + 1) * every; p <= to; p += every) want.push_back(p);
  }
  if (branch_at > from && branch_at <= to) want.push_back(branch_at);
  if (prefill && (to - 1) / bs * bs > from) want.push_back((to - 1) / bs * bs);
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  return want;
}

// Whether slot `slot`, if `cached` has it, is kept where the state after `tokens[0..position)`
// belongs: at the position's offset in a block the tree publishes with those tokens.
inline bool KeptWhereItBelongs(const KvCacheManager& manager,
                               const std::map<int32_t, CachedCheckpoint>& cached, int32_t slot,
                               const std::vector<int32_t>& tokens, int64_t position) {
  const int64_t bs = manager.block_size();
  const int64_t start = (position - 1) / bs * bs;
  for (const auto& [block, c] : cached) {
    if (c.slot != slot) continue;
    return c.offset == position - start &&
           manager.cache()->Agrees(BlockId(block),
                                   std::span(tokens).subspan(static_cast<size_t>(start),
                                                             static_cast<size_t>(c.offset)));
  }
  return true;
}

// Whether the checkpoints in slots `used` are the most recently used of `cached` (in least-
// recently-used order, the last to be evicted).
inline bool UsedLast(const std::map<int32_t, CachedCheckpoint>& cached,
                     const std::set<int32_t>& used) {
  uint64_t newest_other = 0, oldest_used = UINT64_MAX;
  for (const auto& [block, c] : cached) {
    if (used.contains(c.slot)) {
      oldest_used = std::min(oldest_used, c.stamp);
    } else {
      newest_other = std::max(newest_other, c.stamp);
    }
  }
  return newest_other < oldest_used;
}

// Whether the tree publishes blocks [first, last] of `seq` with no other tokens than `content`'s
// (a step may write their KV).
inline bool Writable(const KvCacheManager& manager, const Sequence& seq,
                     const std::vector<int32_t>& content, int64_t first, int64_t last) {
  const int64_t bs = manager.block_size();
  for (int64_t b = first; b <= last; ++b) {
    const int64_t end = std::min<int64_t>((b + 1) * bs, static_cast<int64_t>(content.size()));
    const std::span<const int32_t> tokens(content.data() + b * bs,
                                          static_cast<size_t>(end - b * bs));
    if (!manager.cache()->Agrees(seq.table[static_cast<size_t>(b)], tokens)) return false;
  }
  return true;
}

}  // namespace kvpool::testing
