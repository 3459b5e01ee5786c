#pragma once

// Configuration of the Redis tier (L3, DESIGN.md §9): where Redis is, how long to wait for it,
// how much to queue for it and when to stop trying. A plain struct: the daemon fills it from its
// config file; RedisBlockStore::Create validates it (INVALID_ARGUMENT names the field).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kvpool::tier {

// Where the hash tag of a block key goes, i.e. which blocks share a Redis Cluster slot.
// Irrelevant for a standalone server.
enum class KeySlotting : uint8_t {
  // `kvp1:{<namespace>}:<layout>:<hash>`: every block of a namespace lives in one slot, so a
  // Lookup is one pipeline to one node, but a namespace (one model) cannot use more than one
  // node's memory or bandwidth. The key format the issue and DESIGN.md §9 name.
  kNamespace,
  // `kvp1:<namespace>:<layout>:{<hash>}`: blocks spread over every node; a Lookup sends one
  // pipeline per node, all in flight together.
  kBlock,
};

struct RedisTierOptions {
  bool enabled = false;  // the tier is off by default; the daemon builds no store when false

  // Exactly one of these three names the server(s).
  std::string unix_socket;                 // path of a standalone server's Unix socket
  std::string host;                        // standalone server over TCP (with `port`)
  int port = 6379;                         // TCP port of `host`
  std::vector<std::string> cluster_seeds;  // "host:port" of any Redis Cluster nodes

  // Credentials sent with AUTH on every new connection; empty password: no AUTH. An empty
  // username is the legacy single-password form (requirepass); otherwise an ACL user.
  std::string username;
  std::string password;

  KeySlotting key_slotting = KeySlotting::kNamespace;  // cluster only; see KeySlotting

  // One connect attempt (TCP or Unix socket), at most; it also counts against command_timeout.
  absl::Duration connect_timeout = absl::Milliseconds(200);
  // The deadline of one whole call: a Lookup's round trip or a write batch, from its start to its
  // last reply (connecting, AUTH, writing every command, reading every reply, cluster redirects
  // and slot map refreshes included), not a timeout per read. A dead, hung or slow-dripping
  // server costs a caller at most this (plus 10 ms) per call, and the calls that run out of it
  // count as failures toward the breaker, after which later calls cost nothing.
  absl::Duration command_timeout = absl::Milliseconds(500);
  int max_redirects = 5;  // MOVED / ASK hops followed per command before it fails

  int64_t write_queue_blocks = 1024;             // blocks queued for write-behind at most
  int64_t write_queue_bytes = int64_t{1} << 30;  // value bytes queued at most
  int write_batch_blocks = 64;                   // blocks per pipelined SET NX round trip
  // Seconds a stored block lives in Redis; 0: no TTL (Redis's maxmemory policy evicts).
  int64_t ttl_seconds = 0;
  // Fair by tenant (docs/tiers.md): bytes (values and keys) this store may have written within
  // the last ttl_seconds, all tenants together, and each tenant's share of it (total * its
  // weight / the weights of the tenants writing now; SetTenantWeight). A write past either is
  // dropped (dropped_over_budget). With Redis's maxmemory above the sum of every store's budget,
  // Redis never evicts and one tenant's writes cannot push out another's blocks. 0: no budget.
  // REQUIRES ttl_seconds > 0 when set.
  int64_t tenant_write_budget_bytes = 0;
  // Tenant shares of that budget beside the default one (tenants past it share the default);
  // the daemon passes the pool's limits.eviction_shares. 0: one share for every tenant.
  int32_t tenant_shares = 16;
  // Tests only. Runs in Put with no lock held, in its lock gap: after the block's budget is
  // reserved and before it is queued (the queue may fill meanwhile). A test works the store from
  // there.
  std::function<void()> put_gap_hook;

  // Breaker: this many consecutive failed round trips (I/O error, timeout, unreachable) open it;
  // while open, Lookups miss and Puts drop at once. After `breaker_backoff` one call is let
  // through as a probe: success closes the breaker, failure reopens it with the backoff doubled,
  // up to `breaker_max_backoff`.
  int breaker_failure_threshold = 3;
  absl::Duration breaker_backoff = absl::Seconds(1);
  absl::Duration breaker_max_backoff = absl::Seconds(30);
};

}  // namespace kvpool::tier
