#pragma once

// EvictionPolicy: orders the prefix cache's eviction candidates (docs/eviction.md).
//
// The cache, not the policy, keeps the structural rules:
//  - Leaf only. A candidate is an evictable node (it holds a block, no sequence or pin locks it,
//    no sequence holds its block) with no cached child. The cache adds a node when it becomes
//    one and removes it when it stops being one, so a policy can order its candidates however it
//    likes and still never name a node with cached descendants. When planning several
//    evictions the cache itself adds the parents that the earlier victims turn into leaves,
//    ranked by Rank().
//  - Unretained partial tails of finished requests are evicted before any candidate the policy
//    holds (the cache keeps them in its own list; the policy never sees them as candidates).
//
// The policy hears every access: inserts, hits (a new sequence adopted the node), erasures, and
// the clock (`now_ns` from the cache's injected Clock; never the wall clock). It ranks candidates
// by EvictionRank: priority class first (a client's choice), then a policy score, then release
// order. A node's class is never below a descendant's (the cache raises ancestors).
//
// Cost contract, n = candidates held: Add/Remove O(log n); OnInsert/OnHit/OnErase O(1)
// amortized; Rank O(1); Visit O(log n + k) for k visited plus a per-policy constant per visited
// node (a few dozen comparisons at most). No operation scans the candidates.
//
// A node, to a policy, is one cached block: the PrefixCache names each by its BlockId's value
// (dense in [0, num_blocks)), whatever runs of blocks its radix nodes hold, and hands it the
// block's own facts.
//
// Thread-compatible; owned by the PrefixCache.

#include <compare>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/kv_events.h"

namespace kvpool {

using NodeIndex = int32_t;
inline constexpr NodeIndex kNoNode = -1;

// Priority classes: lower is evicted first. A node's class is at least each descendant's.
inline constexpr int kNumPriorities = 4;

// A 64-bit name for a full block's chained hash (never 0); 0 for a partial node's zero hash.
inline uint64_t BlockFingerprint(const BlockHash& hash) {
  if (hash == BlockHash{}) return 0;
  const uint64_t f = hash.lo ^ (hash.hi * 0x9e3779b97f4a7c15ULL);
  return f == 0 ? 1 : f;
}

// What the cache knows about a node; passed with every call that concerns it.
struct NodeFacts {
  uint64_t fingerprint = 0;  // BlockFingerprint of a full node's chained hash; 0 when partial
  int32_t depth = 0;         // blocks from the root: 1 for a prompt's first block
  uint32_t hits = 0;         // times a new sequence adopted the node since it was inserted
  int priority = 0;          // class in [0, kNumPriorities)
  int64_t released_ns = 0;   // when it last became evictable (its last user let go); ns
  uint64_t release_seq = 0;  // cache-wide counter stamped at that moment (orders equal times)
};

// Eviction order: lower is evicted first; compared field by field.
struct EvictionRank {
  int priority = 0;    // NodeFacts::priority
  double score = 0;    // the policy's value of keeping the node (>= -1; -1: admission reject)
  uint64_t order = 0;  // NodeFacts::release_seq: older first among equals

  friend auto operator<=>(const EvictionRank&, const EvictionRank&) = default;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  // Node indices are dense in [0, capacity); called before nodes beyond it are used.
  virtual void Reserve(NodeIndex capacity) = 0;

  // Access events. The node is locked (never a candidate) when these are called.
  // A node was created, or a partial node became full (its hash is now known).
  virtual void OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) = 0;
  // A new sequence adopted (or a committing sequence followed) the cached node.
  virtual void OnHit(NodeIndex node, const NodeFacts& facts, int64_t now_ns) = 0;
  // The node left the tree (evicted, dominated or cleared). It is not a candidate.
  virtual void OnErase(NodeIndex node, const NodeFacts& facts, int64_t now_ns) = 0;

  // `node` became a candidate. REQUIRES: not a candidate already.
  virtual void Add(NodeIndex node, const NodeFacts& facts) = 0;
  // `node` stopped being a candidate. REQUIRES: Contains(node); `facts` as given to Add (a
  // candidate's class and release order do not change).
  virtual void Remove(NodeIndex node, const NodeFacts& facts) = 0;
  virtual bool Contains(NodeIndex node) const = 0;
  virtual int64_t size() const = 0;

  // Where `node` (any evictable node, candidate or not) ranks at `now_ns`.
  virtual EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const = 0;
  // Calls `visit` for the candidates in ascending Rank at `now_ns` until it returns false.
  // Changes nothing; `visit` must not call into the policy.
  virtual void Visit(int64_t now_ns,
                     absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const = 0;

  // The policy's own bookkeeping (sizes agree, sets ordered). INTERNAL naming the violation.
  virtual absl::Status CheckInvariants() const = 0;
  // One line for operators: the policy and its state (e.g. learned estimates).
  virtual std::string DebugString() const = 0;

  // Whether the policy reads NodeFacts::fingerprint. When it does not (and nothing else needs
  // them), the cache skips the chained hash of every stored block and passes 0.
  virtual bool uses_fingerprints() const { return true; }
  // Whether `node` is below the policy's admission bar (kept only on probation, evicted before
  // every admitted node): the cache remembers it of an evicted block, so that a later miss on
  // that block counts as "below the admission bar", not as "evicted". Asked once per evicted
  // full node, before OnErase.
  virtual bool below_admission_bar(NodeIndex node) const {
    (void)node;
    return false;
  }
  // Whether Rank() is {facts.priority, 0, facts.release_seq} for every node at every time. When
  // it is, the cache ranks the parents an eviction plan frees itself, without a call per node.
  virtual bool ranks_by_release() const { return false; }
  // Whether OnInsert, OnHit and OnErase do anything. When they do not, the cache skips the calls
  // (one per stored and one per evicted block).
  virtual bool hears_accesses() const { return true; }
};

// The ordering policies.
enum class EvictionPolicyKind : uint8_t {
  kLru,    // least recently released leaf first (LruEvictionPolicy)
  kReuse,  // lowest learned reuse probability first (ReuseEvictionPolicy)
};

// A policy choice as the cache applies it. Spelled as a spec string (ParseEvictionSpec):
// "lru" or "reuse", then any of "+admit" (admission filter) and "+notail" (do not retain
// partial tails); "default" is the measured default (kDefaultEvictionSpec).
struct EvictionOptions {
  EvictionPolicyKind kind = EvictionPolicyKind::kLru;
  bool admission = false;            // AdmissionFilter in front of the policy
  bool retain_partial_tails = true;  // keep partial tails of finished requests like other leaves
  // Block hashes remembered by the admission filter and the reuse model's history, in blocks of
  // the pool; 0: 4 per pool block.
  int64_t history_blocks = 0;
  // The reuse model's horizon: it estimates P(reused within this long | age, reuse count); ns.
  int64_t reuse_horizon_ns = 120'000'000'000;
};

// The default chosen from the Mooncake replays (docs/eviction.md): LRU behind the admission
// filter, partial tails not retained.
inline constexpr std::string_view kDefaultEvictionSpec = "lru+admit+notail";

// Parses a spec ("lru", "reuse+admit", "default", ...). Errors: INVALID_ARGUMENT naming the
// unknown part.
absl::StatusOr<EvictionOptions> ParseEvictionSpec(std::string_view spec);
// The canonical spec of `options` (ParseEvictionSpec(EvictionSpecName(o)) gives o back, sizes
// aside).
std::string EvictionSpecName(const EvictionOptions& options);

// Makes the policy `options` describe for a pool of `num_blocks` blocks.
// Errors: INVALID_ARGUMENT for num_blocks <= 0, a negative history size or a horizon <= 0.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(const EvictionOptions& options,
                                                                   int64_t num_blocks);
// Checks a spec and makes its policy for a small pool (config validation).
// Errors: INVALID_ARGUMENT (ParseEvictionSpec).
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view spec);

}  // namespace kvpool
