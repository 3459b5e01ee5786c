#pragma once

// PrefixCache: the radix tree of token blocks that lets sequences of one namespace share KV
// (DESIGN.md §5). One node per cached block; a node's edge is the block's tokens, compared
// exactly. A full node (coverage == block_size) may have children and is named by a chained
// xxh3-128 hash; a partial node (coverage < block_size, a rewind endpoint) is always a leaf.
//
// Coverage rules (the partial-block bugs real engines shipped):
//  - a block is reused only up to its coverage: a match never claims more tokens of a block
//    than the node covers;
//  - per position the widest block wins: a partial block that an existing sibling already covers
//    is not inserted, and a new wider block removes the (unused) narrower siblings it covers, so
//    a rewind endpoint stays reusable whichever of the two was created first;
//  - events announce full blocks only.
//
// Eviction (docs/eviction.md): a node is evictable when it holds a block, no sequence or pin
// locks it and no sequence holds its block (the block is CACHED). Only evictable leaves are
// candidates: the cache keeps the EvictionPolicy's candidate set equal to them, so whatever order
// a policy chooses, a node with cached descendants is never a victim. Partial tails of finished
// requests that nobody asked to retain (PrefixCacheOptions::policy "+notail", no
// Commit(retain_tail)) go to a first-out list of their own instead of the policy. A plan takes
// that list, then the policy's candidates in rank order, merging in the parents its earlier
// victims turn into leaves. Each planned eviction costs O(log n) in the candidates, whatever the
// tree's size. The tree owns exactly one pool reference per cached block and an eviction
// returns exactly that one.
//
// Pins (KvCacheManager::PinPrefix): a pinned node is locked, so it is never evicted; while its
// block is CACHED it counts as pin-held for its namespace's quota. Pin() raises the pinned
// nodes' priority class for good.
//
// Thread-compatible; owned by the KvCacheManager, which serializes calls. The cache calls into
// the BlockPool (AddCacheRef/DropCacheRef) and must be told, through OnBlockRefsChanged(), when
// a sequence retains or releases a block.

#include <cstdint>
#include <functional>
#include <memory>
#include <source_location>
#include <span>
#include <string>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/block_pool.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/internal/eviction_planner.h"
#include "kvpool/kv_events.h"

namespace kvpool {

// A sequence's place in the tree: the nodes it follows, each locked once on its behalf.
struct CachePath {
  std::vector<NodeIndex> full;  // nodes for the sequence's full blocks 0, 1, ... (a chain)
  NodeIndex partial = kNoNode;  // node for the next block, when only part of it is shared
};

struct PrefixMatch {
  int64_t matched_tokens = 0;
  std::vector<NodeIndex> full;  // fully matched blocks, root first
  NodeIndex partial = kNoNode;  // the block matched for part of its tokens, if any
  int32_t partial_tokens = 0;   // how many (<= that node's coverage)
};

// Why a prompt matched no further (for operators: `kvpoolctl explain`).
enum class MatchStop : uint8_t {
  kPromptEnd,             // the whole prompt matched
  kUnknownNamespace,      // nothing was ever cached in this namespace
  kNoChild,               // nothing cached after the matched prefix
  kDiverged,              // cached blocks follow, but their tokens differ from the prompt's
  kInsufficientCoverage,  // a cached block agrees as far as it goes but covers too few tokens
  kEvicted,               // the next full block was cached and has been evicted
};

struct MatchExplanation {
  int64_t matched_tokens = 0;
  MatchStop stop = MatchStop::kPromptEnd;
  int64_t block_index = 0;    // first block not fully matched
  int32_t tokens_needed = 0;  // prompt tokens in that block
  int32_t best_coverage = 0;  // coverage of the closest cached block there
  int32_t best_common = 0;    // tokens it shares with the prompt
  // kUnknownNamespace, kNoChild or kDiverged at block 0: another namespace holds this prompt's
  // first block (the prefix is cached, under another tenant's or salt's namespace).
  bool first_block_elsewhere = false;
  // kEvicted: the policy had that block below its admission bar (on probation) when it was
  // evicted (AdmissionFilter): it was never kept past its request.
  bool below_admission_bar = false;
  // Other namespaces whose trees would match more of this prompt (prefixes are never shared
  // across namespaces), with how many tokens.
  std::vector<std::pair<NamespaceId, int64_t>> other_namespaces;

  std::string ToString() const;
};

// The chained name of a full block: xxh3-128 over (parent's hash, namespace, tokens). The root's
// "hash" is zero. Used in events and by remote tiers; matching never relies on it.
BlockHash PrefixChainHash(const BlockHash& parent, NamespaceId ns, std::span<const int32_t> tokens);

// A full block that became cached (PrefixCache::TakePublished): what a lower tier needs to store
// a copy of it. Its bytes are the block's while the block stays cached or held.
struct PublishedBlock {
  NamespaceId ns;
  BlockId block;
  BlockHash hash;
  BlockHash parent;  // zero for a chain's first block
};

struct PrefixCacheOptions {
  int32_t block_size = 16;                              // tokens per block; > 0
  uint64_t epoch = 0;                                   // stamped on every event
  size_t event_capacity = 65536;                        // events kept for replay; > 0
  size_t event_capacity_bytes = kDefaultEventLogBytes;  // and the bytes they may take; > 0
  size_t evicted_memory = 65536;  // recently evicted block hashes remembered for Explain()
  // Record KV events. Off (a replay or bench with no event consumer) the log stays empty and
  // stored blocks cost no token copies.
  bool events = true;
  // Keep a journal of the full blocks that become cached, for a tier writer to drain
  // (TakePublished). Turns chained hashes on.
  bool journal = false;
  // Eviction spec (ParseEvictionSpec): the ordering policy and whether partial tails are kept.
  std::string policy = std::string(kDefaultEvictionSpec);
  int64_t history_blocks = 0;  // EvictionOptions::history_blocks (0: 4 per pool block)
  // When set, makes the ordering policy instead of the spec (tests inject theirs); the spec
  // still decides partial-tail retention.
  std::function<std::unique_ptr<EvictionPolicy>()> policy_factory;
};

struct PrefixCacheStats {
  int64_t nodes = 0;           // cached blocks (full + partial)
  int64_t full_nodes = 0;      // of which full
  int64_t evictable = 0;       // nodes that could be evicted now (leaves or not)
  int64_t candidates = 0;      // of which leaves (the policy's candidates plus first-out tails)
  int64_t pinned = 0;          // nodes held by at least one pin
  int64_t namespaces = 0;      // namespaces with a tree
  uint64_t inserted = 0;       // nodes created
  uint64_t widened = 0;        // partial nodes widened in place as their sequence published more
  uint64_t evicted = 0;        // nodes evicted (including dominated partial nodes)
  uint64_t dominated = 0;      // partial nodes removed because a wider sibling covers them
  uint64_t hits = 0;           // nodes adopted by new sequences (or followed by committing ones)
  uint64_t tails_evicted = 0;  // unretained partial tails evicted first
  // Children compared by partial-block lookups (BestChild, Covering, RemoveDominated): at most
  // those sharing the block's first token per lookup once a node has many children.
  uint64_t child_scans = 0;
};

class PrefixCache final {
 public:
  // Errors: INVALID_ARGUMENT (block_size <= 0, event_capacity 0, bad policy spec or sizes, a
  // policy_factory that returns null).
  static absl::StatusOr<std::unique_ptr<PrefixCache>> Create(const PrefixCacheOptions& options,
                                                             BlockPool* pool);

  // The time (ns, from the owner's injected Clock) stamped on what follows and shown to the
  // policy, until the next call. The manager sets it once per call.
  void SetTime(int64_t now_ns) { now_ns_ = now_ns; }

  // The longest cached prefix of `tokens` in `ns`. Changes nothing.
  PrefixMatch Match(NamespaceId ns, std::span<const int32_t> tokens) const;
  MatchExplanation Explain(NamespaceId ns, std::span<const int32_t> tokens) const;
  // Explain() for a match already made (`m` is Match(ns, tokens), the tree unchanged since),
  // without the search of other namespaces: fills every field of `e` but other_namespaces.
  // Cost: one scan of the stopping block's candidates and at most one block hash.
  void ExplainStop(NamespaceId ns, std::span<const int32_t> tokens, const PrefixMatch& m,
                   MatchExplanation* e) const;

  // Locks the nodes of `match` for a new sequence and tells the policy they were hit. Block
  // references are the caller's business.
  CachePath Adopt(const PrefixMatch& match);
  // Locks `path`'s nodes once more (a forked sequence follows its parent's path).
  CachePath Clone(const CachePath& path);
  void Lock(NodeIndex node);
  void Unlock(NodeIndex node);
  // A sequence whose blocks are `table` leaves its path's full nodes past the first `keep`,
  // deepest first: for each it drops its pool reference to the block at that position (the
  // caller's reference, recorded at `site`) and unlocks the node, re-evaluating the node once.
  // Its partial node, if any, is the caller's business. REQUIRES: table.size() >=
  // path->full.size().
  void ReleasePath(CachePath* path, std::span<const BlockId> table, size_t keep,
                   const TraceContext& ctx,
                   std::source_location site = std::source_location::current());

  // Publishes the blocks of a sequence in `ns` whose tokens are `tokens` and whose block table
  // is `table` (covering them), extending `path`: full blocks become (or follow) full nodes, a
  // trailing partial block becomes (or widens, or follows) a partial node. The tree takes one
  // pool reference per block it adopts. `priority` in [0, kNumPriorities). `retain_tail`: the
  // trailing partial node the path ends on is kept like any other leaf once released, even when
  // the spec says "+notail".
  // REQUIRES: Agrees() for every block of `table` past `path->full` with its tokens.
  void Commit(NamespaceId ns, std::span<const int32_t> tokens, std::span<const BlockId> table,
              int priority, bool retain_tail, CachePath* path, const TraceContext& ctx);

  // Unlocks the nodes of `path` past its first `keep_full` full blocks, deepest first, and its
  // partial node.
  void Truncate(CachePath* path, size_t keep_full);

  // A sequence retained or released `block`: re-evaluates whether its node is evictable.
  void OnBlockRefsChanged(BlockId block);

  // Works out, without changing anything, which nodes to evict (in order) to free `blocks`
  // blocks now, never touching a node listed in `keep`. Appends them to `victims` and returns
  // how many blocks they free (fewer than asked when the cache cannot free more).
  // Not const: the planner's scratch is the cache's (EvictionPlanner).
  int64_t PlanEviction(int64_t blocks, std::span<const NodeIndex> keep,
                       std::vector<NodeIndex>* victims) {
    return planner_.Plan(*this, blocks, keep, victims);
  }
  // Evicts the planned nodes, in order.
  void Evict(std::span<const NodeIndex> victims, const TraceContext& ctx);
  // Evicts up to `blocks` evictable nodes (an operator's request). Returns how many.
  int64_t EvictUpTo(int64_t blocks, const TraceContext& ctx);
  // Drops every node. Errors: FAILED_PRECONDITION while any node is locked (by a sequence or a
  // pin) or in use (nothing evicted).
  absl::Status Clear(const TraceContext& ctx);

  // Pins `nodes` (locks each once more) and raises their class to at least `priority`.
  // REQUIRES: nodes hold blocks and form a path from a root (parents first), each listed once;
  // 0 <= priority < kNumPriorities.
  void Pin(std::span<const NodeIndex> nodes, int priority);
  // Undoes one Pin() of `nodes`. REQUIRES: each is pinned.
  void Unpin(std::span<const NodeIndex> nodes);
  // Of `nodes` (distinct), how many a new pin would add to their namespace's pin-held blocks
  // (CACHED, not pinned yet), and how many are not pinned yet.
  int64_t PinCharge(std::span<const NodeIndex> nodes) const;
  int64_t NewlyPinned(std::span<const NodeIndex> nodes) const;
  // Blocks of `ns` that only pins hold (CACHED and pinned): they count against its quota.
  int64_t pin_held(NamespaceId ns) const;
  // Whether `block` is one of those.
  bool pin_held(BlockId block) const {
    const NodeIndex node = node_of_block_[static_cast<size_t>(block.value())];
    return node != kNoNode && state_[node].pin_charged != 0;
  }
  int64_t pinned_nodes() const { return pinned_nodes_; }
  uint32_t pins(NodeIndex node) const { return state_[node].pins; }

  // How many leading tokens of `block` the tree has published (0 when it holds no node for it).
  // Those tokens are immutable: a write below it must go to a copy.
  int32_t CoverageOf(BlockId block) const {
    const NodeIndex node = node_of_block_[static_cast<size_t>(block.value())];
    return node == kNoNode ? 0 : nodes_[node].coverage;
  }
  // Whether `tokens`, the tokens a sequence says `block` holds from its first slot on, agree with
  // what the tree published for it (one is a prefix of the other). A block holds one set of
  // bytes: a publisher that disagrees wrote into a block another sequence shares without the
  // copy-on-write of a Grow, and Commit() must not be called for it (it would corrupt the tree).
  bool Agrees(BlockId block, std::span<const int32_t> tokens) const;
  int32_t block_size() const { return block_size_; }
  BlockId block_of(NodeIndex node) const { return nodes_[node].block; }
  int32_t coverage(NodeIndex node) const { return nodes_[node].coverage; }
  uint32_t locks(NodeIndex node) const { return nodes_[node].lock; }
  int priority(NodeIndex node) const { return nodes_[node].priority; }
  NamespaceId ns_of(NodeIndex node) const { return ns_[node]; }
  const EvictionPolicy& policy() const { return *policy_; }

  const EventLog& events() const { return events_; }
  // Appends an event about blocks outside the tree (a lower tier's), when events are on.
  void AppendEvent(KvEvent event) {
    if (events_on_) events_.Append(std::move(event));
  }
  // Moves the journal (PrefixCacheOptions::journal) into `out`, oldest first, and empties it.
  void TakePublished(std::vector<PublishedBlock>* out) {
    out->clear();
    out->swap(published_);
  }
  // BlockStored events (seq 0) describing every full node now cached, parents first; a consumer
  // that applies them after clearing its view, then reads from `*resume_seq`, misses nothing.
  std::vector<KvEvent> SnapshotEvents(uint64_t* resume_seq) const;

  PrefixCacheStats stats() const;
  // Tree shape, hash chains, coverage, the child index, one cache reference per node, that the
  // policy (plus the first-out tails) holds exactly the evictable leaves and that its own books
  // balance, and the pin counts behind pin_held(). `expected_locks` and `expected_pins`
  // (node -> count), when given, must equal every node's lock and pin counts. Returns INTERNAL
  // naming the first violation.
  absl::Status CheckInvariants(
      const absl::flat_hash_map<NodeIndex, uint32_t>* expected_locks = nullptr,
      const absl::flat_hash_map<NodeIndex, uint32_t>* expected_pins = nullptr) const;
  // Every node and the event position in canonical text form (fail-clean tests compare it).
  std::string DebugString() const;

 private:
  friend class EvictionPlanner;  // reads the tree, the tails and the policy; changes nothing

  struct ChildKey {
    NodeIndex parent;
    uint64_t token_hash;
    friend bool operator==(const ChildKey&, const ChildKey&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const ChildKey& k) {
      return H::combine(std::move(h), k.parent, k.token_hash);
    }
  };

  // What eviction reads and writes of a node, packed so that evicting a node and re-ranking its
  // parent touch one cache line each, not one per field (a miss each at 1M nodes). 40 bytes.
  struct NodeState {
    int64_t released_ns = 0;   // when it last became evictable
    uint64_t release_seq = 0;  // release_counter_ at that moment
    uint64_t fingerprint = 0;  // BlockFingerprint(hash_) of a full node, 0 when partial
    uint32_t hits = 0;         // adoptions since insert
    int32_t depth = 0;         // blocks from the root (roots: 0)
    uint32_t pins = 0;         // pins among its locks
    uint8_t evictable = 0;     // ShouldBeEvictable() as last evaluated
    uint8_t retain = 0;        // a partial node someone asked to retain
    uint8_t pin_charged = 0;   // counted in pin_held_
    uint8_t in_tails = 0;      // a candidate on the first-out tail list
    uint8_t in_policy = 0;     // a candidate the policy holds
  };

  // The tree's links and what every lookup, publish and eviction reads of a node, packed so that
  // walking or changing a node touches one or two cache lines, not one per field. 48 bytes.
  struct Node {
    NodeIndex parent = kNoNode;
    NodeIndex first_child = kNoNode;
    NodeIndex next_sibling = kNoNode;
    NodeIndex prev_sibling = kNoNode;
    int32_t num_children = 0;
    BlockId block = kInvalidBlock;  // kInvalidBlock for roots and free slots
    int32_t coverage = 0;           // tokens of the block published (0 for roots)
    uint32_t lock = 0;              // sequences and pins following the node
    // HashTokens(tokens) of a full child of a wide parent (its key in children_), set when it is
    // indexed or its parent turns wide. Not computed otherwise: a narrow parent's children are
    // compared by tokens, so publishing or matching a block under one hashes nothing.
    uint64_t token_hash = 0;
    int8_t priority = 0;
    uint8_t wide = 0;  // children chained by first token (> kWideFanout once)
  };

  PrefixCache(const PrefixCacheOptions& options, BlockPool* pool,
              std::unique_ptr<EvictionPolicy> policy, bool retain_partial_tails);

  std::span<const int32_t> Tokens(NodeIndex node) const {
    return {tokens_.data() + static_cast<size_t>(node) * block_size_,
            static_cast<size_t>(nodes_[node].coverage)};
  }
  NodeIndex Root(NamespaceId ns) const;
  NodeIndex RootOrCreate(NamespaceId ns);
  // A free node slot: a recycled one (inline: one per stored block), or GrowNodes().
  NodeIndex NewNode() {
    if (free_nodes_.empty()) return GrowNodes();
    const NodeIndex node = free_nodes_.back();
    free_nodes_.pop_back();
    return node;
  }
  NodeIndex GrowNodes();
  // The full child of `parent` holding exactly `tokens` (a whole block), or kNoNode. Hashes the
  // tokens only when `parent` is wide.
  NodeIndex FindFull(NodeIndex parent, std::span<const int32_t> tokens) const;
  // The child of `parent` sharing the most leading tokens with `tokens` (capped at its
  // coverage); ties go to the wider node. Returns kNoNode when none shares any.
  NodeIndex BestChild(NodeIndex parent, std::span<const int32_t> tokens, int32_t* common) const;
  // A child of `parent` other than `except` that covers all of `tokens`, or kNoNode.
  NodeIndex Covering(NodeIndex parent, std::span<const int32_t> tokens, NodeIndex except) const;
  // Children: a sibling list per parent. A parent with more than kWideFanout children also
  // chains them by first token, so the partial-block scans (BestChild, Covering,
  // RemoveDominated) compare only the children that share the block's first token, whatever the
  // fan-out (a root with thousands of children stays cheap), and indexes its full children in
  // children_ for FindFull. It stays wide until it has none.
  static constexpr int32_t kWideFanout = 8;
  struct FirstTokenKey {
    NodeIndex parent;
    int32_t token;
    friend bool operator==(const FirstTokenKey&, const FirstTokenKey&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const FirstTokenKey& k) {
      return H::combine(std::move(h), k.parent, k.token);
    }
  };
  // REQUIRES: `node`'s parent, tokens and coverage are set.
  void LinkChild(NodeIndex parent, NodeIndex node);
  void UnlinkChild(NodeIndex node);
  void ChainPush(NodeIndex node);
  void ChainRemove(NodeIndex node);
  // The children of `parent` a block starting with `token` may share tokens with: the first, and
  // the one after `child`. Every child sharing the token is among them.
  NodeIndex FirstCandidate(NodeIndex parent, int32_t token) const;
  NodeIndex NextCandidate(NodeIndex child) const {
    return nodes_[nodes_[child].parent].wide != 0 ? chain_next_[child] : nodes_[child].next_sibling;
  }
  absl::Status CheckChains() const;
  // first_blocks_ holds exactly the full first blocks, each under its tokens' hash.
  absl::Status CheckFirstBlocks() const;
  // Commit() without the retention mark.
  void CommitBlocks(NamespaceId ns, std::span<const int32_t> tokens, std::span<const BlockId> table,
                    int priority, CachePath* path, const TraceContext& ctx);
  // Its trailing partial `block`, held in the sequence's block `mine`, after the full node
  // `parent`: follows a sibling that covers it, widens the sequence's own node, or inserts one.
  void CommitPartial(NodeIndex parent, std::span<const int32_t> block, BlockId mine, int priority,
                     CachePath* path, const TraceContext& ctx);
  NodeIndex Insert(NodeIndex parent, std::span<const int32_t> tokens, BlockId block, int priority,
                   const TraceContext& ctx);
  // A fresh slot `node` becomes a childless node below `parent` holding `tokens` in `block`,
  // locked once by the committing sequence, with the cache's pool reference taken. Linking it
  // into `parent`'s children and the counts are the caller's (Insert, AppendChain).
  void FillNode(NodeIndex node, NodeIndex parent, std::span<const int32_t> tokens, BlockId block,
                int priority, const TraceContext& ctx);
  // Inserts the full blocks `tokens` held in `table` as a chain below `parent`, which has no
  // child, extending `path`, up to the first block the tree already holds a node for. Returns
  // how many it inserted.
  size_t AppendChain(NodeIndex parent, std::span<const int32_t> tokens,
                     std::span<const BlockId> table, int priority, CachePath* path,
                     const TraceContext& ctx);
  // A node's class is at least its descendants' (the policy's leaf-first promise): raises
  // `node` and its ancestors to `priority`. They are locked by the committing sequence, so none
  // is in the policy's lists.
  void RaiseAncestors(NodeIndex node, int priority);
  // Extends `node` (holding the sequence's own block) to `tokens`; a node reaching a full block
  // joins the child index and is announced.
  void Widen(NodeIndex node, std::span<const int32_t> tokens);
  void MakeFull(NodeIndex node);
  // first_blocks_ upkeep: `node`, a full first block, was made (MakeFull, AppendChain) or is
  // being freed (FreeSlot).
  void IndexFirstBlock(NodeIndex node);
  void UnindexFirstBlock(NodeIndex node);
  // Whether a namespace other than `ns` holds a full first block of exactly `block`.
  bool FirstBlockElsewhere(NamespaceId ns, std::span<const int32_t> block) const;
  // Removes unused partial siblings of `node` that it covers.
  void RemoveDominated(NodeIndex node, const TraceContext& ctx);
  // Removes an unlocked leaf and returns its cache reference. `offer_parent`: re-evaluate the
  // parent, which may have become a candidate; false only when the caller removes the parent
  // next (an evicted chain), so it is never added to the policy just to be taken out again.
  void RemoveNode(NodeIndex node, const TraceContext& ctx, bool offer_parent = true);
  // RemoveNode()'s last step: returns the node's cache reference and its slot. Defined inline in
  // prefix_cache_evict.cc (its callers: RemoveNode and Evict's chain path).
  void FreeSlot(NodeIndex node, const TraceContext& ctx);
  // Lock() for a node a sequence reuses: also counts the hit and tells the policy.
  void LockHit(NodeIndex node);
  // Re-evaluates a node after its locks or its block's references changed. Defined inline in
  // prefix_cache.cc, whose functions are its only callers (one call per node a sequence locks,
  // unlocks or releases).
  void UpdateEvictable(NodeIndex node);
  bool ShouldBeEvictable(NodeIndex node) const {
    const BlockId block = nodes_[node].block;
    return block != kInvalidBlock && nodes_[node].lock == 0 &&
           pool_->state(block) == BlockState::kCached;
  }
  // Puts `node` into, or takes it out of, the candidates (policy or first-out tails) as it is
  // or is not an evictable leaf.
  void UpdateCandidate(NodeIndex node);
  bool IsFirstOutTail(NodeIndex node) const {
    return nodes_[node].coverage < block_size_ && !retain_partial_tails_ &&
           state_[node].retain == 0;
  }
  void TailPush(NodeIndex node);
  void TailRemove(NodeIndex node);
  void UpdatePinCharge(NodeIndex node);
  // The policy's Rank() of an evictable node, computed here when the policy ranks by release.
  EvictionRank RankOf(NodeIndex node) const {
    if (ranks_by_release_) {
      return EvictionRank{.priority = nodes_[node].priority, .order = state_[node].release_seq};
    }
    return policy_->Rank(node, Facts(node), now_ns_);
  }
  NodeFacts Facts(NodeIndex node) const {
    return NodeFacts{.fingerprint = state_[node].fingerprint,
                     .depth = state_[node].depth,
                     .hits = state_[node].hits,
                     .priority = nodes_[node].priority,
                     .released_ns = state_[node].released_ns,
                     .release_seq = state_[node].release_seq};
  }
  absl::Status CheckNode(NodeIndex node, const absl::flat_hash_map<NodeIndex, uint32_t>* pins,
                         absl::flat_hash_map<NamespaceId, int64_t>* pin_held) const;
  void Announce(NodeIndex first, NodeIndex last);  // BlockStored for the chain first..last
  void FlushRemoved();

  const int32_t block_size_;
  const size_t evicted_memory_;
  const bool retain_partial_tails_;
  const bool events_on_;
  const bool journal_on_;
  // Chained hashes are computed: events, the evicted-hash memory or the policy need them. Off,
  // hash_ and the fingerprints stay zero.
  const bool hashes_on_;
  BlockPool* const pool_;
  std::unique_ptr<EvictionPolicy> policy_;
  const bool ranks_by_release_;  // policy_->ranks_by_release()
  const bool hears_accesses_;    // policy_->hears_accesses()
  // Nothing is recorded per evicted block (no events, no policy hearing erasures, no memory of
  // evicted hashes): Evict() removes a chain's inner nodes without RemoveNode().
  const bool lean_evictions_;
  EventLog events_;
  int64_t now_ns_ = 0;
  uint64_t release_counter_ = 0;

  // Node metadata by NodeIndex: the hot fields in nodes_, the rest in arrays of their own.
  std::vector<Node> nodes_;
  std::vector<NodeIndex> chain_prev_;  // children of a wide parent: the first-token chain
  std::vector<NodeIndex> chain_next_;
  std::vector<NodeIndex> tail_prev_;  // first-out tails: a FIFO threaded through the nodes
  std::vector<NodeIndex> tail_next_;
  std::vector<NodeState> state_;  // eviction bookkeeping, one cache line per two nodes
  std::vector<NamespaceId> ns_;
  std::vector<BlockHash> hash_;  // full nodes when hashes_on_ (roots: zero)
  std::vector<int32_t> tokens_;  // [node][block_size]
  std::vector<NodeIndex> free_nodes_;
  std::vector<NodeIndex> node_of_block_;  // by BlockId

  absl::flat_hash_map<NamespaceId, NodeIndex> roots_;
  // Full children of wide parents (a narrow parent's few are compared by tokens in place).
  absl::flat_hash_map<ChildKey, NodeIndex> children_;
  absl::flat_hash_map<FirstTokenKey, NodeIndex> chains_;  // wide parents' chain heads
  mutable uint64_t child_scans_ = 0;

  // Recently evicted full blocks, for Explain().
  std::vector<BlockHash> evicted_ring_;
  size_t evicted_next_ = 0;
  // The hashes of evicted_ring_, each with whether the policy had it below its admission bar.
  absl::flat_hash_map<BlockHash, bool> evicted_set_;
  // The full first blocks of every namespace, by HashTokens of their tokens, each with its node:
  // tells a miss whose first block another namespace holds (ExplainStop) without a match per
  // namespace. Only ever counted: a match never leaves its namespace.
  absl::btree_set<std::pair<uint64_t, NodeIndex>> first_blocks_;

  std::vector<BlockHash> pending_removed_;  // batched into one BlockRemoved per call
  std::vector<PublishedBlock> published_;   // the journal, when on
  NamespaceId pending_removed_ns_;

  EvictionPlanner planner_;  // PlanEviction's, with its scratch

  NodeIndex tails_head_ = kNoNode;
  NodeIndex tails_tail_ = kNoNode;
  int64_t num_tails_ = 0;
  absl::flat_hash_map<NamespaceId, int64_t> pin_held_;  // CACHED pinned blocks by namespace

  int64_t num_nodes_ = 0;
  int64_t num_full_ = 0;
  int64_t num_evictable_ = 0;
  int64_t pinned_nodes_ = 0;
  PrefixCacheStats counters_;
};

}  // namespace kvpool
