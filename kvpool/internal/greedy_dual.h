#pragma once

// GreedyDualOrder: the eviction order of a set of ids of equal size that each save a different
// amount when kept, GreedyDual-Size (Cao and Irani, USENIX ITS 1997) with every size 1. Each id's
// priority is the floor when it was last inserted or touched plus its cost; the lowest priority
// goes first, and each victim raises the floor to its own priority, so what stays ages against
// what comes after it: an id costing c outlives one costing less only while fewer than c's worth
// of the floor has passed since its last use. Among equal priorities the least recently inserted
// or touched goes first, so with every cost 0 the order is least recently used.
//
// The state group's checkpoints use it with cost = the tokens a prompt resuming from the
// checkpoint does not compute that it would without it (those since the next checkpoint up its
// path), as Marconi (Pan et al., MLSys 2025) weighs a hybrid model's states by the compute they
// save per byte; docs/hybrid-groups.md §4.
//
// O(log n) per operation (an ordered set). The floor cannot wrap: past `rebase_at` every
// priority is lowered by the floor, in O(n), once per rebase_at / (largest cost) victims.
//
// Thread-compatible.

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "absl/container/btree_set.h"
#include "kvpool/util/check.h"

namespace kvpool::internal {

template <typename Id>
class GreedyDualOrder final {
 public:
  struct Key {
    uint64_t priority = 0;  // the floor at its last insert or touch, plus its cost
    uint64_t stamp = 0;     // the order of inserts and touches (unique)
    Id id{};

    friend bool operator<(const Key& a, const Key& b) {
      return std::tie(a.priority, a.stamp) < std::tie(b.priority, b.stamp);
    }
    friend bool operator==(const Key& a, const Key& b) {
      return a.priority == b.priority && a.stamp == b.stamp && a.id == b.id;
    }
  };

  explicit GreedyDualOrder(uint64_t rebase_at = uint64_t{1} << 62) : rebase_at_(rebase_at) {}

  // Adds `id` (not held) with `cost`; returns the key that names it until it leaves or is
  // touched. REQUIRES: cost <= rebase_at.
  Key Insert(Id id, uint64_t cost) {
    KVPOOL_CHECK(cost <= rebase_at_);
    const Key key{.priority = floor_ + cost, .stamp = ++clock_, .id = id};
    KVPOOL_CHECK(keys_.insert(key).second);
    return key;
  }
  // Takes `key` (held) out, without aging anything: not a victim.
  void Erase(const Key& key) { KVPOOL_CHECK(keys_.erase(key) == 1); }
  // `key`'s id was used again: its priority is the floor now plus `cost`.
  Key Touch(const Key& key, uint64_t cost) {
    Erase(key);
    return Insert(key.id, cost);
  }
  // Takes `key` (held) out as a victim: the floor rises to its priority. The caller picks it,
  // walking from begin() past ids it may not evict now. Returns whether the priorities were
  // rebased (every key held changed: the caller must read them again).
  bool Evict(const Key& key) {
    Erase(key);
    floor_ = std::max(floor_, key.priority);
    if (floor_ < rebase_at_) return false;
    absl::btree_set<Key> rebased;
    for (Key k : keys_) {
      k.priority -= std::min(k.priority, floor_);
      rebased.insert(k);
    }
    keys_ = std::move(rebased);
    floor_ = 0;
    ++rebases_;
    return true;
  }

  // The keys held, the next victim first.
  auto begin() const { return keys_.begin(); }
  auto end() const { return keys_.end(); }
  size_t size() const { return keys_.size(); }
  bool empty() const { return keys_.empty(); }
  bool contains(const Key& key) const { return keys_.contains(key); }
  uint64_t floor() const { return floor_; }
  uint64_t rebases() const { return rebases_; }

 private:
  uint64_t rebase_at_;  // not const: a test gives an empty order a low one (assignment)
  absl::btree_set<Key> keys_;
  uint64_t floor_ = 0;
  uint64_t clock_ = 0;
  uint64_t rebases_ = 0;
};

}  // namespace kvpool::internal
