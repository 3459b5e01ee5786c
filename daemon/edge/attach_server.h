#pragma once

// AttachServer: the session socket (DESIGN.md §7). Accepts connections on attach.sock, reads the
// AttachRequest, learns the peer's pid/uid/gid from SO_PEERCRED, and asks its owner whether to
// accept; an accepted client gets the AttachResponse with the pool's descriptors as SCM_RIGHTS, a
// refused one only the error. It then watches every accepted connection: when one closes, the
// owner is told how: after the client's Detach frame (ended normally), or without it (the client
// exited, crashed or was killed: connection lost).
//
// One thread polls everything. A handshake must arrive within a second of connecting.
// Thread-safe. A session's descriptor is closed only after it left the watch list, under the
// lock the watch loop reads it with, so the loop never reads a descriptor that was closed (and
// perhaps reused) meanwhile.

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/edge/attach_policy.h"
#include "daemon/engine/session.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/attach.pb.h"

namespace kvpool::daemon {

// An accepted attach: the response and the descriptors to send with it (in response.fds order).
struct AttachReply {
  SessionId session;
  v1::AttachResponse response;
  std::vector<UniqueFd> fds;
};

class AttachServer final {
 public:
  // Decides a handshake: the reply of an accepted one, or the refusal.
  using AttachFn =
      std::function<absl::StatusOr<AttachReply>(const PeerCredentials&, const v1::AttachRequest&)>;
  // An accepted session's connection closed (`how`: kDetached or kConnectionLost; kShutdown from
  // CloseAll()).
  using ClosedFn = std::function<void(SessionId, SessionEnd how)>;

  // Binds `path` (mode `mode`) and starts the thread. Errors: INVALID_ARGUMENT (path too long),
  // INTERNAL for socket errors.
  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(const std::string& path, uint32_t mode,
                                                             AttachFn attach, ClosedFn closed);
  ~AttachServer();  // stops the thread and closes everything (without calling ClosedFn)

  // Stops accepting (the socket file is removed); live sessions are kept.
  void StopAccepting();
  // Closes every session connection, calling ClosedFn(kShutdown) for each.
  void CloseAll();
  size_t sessions() const;

 private:
  AttachServer(std::string path, UniqueFd listener, UniqueFd wake, AttachFn attach,
               ClosedFn closed);
  void Loop();
  void Accept();
  void Handshake(UniqueFd connection);
  // The session connection `fd` is readable: a Detach, or a close. Ends the session when so.
  void Watch(int fd);
  void Wake();

  const std::string path_;
  const UniqueFd wake_;  // eventfd: tells the loop to re-read its state
  const AttachFn attach_;
  const ClosedFn closed_;

  mutable absl::Mutex mu_;
  UniqueFd listener_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  struct Connection {
    UniqueFd socket;
    SessionId session;
  };
  absl::flat_hash_map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);  // by descriptor
  std::thread thread_;
};

}  // namespace kvpool::daemon
