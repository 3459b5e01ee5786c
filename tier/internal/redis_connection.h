#pragma once

// RedisConnection: one blocking hiredis connection, used in three steps so several connections
// can be in flight at once: Append (buffer only), Flush (write), Read (one reply). Every step
// that does I/O takes the deadline of the whole call it belongs to (CallDeadline), not a timeout
// per syscall: a server that dribbles a reply a byte at a time keeps a caller no longer than the
// deadline (plus kDeadlineSlack). Any I/O error, timeout or passed deadline breaks the
// connection for good (broken()). Thread-compatible.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tier/redis_client.h"

struct redisContext;

namespace kvpool::tier::internal {

// A deadline on Clock::Real() (nanoseconds): the kernel's socket timeouts count real time, so a
// deadline on an injected clock could never be enforced by them.
int64_t CallDeadline(absl::Duration timeout);

// How far a blocking syscall may run past its call's deadline: the socket timeout is re-armed
// to the time left only when the last arming is older than this, so a fast call costs one
// arming (two setsockopt) rather than two per read.
inline constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(10);

class RedisConnection final {
 public:
  // Connects within connect_timeout and before `deadline`, whichever comes first.
  // Errors: UNAVAILABLE when the server cannot be reached in that time.
  static absl::StatusOr<std::unique_ptr<RedisConnection>> ConnectTcp(const std::string& host,
                                                                     int port,
                                                                     absl::Duration connect_timeout,
                                                                     int64_t deadline);
  static absl::StatusOr<std::unique_ptr<RedisConnection>> ConnectUnix(
      const std::string& path, absl::Duration connect_timeout, int64_t deadline);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Adds `command` to the output buffer. No I/O.
  void Append(const RedisCommand& command);
  // Writes the output buffer before `deadline`. Errors: UNAVAILABLE (broken() afterwards).
  absl::Status Flush(int64_t deadline);
  // Reads the next reply before `deadline`; an error reply is returned as a reply (type
  // REDIS_REPLY_ERROR). A bulk-string reply is offered to `sink` first, when given (ReplySink).
  // Errors: UNAVAILABLE on I/O error, timeout or a passed deadline (broken() afterwards).
  absl::StatusOr<RedisReply> Read(int64_t deadline, ReplySink* sink = nullptr);
  // Append + Flush + Read for one command, error replies turned into statuses (ReplyStatus).
  absl::StatusOr<RedisReply> Call(const RedisCommand& command, int64_t deadline);

  bool broken() const;
  const std::string& address() const { return address_; }

 private:
  // Read for a reply the sink places (ReplySink::Place): when the next reply is a bulk string
  // the sink places, reads its bytes from the socket into the placement and returns an empty
  // string reply; a null reply when the reply is to be read as usual (not a bulk string, or the
  // sink declined; nothing of it consumed). Errors: as Read.
  absl::StatusOr<RedisReply> ReadPlaced(int64_t deadline, ReplySink& sink);
  // Fills `to` with the reply bytes hiredis buffered, then from the socket.
  absl::Status ReadInto(std::span<char> to, int64_t deadline);
  // Makes sure hiredis buffered at least `n` unread bytes.
  absl::Status Buffer(size_t n, int64_t deadline);
  // Takes `c` (freed on error). Errors: UNAVAILABLE when it failed to connect.
  static absl::StatusOr<std::unique_ptr<RedisConnection>> Adopt(redisContext* c,
                                                                std::string address);
  RedisConnection(redisContext* context, std::string address)
      : context_(context), address_(std::move(address)) {}
  // Before a blocking syscall: fails (and breaks the connection) when `deadline` has passed,
  // else makes sure the socket timeouts end the syscall by deadline + kDeadlineSlack.
  absl::Status Arm(int64_t deadline);
  // UNAVAILABLE for a failed `what`; says the deadline passed when it (nearly) has.
  absl::Status IoError(std::string_view what, int64_t deadline);

  redisContext* context_;
  std::string address_;     // "host:port" or the socket path, for messages
  bool timed_out_ = false;  // a deadline passed with the protocol mid-stream
  bool failed_ = false;     // a read of our own (ReadInto) failed: the stream is mid-reply
  int64_t armed_for_ = 0;   // the deadline the socket timeouts were last set for
  int64_t armed_at_ = 0;    // when (Clock::Real())
};

// Sends AUTH when `options` carry a password, before `deadline`. Errors: UNAVAILABLE when the
// server refuses it or does not answer in time (the connection is then unusable for the tier,
// as if it could not be reached).
absl::Status Authenticate(RedisConnection& connection, const RedisTierOptions& options,
                          int64_t deadline);

// OK for a non-error reply; UNAVAILABLE for CLUSTERDOWN / TRYAGAIN / LOADING / MASTERDOWN;
// INTERNAL with the text for any other error reply.
absl::Status ReplyStatus(const redisReply& reply);

// Sets SIGPIPE to SIG_IGN if it is SIG_DFL (once per process).
void IgnoreSigpipeOnce();

}  // namespace kvpool::tier::internal
