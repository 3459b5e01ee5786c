#pragma once

// RedisClient: a synchronous, pipelining Redis client over hiredis, for one standalone server
// (TCP or Unix socket) or a Redis Cluster (slot routing, MOVED / ASK redirects), which hiredis
// itself does not do. The store (redis_block_store.h) is its user; tests use it to reach the
// servers they start.
//
// Not thread-safe: one client is one caller at a time (the store keeps one per concurrent
// caller). Connections are made on first use and again after any I/O error, so a client can be
// created while Redis is down. Replies are owned by the caller (RedisReply frees itself).
//
// Installs SIG_IGN for SIGPIPE when its disposition is still SIG_DFL (hiredis writes with
// write(2); a server that went away would otherwise kill the process).

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tier/redis_tier_options.h"

struct redisReply;

namespace kvpool::tier {

struct RedisReplyDeleter {
  void operator()(redisReply* reply) const;
};
// A hiredis reply: type REDIS_REPLY_STRING / NIL / INTEGER / STATUS / ARRAY (errors are turned
// into statuses before a reply reaches a caller).
using RedisReply = std::unique_ptr<redisReply, RedisReplyDeleter>;

// Takes a command's bulk-string reply where hiredis read it (its read buffer), so a large value
// is copied once, to where the sink wants it, rather than into a reply of its own first.
class ReplySink {
 public:
  virtual ~ReplySink() = default;
  // Called at most once per reply that is a bulk string, on the thread that runs the command;
  // `value` is valid only during the call. Returns true when the sink took the value: the reply
  // handed on is then an empty string (REDIS_REPLY_STRING, len 0); false: it carries the value.
  virtual bool Take(std::string_view value) = 0;

  // Where to read a bulk string of `len` bytes whose bytes are (mostly) still in the socket:
  // `head` then `tail`, their sizes summing to len. When a sink places a value its bytes are read
  // from the socket straight there (only what hiredis had already buffered is copied), Placed()
  // is called instead of Take, and the reply handed on is an empty string. Returning false (the
  // default) has the value read as usual and offered to Take.
  struct Placement {
    std::span<char> head;
    std::span<char> tail;
  };
  virtual bool Place(size_t len, Placement* where) {
    (void)len;
    (void)where;
    return false;
  }
  // Every byte of the placed value has arrived (on the thread that runs the command).
  virtual void Placed() {}
};

// One command. The strings `args` point to must outlive the Execute call.
struct RedisCommand {
  std::vector<std::string_view> args;  // args[0] is the command name
  int key_index = 1;                   // which arg is the key a cluster routes by; -1: none
  ReplySink* sink = nullptr;           // when set, offered the reply if it is a bulk string
};

struct RedisClientStats {
  uint64_t round_trips = 0;         // pipelines flushed and read back (one per node touched)
  uint64_t connects = 0;            // connections made
  uint64_t connect_failures = 0;    // connection attempts that failed or timed out
  uint64_t io_errors = 0;           // connections lost mid-pipeline (reset, EOF, timeout)
  uint64_t moved_redirects = 0;     // cluster: MOVED replies followed
  uint64_t ask_redirects = 0;       // cluster: ASK replies followed (ASKING + retry)
  uint64_t slot_map_refreshes = 0;  // cluster: CLUSTER SLOTS answers adopted
  // cluster: MOVED / ASK to an address that is no node of the cluster (seeds and what CLUSTER
  // SLOTS named), refused: never connected to, never sent the credentials
  uint64_t refused_redirects = 0;
};

class RedisClient {
 public:
  virtual ~RedisClient() = default;

  // Receives each command's result once, as soon as it is known (a cluster's nodes answer in
  // any order, so indices can arrive out of order). The reply is the callback's to keep or drop;
  // dropping it at once keeps a large pipeline from holding every value in memory together.
  using ReplyCallback = absl::FunctionRef<void(size_t index, absl::StatusOr<RedisReply> reply)>;

  // Sends every command, pipelined, and hands `on_reply` one result per command. A standalone
  // client makes one round trip; a cluster client one per node the commands' slots live on, all
  // flushed before any is read, plus one per redirect hop (at most max_redirects). The whole
  // call, connecting and redirects included, has one deadline, options.command_timeout from its
  // start (plus at most internal::kDeadlineSlack): whatever is not answered by then fails.
  // Per-command errors: UNAVAILABLE (cannot connect, connection lost, the deadline passed,
  // CLUSTERDOWN / TRYAGAIN / LOADING, too many redirects); INTERNAL (any other Redis error reply,
  // with its text, and a cluster redirect to an address that is no node of the cluster).
  // After an I/O error the connection is dropped and remade on the next call; a connection kept
  // from an earlier call that fails before its first reply (the server restarted) is retried
  // once on a fresh one, so commands must be idempotent (GET, SET NX).
  virtual void Stream(std::span<const RedisCommand> commands, ReplyCallback on_reply) = 0;

  // Stream, with the results collected in command order.
  std::vector<absl::StatusOr<RedisReply>> Execute(std::span<const RedisCommand> commands);

  virtual RedisClientStats stats() const = 0;
};

// Builds a cluster client when options.cluster_seeds is non-empty, else a standalone client for
// options.unix_socket or options.host:port. Connects to nothing yet.
// Errors: INVALID_ARGUMENT when no server, or more than one kind of server, is named, or a seed
// is not "host:port".
absl::StatusOr<std::unique_ptr<RedisClient>> CreateRedisClient(const RedisTierOptions& options);

// Parses "host:port" (the last ':' splits, so "::1:7000" works). INVALID_ARGUMENT otherwise.
absl::Status ParseHostPort(std::string_view address, std::string* host, int* port);

}  // namespace kvpool::tier
