#include "daemon/edge/attach_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(fmt::format("{}: {}", what, std::strerror(errno)));
}

spdlog::logger& Log() { return Logger("daemon"); }

}  // namespace

absl::StatusOr<std::unique_ptr<AttachServer>> AttachServer::Start(const std::string& path,
                                                                  uint32_t mode, AttachFn attach,
                                                                  ClosedFn closed) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path too long: {}", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener.valid()) return Errno("socket(attach)");
  unlink(path.c_str());  // a stale socket of a daemon that died (the caller checked none is live)
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), mode) != 0 || listen(listener.get(), 64) != 0) {
    return Errno(fmt::format("bind/listen {}", path));
  }
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return Errno("eventfd");
  return std::unique_ptr<AttachServer>(new AttachServer(path, std::move(listener), std::move(wake),
                                                        std::move(attach), std::move(closed)));
}

AttachServer::AttachServer(std::string path, UniqueFd listener, UniqueFd wake, AttachFn attach,
                           ClosedFn closed)
    : path_(std::move(path)),
      wake_(std::move(wake)),
      attach_(std::move(attach)),
      closed_(std::move(closed)),
      listener_(std::move(listener)) {
  thread_ = std::thread([this] { Loop(); });
}

AttachServer::~AttachServer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
  absl::MutexLock lock(&mu_);
  connections_.clear();
  if (listener_.valid()) {
    listener_.reset();
    unlink(path_.c_str());
  }
}

void AttachServer::Wake() {
  const uint64_t one = 1;
  // A full eventfd counter already wakes the loop: nothing is lost when the write fails.
  [[maybe_unused]] const ssize_t n = write(wake_.get(), &one, sizeof(one));
}

void AttachServer::StopAccepting() {
  absl::MutexLock lock(&mu_);
  if (!listener_.valid()) return;
  listener_.reset();
  unlink(path_.c_str());
  Wake();
}

void AttachServer::CloseAll() {
  absl::flat_hash_map<int, Connection> closing;
  {
    absl::MutexLock lock(&mu_);
    closing.swap(connections_);
  }
  Wake();
  for (auto& [fd, connection] : closing) {
    connection.socket.reset();
    closed_(connection.session, SessionEnd::kShutdown);
  }
}

size_t AttachServer::sessions() const {
  absl::MutexLock lock(&mu_);
  return connections_.size();
}

void AttachServer::Loop() {
  for (;;) {
    std::vector<pollfd> fds;
    int listener;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      listener = listener_.get();
      fds.push_back({wake_.get(), POLLIN, 0});
      if (listener >= 0) fds.push_back({listener, POLLIN, 0});
      for (const auto& [fd, connection] : connections_) fds.push_back({fd, POLLIN | POLLRDHUP, 0});
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      Log().error("attach poll: {}", std::strerror(errno));
      return;
    }
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      if (p.fd == wake_.get()) {
        uint64_t drained;
        [[maybe_unused]] const ssize_t n = read(wake_.get(), &drained, sizeof(drained));
      } else if (p.fd == listener) {
        Accept();
      } else {
        Watch(p.fd);
      }
    }
  }
}

void AttachServer::Watch(int fd) {
  SessionId session;
  SessionEnd how = SessionEnd::kConnectionLost;
  UniqueFd closing;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(fd);
    if (it == connections_.end()) return;  // CloseAll took it
    // Clients send nothing after the handshake but, optionally, a Detach frame right before they
    // close: an empty message, so a frame of length 0.
    char bytes[16];
    const ssize_t n = recv(fd, bytes, sizeof(bytes), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n == 4 && std::memcmp(bytes, "\0\0\0\0", 4) == 0) how = SessionEnd::kDetached;
    session = it->second.session;
    closing = std::move(it->second.socket);
    connections_.erase(it);
  }
  closing.reset();
  closed_(session, how);
}

void AttachServer::Accept() {
  for (;;) {
    int listener;
    {
      absl::MutexLock lock(&mu_);
      listener = listener_.get();
    }
    if (listener < 0) return;
    UniqueFd connection(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection.valid()) return;  // EAGAIN: drained
    Handshake(std::move(connection));
  }
}

void AttachServer::Handshake(UniqueFd connection) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(connection.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  const PeerCredentials peer{cred.pid, cred.uid, cred.gid};
  v1::AttachRequest request;
  if (absl::Status s = wire::ReceiveFrame(connection.get(), &request, nullptr, absl::Seconds(1));
      !s.ok()) {
    // A peer that connects and closes at once is a readiness probe; anything else is worth a
    // warning.
    if (absl::IsUnavailable(s)) {
      Log().debug("attach socket probed by pid {}", peer.pid);
    } else {
      Log().warn("attach from pid {} uid {}: {}", peer.pid, peer.uid, s.ToString());
    }
    return;
  }
  absl::StatusOr<AttachReply> reply = attach_(peer, request);
  if (!reply.ok()) {
    v1::AttachResponse refusal;
    refusal.set_error(std::string(reply.status().message()));
    refusal.set_error_code(static_cast<int32_t>(reply.status().code()));
    if (absl::Status s = wire::SendFrame(connection.get(), refusal); !s.ok()) {
      Log().debug("attach refusal to pid {}: {}", peer.pid, s.ToString());
    }
    return;
  }
  std::vector<int> fds;
  for (const UniqueFd& fd : reply->fds) fds.push_back(fd.get());
  const absl::Status sent = wire::SendFrame(connection.get(), reply->response, fds);
  reply->fds.clear();  // the client has its own copies now
  if (!sent.ok()) {
    Log().warn("attach reply to pid {}: {}", peer.pid, sent.ToString());
    connection.reset();
    closed_(reply->session, SessionEnd::kConnectionLost);
    return;
  }
  absl::MutexLock lock(&mu_);
  const int fd = connection.get();
  connections_.emplace(fd, Connection{std::move(connection), reply->session});
}

}  // namespace kvpool::daemon
