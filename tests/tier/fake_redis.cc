#include "tests/tier/fake_redis.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>

#include "absl/strings/str_cat.h"

namespace kvpool::tier::testing {
namespace {

std::optional<int64_t> ParseInt(std::string_view digits) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace

std::string RespBulk(std::string_view s) {
  return absl::StrCat("$", s.size(), "\r\n", std::string(s), "\r\n");
}

std::string RespError(std::string_view text) {
  return absl::StrCat("-", std::string(text), "\r\n");
}

std::string RespAllSlotsOn(int port) {
  return absl::StrCat("*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n", RespBulk("127.0.0.1"), ":", port,
                      "\r\n", RespBulk(std::string(40, 'f')));
}

bool FakeConnection::Fill() {
  char chunk[65536];
  for (;;) {
    const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
    if (n > 0) {
      buffer_.append(chunk, static_cast<size_t>(n));
      return true;
    }
    if (n < 0 && errno == EINTR) continue;
    return false;
  }
}

std::optional<std::string> FakeConnection::Line() {
  size_t end;
  while ((end = buffer_.find("\r\n")) == std::string::npos) {
    if (!Fill()) return std::nullopt;
  }
  std::string line = buffer_.substr(0, end);
  buffer_.erase(0, end + 2);
  return line;
}

std::optional<std::vector<std::string>> FakeConnection::ReadCommand() {
  const std::optional<std::string> header = Line();
  if (!header || header->empty() || (*header)[0] != '*') return std::nullopt;
  const std::optional<int64_t> count = ParseInt(std::string_view(*header).substr(1));
  if (!count || *count < 0) return std::nullopt;
  std::vector<std::string> args;
  for (int64_t i = 0; i < *count; ++i) {
    const std::optional<std::string> length_line = Line();
    if (!length_line || length_line->empty() || (*length_line)[0] != '$') return std::nullopt;
    const std::optional<int64_t> length = ParseInt(std::string_view(*length_line).substr(1));
    if (!length || *length < 0) return std::nullopt;
    const size_t need = static_cast<size_t>(*length) + 2;
    while (buffer_.size() < need) {
      if (!Fill()) return std::nullopt;
    }
    args.push_back(buffer_.substr(0, static_cast<size_t>(*length)));
    buffer_.erase(0, need);
  }
  server_->Record(args);
  return args;
}

bool FakeConnection::Write(std::string_view bytes) {
  while (!bytes.empty()) {
    if (server_->stopping()) return false;
    const ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

bool FakeConnection::Pause(absl::Duration how_long) {
  absl::MutexLock lock(&server_->mu_);
  return !server_->mu_.AwaitWithTimeout(absl::Condition(&server_->stopping_), how_long);
}

void FakeConnection::HangUp() { shutdown(fd_, SHUT_RDWR); }

absl::StatusOr<std::unique_ptr<FakeRedisServer>> FakeRedisServer::Start(Handler handler) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (fd >= 0) close(fd);
    return absl::InternalError("fake redis: cannot listen on 127.0.0.1");
  }
  auto server = absl::WrapUnique(new FakeRedisServer(fd, ntohs(addr.sin_port), std::move(handler)));
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

FakeRedisServer::~FakeRedisServer() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
  }
  shutdown(listen_fd_, SHUT_RDWR);  // wakes accept(2)
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) close(fd);
  close(listen_fd_);
}

void FakeRedisServer::AcceptLoop() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && errno == EINTR) continue;
    absl::MutexLock lock(&mu_);
    if (fd < 0 || stopping_) {
      if (fd >= 0) close(fd);
      return;
    }
    ++accepted_;
    fds_.push_back(fd);
    threads_.emplace_back([this, fd] {
      FakeConnection connection(this, fd);
      handler_(connection);
    });
  }
}

std::string FakeRedisServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

std::vector<std::vector<std::string>> FakeRedisServer::commands() const {
  absl::MutexLock lock(&mu_);
  return commands_;
}

bool FakeRedisServer::stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void FakeRedisServer::Record(std::vector<std::string> command) {
  absl::MutexLock lock(&mu_);
  commands_.push_back(std::move(command));
}

}  // namespace kvpool::tier::testing
