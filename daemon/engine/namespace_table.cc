#include "daemon/engine/namespace_table.h"

#include "kvpool/util/check.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {

std::string NamespaceTable::Encode(const NamespaceKey& key) {
  std::string out = tier::LittleEndian64(key.layout_hash);
  for (std::string_view part : {key.tenant, key.model, key.salt}) {
    out += tier::LittleEndian64(part.size());
    out.append(part);
  }
  return out;
}

NamespaceTable::NamespaceTable(const tier::DeploymentSecret* secret)
    : NamespaceTable(secret, [secret](std::string_view encoded, uint64_t round) {
        return secret->Mac64("kvpool namespace v1", {encoded, tier::LittleEndian64(round)});
      }) {}

NamespaceId NamespaceTable::Derive(std::string_view encoded, uint64_t round) const {
  return NamespaceId(derive_(encoded, round));
}

NamespaceId NamespaceTable::FirstFree(std::string_view encoded) const {
  for (uint64_t round = 0;; ++round) {
    const NamespaceId id = Derive(encoded, round);
    if (id == kNoNamespace) continue;
    auto it = by_id_.find(id);
    if (it == by_id_.end() || it->second.key == encoded) return id;
  }
}

NamespaceId NamespaceTable::Acquire(const NamespaceKey& key) {
  std::string encoded = Encode(key);
  if (auto it = by_key_.find(encoded); it != by_key_.end()) {
    ++by_id_.at(it->second).users;
    return it->second;
  }
  const NamespaceId id = FirstFree(encoded);
  if (id != Derive(encoded, 0)) {
    ++collisions_;
    Logger("daemon").error(
        "namespace ids: the keyed MAC of two keys collided (namespace {:016x}); the second got "
        "another id. Check that the deployment secret is random.",
        Derive(encoded, 0).value());
  }
  by_key_.emplace(encoded, id);
  by_id_.emplace(id, Entry{.key = std::move(encoded), .users = 1});
  return id;
}

bool NamespaceTable::Release(NamespaceId id) {
  auto it = by_id_.find(id);
  KVPOOL_CHECK(it != by_id_.end() && it->second.users > 0);
  if (--it->second.users > 0) return false;
  by_key_.erase(it->second.key);
  by_id_.erase(it);
  return true;
}

NamespaceId NamespaceTable::Peek(const NamespaceKey& key) const {
  const std::string encoded = Encode(key);
  if (auto it = by_key_.find(encoded); it != by_key_.end()) return it->second;
  return FirstFree(encoded);
}

uint64_t NamespaceTable::QuotaGroup(std::string_view tenant) const {
  const uint64_t group = secret_->Mac64("kvpool quota group v1", {tenant});
  return group == 0 ? 1 : group;
}

}  // namespace kvpool::daemon
