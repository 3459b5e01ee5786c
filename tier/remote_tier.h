#pragma once

// RemoteTier: the interface the daemon holds for a block store below the host tier (L3,
// DESIGN.md §9), and its test seam. One implementation today, RedisBlockStore
// (redis_block_store.h); tests of the daemon's wiring can substitute a fake.
//
// Contract for every implementation:
// - Put never blocks the caller on the remote: it copies the block and queues it, or drops it
//   and counts why. A stored block may vanish later (the remote evicts); nothing assumes a key
//   survives.
// - Lookup takes a chain of block hashes and returns the longest leading run of blocks that
//   passed every check, copied into the caller's buffers. Anything the remote returns that fails
//   a check is a miss, never data. A slow or absent remote costs at most the configured
//   timeouts, and once a breaker opens, nothing.
// - Implementations are thread-safe.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/kv_events.h"
#include "tier/block_codec.h"
#include "tier/circuit_breaker.h"

namespace kvpool::tier {

// Keyed MACs of a namespace's tenant and of its (tenant, model) under the deployment secret
// (NamespaceTable::TagsOf): a store that keeps them can drop every block of a tenant, or of one
// of its models (an invalidation), without ever holding the client strings. 0: untagged.
struct NamespaceTags {
  uint64_t tenant = 0;
  uint64_t model = 0;
  friend bool operator==(const NamespaceTags&, const NamespaceTags&) = default;
};

// Which blocks an invalidation drops: every block of `tenant`, or only those of one model of it.
struct TagFilter {
  uint64_t tenant = 0;
  bool any_model = true;
  uint64_t model = 0;  // when !any_model
  bool Matches(const NamespaceTags& tags) const {
    return tags.tenant == tenant && (any_model || tags.model == model);
  }
};

// One block to store: its chained hash, its parent's (zero for a chain's first block), how many
// tokens it covers and its bytes (copied by Put; the caller may reuse them on return).
struct BlockToStore {
  BlockHash hash;
  BlockHash parent;
  uint32_t coverage = 0;
  std::span<const std::byte> bytes;
  NamespaceTags tags;  // kept by the host and disk tiers, for invalidation
};

// One tenant's writes under a store's write budget (RedisTierOptions::tenant_write_budget_bytes).
struct TenantWrites {
  int64_t live_bytes = 0;  // written within the last TTL, or queued
  // Its share's budget now, with the tenants writing now (0: no budget, or no share of its
  // own); the budget's total caps every share's bytes together as well.
  int64_t budget_bytes = 0;
  uint64_t over_budget = 0;  // writes dropped past it
};

struct LookupResult {
  int64_t hits = 0;                // leading blocks found whole; out[0, hits) hold them
  std::vector<uint32_t> coverage;  // [hits] tokens each found block covers
};

struct RemoteTierStats {
  BreakerState breaker = BreakerState::kClosed;  // breaker state now
  uint64_t breaker_opens = 0;                    // times the breaker opened
  uint64_t lookups = 0;                          // Lookup calls with at least one hash
  uint64_t rejected_lookups = 0;  // of those, answered "all miss" at once: breaker open
  uint64_t lookup_errors = 0;     // Lookups with a failed command (I/O, timeout, error reply)
  uint64_t hits = 0;              // blocks returned by Lookup
  uint64_t misses = 0;            // blocks asked for and not returned, for any reason
  uint64_t corrupt = 0;           // values refused by any check (counted in misses)
  // Of corrupt, values whose MAC did not verify (BlockCheck::kMac): planted by a writer without
  // the deployment secret, damaged, copied from another key, or written by a daemon with
  // another secret (a misconfiguration: daemons that share a tier must share the secret).
  uint64_t forged = 0;
  uint64_t puts = 0;                  // Put calls
  uint64_t written = 0;               // blocks stored
  uint64_t already_present = 0;       // writes that found the key: stored before, by anyone
  uint64_t dropped_queue_full = 0;    // Puts refused: write queue full (blocks or bytes)
  uint64_t dropped_over_budget = 0;   // Puts refused: past the write budget or its tenant's share
  uint64_t dropped_breaker_open = 0;  // Puts refused or queued writes discarded: breaker open
  uint64_t dropped_write_errors = 0;  // queued writes lost to a failed round trip / error reply
  uint64_t dropped_shutdown = 0;      // queued writes discarded when the store was destroyed
  uint64_t bytes_read = 0;            // payload bytes copied out by Lookup
  uint64_t bytes_written = 0;         // value bytes (header + payload) stored
  int64_t queued_blocks = 0;          // blocks waiting in the write queue now
  int64_t queued_bytes = 0;           // value bytes in the write queue and in flight now
};

class RemoteTier {
 public:
  virtual ~RemoteTier() = default;

  // Queues a copy of `block` for write-behind under `space` and returns at once. Returns whether
  // it was queued; false when it was dropped and counted (queue full, breaker open). A queued
  // block can still be lost (remote error, breaker opening, shutdown): stats say how many were.
  virtual bool Put(const BlockSpace& space, const BlockToStore& block) = 0;

  // Looks up `hashes`, a chain: hashes[i] is the parent of hashes[i + 1], and `parent` that of
  // hashes[0] (zero at the root). Copies the longest run of leading verified blocks into `out`,
  // block i into out[i]; every payload must be exactly out[i].size() bytes. Beyond that run
  // out[i] holds anything: a store may read a value straight into it and refuse it there (out
  // is the caller's staging; only out[0, hits) is ever to be used). The remote being down, slow,
  // evicting or corrupt is never an error: those blocks are misses.
  // Errors: INVALID_ARGUMENT when out.size() != hashes.size() or a buffer is empty (nothing
  // looked up, nothing counted).
  absl::StatusOr<LookupResult> Lookup(const BlockSpace& space, const BlockHash& parent,
                                      std::span<const BlockHash> hashes,
                                      std::span<const std::span<std::byte>> out);

  // Whether each of `hashes` (any blocks, not a chain) may be stored, as one cheap ask tells: a
  // false is a block the store knows it lacks; a true may still miss at Lookup (evicted since,
  // or refused when checked). For a caller that would otherwise look blocks up one at a time to
  // find one: a store whose misses cost a round trip each answers them all in one. This default
  // knows nothing (all true). The remote down: none (its lookups would miss).
  virtual std::vector<bool> MayHave(const BlockSpace& space, std::span<const BlockHash> hashes) {
    return std::vector<bool>(hashes.size(), true);
  }

  // The weight of `tenant`'s share where the store shares its room or its writes by tenant
  // (TenantSpec.cache_weight). This default shares nothing (OK).
  virtual absl::Status SetTenantWeight(uint64_t /*tenant*/, int32_t /*weight*/) {
    return absl::OkStatus();
  }
  // `tenant`'s writes under the store's write budget; this default has none (all zero).
  virtual TenantWrites WritesOf(uint64_t /*tenant*/) const { return {}; }
  // Waits until every block queued before this call was written or dropped.
  // Errors: DEADLINE_EXCEEDED after `timeout` (the queue keeps draining).
  virtual absl::Status Flush(absl::Duration timeout) = 0;

  virtual RemoteTierStats stats() const = 0;

 protected:
  // Lookup after its arguments were checked. REQUIRES: out.size() == hashes.size() > 0, no
  // buffer empty.
  virtual LookupResult LookupChecked(const BlockSpace& space, const BlockHash& parent,
                                     std::span<const BlockHash> hashes,
                                     std::span<const std::span<std::byte>> out) = 0;
};

}  // namespace kvpool::tier
