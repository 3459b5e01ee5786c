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

  void Stream(std::span<const RedisCommand> commands, ReplyCallback on_reply) override {
    const int64_t deadline = internal::CallDeadline(options_.command_timeout);
    const bool reused = connection_ != nullptr && !connection_->broken();
    if (!Attempt(commands, on_reply, /*may_retry=*/reused, deadline)) {
      Attempt(commands, on_reply, /*may_retry=*/false, deadline);
    }
  }

  RedisClientStats stats() const override { return stats_; }

 private:
  // One pipelined round trip, over before `deadline`. Returns false, having delivered nothing,
  // when it failed before the first reply and `may_retry`; otherwise delivers every result and
  // returns true.
  bool Attempt(std::span<const RedisCommand> commands, ReplyCallback on_reply, bool may_retry,
               int64_t deadline) {
    absl::Status status = Connect(deadline);
    if (status.ok()) {
      for (const RedisCommand& command : commands) connection_->Append(command);
      status = connection_->Flush(deadline);
      ++stats_.round_trips;
    }
    for (size_t i = 0; i < commands.size(); ++i) {
      absl::StatusOr<RedisReply> reply = status.ok() ? connection_->Read(deadline, commands[i].sink)
                                                     : absl::StatusOr<RedisReply>(status);
      if (!reply.ok()) {
        status = reply.status();
        if (i == 0 && may_retry) {
          ++stats_.io_errors;
          connection_.reset();
          return false;
        }
        on_reply(i, status);
        continue;
      }
      absl::Status reply_status = internal::ReplyStatus(**reply);
      on_reply(i, reply_status.ok() ? std::move(reply) : absl::StatusOr<RedisReply>(reply_status));
    }
    if (!status.ok() && connection_ != nullptr) {
      ++stats_.io_errors;
      connection_.reset();
    }
    return true;
  }

  absl::Status Connect(int64_t deadline) {
    if (connection_ != nullptr && !connection_->broken()) return absl::OkStatus();
    connection_.reset();
    absl::StatusOr<std::unique_ptr<internal::RedisConnection>> connection =
        options_.unix_socket.empty()
            ? internal::RedisConnection::ConnectTcp(options_.host, options_.port,
                                                    options_.connect_timeout, deadline)
            : internal::RedisConnection::ConnectUnix(options_.unix_socket, options_.connect_timeout,
                                                     deadline);
    absl::Status status = connection.status();
    if (status.ok()) status = internal::Authenticate(**connection, options_, deadline);
    if (!status.ok()) {
      ++stats_.connect_failures;
      return status;
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

std::vector<absl::StatusOr<RedisReply>> RedisClient::Execute(
    std::span<const RedisCommand> commands) {
  std::vector<absl::StatusOr<RedisReply>> results(commands.size());
  Stream(commands, [&results](size_t index, absl::StatusOr<RedisReply> reply) {
    results[index] = std::move(reply);
  });
  return results;
}

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
