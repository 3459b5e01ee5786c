#pragma once

// NamespaceTable: the ids of the prefix cache's sharing domains (DESIGN.md §1, §7). A namespace
// is a pool layout, a tenant, a model name and a cache salt (kvpool.proto AllocateItem.cache_salt;
// empty for the session's own namespace). Tenant, model and salt are client strings, so an id is
// never an unkeyed hash of them: it is a keyed MAC under the deployment secret (tier/secret.h)
// over their length-prefixed encoding, which no client can aim at another key's id without the
// secret, and which daemons sharing the secret (and so a Redis or disk tier) agree on.
//
// The table is the authority inside the daemon: it remembers which key holds each id while the
// id is in use, so even a collision of the 64-bit MAC can never put two keys in one namespace
// (the second key is given the next derivation instead, and that is logged: it would mean a
// broken secret or a 2^-64 event). Entries are counted by their users (sessions, and the
// sessions that used a salt); Release forgets an entry with no user left. An id forgotten and
// interned again by the same key is the same id, so what the cache holds under it stays
// reachable; it could go to another key only after a MAC collision, which the table checks while
// either key is in use.
//
// Invalidation (docs/tiers.md): every entry carries the tags of its tenant and of its (tenant,
// model) (keyed MACs, NamespaceTags), which the host and disk tiers keep with each block. An
// invalidation of a tenant, or of one of its models, raises that tag's generation, and a key
// whose tenant or model tag has a generation is encoded with both: from then on the key derives
// another id, so nothing cached under the old one (in any tier, Redis included) is ever matched
// again. Entries already in use keep their old id until their users release them (the engine
// moves its sessions to the new one).
//
// Thread-compatible (EngineState's lock guards it).

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "kvpool/util/strong_id.h"
#include "tier/remote_tier.h"
#include "tier/secret.h"

namespace kvpool::daemon {

struct NamespaceKey {
  uint64_t layout_hash = 0;  // kernels::PoolLayout::Hash() of the pool
  std::string_view tenant;
  std::string_view model;
  std::string_view salt;  // empty: none
};

class NamespaceTable final {
 public:
  // Derivation `round` of an encoded key: the keyed MAC, or a test's stand-in.
  using DeriveFn = std::function<uint64_t(std::string_view encoded, uint64_t round)>;

  // `secret` is not owned and outlives the table.
  explicit NamespaceTable(const tier::DeploymentSecret* secret);
  // Ids from `derive` (tests: collisions on demand); quota groups still from `secret`.
  NamespaceTable(const tier::DeploymentSecret* secret, DeriveFn derive)
      : secret_(secret), derive_(std::move(derive)) {}

  // The id of `key`, with one more user. Never kNoNamespace.
  NamespaceId Acquire(const NamespaceKey& key);
  // One user fewer of `id`; forgets it at none. Returns whether it was forgotten.
  // REQUIRES: `id` was acquired and not released as often.
  bool Release(NamespaceId id);
  // The id `key` has, or would get if acquired now; changes nothing.
  NamespaceId Peek(const NamespaceKey& key) const;

  // The tags of `tenant` and of (`tenant`, `model`): keyed MACs under the secret, never 0.
  tier::NamespaceTags Tags(std::string_view tenant, std::string_view model) const;
  // The tags of an id in use; zero tags for an id the table does not hold.
  tier::NamespaceTags TagsOf(NamespaceId id) const;

  // Generations by tag (a tenant's or a model's tag: Tags); 0 for a tag never invalidated.
  uint64_t generation(uint64_t tag) const;
  // Raises `tag`'s generation by one; keys under it derive new ids from now on. Returns it.
  uint64_t Invalidate(uint64_t tag);
  // Every tag's generation (persisted by the engine, restored with SetGenerations at start).
  const absl::flat_hash_map<uint64_t, uint64_t>& generations() const { return generations_; }
  void SetGenerations(absl::flat_hash_map<uint64_t, uint64_t> generations) {
    generations_ = std::move(generations);
  }

  // The quota group of every namespace of `tenant` (KvCacheManager::SetNamespaceQuota): a keyed
  // MAC too, so no tenant name chosen by a client lands in another tenant's group. Never 0.
  uint64_t QuotaGroup(std::string_view tenant) const;

  size_t size() const { return by_key_.size(); }
  // Collisions of the MAC met so far (each logged).
  uint64_t collisions() const { return collisions_; }

 private:
  struct Entry {
    std::string key;  // the encoded key
    int64_t users = 0;
    tier::NamespaceTags tags;
  };
  // The key's encoding, with its tags' generations when either has one (then `tags` are filled,
  // when given, to spare the caller computing them again).
  std::string Encode(const NamespaceKey& key, tier::NamespaceTags* tags = nullptr) const;
  // The id of derivation `round` of the encoded key.
  NamespaceId Derive(std::string_view encoded, uint64_t round) const;
  // The first derivation of `encoded` that no other key holds.
  NamespaceId FirstFree(std::string_view encoded) const;

  const tier::DeploymentSecret* const secret_;
  const DeriveFn derive_;
  absl::flat_hash_map<NamespaceId, Entry> by_id_;
  absl::flat_hash_map<std::string, NamespaceId> by_key_;
  absl::flat_hash_map<uint64_t, uint64_t> generations_;
  uint64_t collisions_ = 0;
};

}  // namespace kvpool::daemon
