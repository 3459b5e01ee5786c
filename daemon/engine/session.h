#pragma once

// Sessions (DESIGN.md §7): one per attached client process. The attach edge decides who a peer
// is and what it may claim (SessionSpec); the engine opens the session, names it with an id and a
// token, and ends it when its attach connection closes. A session's life bounds everything it
// does: once it has ended, its calls are refused and whatever it held is released (§4.7).

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvpool/util/strong_id.h"

namespace kvpool::daemon {

// The longest cache salt a call may name (kvpool.proto AllocateItem.cache_salt).
inline constexpr size_t kMaxCacheSaltBytes = 256;

// Who attached and what they claimed, as the attach policy accepted it.
struct SessionSpec {
  std::string client_name;  // for operators (kvpoolctl sessions)
  pid_t pid = 0;            // the peer's credentials (SO_PEERCRED)
  uid_t uid = 0;
  gid_t gid = 0;
  std::string tenant;  // empty: an admin-only session (admin RPCs and Ping only)
  std::string model;   // non-empty
  bool admin = false;  // may call admin RPCs
  // KV access: the pool's arena and the RPCs that hand out blocks to write (Allocate, Grow,
  // Commit). Without it the session is compute-only (docs/trust-model.md).
  bool kv_access = false;
};

// An open session. Immutable but for its count of compute calls, shared with the calls that
// authenticated as it; the engine still refuses those calls once the session has ended.
struct Session {
  SessionId id;
  std::string token;  // 128 random bits as hex: authenticates the session's gRPC calls
  SessionSpec spec;
  NamespaceId ns;             // the prefix-sharing domain: tenant + model + pool layout
  int64_t opened_ns = 0;      // the engine clock's reading at attach
  int32_t pool = 0;           // the pool its sequences live in (EngineOptions::pools)
  int32_t max_priority = 0;   // the highest prefix-cache priority its tenant allows
  int64_t quota_blocks = 0;   // its tenant's block quota, over all its namespaces (0: none)
  uint32_t cache_weight = 1;  // its tenant's weight in fair eviction (TenantLimits)
  // Its ComputeCalls queued or in a step, until answered (ComputeCall::Complete): ClientLimits
  // bounds them.
  mutable std::atomic<int32_t> compute_calls{0};
};

// How a session ended.
enum class SessionEnd : uint8_t {
  kDetached,        // the client said goodbye (attach.proto Detach) before closing
  kConnectionLost,  // the connection closed without a goodbye: the process died or was killed
  kShutdown,        // the daemon shut down
};

std::string_view SessionEndName(SessionEnd how);

// 128 random bits (getrandom(2)) as 32 hex digits.
std::string NewToken();

}  // namespace kvpool::daemon
