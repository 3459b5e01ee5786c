#pragma once

// RedisConnection: one blocking hiredis connection with connect and I/O timeouts, used in three
// steps so several connections can be in flight at once: Append (buffer only), Flush (write),
// Read (one reply). Any I/O error or timeout breaks the connection for good (broken()).
// Thread-compatible.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tier/redis_client.h"

struct redisContext;

namespace kvpool::tier::internal {

class RedisConnection final {
 public:
  // Errors: UNAVAILABLE when the server cannot be reached within connect_timeout.
  static absl::StatusOr<std::unique_ptr<RedisConnection>> ConnectTcp(
      const std::string& host, int port, absl::Duration connect_timeout,
      absl::Duration command_timeout);
  static absl::StatusOr<std::unique_ptr<RedisConnection>> ConnectUnix(
      const std::string& path, absl::Duration connect_timeout, absl::Duration command_timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Adds `command` to the output buffer. No I/O.
  void Append(const RedisCommand& command);
  // Writes the output buffer. Errors: UNAVAILABLE (broken() afterwards).
  absl::Status Flush();
  // Reads the next reply; an error reply is returned as a reply (type REDIS_REPLY_ERROR).
  // Errors: UNAVAILABLE on I/O error or timeout (broken() afterwards).
  absl::StatusOr<RedisReply> Read();
  // Append + Flush + Read for one command, error replies turned into statuses (ReplyStatus).
  absl::StatusOr<RedisReply> Call(const RedisCommand& command);

  bool broken() const;
  const std::string& address() const { return address_; }

 private:
  // Takes `c` (freed on error). Errors: UNAVAILABLE when it failed to connect.
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Adopt(redisContext* c,
                                                                std::string address,
                                                                absl::Duration command_timeout);
  RedisConnection(redisContext* context, std::string address)
      : context_(context), address_(std::move(address)) {}
  absl::Status IoError(std::string_view what);

  redisContext* context_;
  std::string address_;  // "host:port" or the socket path, for messages
};

// Sends AUTH when `options` carry a password. Errors: UNAVAILABLE when the server refuses it
// (the connection is then unusable for the tier, as if it could not be reached).
absl::Status Authenticate(RedisConnection& connection, const RedisTierOptions& options);

// OK for a non-error reply; UNAVAILABLE for CLUSTERDOWN / TRYAGAIN / LOADING / MASTERDOWN;
// INTERNAL with the text for any other error reply.
absl::Status ReplyStatus(const redisReply& reply);

// Sets SIGPIPE to SIG_IGN if it is SIG_DFL (once per process).
void IgnoreSigpipeOnce();

}  // namespace kvpool::tier::internal
