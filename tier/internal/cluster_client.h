#pragma once

// ClusterClient: RedisClient for a Redis Cluster. Keeps a slot -> node map learnt from
// CLUSTER SLOTS (asked of any reachable node or seed), routes each command by its key's slot,
// pipelines per node (every node's pipeline is flushed before any is read, so nodes work in
// parallel), follows MOVED (re-route, and refresh the map before the next call) and ASK
// (ASKING + the command on the target, map unchanged) up to max_redirects hops per command.
//
// The nodes it knows are the seeds and the nodes CLUSTER SLOTS answers from known nodes named;
// it connects to no other address, so the credentials go to no other. A MOVED or ASK to an
// address it does not know is refused (INTERNAL for that command, counted in
// refused_redirects, logged) and the map is refreshed before the next call: a node added to the
// cluster is learnt that way, a redirect planted by whoever can answer for a node is not
// followed.
// Thread-compatible, like every RedisClient.

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tier/internal/redis_connection.h"
#include "tier/key_slot.h"
#include "tier/redis_client.h"

namespace kvpool::tier::internal {

class ClusterClient final : public RedisClient {
 public:
  // REQUIRES: every seed parses with ParseHostPort (CreateRedisClient checked).
  explicit ClusterClient(const RedisTierOptions& options);

  void Stream(std::span<const RedisCommand> commands, ReplyCallback on_reply) override;
  RedisClientStats stats() const override { return stats_; }

 private:
  struct Node {
    std::string host;
    int port = 0;
    std::unique_ptr<RedisConnection> connection;  // null until used or after an I/O error
    uint64_t connected_in_call = 0;               // the Stream call that made `connection`
  };
  // A command still to be answered, where it goes next and whether it must be preceded by
  // ASKING.
  struct Pending {
    size_t index = 0;
    int node = 0;
    bool asking = false;
  };

  int NodeIndex(const std::string& host, int port);       // adds the node when new
  int FindNode(const std::string& host, int port) const;  // -1 when it is no known node
  // Null when it cannot connect (and AUTH) before `deadline`.
  RedisConnection* Connect(int node, int64_t deadline);
  void RefreshSlotMap(int64_t deadline);
  bool AdoptSlotMap(const redisReply& slots, const std::string& asked_host);
  int RouteOf(const RedisCommand& command);  // node index; -1 when no node is known
  // One redirect round, over before `deadline`: sends `pending` grouped per node, reads every
  // reply; answers `on_reply` or appends to `next` what was redirected.
  void RunRound(std::span<const RedisCommand> commands, const std::vector<Pending>& pending,
                ReplyCallback on_reply, std::vector<Pending>* next, int64_t deadline);
  void ReadNode(std::span<const RedisCommand> commands, const std::vector<Pending>& sent, int node,
                ReplyCallback on_reply, std::vector<Pending>* next, int64_t deadline);
  // Whether `node`'s connection predates this call (and so may have died unseen: a failure
  // before its first reply is retried once on a fresh connection; GET and SET NX are
  // idempotent).
  bool Reused(int node) const { return nodes_[node].connected_in_call < call_; }
  // When `reply` is a MOVED or ASK: follows it (appends to `next`) if its target is a known
  // node, or answers `on_reply` with the refusal; returns true. False for any other reply.
  bool HandleRedirect(const redisReply& reply, const Pending& p, ReplyCallback on_reply,
                      std::vector<Pending>* next);

  const RedisTierOptions options_;
  std::vector<Node> nodes_;  // seeds first, then nodes CLUSTER SLOTS named; only grows
  std::array<int16_t, kNumClusterSlots> slot_node_;  // node index per slot; -1 unknown
  bool map_stale_ = true;
  uint64_t call_ = 0;                    // Stream calls so far
  uint64_t warned_refusal_in_call_ = 0;  // the last call that logged a refused redirect

  RedisClientStats stats_;
};

}  // namespace kvpool::tier::internal
