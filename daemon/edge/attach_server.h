#pragma once

// AttachServer: the session socket (DESIGN.md §7). Accepts connections on attach.sock, reads the
// AttachRequest, and asks its owner whether to accept; an accepted client gets the
// AttachResponse with the pool's descriptors as SCM_RIGHTS, a refused one only the error. It then
// watches every accepted connection: when one closes, the owner is told how: after the client's
// Detach frame (ended normally), or without it (the client exited, crashed or was killed:
// connection lost).
//
// Nothing a peer does can hold it up (issue 12). One thread runs an epoll loop over the listener,
// the handshakes in progress and the session connections, and never blocks on any of them:
//  - the peer's credentials (SO_PEERCRED) are checked at accept, before a byte is read; a peer
//    that may not attach is refused at once;
//  - a handshake is a state (bytes read so far), advanced as bytes arrive; it must complete
//    within `handshake_timeout`;
//  - at most `max_pending` handshakes are in progress, `max_pending_per_uid` per uid: a new
//    connection beyond either displaces the oldest one of the same uid (else the oldest
//    overall), so a peer holding silent connections cannot keep a well-behaved one out;
//  - when accept fails for want of descriptors (EMFILE, ENFILE) the listener is left alone for
//    `accept_backoff` instead of spinning on it;
//  - session connections are in the same loop, so a client killed mid-handshake-storm is noticed
//    at once;
//  - the loop never makes the last close() of a peer's file, which can block for as long as the
//    peer likes (a TCP socket lingering on a send queue that cannot drain, a FUSE file whose
//    server does not answer; the kernel also runs the last close of the files still queued in a
//    Unix socket on the thread that drops the socket). Where the kernel has SO_PASSRIGHTS (Linux
//    6.16+) the listener refuses them: a peer's sendmsg with SCM_RIGHTS fails with EPERM, on a
//    connection not yet accepted too (it takes the listener's setting at connect()), and no
//    descriptor of a peer's ever reaches the daemon (PeerFds::kRefusedByKernel). Older kernels
//    deliver them, and every close that can drop one runs on a closer thread instead
//    (PeerFds::kClosedOffLoop, daemon/edge/internal/fd_closer.h): the descriptors a peer sent
//    (a request carrying any is still refused as malformed), each connection socket and the
//    listener (their queues may hold more). A close that blocks there holds up only the closes
//    queued behind it: those descriptors stay open, counted against the daemon's descriptor limit,
//    until it returns; once the limit is reached, accept backs off (above) and a descriptor the
//    kernel cannot install in the daemon is dropped on the loop thread, the one close left on it.
// Handshake deadlines and the accept back-off are read on the injected Clock (tests drive a
// ManualClock; epoll_wait sleeps as long as Clock::PollTimeoutMs allows).
// Everything the loop owns is touched only by the loop thread: StopAccepting() and CloseAll()
// hand their work to it and wait, so no descriptor is ever closed under a reader. A socket the
// loop gives up is taken out of its epoll set and shut down (the peer sees the end at once)
// before it goes to the closer, which then owns it and only closes it.
//
// Thread-safe.

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/edge/attach_policy.h"
#include "daemon/edge/internal/fd_closer.h"
#include "daemon/engine/session.h"
#include "daemon/metrics/edge_counters.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/wire.h"

namespace kvpool::daemon {

struct LockOrderPeer;

// An accepted attach: the response and the descriptors to send with it (in response.fds order).
struct AttachReply {
  SessionId session;
  v1::AttachResponse response;
  std::vector<UniqueFd> fds;
};

struct AttachLimits {
  absl::Duration handshake_timeout = absl::Milliseconds(500);
  int max_pending = 64;                                     // handshakes in progress
  int max_pending_per_uid = 8;                              // of them, per peer uid
  absl::Duration accept_backoff = absl::Milliseconds(100);  // after EMFILE/ENFILE
  uint32_t max_request_bytes = 64 << 10;                    // one AttachRequest frame
  // Refuse peers' descriptors in the kernel (SO_PASSRIGHTS) where it can; false closes them on
  // the closer thread even then (tests of the path older kernels take).
  bool refuse_peer_fds_in_kernel = true;
};

// How the attach socket keeps a peer's descriptors from blocking its loop (AttachServer's class
// comment).
enum class PeerFds : uint8_t {
  kRefusedByKernel,  // SO_PASSRIGHTS 0: a peer's sendmsg with SCM_RIGHTS fails with EPERM
  kClosedOffLoop,    // they arrive, and the closer thread closes them
};

class AttachServer final {
 public:
  // Whether a peer may attach at all, from its credentials alone: OK or the refusal.
  using AdmitFn = std::function<absl::Status(const PeerCredentials&)>;
  // Decides a handshake: the reply of an accepted one, or the refusal.
  using AttachFn =
      std::function<absl::StatusOr<AttachReply>(const PeerCredentials&, const v1::AttachRequest&)>;
  // An accepted session's connection closed (`how`: kDetached or kConnectionLost; kShutdown from
  // CloseAll()). Called on the loop thread.
  using ClosedFn = std::function<void(SessionId, SessionEnd how)>;

  // Binds `path` (permission bits `mode`, set through the umask at bind: no chmod by path) and
  // starts the loop. Errors: INVALID_ARGUMENT (path too long), INTERNAL for socket errors.
  // `counters` and `clock` (not owned) outlive the server; `clock` times handshakes and the
  // accept back-off. Logs which PeerFds mode it runs in.
  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(const std::string& path, uint32_t mode,
                                                             AttachLimits limits, AdmitFn admit,
                                                             AttachFn attach, ClosedFn closed,
                                                             AttachCounters* counters,
                                                             const Clock* clock);
  // Stops the loop and closes everything (without calling ClosedFn). In kClosedOffLoop it waits
  // for the closer to finish, so a close that blocks there delays it by as long.
  ~AttachServer();

  // Stops accepting (the socket file is removed) and drops the handshakes in progress; live
  // sessions are kept. Returns once done.
  void StopAccepting();
  // Closes every session connection, calling ClosedFn(kShutdown) for each. Returns once done.
  void CloseAll();
  size_t sessions() const { return sessions_.load(std::memory_order_relaxed); }
  size_t pending() const { return pending_.load(std::memory_order_relaxed); }
  PeerFds peer_fds() const {
    return closer_ == nullptr ? PeerFds::kRefusedByKernel : PeerFds::kClosedOffLoop;
  }

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  struct Connection;
  enum class Command : uint8_t { kStopAccepting, kCloseAll, kExit };

  AttachServer(std::string path, AttachLimits limits, UniqueFd listener, UniqueFd epoll,
               UniqueFd wake, std::unique_ptr<FdCloser> closer, AdmitFn admit, AttachFn attach,
               ClosedFn closed, AttachCounters* counters, const Clock* clock);

  // The loop thread's work.
  void Loop();
  bool RunCommands();  // false: exit
  void Accept();
  void Admit(UniqueFd socket);
  void ReadHandshake(Connection& c);
  void FinishHandshake(Connection& c);
  void Refuse(Connection& c, const absl::Status& why);
  void WatchSession(Connection& c);
  void ExpireHandshakes(int64_t now_ns);
  void MakeRoomFor(uid_t uid);
  void EndPending(Connection& c);  // the handshake is over, one way or another
  void Drop(uint64_t id);          // closes a connection, whatever its state, without callbacks
  void CloseListener();
  // Closes what may hold a peer's files: on the closer thread in kClosedOffLoop, else here.
  void Release(UniqueFd fd);
  void ReleaseSocket(UniqueFd socket);  // and first out of the epoll set, shut down
  int PollTimeoutMs() const;

  // Any thread.
  void Post(Command command);
  void Wake();

  const std::string path_;
  const AttachLimits limits_;
  const AdmitFn admit_;
  const AttachFn attach_;
  const ClosedFn closed_;
  AttachCounters* const counters_;
  const Clock* const clock_;
  const int64_t handshake_timeout_ns_;
  const int64_t accept_backoff_ns_;
  const UniqueFd epoll_;
  const UniqueFd wake_;  // eventfd: commands are waiting
  // kClosedOffLoop only (else null): destroyed after the loop's last Release.
  std::unique_ptr<FdCloser> closer_;

  // Loop thread only.
  UniqueFd listener_;
  int64_t listener_paused_until_ns_ = INT64_MIN;  // on clock_
  bool listener_in_epoll_ = false;
  uint64_t next_id_ = 1;  // 0 is the listener's epoll key; 1 the wake eventfd's
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::deque<uint64_t> handshakes_;  // pending, oldest first (stale ids are skipped)
  absl::flat_hash_map<uid_t, int> pending_by_uid_;

  std::atomic<size_t> sessions_{0};
  std::atomic<size_t> pending_{0};

  mutable absl::Mutex mu_;
  struct Posted {
    Command command;
    absl::Notification* done;
  };
  std::vector<Posted> commands_ ABSL_GUARDED_BY(mu_);
  bool exited_ ABSL_GUARDED_BY(mu_) = false;

  std::thread thread_;
};

}  // namespace kvpool::daemon
