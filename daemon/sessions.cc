#include "daemon/sessions.h"

#include <sys/random.h>

#include "fmt/format.h"
#include "kvpool/util/check.h"

namespace kvpool::daemon {

std::string NewToken() {
  uint64_t bits[2];
  size_t got = 0;
  while (got < sizeof(bits)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(bits) + got, sizeof(bits) - got, 0);
    KVPOOL_CHECK_MSG(n > 0 || errno == EINTR, "getrandom failed");
    if (n > 0) got += static_cast<size_t>(n);
  }
  return fmt::format("{:016x}{:016x}", bits[0], bits[1]);
}

std::shared_ptr<const Session> SessionRegistry::Add(Session session) {
  session.token = NewToken();
  absl::MutexLock lock(&mu_);
  session.id = SessionId(next_id_++);
  auto shared = std::make_shared<const Session>(std::move(session));
  by_id_.emplace(shared->id.value(), shared);
  by_token_.emplace(shared->token, shared);
  return shared;
}

std::shared_ptr<const Session> SessionRegistry::FindByToken(std::string_view token) const {
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(std::string(token));
  return it == by_token_.end() ? nullptr : it->second;
}

std::shared_ptr<const Session> SessionRegistry::Remove(SessionId id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id.value());
  if (it == by_id_.end()) return nullptr;
  std::shared_ptr<const Session> session = it->second;
  by_id_.erase(it);
  by_token_.erase(session->token);
  return session;
}

std::vector<std::shared_ptr<const Session>> SessionRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Session>> out;
  for (const auto& [id, s] : by_id_) out.push_back(s);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id < b->id; });
  return out;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

}  // namespace kvpool::daemon
