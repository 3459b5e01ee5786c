#pragma once

// Sessions: one per attached client process (DESIGN.md §7). A session is created when the attach
// handshake succeeds and ends when its attach connection closes; its token authenticates gRPC
// calls.
//
// Thread-safe. Sessions are immutable once registered and handed out as shared_ptr<const>: an RPC
// handler keeps the one it authenticated alive even if the attach thread removes it meanwhile
// (its sequences are then already released, so the call fails with NOT_FOUND, never UB).

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/util/strong_id.h"

namespace kvpool::daemon {

struct Session {
  SessionId id;
  std::string token;  // 128 random bits, hex
  std::string client_name;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::string tenant;
  std::string model;
  NamespaceId ns;
  bool admin = false;
  absl::Time attached;
};

class SessionRegistry final {
 public:
  // Assigns the session's id and token and registers it.
  std::shared_ptr<const Session> Add(Session session);
  // Null when the token is unknown.
  std::shared_ptr<const Session> FindByToken(std::string_view token) const;
  // Removes and returns the session (null when unknown).
  std::shared_ptr<const Session> Remove(SessionId id);
  std::vector<std::shared_ptr<const Session>> List() const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<const Session>> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const Session>> by_token_ ABSL_GUARDED_BY(mu_);
};

// 128 random bits as 32 hex digits (getrandom(2)).
std::string NewToken();

}  // namespace kvpool::daemon
