#pragma once

// RedisBlockStore: the Redis tier (L3, DESIGN.md §9), a content-addressed block store shared by
// every daemon that points at the same Redis (standalone or Cluster). Self-contained: the daemon
// wires it in by building one store from its config (Create), calling Put() for each committed
// full block it wants kept below (write-behind, never blocks), Lookup() after a local prefix miss
// (one pipelined round trip; fills caller buffers with the longest run of verified blocks), and
// exporting stats(). Keys and values: block_codec.h.
//
//   auto store = RedisBlockStore::Create(options);            // connects lazily
//   store->Put(space, {.hash = h, .parent = p, .coverage = 16, .bytes = block});
//   auto found = store->Lookup(space, parent_of_first, hashes, buffers);  // found->hits blocks
//
// Guarantees:
// - Never a wrong byte: a value is returned only after its magic, version, layout fingerprint,
//   block and parent hash, length and xxh3-64 checksum all match; anything else is a miss,
//   counted in `corrupt` and logged (warn). Redis may evict any key at any time (maxmemory +
//   an LRU policy are its business); a missing key is an ordinary miss.
// - Never blocks a caller on a slow or absent Redis for more than one connect_timeout +
//   command_timeout (per round trip; a cluster redirect adds one): consecutive failures open a
//   circuit breaker, after which Lookup misses and Put drops at once until a probe succeeds.
// - Put never blocks: it copies the block into a bounded queue (blocks and bytes) drained by one
//   background thread with pipelined `SET key value NX [EX ttl]`; a full queue drops and counts.
//
// Thread-safe: any number of threads may call Put / Lookup / Flush / stats at once. Lookups run
// in parallel on a pool of connections (one per concurrent caller, kept for reuse); no lock is
// held across Redis I/O. The store owns its thread and connections; results are copied into
// memory the caller owns.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/kv_events.h"
#include "kvpool/util/clock.h"
#include "tier/block_codec.h"
#include "tier/circuit_breaker.h"
#include "tier/redis_client.h"
#include "tier/redis_tier_options.h"

struct redisReply;

namespace kvpool::tier {

struct RedisTierStats {
  BreakerState breaker = BreakerState::kClosed;  // breaker state now
  uint64_t breaker_opens = 0;                    // times the breaker opened
  uint64_t lookups = 0;                          // Lookup calls with at least one hash
  uint64_t rejected_lookups = 0;      // of those, answered "all miss" at once: breaker open
  uint64_t lookup_errors = 0;         // Lookup round trips with a failed command (I/O, Redis)
  uint64_t hits = 0;                  // blocks returned by Lookup
  uint64_t misses = 0;                // blocks asked for and not returned, for any reason
  uint64_t corrupt = 0;               // values refused by CheckBlockValue (counted in misses)
  uint64_t puts = 0;                  // Put calls
  uint64_t written = 0;               // blocks stored by SET NX
  uint64_t already_present = 0;       // SET NX found the key: stored before, by us or a peer
  uint64_t dropped_queue_full = 0;    // Puts refused: queue at write_queue_blocks / _bytes
  uint64_t dropped_breaker_open = 0;  // Puts refused or queued writes discarded: breaker open
  uint64_t dropped_write_errors = 0;  // queued writes lost to a failed round trip / error reply
  uint64_t dropped_shutdown = 0;      // queued writes discarded when the store was destroyed
  uint64_t bytes_read = 0;            // payload bytes copied out by Lookup
  uint64_t bytes_written = 0;         // value bytes (header + payload) stored by SET NX
  int64_t queued_blocks = 0;          // blocks in the write queue now
  int64_t queued_bytes = 0;           // value bytes in the write queue now
  RedisClientStats client;            // summed over every connection the store has used
};

// One block to store: its chained hash, its parent's (zero for a chain's first block), how many
// tokens it covers and its bytes (copied by Put; the caller may reuse them on return).
struct BlockToStore {
  BlockHash hash;
  BlockHash parent;
  uint32_t coverage = 0;
  std::span<const std::byte> bytes;
};

struct LookupResult {
  int64_t hits = 0;                // leading blocks found whole; out[0, hits) hold them
  std::vector<uint32_t> coverage;  // [hits] tokens each found block covers
};

class RedisBlockStore final {
 public:
  // Validates `options` and starts the writer thread; connects on first use.
  // Errors: INVALID_ARGUMENT naming the bad field (options.enabled false included: a disabled
  // tier has no store). REQUIRES: `clock` outlives the store (it times the breaker and Flush).
  static absl::StatusOr<std::unique_ptr<RedisBlockStore>> Create(
      const RedisTierOptions& options, const Clock* clock = Clock::Real());

  // Stops the writer: the round trip in flight completes (bounded by the timeouts), whatever is
  // still queued is dropped and counted in dropped_shutdown.
  ~RedisBlockStore();
  RedisBlockStore(const RedisBlockStore&) = delete;
  RedisBlockStore& operator=(const RedisBlockStore&) = delete;

  // Queues a copy of `block` for write-behind under `space` and returns at once. Returns whether
  // it was queued; false when it was dropped (queue full, breaker open) and counted. A queued
  // block can still be lost (Redis error, breaker opening, shutdown): stats say how many were.
  bool Put(const BlockSpace& space, const BlockToStore& block);

  // Looks up `hashes` (a chain: hashes[i] is the parent of hashes[i + 1], and `parent` the
  // parent of hashes[0], zero at the root) in one pipelined round trip (one per node for a
  // cluster) and copies the longest run of leading verified blocks into `out`, block i into
  // out[i]. Every payload must be exactly out[i].size() bytes. Beyond the prefix, out[i] is
  // either untouched or holds block i's verified bytes (a cluster's nodes answer out of order);
  // never anything that failed a check.
  // Redis being down, slow, evicting or corrupt is never an error: those blocks are misses.
  // Errors: INVALID_ARGUMENT when out.size() != hashes.size() (nothing looked up).
  absl::StatusOr<LookupResult> Lookup(const BlockSpace& space, const BlockHash& parent,
                                      std::span<const BlockHash> hashes,
                                      std::span<const std::span<std::byte>> out);

  // Waits until every block queued before this call was written or dropped. Errors:
  // DEADLINE_EXCEEDED after `timeout` on the store's clock (the queue keeps draining).
  absl::Status Flush(absl::Duration timeout);

  RedisTierStats stats() const;

  // Queue accounting (count and bytes match the queue, nothing completed that was not queued)
  // and the breaker's invariants.
  absl::Status CheckInvariants() const;

 private:
  struct WriteItem {
    std::string key;
    std::string value;  // header + payload
  };
  // A client with the client stats already added to the store's totals.
  struct PooledClient {
    std::unique_ptr<RedisClient> client;
    RedisClientStats reported;
  };

  RedisBlockStore(const RedisTierOptions& options, const Clock* clock,
                  std::unique_ptr<RedisClient> writer);

  absl::StatusOr<PooledClient> AcquireReader();
  void ReleaseReader(PooledClient reader);
  void AddClientStats(PooledClient* pooled);
  // Feeds one round trip's outcome to the breaker, logging transitions.
  void ReportOutcome(const absl::Status& transport);
  // Checks one GET reply for block `hash` and copies its payload into `out` when it passes;
  // counts and logs a refusal. Returns whether it passed.
  bool VerifyAndCopy(const BlockSpace& space, const BlockHash& hash, const BlockHash& parent,
                     const redisReply& reply, std::span<std::byte> out, uint32_t* coverage);

  void WriterLoop();
  void WriteBatch(std::vector<WriteItem>& batch);
  void CompleteBatch(const std::vector<WriteItem>& batch);

  const RedisTierOptions options_;
  const Clock* const clock_;
  CircuitBreaker breaker_;

  mutable absl::Mutex readers_mu_;
  std::vector<PooledClient> idle_readers_ ABSL_GUARDED_BY(readers_mu_);

  mutable absl::Mutex queue_mu_;
  std::deque<WriteItem> queue_ ABSL_GUARDED_BY(queue_mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(queue_mu_) = 0;
  int64_t enqueued_ ABSL_GUARDED_BY(queue_mu_) = 0;   // blocks ever queued
  int64_t completed_ ABSL_GUARDED_BY(queue_mu_) = 0;  // of those, written or dropped
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;

  PooledClient writer_;  // used by the writer thread only
  std::thread writer_thread_;

  struct Counters {
    std::atomic<uint64_t> lookups{0}, rejected_lookups{0}, lookup_errors{0}, hits{0}, misses{0},
        corrupt{0}, puts{0}, written{0}, already_present{0}, dropped_queue_full{0},
        dropped_breaker_open{0}, dropped_write_errors{0}, dropped_shutdown{0}, bytes_read{0},
        bytes_written{0};
    std::atomic<uint64_t> round_trips{0}, connects{0}, connect_failures{0}, io_errors{0},
        moved_redirects{0}, ask_redirects{0}, slot_map_refreshes{0};
  };
  Counters counters_;
};

}  // namespace kvpool::tier
