#pragma once

// FifoHistory: a bounded memory of 64-bit keys (block-hash fingerprints) with a value each,
// forgetting the least recently put key once `capacity` puts have followed it. The eviction
// policies use it to remember blocks they no longer hold (the admission filter's ghost set, the
// reuse model's history of evicted blocks).
//
// Put, Find and Erase are O(1) (amortized; one hash-map operation and one ring slot). Memory:
// `capacity` ring slots of 16 bytes plus one hash-map entry per live key. A re-put key moves to
// the newest position (its old ring slot goes stale and is skipped when reached).
//
// Thread-compatible.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace kvpool::internal {

template <typename Value>
class FifoHistory {
 public:
  // REQUIRES: capacity > 0.
  explicit FifoHistory(size_t capacity) : ring_(capacity) {}

  const Value* Find(uint64_t key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second.value;
  }

  // Remembers `key` with `value` as the newest key. When this reuses the ring slot of a key that
  // is still remembered, that key is forgotten and returned.
  std::optional<std::pair<uint64_t, Value>> Put(uint64_t key, Value value) {
    std::optional<std::pair<uint64_t, Value>> forgotten;
    Slot& slot = ring_[next_];
    if (slot.stamp != 0) {
      auto it = map_.find(slot.key);
      if (it != map_.end() && it->second.stamp == slot.stamp) {
        forgotten.emplace(slot.key, std::move(it->second.value));
        map_.erase(it);
      }
    }
    const uint64_t stamp = ++stamp_;
    slot = Slot{key, stamp};
    map_.insert_or_assign(key, Entry{std::move(value), stamp});
    next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
    return forgotten;
  }

  // Put(key, value), and whether `key` was remembered just before (as Find then Put would say, in
  // one probe of the map fewer).
  bool Touch(uint64_t key, Value value) {
    Slot& slot = ring_[next_];
    // The slot's key is forgotten unless it is `key` itself, which is remembered again now.
    if (slot.stamp != 0 && slot.key != key) {
      auto it = map_.find(slot.key);
      if (it != map_.end() && it->second.stamp == slot.stamp) map_.erase(it);
    }
    const uint64_t stamp = ++stamp_;
    slot = Slot{key, stamp};
    const bool inserted = map_.insert_or_assign(key, Entry{std::move(value), stamp}).second;
    next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
    return !inserted;
  }

  // Forgets `key` now (its ring slot goes stale). Returns whether it was remembered.
  bool Erase(uint64_t key) { return map_.erase(key) > 0; }

  size_t size() const { return map_.size(); }
  size_t capacity() const { return ring_.size(); }

 private:
  struct Slot {
    uint64_t key = 0;
    uint64_t stamp = 0;  // 0: never used
  };
  struct Entry {
    Value value;
    uint64_t stamp = 0;  // the ring slot that holds this key's latest put
  };

  std::vector<Slot> ring_;
  size_t next_ = 0;
  uint64_t stamp_ = 0;
  absl::flat_hash_map<uint64_t, Entry> map_;
};

}  // namespace kvpool::internal
