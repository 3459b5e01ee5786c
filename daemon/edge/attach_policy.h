#pragma once

// AttachPolicy: who may attach to kvpoold and what their session is (DESIGN.md §7). Pure: it
// takes the peer's credentials (SO_PEERCRED, read by the attach server) and the claims of its
// AttachRequest, and returns the session to open or why not. The attach server asks it for every
// handshake; it holds no state but its configuration.
//
// Decisions, in order (docs/trust-model.md):
//  1. the peer's uid or gid is on the allow-list, else PERMISSION_DENIED;
//  2. the client speaks this daemon's protocol version, else INVALID_ARGUMENT;
//  3. client name, tenant and model are short and printable, else INVALID_ARGUMENT;
//  4. with tenants configured, the tenant exists and grants the peer (by uid or gid), and KV
//     access only when the tenant grants it, else PERMISSION_DENIED; without tenants (the
//     zero-configuration default) any tenant name may be claimed, with KV access;
//  5. while the daemon drains, only admin peers attach (operators keep kvpoolctl to watch the
//     drain; their sessions cannot create sequences), else UNAVAILABLE.
// An empty tenant or model means "default", except that with tenants configured an admin peer
// claiming no tenant gets an admin-only session (tenant ""): admin RPCs and Ping only.
//
// Thread-safe (immutable).

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
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
  bool kv_access = false;
};

// Who may claim a tenant, and whether with KV access.
struct TenantGrant {
  std::vector<uid_t> uids;
  std::vector<gid_t> gids;
  bool kv_access = false;
};

class AttachPolicy final {
 public:
  struct Options {
    std::vector<uid_t> allowed_uids;
    std::vector<gid_t> allowed_gids;
    std::vector<uid_t> admin_uids;
    uint32_t protocol_version = 1;
    // By tenant name. Empty: any tenant may be claimed by any allowed peer, with KV access.
    absl::flat_hash_map<std::string, TenantGrant> tenants;
  };
  static constexpr size_t kMaxNameBytes = 128;  // client name, tenant, model

  explicit AttachPolicy(Options options) : options_(std::move(options)) {}

  // The session a peer may open. Errors as in the class comment.
  absl::StatusOr<SessionSpec> Decide(const PeerCredentials& peer, const AttachClaims& claims,
                                     bool draining) const;

  // Step 1 alone, from the credentials: the attach server asks it at accept, before it reads a
  // byte. Errors: PERMISSION_DENIED.
  absl::Status Admit(const PeerCredentials& peer) const;
  bool allowed(const PeerCredentials& peer) const;
  bool admin(const PeerCredentials& peer) const;

 private:
  // Step 4. Errors: PERMISSION_DENIED.
  absl::Status CheckTenant(const PeerCredentials& peer, const std::string& tenant,
                           bool kv_access) const;

  const Options options_;
};

}  // namespace kvpool::daemon
