#pragma once

// What one of the Redis tier's keys costs Redis in memory, for the write budget
// (TenantWriteBudget counts these bytes, not the bytes sent). Redis spends more than the key and
// the value: its allocator (jemalloc in every Debian and upstream build) rounds each allocation up
// to a size class, four per doubling, so a 4,192-byte value takes 5,120 bytes and a 65,632-byte
// one 81,920; and each key has an object, an entry in the keyspace table and one in the expires
// table (the tier always sets a TTL under a budget), and slots in both tables. Counting the bytes
// sent, a budget of B lets Redis spend up to 1.25 B: a budget set just under maxmemory makes
// Redis evict, which is what the budget is there to prevent.
//
// The cost of a key is the larger of a model of Redis 7 with jemalloc (ModeledEntryBytes, an
// upper bound there) and what the server itself says (`MEMORY USAGE` of the first key written
// with a value of that length, plus what that command leaves out: the expires entry and the
// table slots). The second covers servers the model does not describe (another allocator, other
// object layouts); where the ACL refuses MEMORY USAGE the model stands alone.
//
// Not thread-safe: the owning store's lock covers RedisEntryCost.

#include <cstdint>

#include "absl/container/flat_hash_map.h"

namespace kvpool::tier::internal {

// The allocation jemalloc makes for `bytes` (> 0): 8 up to 8 bytes, multiples of 16 up to 128,
// then 2^k + j * 2^(k-2) (j = 1..4) for bytes in (2^k, 2^(k+1)].
int64_t JemallocSizeClass(int64_t bytes);

// Per key, besides the key's and the value's strings: the value's object (16), the keyspace and
// expires entries (24 each, allocated as 32), and one slot (8) in each of the two tables at up to
// three slots per key (a table just doubled holds two per key; while it rehashes into the next
// one, the old table's slot too).
inline constexpr int64_t kRedisPerKeyBytes = 16 + 32 + 32 + 2 * 3 * 8;
// What MEMORY USAGE leaves out of that: the keyspace entry's allocation beyond its size (32 -
// 24), the expires entry and the table slots.
inline constexpr int64_t kRedisUnreportedPerKeyBytes = (32 - 24) + 32 + 2 * 3 * 8;

// Redis 7's memory, with jemalloc, for one string key of `key_bytes` holding a value of
// `value_bytes` with a TTL: both strings with their headers, rounded to their size classes, and
// kRedisPerKeyBytes.
int64_t ModeledEntryBytes(int64_t key_bytes, int64_t value_bytes);

class RedisEntryCost {
 public:
  // Value lengths measured at most: the tier writes a few (one per layout and component); a
  // length past these is charged by the model alone.
  static constexpr size_t kMaxMeasured = 64;

  // What a key of `key_bytes` holding `value_bytes` is charged: the model, or the server's MEMORY
  // USAGE for a value of that length plus kRedisUnreportedPerKeyBytes, whichever is more.
  int64_t Of(int64_t key_bytes, int64_t value_bytes) const;
  // Whether values of this length are still to be measured.
  bool Unmeasured(int64_t value_bytes) const {
    return usage_.size() < kMaxMeasured && !usage_.contains(value_bytes);
  }
  // Records the server's MEMORY USAGE of a key holding `value_bytes`; `usage` < 0: the server
  // would not say (the length is not asked again).
  void Measured(int64_t value_bytes, int64_t usage) { usage_.try_emplace(value_bytes, usage); }

 private:
  absl::flat_hash_map<int64_t, int64_t> usage_;  // value length -> MEMORY USAGE, or -1
};

}  // namespace kvpool::tier::internal
