#include "daemon/edge/attach_server.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "fmt/format.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/v1/runtime_dir.h"

namespace kvpool::daemon {
namespace {

constexpr uint64_t kListenerKey = 0;
constexpr uint64_t kWakeKey = 1;

// Linux 6.16's (include/uapi/asm-generic/socket.h; Debian 12's headers predate it). Another value
// on alpha, mips, parisc and sparc, which kvpoold is not built for.
#ifndef SO_PASSRIGHTS
#define SO_PASSRIGHTS 83
#endif

// The most descriptors one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD). A stream
// recvmsg returns at most one message's, so a control buffer this large is never truncated: a
// truncated one would have the kernel drop the rest, on this thread.
constexpr size_t kMaxPeerFds = 253;

absl::Status Errno(std::string_view what) {
  return absl::InternalError(fmt::format("{}: {}", what, std::strerror(errno)));
}

spdlog::logger& Log() { return Logger("daemon"); }

bool EpollAdd(int epoll, int fd, uint32_t events, uint64_t key) {
  epoll_event e{};
  e.events = events;
  e.data.u64 = key;
  return epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &e) == 0;
}

// Reads up to `len` bytes without waiting, taking in the descriptors sent with them (into
// `fds`: the caller releases them). recvmsg's result; errno is recvmsg's.
ssize_t Receive(int socket, char* bytes, size_t len, std::vector<UniqueFd>* fds, bool* truncated) {
  iovec iov{bytes, len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPeerFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return n;
  for (cmsghdr* m = CMSG_FIRSTHDR(&msg); m != nullptr; m = CMSG_NXTHDR(&msg, m)) {
    if (m->cmsg_level != SOL_SOCKET || m->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (m->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(m);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
  *truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  return n;
}

// Has the kernel refuse SCM_RIGHTS sent to `listener` and to every connection accepted from it
// (they copy the listener's setting at connect(), before a peer can send on them: af_unix.c
// since the series that added the option). False, with errno, where the kernel cannot (ENOPROTOOPT
// before Linux 6.16).
bool RefusePeerFds(int listener) {
  const int off = 0;
  return setsockopt(listener, SOL_SOCKET, SO_PASSRIGHTS, &off, sizeof(off)) == 0;
}

}  // namespace

struct AttachServer::Connection {
  uint64_t id = 0;
  UniqueFd socket;
  PeerCredentials peer;
  bool handshaking = true;
  int64_t deadline_ns = 0;  // of the handshake, on the server's clock
  wire::FrameReader request;
  SessionId session;  // once accepted

  explicit Connection(uint32_t max_request_bytes) : request(max_request_bytes) {}
};

absl::StatusOr<std::unique_ptr<AttachServer>> AttachServer::Start(
    const std::string& path, uint32_t mode, AttachLimits limits, AdmitFn admit, AttachFn attach,
    ClosedFn closed, AttachCounters* counters, const Clock* clock) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path too long: {}", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener.valid()) return Errno("socket(attach)");
  // Before bind(): no peer can connect earlier.
  std::string peer_fds = "the kernel refuses descriptors sent by peers (SO_PASSRIGHTS)";
  std::unique_ptr<FdCloser> closer;
  if (!limits.refuse_peer_fds_in_kernel) {
    peer_fds = "descriptors sent by peers are closed on a closer thread (as configured)";
    closer = std::make_unique<FdCloser>();
  } else if (!RefusePeerFds(listener.get())) {
    peer_fds = fmt::format(
        "the kernel cannot refuse descriptors sent by peers (SO_PASSRIGHTS: {}; Linux 6.16+ "
        "can): they are closed on a closer thread",
        std::strerror(errno));
    closer = std::make_unique<FdCloser>();
  }
  unlink(path.c_str());  // a stale socket of a daemon that died (the caller checked none is live)
  {
    wire::ScopedUmask umask(mode);
    if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Errno(fmt::format("bind {}", path));
    }
  }
  // A deep backlog: a reconnect storm queues in the kernel instead of blocking connect().
  if (listen(listener.get(), SOMAXCONN) != 0) return Errno(fmt::format("listen {}", path));
  UniqueFd epoll(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll.valid()) return Errno("epoll_create1");
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return Errno("eventfd");
  if (!EpollAdd(epoll.get(), wake.get(), EPOLLIN, kWakeKey)) return Errno("epoll_ctl(wake)");
  Log().info("attach: {}", peer_fds);
  return std::unique_ptr<AttachServer>(new AttachServer(
      path, limits, std::move(listener), std::move(epoll), std::move(wake), std::move(closer),
      std::move(admit), std::move(attach), std::move(closed), counters, clock));
}

AttachServer::AttachServer(std::string path, AttachLimits limits, UniqueFd listener, UniqueFd epoll,
                           UniqueFd wake, std::unique_ptr<FdCloser> closer, AdmitFn admit,
                           AttachFn attach, ClosedFn closed, AttachCounters* counters,
                           const Clock* clock)
    : path_(std::move(path)),
      limits_(limits),
      admit_(std::move(admit)),
      attach_(std::move(attach)),
      closed_(std::move(closed)),
      counters_(counters),
      clock_(clock),
      handshake_timeout_ns_(absl::ToInt64Nanoseconds(limits.handshake_timeout)),
      accept_backoff_ns_(absl::ToInt64Nanoseconds(limits.accept_backoff)),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)),
      closer_(std::move(closer)),
      listener_(std::move(listener)) {
  next_id_ = kWakeKey + 1;
  thread_ = std::thread([this] { Loop(); });
}

AttachServer::~AttachServer() {
  Post(Command::kExit);
  thread_.join();
  // The loop is gone: what it owned is released here, on the destroying thread.
  for (auto& [id, c] : connections_) ReleaseSocket(std::move(c->socket));
  connections_.clear();
  CloseListener();
  closer_.reset();  // waits for the closes queued
}

void AttachServer::StopAccepting() { Post(Command::kStopAccepting); }

void AttachServer::CloseAll() { Post(Command::kCloseAll); }

void AttachServer::Post(Command command) {
  absl::Notification done;
  {
    absl::MutexLock lock(&mu_);
    if (exited_) return;
    commands_.push_back({command, &done});
  }
  Wake();
  done.WaitForNotification();
}

void AttachServer::Wake() {
  const uint64_t one = 1;
  // A full eventfd counter already wakes the loop: nothing is lost when the write fails.
  [[maybe_unused]] const ssize_t n = write(wake_.get(), &one, sizeof(one));
}

bool AttachServer::RunCommands() {
  uint64_t drained;
  [[maybe_unused]] const ssize_t n = read(wake_.get(), &drained, sizeof(drained));
  std::vector<Posted> commands;
  {
    absl::MutexLock lock(&mu_);
    commands.swap(commands_);
  }
  bool keep_going = true;
  for (const Posted& posted : commands) {
    switch (posted.command) {
      case Command::kStopAccepting:
        CloseListener();
        // Only handshakes still under way: an entry behind a slower one may name a connection
        // that attached since (stale, as in ExpireHandshakes), a live session kept here.
        while (!handshakes_.empty()) {
          auto it = connections_.find(handshakes_.front());
          if (it != connections_.end() && it->second->handshaking) Drop(it->first);
          handshakes_.pop_front();
        }
        break;
      case Command::kCloseAll: {
        std::vector<SessionId> closing;
        for (auto it = connections_.begin(); it != connections_.end();) {
          auto next = std::next(it);
          if (!it->second->handshaking) {
            closing.push_back(it->second->session);
            Drop(it->first);
          }
          it = next;
        }
        for (SessionId session : closing) closed_(session, SessionEnd::kShutdown);
        break;
      }
      case Command::kExit:
        keep_going = false;
        break;
    }
  }
  if (!keep_going) {
    absl::MutexLock lock(&mu_);
    exited_ = true;
    // Anyone who posted after the exit command returns without waiting.
    for (const Posted& late : commands_) late.done->Notify();
    commands_.clear();
  }
  for (const Posted& posted : commands) posted.done->Notify();
  return keep_going;
}

void AttachServer::CloseListener() {
  if (!listener_.valid()) return;
  ReleaseSocket(std::move(listener_));  // with the connections not yet accepted
  listener_in_epoll_ = false;
  unlink(path_.c_str());
}

void AttachServer::Release(UniqueFd fd) {
  if (closer_ != nullptr) closer_->Close(std::move(fd));
  // else `fd` closes here: the kernel let no peer's descriptor reach it.
}

void AttachServer::ReleaseSocket(UniqueFd socket) {
  if (closer_ != nullptr && socket.valid()) {
    // Open until the closer gets to it: out of the epoll set now (its events would wake the loop
    // for nothing, level-triggered, again and again), and shut down so that the peer sees the
    // end at once and can queue nothing more in it.
    epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket.get(), nullptr);
    shutdown(socket.get(), SHUT_RDWR);
  }
  Release(std::move(socket));
}

int AttachServer::PollTimeoutMs() const {
  int64_t next = INT64_MAX;
  for (uint64_t id : handshakes_) {
    auto it = connections_.find(id);
    if (it != connections_.end() && it->second->handshaking) {
      next = it->second->deadline_ns;  // the oldest live handshake expires first
      break;
    }
  }
  if (listener_.valid() && !listener_in_epoll_) next = std::min(next, listener_paused_until_ns_);
  if (next == INT64_MAX) return -1;
  return clock_->PollTimeoutMs(next);
}

void AttachServer::Loop() {
  std::vector<epoll_event> events(64);
  for (;;) {
    if (listener_.valid() && !listener_in_epoll_ &&
        clock_->NowNanos() >= listener_paused_until_ns_) {
      listener_in_epoll_ = EpollAdd(epoll_.get(), listener_.get(), EPOLLIN, kListenerKey);
    }
    const int n =
        epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), PollTimeoutMs());
    if (n < 0) {
      if (errno == EINTR) continue;
      Log().critical("attach loop: epoll_wait: {}", std::strerror(errno));
      std::abort();  // a broken loop would leak every session: better restart (systemd)
    }
    bool exit = false;
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kWakeKey) {
        exit = !RunCommands();
        if (exit) break;
      } else if (key == kListenerKey) {
        Accept();
      } else if (auto it = connections_.find(key); it != connections_.end()) {
        Connection& c = *it->second;
        if (c.handshaking) {
          ReadHandshake(c);
        } else {
          WatchSession(c);
        }
      }  // else: dropped earlier in this batch
    }
    if (exit) return;
    ExpireHandshakes(clock_->NowNanos());
  }
}

void AttachServer::Accept() {
  while (listener_.valid()) {
    UniqueFd socket(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (socket.valid()) {
      Admit(std::move(socket));
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The connection stays in the backlog while the listener stays readable: waiting on it
      // now would spin. Leave it alone for a while; sessions closing meanwhile free descriptors.
      epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listener_.get(), nullptr);
      listener_in_epoll_ = false;
      listener_paused_until_ns_ = clock_->NowNanos() + accept_backoff_ns_;
      const uint64_t backoffs =
          counters_->accept_backoffs.fetch_add(1, std::memory_order_relaxed) + 1;
      if ((backoffs & (backoffs - 1)) == 0) {  // the 1st, 2nd, 4th, 8th ... time
        Log().error("attach: accept: {}; pausing accepts for {} (happened {} time(s))",
                    std::strerror(errno), absl::FormatDuration(limits_.accept_backoff), backoffs);
      }
    } else if (errno != EAGAIN) {
      Log().warn("attach: accept: {}", std::strerror(errno));
    }
    return;
  }
}

void AttachServer::Admit(UniqueFd socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    ReleaseSocket(std::move(socket));
    return;
  }
  auto c = std::make_unique<Connection>(limits_.max_request_bytes);
  c->id = next_id_++;
  c->socket = std::move(socket);
  c->peer = {cred.pid, cred.uid, cred.gid};
  if (absl::Status admitted = admit_(c->peer); !admitted.ok()) {
    counters_->refused_at_accept.fetch_add(1, std::memory_order_relaxed);
    Log().warn("attach refused at accept: pid {} uid {} gid {}: {}", c->peer.pid, c->peer.uid,
               c->peer.gid, admitted.message());
    Refuse(*c, admitted);
    ReleaseSocket(std::move(c->socket));
    return;
  }
  MakeRoomFor(c->peer.uid);
  if (!EpollAdd(epoll_.get(), c->socket.get(), EPOLLIN | EPOLLRDHUP, c->id)) {
    Log().warn("attach: epoll_ctl: {}", std::strerror(errno));
    ReleaseSocket(std::move(c->socket));
    return;
  }
  c->deadline_ns = clock_->NowNanos() + handshake_timeout_ns_;
  ++pending_by_uid_[c->peer.uid];
  pending_.fetch_add(1, std::memory_order_relaxed);
  handshakes_.push_back(c->id);
  Connection& added = *connections_.emplace(c->id, std::move(c)).first->second;
  // Clients send their request right after connecting: it is often here already.
  ReadHandshake(added);
}

void AttachServer::MakeRoomFor(uid_t uid) {
  const auto mine = pending_by_uid_.find(uid);
  const bool uid_full =
      mine != pending_by_uid_.end() && mine->second >= limits_.max_pending_per_uid;
  const bool all_full =
      pending_.load(std::memory_order_relaxed) >= static_cast<size_t>(limits_.max_pending);
  if (!uid_full && !all_full) return;
  // The oldest handshake of this uid when it is over its own cap, else the oldest of all.
  for (auto it = handshakes_.begin(); it != handshakes_.end(); ++it) {
    auto c = connections_.find(*it);
    if (c == connections_.end() || !c->second->handshaking) continue;
    if (uid_full && c->second->peer.uid != uid) continue;
    counters_->displaced.fetch_add(1, std::memory_order_relaxed);
    Log().debug("attach: handshake of pid {} displaced by a newer one", c->second->peer.pid);
    Refuse(*c->second, absl::ResourceExhaustedError(fmt::format(
                           "too many attach handshakes in progress (at most {} per uid, {} in "
                           "all); this one was the oldest",
                           limits_.max_pending_per_uid, limits_.max_pending)));
    Drop(*it);
    handshakes_.erase(it);
    return;
  }
}

void AttachServer::ReadHandshake(Connection& c) {
  while (!c.request.complete()) {
    char chunk[4096];
    std::vector<UniqueFd> fds;  // only where the kernel delivers them (kClosedOffLoop)
    bool truncated = false;
    const ssize_t n = Receive(c.socket.get(), chunk, std::min(sizeof(chunk), c.request.wanted()),
                              &fds, &truncated);
    const int error = errno;
    if (n < 0 && error == EINTR) continue;
    if (n < 0 && (error == EAGAIN || error == EWOULDBLOCK)) return;  // more later
    const bool carried_fds = !fds.empty();
    for (UniqueFd& fd : fds) Release(std::move(fd));
    absl::Status bad;
    if (n <= 0) {
      // A peer that connects and closes at once is a readiness probe.
      if (c.request.size() == 0 && n == 0) {
        Log().debug("attach socket probed by pid {}", c.peer.pid);
      } else {
        Log().warn("attach from pid {} uid {}: {}", c.peer.pid, c.peer.uid,
                   n == 0 ? "closed mid-request" : std::strerror(error));
      }
      Drop(c.id);
      return;
    }
    if (carried_fds) {
      bad = absl::InvalidArgumentError("an attach request carries no descriptors");
    } else if (truncated) {
      bad = absl::InvalidArgumentError("an attach request carries no control data");
    } else {
      bad = c.request.Append({chunk, static_cast<size_t>(n)});
    }
    if (!bad.ok()) {
      counters_->malformed.fetch_add(1, std::memory_order_relaxed);
      Log().warn("attach from pid {} uid {}: {}", c.peer.pid, c.peer.uid, bad.message());
      Refuse(c, bad);
      Drop(c.id);
      return;
    }
  }
  FinishHandshake(c);
}

void AttachServer::FinishHandshake(Connection& c) {
  EndPending(c);
  v1::AttachRequest request;
  if (absl::Status parsed = c.request.Parse(&request); !parsed.ok()) {
    counters_->malformed.fetch_add(1, std::memory_order_relaxed);
    Log().warn("attach from pid {} uid {}: {}", c.peer.pid, c.peer.uid, parsed.message());
    Refuse(c, parsed);
    Drop(c.id);
    return;
  }
  c.request = wire::FrameReader(0);  // frees the request's bytes
  absl::StatusOr<AttachReply> reply = attach_(c.peer, request);
  if (!reply.ok()) {
    Refuse(c, reply.status());
    Drop(c.id);
    return;
  }
  c.session = reply->session;
  sessions_.fetch_add(1, std::memory_order_relaxed);
  std::vector<int> fds;
  for (const UniqueFd& fd : reply->fds) fds.push_back(fd.get());
  // The reply is a few hundred bytes on a fresh connection: it fits the socket buffer, so the
  // non-blocking send completes or fails, never waits.
  const absl::Status sent = wire::SendFrame(c.socket.get(), reply->response, fds);
  reply->fds.clear();  // the client has its own copies now
  if (!sent.ok()) {
    Log().warn("attach reply to pid {}: {}", c.peer.pid, sent.ToString());
    const SessionId session = c.session;
    Drop(c.id);
    closed_(session, SessionEnd::kConnectionLost);
  }
}

void AttachServer::Refuse(Connection& c, const absl::Status& why) {
  v1::AttachResponse refusal;
  refusal.set_error(std::string(why.message()));
  refusal.set_error_code(static_cast<int32_t>(why.code()));
  // Best effort and non-blocking: a peer that does not read its refusal just loses it.
  if (absl::Status s = wire::SendFrame(c.socket.get(), refusal); !s.ok()) {
    Log().debug("attach refusal to pid {}: {}", c.peer.pid, s.ToString());
  }
}

void AttachServer::WatchSession(Connection& c) {
  // Clients send nothing after the handshake but, optionally, a Detach frame right before they
  // close: an empty message, so a frame of length 0.
  // Descriptors sent with them are released off the loop (kClosedOffLoop): a recv without a
  // control buffer would have the kernel drop them here.
  char bytes[16];
  std::vector<UniqueFd> fds;
  bool truncated = false;
  const ssize_t n = Receive(c.socket.get(), bytes, sizeof(bytes), &fds, &truncated);
  const int error = errno;
  for (UniqueFd& fd : fds) Release(std::move(fd));
  if (n < 0 && (error == EAGAIN || error == EWOULDBLOCK || error == EINTR)) return;
  const SessionEnd how = n == 4 && std::memcmp(bytes, "\0\0\0\0", 4) == 0
                             ? SessionEnd::kDetached
                             : SessionEnd::kConnectionLost;
  const SessionId session = c.session;
  Drop(c.id);
  closed_(session, how);
}

void AttachServer::ExpireHandshakes(int64_t now_ns) {
  while (!handshakes_.empty()) {
    auto it = connections_.find(handshakes_.front());
    if (it == connections_.end() || !it->second->handshaking) {
      handshakes_.pop_front();  // finished or dropped
      continue;
    }
    Connection& c = *it->second;
    if (c.deadline_ns > now_ns) return;  // the rest are younger
    counters_->timed_out.fetch_add(1, std::memory_order_relaxed);
    Log().warn("attach from pid {} uid {}: no complete request within {}", c.peer.pid, c.peer.uid,
               absl::FormatDuration(limits_.handshake_timeout));
    Refuse(c, absl::DeadlineExceededError(
                  fmt::format("no complete attach request within {}",
                              absl::FormatDuration(limits_.handshake_timeout))));
    Drop(c.id);
    handshakes_.pop_front();
  }
}

void AttachServer::EndPending(Connection& c) {
  auto it = pending_by_uid_.find(c.peer.uid);
  if (--it->second == 0) pending_by_uid_.erase(it);
  pending_.fetch_sub(1, std::memory_order_relaxed);
  c.handshaking = false;  // its id in handshakes_ is now stale
}

void AttachServer::Drop(uint64_t id) {
  auto it = connections_.find(id);
  if (it == connections_.end()) return;
  Connection& c = *it->second;
  if (c.handshaking) {
    EndPending(c);
  } else if (c.session != kNoSession) {
    sessions_.fetch_sub(1, std::memory_order_relaxed);
  }
  ReleaseSocket(std::move(c.socket));  // which takes it out of the epoll set
  connections_.erase(it);
}

}  // namespace kvpool::daemon
