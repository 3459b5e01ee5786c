#include "daemon/edge/attach_policy.h"

#include <algorithm>

#include "fmt/format.h"

namespace kvpool::daemon {
namespace {

template <typename T>
bool Contains(const std::vector<T>& list, T value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

absl::Status CheckName(std::string_view field, const std::string& value) {
  if (value.size() > AttachPolicy::kMaxNameBytes) {
    return absl::InvalidArgumentError(fmt::format("attach: {} is {} bytes long (at most {})", field,
                                                  value.size(), AttachPolicy::kMaxNameBytes));
  }
  for (unsigned char c : value) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(
          fmt::format("attach: {} holds a byte 0x{:02x} that is not printable ASCII", field, c));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool AttachPolicy::allowed(const PeerCredentials& peer) const {
  return Contains(options_.allowed_uids, peer.uid) || Contains(options_.allowed_gids, peer.gid);
}

bool AttachPolicy::admin(const PeerCredentials& peer) const {
  return Contains(options_.admin_uids, peer.uid);
}

absl::Status AttachPolicy::Admit(const PeerCredentials& peer) const {
  if (allowed(peer)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      fmt::format("uid {} gid {} may not attach to this kvpoold", peer.uid, peer.gid));
}

absl::StatusOr<SessionSpec> AttachPolicy::Decide(const PeerCredentials& peer,
                                                 const AttachClaims& claims, bool draining) const {
  if (absl::Status admitted = Admit(peer); !admitted.ok()) return admitted;
  if (claims.protocol_version != options_.protocol_version) {
    return absl::InvalidArgumentError(fmt::format("protocol version {} (this daemon speaks {})",
                                                  claims.protocol_version,
                                                  options_.protocol_version));
  }
  for (const auto& [field, value] :
       {std::pair<std::string_view, const std::string&>{"client_name", claims.client_name},
        {"tenant", claims.tenant},
        {"model", claims.model}}) {
    if (absl::Status s = CheckName(field, value); !s.ok()) return s;
  }
  const bool is_admin = admin(peer);
  // With tenants configured, an admin that claims none gets an admin-only session (kvpoolctl).
  const bool admin_only = claims.tenant.empty() && is_admin && !options_.tenants.empty();
  const std::string tenant = admin_only ? "" : claims.tenant.empty() ? "default" : claims.tenant;
  if (!admin_only) {
    if (absl::Status s = CheckTenant(peer, tenant, claims.kv_access); !s.ok()) return s;
  } else if (claims.kv_access) {
    return absl::PermissionDeniedError("an admin session without a tenant has no KV access");
  }
  if (draining && !is_admin) {
    return absl::UnavailableError("kvpoold is draining: only admin sessions may attach");
  }
  return SessionSpec{.client_name = claims.client_name,
                     .pid = peer.pid,
                     .uid = peer.uid,
                     .gid = peer.gid,
                     .tenant = tenant,
                     .model = claims.model.empty() ? "default" : claims.model,
                     .admin = is_admin,
                     .kv_access = claims.kv_access};
}

absl::Status AttachPolicy::CheckTenant(const PeerCredentials& peer, const std::string& tenant,
                                       bool kv_access) const {
  if (options_.tenants.empty()) return absl::OkStatus();  // the zero-configuration default
  auto it = options_.tenants.find(tenant);
  if (it == options_.tenants.end()) {
    return absl::PermissionDeniedError(fmt::format("no tenant '{}' on this kvpoold", tenant));
  }
  const TenantGrant& grant = it->second;
  if (!Contains(grant.uids, peer.uid) && !Contains(grant.gids, peer.gid)) {
    return absl::PermissionDeniedError(
        fmt::format("uid {} gid {} may not claim tenant '{}'", peer.uid, peer.gid, tenant));
  }
  if (kv_access && !grant.kv_access) {
    return absl::PermissionDeniedError(
        fmt::format("tenant '{}' is compute-only: KV access is not granted", tenant));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::daemon
