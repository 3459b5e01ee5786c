#include "tier/redis_client.h"

#include <hiredis/hiredis.h>

#include <charconv>

#include "absl/strings/str_cat.h"
#include "tier/internal/cluster_client.h"
#include "tier/internal/redis_connection.h"

namespace kvpool::tier {
namespace {

// One server, one connection, one round trip per Execute.
class StandaloneClient final : public RedisClient {
 public:
  explicit StandaloneClient(const RedisTierOptions& options) : options_(options) {}

  // A connection kept from an earlier call may have died since (a restarted server); a failure
  // before its first reply is retried once on a fresh connection. GET and SET NX are
  // idempotent, so a command the dead connection did deliver is harmless to send again.
  std::vector<absl::StatusOr<RedisReply>> Execute(std::span<const RedisCommand> commands) override {
    const bool reused = connection_ != nullptr && !connection_->broken();
    size_t answered = 0;
    std::vector<absl::StatusOr<RedisReply>> results = Attempt(commands, &answered);
    if (reused && answered == 0 && !commands.empty() && !results[0].ok() &&
        absl::IsUnavailable(results[0].status())) {
      results = Attempt(commands, &answered);
    }
    return results;
  }

  RedisClientStats stats() const override { return stats_; }

 private:
  // One pipelined round trip; `answered` counts the replies read before any I/O error.
  std::vector<absl::StatusOr<RedisReply>> Attempt(std::span<const RedisCommand> commands,
                                                  size_t* answered) {
    std::vector<absl::StatusOr<RedisReply>> results;
    results.reserve(commands.size());
    *answered = 0;
    absl::Status status = Connect();
    if (status.ok()) {
      for (const RedisCommand& command : commands) connection_->Append(command);
      status = connection_->Flush();
      ++stats_.round_trips;
    }
    for (size_t i = 0; i < commands.size(); ++i) {
      absl::StatusOr<RedisReply> reply =
          status.ok() ? connection_->Read() : absl::StatusOr<RedisReply>(status);
      if (!reply.ok()) {
        status = reply.status();
        results.push_back(status);
        continue;
      }
      ++*answered;
      absl::Status reply_status = internal::ReplyStatus(**reply);
      if (reply_status.ok()) {
        results.push_back(std::move(reply));
      } else {
        results.push_back(reply_status);
      }
    }
    if (!status.ok() && connection_ != nullptr) {
      ++stats_.io_errors;
      connection_.reset();
    }
    return results;
  }

  absl::Status Connect() {
    if (connection_ != nullptr && !connection_->broken()) return absl::OkStatus();
    connection_.reset();
    absl::StatusOr<std::unique_ptr<internal::RedisConnection>> connection =
        options_.unix_socket.empty()
            ? internal::RedisConnection::ConnectTcp(
                  options_.host, options_.port, options_.connect_timeout, options_.command_timeout)
            : internal::RedisConnection::ConnectUnix(options_.unix_socket, options_.connect_timeout,
                                                     options_.command_timeout);
    if (!connection.ok()) {
      ++stats_.connect_failures;
      return connection.status();
    }
    ++stats_.connects;
    connection_ = std::move(*connection);
    return absl::OkStatus();
  }

  const RedisTierOptions options_;
  std::unique_ptr<internal::RedisConnection> connection_;
  RedisClientStats stats_;
};

}  // namespace

absl::Status ParseHostPort(std::string_view address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", std::string(address), "' is not host:port"));
  }
  const std::string_view digits = address.substr(colon + 1);
  int value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size() || value <= 0 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", std::string(address), "' has no valid port"));
  }
  *host = std::string(address.substr(0, colon));
  *port = value;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RedisClient>> CreateRedisClient(const RedisTierOptions& options) {
  const int kinds = static_cast<int>(!options.unix_socket.empty()) +
                    static_cast<int>(!options.host.empty()) +
                    static_cast<int>(!options.cluster_seeds.empty());
  if (kinds != 1) {
    return absl::InvalidArgumentError(
        "redis tier: set exactly one of unix_socket, host or cluster_seeds");
  }
  if (options.cluster_seeds.empty()) return std::make_unique<StandaloneClient>(options);
  for (const std::string& seed : options.cluster_seeds) {
    std::string host;
    int port = 0;
    absl::Status status = ParseHostPort(seed, &host, &port);
    if (!status.ok())
      return absl::InvalidArgumentError(absl::StrCat("cluster_seeds: ", status.message()));
  }
  return std::make_unique<internal::ClusterClient>(options);
}

}  // namespace kvpool::tier
