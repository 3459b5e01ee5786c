#pragma once

// RedisBlockStore: the Redis tier (L3, DESIGN.md §9), a content-addressed block store shared by
// every daemon that points at the same Redis (standalone or Cluster); the RemoteTier
// (remote_tier.h) the daemon holds. Self-contained: the daemon wires it in by building one store
// from its config (Create, when RedisTierOptions::enabled), calling Put() for each committed
// full block it wants kept below (write-behind, never blocks), Lookup() after a local prefix miss
// (one pipelined round trip; fills caller buffers with the longest run of verified blocks), and
// exporting stats(). Keys and values: block_codec.h.
//
//   auto store = RedisBlockStore::Create(options, secret);    // connects lazily
//   store->Put(space, {.hash = h, .parent = p, .coverage = 16, .bytes = block});
//   auto found = store->Lookup(space, parent_of_first, hashes, buffers);  // found->hits blocks
//
// Guarantees:
// - Never a wrong byte: a value is returned only after its magic, version and length match and
//   its MAC verifies under the deployment secret for the key it was read from, and then its
//   layout fingerprint, block and parent hash match; anything else is a miss, counted in
//   `corrupt` (and a failed MAC in `forged` too) and logged (warn). Whoever can write to Redis
//   but lacks the secret can neither plant a value a store accepts nor aim at a block's key
//   (block_codec.h). Redis may evict any key at any time (maxmemory + an LRU policy are its
//   business); a missing key is an ordinary miss.
// - Never blocks a caller on a slow or absent Redis for more than command_timeout (plus 10 ms):
//   a Lookup, and each write batch, has one deadline for its whole exchange (connect, AUTH,
//   every command and every reply, cluster redirects included), however slowly the server
//   dribbles its answer. A call that runs out of it fails, and consecutive failures open a
//   circuit breaker, after which Lookup misses and Put drops at once until a probe succeeds.
// - Put never blocks: it copies the block into a bounded queue (blocks and bytes) drained by one
//   background thread with pipelined `SET key value NX [EX ttl]`; a full queue drops and counts.
// - With tenant_write_budget_bytes, what it writes is bounded and fair by tenant: a block past
//   the budget, or past its tenant's (NamespaceTags::tenant) share of it, within the last TTL is
//   dropped and counted in dropped_over_budget (internal::TenantWriteBudget), so one tenant
//   cannot make Redis evict another's blocks.
//
// Thread-safe: any number of threads may call Put / Lookup / Flush / stats at once. Lookups run
// in parallel on a pool of connections (one per concurrent caller, kept for reuse); no lock is
// held across Redis I/O. The store owns its thread and connections; results are copied into
// memory the caller owns. Like every RedisClient it sets SIGPIPE to SIG_IGN if still SIG_DFL.
//
// Wiring (for the daemon): BlockSpace{namespace id, kernels::PoolLayout::Hash()}; the chained
// hashes are PrefixCache's (PrefixChainHash); out buffers are fresh blocks of the host tier or
// the device pool, handed to a sequence only after Lookup returned (and, on a device, after the
// copy's fence). Health stays SERVING whatever the breaker says; export stats() and
// client_stats() with the other counters.

#include <array>
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
#include "tier/internal/redis_memory.h"
#include "tier/internal/tenant_write_budget.h"
#include "tier/redis_client.h"
#include "tier/redis_tier_options.h"
#include "tier/remote_tier.h"
#include "tier/secret.h"

struct redisReply;

namespace kvpool::tier {

class RedisBlockStore final : public RemoteTier {
 public:
  // Validates `options` and starts the writer thread; connects on first use. Keys and value
  // MACs are derived under (a copy of) `secret`: stores that share blocks must hold the same one.
  // Errors: INVALID_ARGUMENT naming the bad field (options.enabled false included: a disabled
  // tier has no store). REQUIRES: `clock` outlives the store (it times the breaker and Flush).
  static absl::StatusOr<std::unique_ptr<RedisBlockStore>> Create(
      const RedisTierOptions& options, const DeploymentSecret& secret,
      const Clock* clock = Clock::Real());

  // Stops the writer: the round trip in flight completes (bounded by the timeouts), whatever is
  // still queued is dropped and counted in dropped_shutdown.
  ~RedisBlockStore();
  RedisBlockStore(const RedisBlockStore&) = delete;
  RedisBlockStore& operator=(const RedisBlockStore&) = delete;

  // RemoteTier (remote_tier.h has the contract). Put copies the block into the queue, or drops
  // it at once when the queue is full or the breaker is open.
  bool Put(const BlockSpace& space, const BlockToStore& block) override;
  // The weight of `tenant`'s share of the write budget (internal::TenantWriteBudget::SetWeight;
  // OK and nothing else without a budget).
  absl::Status SetTenantWeight(uint64_t tenant, int32_t weight) override;
  // Bytes of `tenant`'s share of the budget written within the last TTL or queued, and its
  // writes dropped over budget; 0 without a budget or a share of its own.
  TenantWrites WritesOf(uint64_t tenant) const override;

  // Waits until every block queued before this call was written or dropped. Errors:
  // DEADLINE_EXCEEDED after `timeout` on the store's clock (the queue keeps draining).
  absl::Status Flush(absl::Duration timeout) override;
  // One pipelined EXISTS per block (per node for a cluster): one round trip for all of them.
  std::vector<bool> MayHave(const BlockSpace& space, std::span<const BlockHash> hashes) override;
  RemoteTierStats stats() const override;
  // Summed over every connection the store has used (round trips, reconnects, redirects).
  RedisClientStats client_stats() const;

  // Queue accounting (count and bytes match the queue, nothing completed that was not queued)
  // and the breaker's invariants.
  absl::Status CheckInvariants() const;

 protected:
  // One pipelined GET per block (per node for a cluster), each reply checked, copied and freed
  // as it arrives.
  LookupResult LookupChecked(const BlockSpace& space, const BlockHash& parent,
                             std::span<const BlockHash> hashes,
                             std::span<const std::span<std::byte>> out) override;

 private:
  struct WriteItem {
    std::string key;
    std::string value;     // header + payload
    int32_t share = -1;    // the budget share its bytes are reserved in; -1: no budget
    int64_t reserved = 0;  // those bytes: what Redis spends on it (internal::RedisEntryCost)
    bool written = false;  // set by WriteBatch: stored (not found there, not lost)
  };
  // A client with the client stats already added to the store's totals.
  struct PooledClient {
    std::unique_ptr<RedisClient> client;
    RedisClientStats reported;
  };

  RedisBlockStore(const RedisTierOptions& options, const DeploymentSecret& secret,
                  const Clock* clock, std::unique_ptr<RedisClient> writer);

  // `command key` for each block's key under `space` (the keys go to *keys, which the commands
  // point into).
  std::vector<RedisCommand> PerBlock(std::string_view command, const BlockSpace& space,
                                     std::span<const BlockHash> hashes,
                                     std::vector<std::string>* keys) const;
  PooledClient AcquireReader();
  void ReleaseReader(PooledClient reader);
  void AddClientStats(PooledClient* pooled);
  // Feeds one round trip's outcome to the breaker, logging transitions.
  void ReportOutcome(const absl::Status& transport);
  // The commands whose failures LogFailure reports.
  enum class Sent { kGet, kExists, kSet };
  // Logs a failed command. The server's refusal (an error reply: NOPERM from an ACL without the
  // command, NOAUTH, OOM under noeviction) is logged at warn the first time for each command,
  // since the call itself only misses or drops (counted) and nothing else would show it; a
  // transport failure, which the breaker reports, and later refusals at debug.
  void LogFailure(Sent sent, const absl::Status& failure);
  // Counts and logs a refusal of `key`'s value.
  void Refused(std::string_view key, BlockCheck check, size_t value_bytes);
  // Checks one GET's value for block `hash` and copies its payload into `out` when it passes
  // (out is untouched otherwise); counts and logs a refusal. Returns whether it passed.
  bool VerifyAndCopy(const BlockSpace& space, std::string_view key, const BlockHash& hash,
                     const BlockHash& parent, std::string_view value, std::span<std::byte> out,
                     uint32_t* coverage);
  // One lookup's GET of block `index`: its value, where hiredis read it, goes through
  // VerifyAndCopy straight into `out` (ReplySink), so the payload is copied once.
  struct ValueSink final : ReplySink {
    ValueSink(RedisBlockStore* store, const BlockSpace* space, std::string_view key,
              const BlockHash* hash, const BlockHash* parent, std::span<std::byte> out,
              size_t index, const size_t* first_miss)
        : store(store),
          space(space),
          key(key),
          hash(hash),
          parent(parent),
          out(out),
          index(index),
          first_miss(first_miss) {}
    bool Take(std::string_view value) override;
    // A value of the expected length is read straight from the socket: its header into `head`,
    // its payload into `out` (unverified until Placed checks it: out is the caller's staging, and
    // only out[0, hits) is handed on). Declines anything else, and values past a gap.
    bool Place(size_t len, Placement* where) override;
    void Placed() override;

    RedisBlockStore* store;
    const BlockSpace* space;
    std::string_view key;
    const BlockHash* hash;
    const BlockHash* parent;  // the hash block `index` must follow
    std::span<std::byte> out;
    size_t index;
    const size_t* first_miss;                    // the lookup's: values past it are not checked
    bool taken = false;                          // the value came through Take or Place
    std::array<char, kBlockHeaderBytes> head{};  // a placed value's header
    bool verified = false;                       // it passed, and out holds its payload
    uint32_t coverage = 0;
  };

  void WriterLoop();
  void WriteBatch(std::vector<WriteItem>& batch);
  void CompleteBatch(const std::vector<WriteItem>& batch);
  // Asks the server what it spends on the first key of `batch` written with a value of a length
  // not measured yet (MEMORY USAGE), for the budget's costs. Writer thread; one round trip, and
  // only while the budget has lengths to learn.
  void MeasureEntries(const std::vector<WriteItem>& batch);

  const RedisTierOptions options_;
  const DeploymentSecret secret_;
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
  // Present when options_.tenant_write_budget_bytes > 0.
  std::unique_ptr<internal::TenantWriteBudget> budget_ ABSL_GUARDED_BY(queue_mu_);
  internal::RedisEntryCost entry_cost_ ABSL_GUARDED_BY(queue_mu_);  // what the budget counts

  std::array<std::atomic<bool>, 3> refusal_logged_{};  // by Sent: LogFailure warned once
  PooledClient writer_;                                // used by the writer thread only
  std::thread writer_thread_;

  struct Counters {
    std::atomic<uint64_t> lookups{0}, rejected_lookups{0}, lookup_errors{0}, hits{0}, misses{0},
        corrupt{0}, forged{0}, puts{0}, written{0}, already_present{0}, dropped_queue_full{0},
        dropped_over_budget{0}, dropped_breaker_open{0}, dropped_write_errors{0},
        dropped_shutdown{0}, bytes_read{0}, bytes_written{0};
    std::atomic<uint64_t> round_trips{0}, connects{0}, connect_failures{0}, io_errors{0},
        moved_redirects{0}, ask_redirects{0}, slot_map_refreshes{0}, refused_redirects{0};
  };
  Counters counters_;
};

}  // namespace kvpool::tier
