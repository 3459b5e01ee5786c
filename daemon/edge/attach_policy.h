#pragma once

// AttachPolicy: who may attach to kvpoold and what their session is (DESIGN.md §7). Pure: it
// takes the peer's credentials (SO_PEERCRED, read by the attach server) and the claims of its
// AttachRequest, and returns the session to open or why not. The attach server asks it for every
// handshake; it holds no state but its configuration.
//
// Decisions, in order:
//  1. the peer's uid or gid is on the allow-list, else PERMISSION_DENIED;
//  2. the client speaks this daemon's protocol version, else INVALID_ARGUMENT;
//  3. client name, tenant and model are short and printable, else INVALID_ARGUMENT;
//  4. while the daemon drains, only admin peers attach (operators keep kvpoolctl to watch the
//     drain; their sessions cannot create sequences), else UNAVAILABLE.
// An empty tenant or model means "default".
//
// Thread-safe (immutable).

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/engine/session.h"

namespace kvpool::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// What an AttachRequest claims.
struct AttachClaims {
  uint32_t protocol_version = 0;
  std::string client_name;
  std::string tenant;
  std::string model;
};

class AttachPolicy final {
 public:
  struct Options {
    std::vector<uid_t> allowed_uids;
    std::vector<gid_t> allowed_gids;
    std::vector<uid_t> admin_uids;
    uint32_t protocol_version = 1;
  };
  static constexpr size_t kMaxNameBytes = 128;  // client name, tenant, model

  explicit AttachPolicy(Options options) : options_(std::move(options)) {}

  // The session a peer may open. Errors as in the class comment.
  absl::StatusOr<SessionSpec> Decide(const PeerCredentials& peer, const AttachClaims& claims,
                                     bool draining) const;

  bool allowed(const PeerCredentials& peer) const;
  bool admin(const PeerCredentials& peer) const;

 private:
  const Options options_;
};

}  // namespace kvpool::daemon
