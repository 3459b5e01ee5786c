#include "tier/internal/redis_connection.h"

#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/time.h>

#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvpool::tier {

void RedisReplyDeleter::operator()(redisReply* reply) const { freeReplyObject(reply); }

namespace internal {
absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::Adopt(
    redisContext* c, std::string address, absl::Duration command_timeout) {
  if (c == nullptr) return absl::UnavailableError(absl::StrCat("redis ", address, ": no memory"));
  if (c->err != 0 || redisSetTimeout(c, absl::ToTimeval(command_timeout)) != REDIS_OK) {
    std::string message = absl::StrCat("redis ", address, ": connect: ", c->errstr);
    redisFree(c);
    return absl::UnavailableError(message);
  }
  return absl::WrapUnique(new RedisConnection(c, std::move(address)));
}

void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::ConnectTcp(
    const std::string& host, int port, absl::Duration connect_timeout,
    absl::Duration command_timeout) {
  IgnoreSigpipeOnce();
  redisContext* c = redisConnectWithTimeout(host.c_str(), port, absl::ToTimeval(connect_timeout));
  return Adopt(c, absl::StrCat(host, ":", port), command_timeout);
}

absl::StatusOr<std::unique_ptr<RedisConnection>> RedisConnection::ConnectUnix(
    const std::string& path, absl::Duration connect_timeout, absl::Duration command_timeout) {
  IgnoreSigpipeOnce();
  redisContext* c = redisConnectUnixWithTimeout(path.c_str(), absl::ToTimeval(connect_timeout));
  return Adopt(c, path, command_timeout);
}

RedisConnection::~RedisConnection() { redisFree(context_); }

bool RedisConnection::broken() const { return context_->err != 0; }

absl::Status RedisConnection::IoError(std::string_view what) {
  return absl::UnavailableError(absl::StrCat("redis ", address_, ": ", std::string(what), ": ",
                                             context_->err != 0 ? context_->errstr : "error"));
}

void RedisConnection::Append(const RedisCommand& command) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  argv.reserve(command.args.size());
  lens.reserve(command.args.size());
  for (std::string_view arg : command.args) {
    argv.push_back(arg.data());
    lens.push_back(arg.size());
  }
  redisAppendCommandArgv(context_, static_cast<int>(argv.size()), argv.data(), lens.data());
}

absl::Status RedisConnection::Flush() {
  int done = 0;
  while (done == 0) {
    if (redisBufferWrite(context_, &done) != REDIS_OK) return IoError("write");
  }
  return absl::OkStatus();
}

absl::StatusOr<RedisReply> RedisConnection::Read() {
  void* reply = nullptr;
  if (redisGetReply(context_, &reply) != REDIS_OK || reply == nullptr) return IoError("read");
  return RedisReply(static_cast<redisReply*>(reply));
}

absl::StatusOr<RedisReply> RedisConnection::Call(const RedisCommand& command) {
  Append(command);
  absl::StatusOr<RedisReply> reply = Read();  // redisGetReply flushes first
  if (reply.ok()) {
    absl::Status status = ReplyStatus(**reply);
    if (!status.ok()) return status;
  }
  return reply;
}

absl::Status Authenticate(RedisConnection& connection, const RedisTierOptions& options) {
  if (options.password.empty()) return absl::OkStatus();
  RedisCommand auth{.args = {"AUTH"}, .key_index = -1};
  if (!options.username.empty()) auth.args.push_back(options.username);
  auth.args.push_back(options.password);
  absl::StatusOr<RedisReply> reply = connection.Call(auth);
  if (reply.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("redis ", connection.address(), ": AUTH failed: ", reply.status().message()));
}

absl::Status ReplyStatus(const redisReply& reply) {
  if (reply.type != REDIS_REPLY_ERROR) return absl::OkStatus();
  const std::string_view text(reply.str, reply.len);
  for (std::string_view transient : {"CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN"}) {
    if (text.starts_with(transient))
      return absl::UnavailableError(absl::StrCat("redis: ", std::string(text)));
  }
  return absl::InternalError(absl::StrCat("redis: ", std::string(text)));
}

}  // namespace internal
}  // namespace kvpool::tier
