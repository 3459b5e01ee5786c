#include "daemon/attach_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(fmt::format("{}: {}", what, std::strerror(errno)));
}

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
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener < 0) return Errno("socket(attach)");
  unlink(path.c_str());  // a stale socket of a daemon that died (the caller checked none is live)
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), mode) != 0 || listen(listener, 64) != 0) {
    const absl::Status s = Errno(fmt::format("bind/listen {}", path));
    close(listener);
    return s;
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(listener);
    return Errno("eventfd");
  }
  return std::unique_ptr<AttachServer>(
      new AttachServer(path, listener, wake, std::move(attach), std::move(closed)));
}

AttachServer::AttachServer(std::string path, int listener, int wake, AttachFn attach,
                           ClosedFn closed)
    : path_(std::move(path)),
      wake_(wake),
      attach_(std::move(attach)),
      closed_(std::move(closed)),
      listener_(listener) {
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
  for (const auto& [fd, id] : connections_) close(fd);
  if (listener_ >= 0) {
    close(listener_);
    unlink(path_.c_str());
  }
  close(wake_);
}

void AttachServer::Wake() {
  const uint64_t one = 1;
  (void)write(wake_, &one, sizeof(one));
}

void AttachServer::StopAccepting() {
  absl::MutexLock lock(&mu_);
  if (listener_ < 0) return;
  close(listener_);
  unlink(path_.c_str());
  listener_ = -1;
  Wake();
}

void AttachServer::CloseAll() {
  absl::flat_hash_map<int, SessionId> closing;
  {
    absl::MutexLock lock(&mu_);
    closing.swap(connections_);
  }
  Wake();
  for (const auto& [fd, id] : closing) {
    close(fd);
    closed_(id);
  }
}

size_t AttachServer::sessions() const {
  absl::MutexLock lock(&mu_);
  return connections_.size();
}

void AttachServer::Loop() {
  for (;;) {
    std::vector<pollfd> fds;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      fds.push_back({wake_, POLLIN, 0});
      if (listener_ >= 0) fds.push_back({listener_, POLLIN, 0});
      for (const auto& [fd, id] : connections_) fds.push_back({fd, POLLIN | POLLRDHUP, 0});
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      Logger("daemon").error("attach poll: {}", std::strerror(errno));
      return;
    }
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      if (p.fd == wake_) {
        uint64_t drained;
        (void)read(wake_, &drained, sizeof(drained));
        continue;
      }
      bool is_listener;
      {
        absl::MutexLock lock(&mu_);
        is_listener = p.fd == listener_;
      }
      if (is_listener) {
        Accept();
        continue;
      }
      // A session connection: anything but silence means it is over (clients never write after
      // the handshake). EOF, hang-up and errors all end the session.
      char byte;
      const ssize_t n = recv(p.fd, &byte, 1, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      SessionId id;
      {
        absl::MutexLock lock(&mu_);
        auto it = connections_.find(p.fd);
        if (it == connections_.end()) continue;  // CloseAll took it
        id = it->second;
        connections_.erase(it);
      }
      close(p.fd);
      closed_(id);
    }
  }
}

void AttachServer::Accept() {
  int listener;
  {
    absl::MutexLock lock(&mu_);
    listener = listener_;
  }
  for (;;) {
    const int connection = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) return;  // EAGAIN: drained
    Handshake(connection);
  }
}

void AttachServer::Handshake(int connection) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    close(connection);
    return;
  }
  const PeerCredentials peer{cred.pid, cred.uid, cred.gid};
  v1::AttachRequest request;
  if (absl::Status s = wire::ReceiveFrame(connection, &request, nullptr, absl::Seconds(1));
      !s.ok()) {
    // A peer that connects and closes at once is a readiness probe; anything else is worth a
    // warning.
    if (absl::IsUnavailable(s)) {
      Logger("daemon").debug("attach socket probed by pid {}", peer.pid);
    } else {
      Logger("daemon").warn("attach from pid {} uid {}: {}", peer.pid, peer.uid, s.ToString());
    }
    close(connection);
    return;
  }
  absl::StatusOr<AttachGrant> grant = attach_(peer, request);
  if (!grant.ok()) {
    v1::AttachResponse refusal;
    refusal.set_error(std::string(grant.status().message()));
    refusal.set_error_code(static_cast<int32_t>(grant.status().code()));
    (void)wire::SendFrame(connection, refusal);
    close(connection);
    return;
  }
  const absl::Status sent = wire::SendFrame(connection, grant->response, grant->fds);
  for (int fd : grant->fds) close(fd);  // the client has its own copies now
  const SessionId id(grant->response.session_id());
  if (!sent.ok()) {
    Logger("daemon").warn("attach reply to pid {}: {}", peer.pid, sent.ToString());
    close(connection);
    closed_(id);
    return;
  }
  absl::MutexLock lock(&mu_);
  connections_.emplace(connection, id);
}

}  // namespace kvpool::daemon
