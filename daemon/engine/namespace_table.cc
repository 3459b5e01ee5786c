#include "daemon/engine/namespace_table.h"

#include "kvpool/util/check.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {

std::string NamespaceTable::Encode(const NamespaceKey& key, tier::NamespaceTags* tags) const {
  std::string out = tier::LittleEndian64(key.layout_hash);
  for (std::string_view part : {key.tenant, key.model, key.salt}) {
    out += tier::LittleEndian64(part.size());
    out.append(part);
  }
  if (generations_.empty()) return out;  // no invalidation yet: no tags needed
  const tier::NamespaceTags t = Tags(key.tenant, key.model);
  if (tags != nullptr) *tags = t;
  const uint64_t tenant_gen = generation(t.tenant);
  const uint64_t model_gen = generation(t.model);
  // Unambiguous: the three parts are length-prefixed, so what follows them is known to be these.
  if (tenant_gen != 0 || model_gen != 0) {
    out += tier::LittleEndian64(tenant_gen);
    out += tier::LittleEndian64(model_gen);
  }
  return out;
}

tier::NamespaceTags NamespaceTable::Tags(std::string_view tenant, std::string_view model) const {
  const uint64_t t = secret_->Mac64("kvpool tenant tag v1", {tenant});
  const uint64_t m = secret_->Mac64("kvpool model tag v1", {tenant, model});
  return {.tenant = t == 0 ? 1 : t, .model = m == 0 ? 1 : m};
}

tier::NamespaceTags NamespaceTable::TagsOf(NamespaceId id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? tier::NamespaceTags{} : it->second.tags;
}

uint64_t NamespaceTable::generation(uint64_t tag) const {
  auto it = generations_.find(tag);
  return it == generations_.end() ? 0 : it->second;
}

uint64_t NamespaceTable::Invalidate(uint64_t tag) { return ++generations_[tag]; }

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
  tier::NamespaceTags tags;
  std::string encoded = Encode(key, &tags);
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
  if (tags == tier::NamespaceTags{}) tags = Tags(key.tenant, key.model);
  by_key_.emplace(encoded, id);
  by_id_.emplace(id, Entry{.key = std::move(encoded), .users = 1, .tags = tags});
  return id;
}

bool NamespaceTable::Release(NamespaceId id) {
  auto it = by_id_.find(id);
  KVPOOL_CHECK(it != by_id_.end() && it->second.users > 0);
  if (--it->second.users > 0) return false;
  // Its encoding is its own even after an invalidation (that changes the encoding of new ids).
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
