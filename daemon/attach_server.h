#pragma once

// AttachServer: the session socket (DESIGN.md §7). Accepts connections on attach.sock, reads the
// AttachRequest, learns the peer's pid/uid/gid from SO_PEERCRED, and asks its owner whether to
// accept; an accepted client gets the AttachResponse with the pool's descriptors as SCM_RIGHTS, a
// refused one only the error. It then watches every accepted connection: when one closes (the
// client exited, crashed or was killed), the owner is told so it can release the session.
//
// One thread polls everything. A handshake must arrive within a second of connecting.
// Thread-safe.

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/pool.h"
#include "kvpool/util/strong_id.h"
#include "kvpool/v1/attach.pb.h"

namespace kvpool::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class AttachServer final {
 public:
  // Decides a handshake: the grant (its response carries the session id), or the refusal.
  using AttachFn =
      std::function<absl::StatusOr<AttachGrant>(const PeerCredentials&, const v1::AttachRequest&)>;
  // An accepted session's connection closed.
  using ClosedFn = std::function<void(SessionId)>;

  // Binds `path` (mode `mode`) and starts the thread. Errors: INTERNAL for socket errors.
  static absl::StatusOr<std::unique_ptr<AttachServer>> Start(const std::string& path, uint32_t mode,
                                                             AttachFn attach, ClosedFn closed);
  ~AttachServer();  // stops the thread and closes everything (without calling ClosedFn)

  // Stops accepting (the socket file is removed); live sessions are kept.
  void StopAccepting();
  // Closes every session connection, calling ClosedFn for each.
  void CloseAll();
  size_t sessions() const;

 private:
  AttachServer(std::string path, int listener, int wake, AttachFn attach, ClosedFn closed);
  void Loop();
  void Accept();
  void Handshake(int connection);
  void Wake();

  const std::string path_;
  const int wake_;  // eventfd: tells the loop to re-read its state
  const AttachFn attach_;
  const ClosedFn closed_;

  mutable absl::Mutex mu_;
  int listener_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool close_all_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<int, SessionId> connections_ ABSL_GUARDED_BY(mu_);  // fd -> session
  std::thread thread_;
};

}  // namespace kvpool::daemon
