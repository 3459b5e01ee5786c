#pragma once

// PrefixCache: the radix tree of token blocks that lets sequences of one namespace share KV
// (DESIGN.md §5). A node holds a run of blocks (internal::RunTree: split where prompts diverge,
// merged back when a split is no longer needed); everything with a meaning of its own stays per
// block inside a run: coverage, locks, pins, priority class, eviction facts, events and the
// journal. The cache names each block it holds by its BlockId: paths, matches, pins, eviction
// plans and the policy's candidates are block ids, so a run's splits and merges are invisible
// to callers. A block's edge is its tokens, compared exactly. A full block (coverage ==
// block_size) may have children and is named by a chained xxh3-128 hash; a partial block
// (coverage < block_size, a rewind endpoint) is always a leaf.
//
// Coverage rules (the partial-block bugs real engines shipped):
//  - a block is reused only up to its coverage: a match never claims more tokens of a block
//    than it covers;
//  - per position the widest block wins: a partial block that an existing sibling already covers
//    is not inserted, and a new wider block removes the (unused) narrower siblings it covers, so
//    a rewind endpoint stays reusable whichever of the two was created first;
//  - events announce full blocks only.
//
// Eviction (docs/eviction.md): a block is evictable when no sequence or pin locks it and no
// sequence holds it (it is CACHED). Only evictable leaves (a childless run's last block, or a
// partial block) are candidates: the cache keeps the EvictionPolicy's candidate set equal to
// them, so whatever order a policy chooses, a block with cached descendants is never a victim,
// and eviction trims a run from its tail. Partial tails of finished requests that nobody asked
// to retain (PrefixCacheOptions::policy "+notail", no Commit(retain_tail)) go to a first-out list
// of their own instead of the policy, and so do leaves no prompt can resume at once the owner
// asked for it (EvictUnresumableFirst: a hybrid model's blocks past a path's last checkpoint). A
// plan takes that list, then the policy's candidates in rank order, merging in the blocks its
// earlier victims turn into leaves. Each planned eviction costs O(log n) in the candidates,
// whatever the tree's size, and O(1) inside a run released at once. The tree owns exactly one pool
// reference per cached block and an eviction returns exactly that one.
//
// Pins (KvCacheManager::PinPrefix): a pinned block is locked, so it is never evicted; while it
// is CACHED it counts as pin-held for its namespace's quota. Pin() raises the pinned blocks'
// priority class for good.
//
// Thread-compatible; owned by the KvCacheManager, which serializes calls. The cache calls into
// the BlockPool (AddCacheRef/DropCacheRef) and must be told, through OnBlockRefsChanged(), when
// a sequence retains or releases a block.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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
#include "kvpool/internal/run_tree.h"
#include "kvpool/kv_events.h"

namespace kvpool {

// A sequence's place in the tree: the blocks it follows, each locked once on its behalf.
struct CachePath {
  std::vector<BlockId> full;        // the tree's blocks for the sequence's full blocks 0, 1, ...
  BlockId partial = kInvalidBlock;  // the tree's block for the next one, when only part is shared
};

struct PrefixMatch {
  int64_t matched_tokens = 0;
  std::vector<BlockId> full;        // fully matched blocks, root first
  BlockId partial = kInvalidBlock;  // the block matched for part of its tokens, if any
  int32_t partial_tokens = 0;       // how many (<= its coverage)
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
  // With a state group (KvCacheManager): the tokens a prompt resumes, the deepest state checkpoint
  // at or below matched_tokens (the rest are computed again); -1 without one.
  int64_t resumable_tokens = -1;
  // Of the tokens resumable_tokens leaves out, those the window group cut (a window block the
  // resumed window needs was evicted, or released before it was published); the others the
  // state group cut (no checkpoint).
  int64_t window_evicted_tokens = 0;
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
  // Stamped on the tree's own Stored and Removed events: the main blocks' group in a pool with
  // more than one layer group (KvEvent::group); absent in a pool of one.
  std::optional<KvEventGroup> event_group;
  // Keep a journal of the full blocks that become cached, for a tier writer to drain
  // (TakePublished). Turns chained hashes on.
  bool journal = false;
  // Eviction spec (ParseEvictionSpec): the ordering policy and whether partial tails are kept.
  std::string policy = std::string(kDefaultEvictionSpec);
  int64_t history_blocks = 0;  // EvictionOptions::history_blocks (0: 4 per pool block)
  // When set, makes the ordering policy instead of the spec (tests inject theirs); the spec
  // still decides partial-tail retention. Called once per eviction share.
  std::function<std::unique_ptr<EvictionPolicy>()> policy_factory;
  // Eviction shares (docs/eviction.md, Fair by tenant): SetShare() files namespaces under shares,
  // at most this many besides the default one. 0: one share, SetShare() refused.
  int32_t max_shares = 0;
  // What one cached block weighs in a share's use (the bytes of a block in every layer of the
  // main group); a share's use is its evictable blocks times this plus ChargeShare()'s bytes.
  int64_t block_bytes = 1;
};

struct PrefixCacheStats {
  int64_t nodes = 0;           // cached blocks (full + partial)
  int64_t full_nodes = 0;      // of which full
  int64_t evictable = 0;       // blocks that could be evicted now (leaves or not)
  int64_t candidates = 0;      // of which leaves (the policy's candidates plus first-out tails)
  int64_t pinned = 0;          // blocks held by at least one pin
  int64_t namespaces = 0;      // namespaces with a tree
  int64_t runs = 0;            // radix nodes holding those blocks (a run each, or a partial block)
  uint64_t inserted = 0;       // blocks published
  uint64_t widened = 0;        // partial blocks widened in place as their sequence published more
  uint64_t evicted = 0;        // blocks evicted (including dominated partial blocks)
  uint64_t dominated = 0;      // partial blocks removed because a wider sibling covers them
  uint64_t hits = 0;           // blocks adopted by new sequences (or followed by committing ones)
  uint64_t tails_evicted = 0;  // unretained partial tails evicted first
  uint64_t splits = 0;         // runs split where a block gained a second child
  uint64_t merges = 0;         // runs merged back when a split was no longer needed
  // Blocks evicted that were no resume point (EvictUnresumableFirst; an unretained partial tail
  // among them counts here, not in tails_evicted).
  uint64_t unresumable_evicted = 0;
  // Children compared by partial-block lookups (BestChild, Covering, RemoveDominated): at most
  // those sharing the block's first token per lookup once a position has many children.
  uint64_t child_scans = 0;
  int64_t shares = 0;  // eviction shares holding evictable blocks or charged bytes
};

// One eviction share's standing (PrefixCache::Shares).
struct ShareUse {
  uint64_t key = 0;       // SetShare()'s; 0: the default share
  uint32_t weight = 1;    // its weight among shares
  int64_t evictable = 0;  // its evictable blocks
  int64_t charged = 0;    // bytes ChargeShare() added (components kept beside its blocks)
  int64_t bytes = 0;      // its use: evictable * block_bytes + charged
  uint64_t evicted = 0;   // blocks evicted from it
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

  // Called for every block the tree lets go (evicted, dominated, cleared), just before its cache
  // reference is returned: the owner drops what it keeps per block (state checkpoints).
  void SetOnRemove(std::function<void(BlockId, const TraceContext&)> on_remove) {
    on_remove_ = std::move(on_remove);
  }

  // Called for every block a Commit widens (its sequence's own block, now covering more tokens):
  // what the owner keeps beside it may hold only the tokens it covered before.
  void SetOnWiden(std::function<void(BlockId)> on_widen) { on_widen_ = std::move(on_widen); }

  // Resume points (docs/hybrid-groups.md §4). A hybrid model's prompt resumes only at a state
  // checkpoint, so the K/V of a block with no checkpoint in it or below it is never reused (a
  // prompt that reaches it resumes above it and computes it again). Once this is called, a leaf
  // its owner has not marked a resume point is a first-out tail (evicted before anything the
  // policy orders), and a plan that frees such a block's parent takes the parent next if it is
  // no resume point either: a path loses its K/V past its last checkpoint first. Call before the
  // first block is published.
  void EvictUnresumableFirst() { unresumable_first_ = true; }
  // Marks `block` (held) as a resume point or not (its owner keeps a checkpoint in it); it moves
  // between the first-out tails and the policy if it is a candidate. O(log n).
  void MarkResumePoint(BlockId block, bool on);
  bool resume_point(BlockId block) const { return entry(block).resume != 0; }

  // Eviction shares (docs/eviction.md, Fair by tenant). The blocks namespace `ns` publishes
  // after SetShare(ns, key, weight) belong to share `key` for as long as the tree holds them;
  // the default share (key 0) holds every other block. Each share orders its own candidates with
  // its own instance of the policy, and a plan takes its next victim from the share whose use
  // (ShareUse::bytes) per unit of weight is the largest: a tenant that floods the cache evicts
  // its own blocks, and the others keep theirs up to their weighted part. First-out tails still
  // go first, whatever their share. Setting an existing share's key again changes its weight.
  // Errors: INVALID_ARGUMENT (ns 0, weight 0 or above kMaxShareWeight), RESOURCE_EXHAUSTED
  // (max_shares shares besides the default one exist; with max_shares 0 shares are off);
  // nothing has changed.
  static constexpr uint32_t kMaxShareWeight = 1'000'000;
  absl::Status SetShare(NamespaceId ns, uint64_t key, uint32_t weight = 1);
  // Adds `bytes` (negative to take them back) to the use of the share `block` belongs to: what
  // the owner keeps beside a cached block (window blocks, state checkpoints) counts with the
  // block's tenant. Nothing with shares off. REQUIRES: the tree holds `block`; the share's
  // charged bytes stay >= 0.
  void ChargeShare(BlockId block, int64_t bytes);
  // Every share, the default one first.
  std::vector<ShareUse> Shares() const;
  // The share `ns` publishes into (the default one unless SetShare named another).
  ShareUse ShareOf(NamespaceId ns) const { return UseOf(shares_[ShareFor(ns)]); }
  bool shares_on() const { return shares_on_; }
  // Shares exist besides the default one: evictions choose between tenants.
  bool fair() const { return shares_.size() > 1; }
  // The share (index into Shares()) `block` belongs to. REQUIRES: the tree holds it.
  size_t ShareIndexOf(BlockId block) const { return entry(block).share; }

  // The longest cached prefix of `tokens` in `ns`. Changes nothing.
  PrefixMatch Match(NamespaceId ns, std::span<const int32_t> tokens) const;
  MatchExplanation Explain(NamespaceId ns, std::span<const int32_t> tokens) const;
  // Explain() for a match already made (`m` is Match(ns, tokens), the tree unchanged since),
  // without the search of other namespaces: fills every field of `e` but other_namespaces.
  // Cost: one scan of the stopping block's candidates and at most one block hash.
  void ExplainStop(NamespaceId ns, std::span<const int32_t> tokens, const PrefixMatch& m,
                   MatchExplanation* e) const;

  // Locks the blocks of `match` for a new sequence and tells the policy they were hit. Block
  // references are the caller's business.
  CachePath Adopt(const PrefixMatch& match);
  // Locks `path`'s blocks once more (a forked sequence follows its parent's path).
  CachePath Clone(const CachePath& path);
  // REQUIRES: the tree holds `block` (and, for Unlock, it is locked).
  void Lock(BlockId block);
  void Unlock(BlockId block);
  // A sequence whose blocks are `table` leaves its path's full blocks past the first `keep`,
  // deepest first: for each it drops its pool reference to the block at that position (the
  // caller's reference, recorded at `site`) and unlocks the path's block, re-evaluating it once.
  // Its partial block, if any, is the caller's business. REQUIRES: table.size() >=
  // path->full.size().
  void ReleasePath(CachePath* path, std::span<const BlockId> table, size_t keep,
                   const TraceContext& ctx,
                   std::source_location site = std::source_location::current());

  // Publishes the blocks of a sequence in `ns` whose tokens are `tokens` and whose block table
  // is `table` (covering them), extending `path`: full blocks become (or follow) full cached
  // blocks, a trailing partial block becomes (or widens, or follows) a partial one. The tree
  // takes one pool reference per block it adopts. `priority` in [0, kNumPriorities).
  // `retain_tail`: the trailing partial block the path ends on is kept like any other leaf once
  // released, even when the spec says "+notail".
  // REQUIRES: Agrees() for every block of `table` past `path->full` with its tokens.
  void Commit(NamespaceId ns, std::span<const int32_t> tokens, std::span<const BlockId> table,
              int priority, bool retain_tail, CachePath* path, const TraceContext& ctx);

  // Unlocks the blocks of `path` past its first `keep_full` full blocks, deepest first, and its
  // partial block.
  void Truncate(CachePath* path, size_t keep_full);

  // A sequence retained or released `block`: re-evaluates whether it is evictable.
  void OnBlockRefsChanged(BlockId block);

  // Works out, without changing anything, which blocks to evict (in order) to free `blocks`
  // blocks now, never touching a block listed in `keep`. Appends them to `victims` and returns
  // how many blocks they free (fewer than asked when the cache cannot free more).
  // Not const: the planner's scratch is the cache's (EvictionPlanner).
  int64_t PlanEviction(int64_t blocks, std::span<const BlockId> keep,
                       std::vector<BlockId>* victims) {
    return planner_.Plan(*this, blocks, keep, victims);
  }
  // Evicts the planned blocks, in order.
  void Evict(std::span<const BlockId> victims, const TraceContext& ctx);
  // Evicts up to `blocks` evictable blocks (an operator's request). Returns how many.
  int64_t EvictUpTo(int64_t blocks, const TraceContext& ctx);
  // Drops every block. Errors: FAILED_PRECONDITION while any block is locked (by a sequence or a
  // pin) or in use (nothing evicted).
  absl::Status Clear(const TraceContext& ctx);

  // Pins `blocks` (locks each once more) and raises their class to at least `priority`.
  // REQUIRES: the tree holds them and they form a path from a root (parents first), each listed
  // once; 0 <= priority < kNumPriorities.
  void Pin(std::span<const BlockId> blocks, int priority);
  // Undoes one Pin() of `blocks`. REQUIRES: each is pinned.
  void Unpin(std::span<const BlockId> blocks);
  // Of `blocks` (distinct), how many a new pin would add to their namespace's pin-held blocks
  // (CACHED, not pinned yet), and how many are not pinned yet.
  int64_t PinCharge(std::span<const BlockId> blocks) const;
  int64_t NewlyPinned(std::span<const BlockId> blocks) const;
  // Blocks of `ns` that only pins hold (CACHED and pinned): they count against its quota.
  int64_t pin_held(NamespaceId ns) const;
  // Files namespace `ns` under tally `tally` (0: none), as BlockPool::SetTally: from now on its
  // pin-held blocks count in tally_pin_held(tally), those it has now included. O(1) amortized.
  void SetTally(NamespaceId ns, uint32_t tally);
  // The tally `ns` is filed under (0: none), and how many namespaces are filed under one.
  uint32_t tally_of(NamespaceId ns) const {
    auto it = tally_of_.find(ns);
    return it == tally_of_.end() ? 0 : it->second;
  }
  size_t tallied_namespaces() const { return tally_of_.size(); }
  // Pin-held blocks of the namespaces filed under `tally` (> 0). O(1).
  int64_t tally_pin_held(uint32_t tally) const {
    return tally < pin_held_by_tally_.size() ? pin_held_by_tally_[tally] : 0;
  }
  // Whether `block` is one of those.
  bool pin_held(BlockId block) const { return tree_.Holds(block) && entry(block).pin_charged; }
  int64_t pinned_blocks() const { return pinned_blocks_; }

  // How many leading tokens of `block` the tree has published (0 when it does not hold it).
  // Those tokens are immutable: a write below it must go to a copy.
  int32_t CoverageOf(BlockId block) const { return tree_.coverage(block); }
  // Blocks from the root to `block` (held by the tree), itself included: 1 for a first block.
  int32_t DepthOf(BlockId block) const { return tree_.depth(block); }
  // The block `block` (held by the tree) hangs below: kInvalidBlock for a first block.
  BlockId ParentOf(BlockId block) const { return tree_.Parent(block); }
  // Whether `tokens`, the tokens a sequence says `block` holds from its first slot on, agree with
  // what the tree published for it (one is a prefix of the other). A block holds one set of
  // bytes: a publisher that disagrees wrote into a block another sequence shares without the
  // copy-on-write of a Grow, and Commit() must not be called for it (it would corrupt the tree).
  bool Agrees(BlockId block, std::span<const int32_t> tokens) const;
  int32_t block_size() const { return block_size_; }
  // Per cached block. REQUIRES: the tree holds `block`.
  uint32_t locks(BlockId block) const { return entry(block).lock; }
  uint32_t pins(BlockId block) const { return entry(block).pins; }
  int priority(BlockId block) const { return entry(block).priority; }
  NamespaceId ns_of(BlockId block) const { return tree_.ns_of(block); }
  bool holds(BlockId block) const { return tree_.Holds(block); }
  // The default share's policy (the only one with shares off).
  const EvictionPolicy& policy() const { return *policy_; }

  const EventLog& events() const { return events_; }
  bool events_on() const { return events_on_; }
  // Appends an event about blocks outside the tree (a lower tier's), when events are on.
  void AppendEvent(KvEvent event) {
    if (events_on_) events_.Append(std::move(event));
  }
  // What a lower tier keys cached full block `block` by (its namespace, chained hash and
  // parent's), with the journal on (PrefixCacheOptions::journal); nullopt otherwise, or for a
  // block that is not a full cached one.
  std::optional<PublishedBlock> PublishedOf(BlockId block) const {
    if (!journal_on_ || !holds(block) || tree_.coverage(block) != block_size_) return std::nullopt;
    return PublishedBlock{.ns = tree_.ns_of(block),
                          .block = block,
                          .hash = hash_[Index(block)],
                          .parent = HashOf(tree_.Parent(block))};
  }
  // Moves the journal (PrefixCacheOptions::journal) into `out`, oldest first, and empties it.
  void TakePublished(std::vector<PublishedBlock>* out) {
    out->clear();
    out->swap(published_);
  }
  // BlockStored events (seq 0) describing every full block now cached, parents first; a consumer
  // that applies them after clearing its view, then reads from `*resume_seq`, misses nothing.
  std::vector<KvEvent> SnapshotEvents(uint64_t* resume_seq) const;

  // Events of a component its owner keeps beside full tree blocks (KvCacheManager's window blocks
  // and state checkpoints), stamped with `group`. AnnounceComponent: one Stored event naming
  // `chain` as the tree's own events name full blocks (hashes, parent, tokens). ForgetComponent:
  // one Removed event naming `blocks` by hash, before the tree's removals still batched (the
  // owner drops components from SetOnRemove's callback: they leave before their block does);
  // nothing while Clear() runs, whose AllBlocksCleared covers every group. Both do nothing with
  // events off. REQUIRES: every block is a full block in the tree, all in one namespace; `chain`'s
  // blocks each the parent of the next.
  void AnnounceComponent(std::span<const BlockId> chain, const KvEventGroup& group);
  void ForgetComponent(std::span<const BlockId> blocks, const KvEventGroup& group);
  // The Stored event of one block's component, as a snapshot entry (seq 0).
  KvEvent ComponentStored(BlockId block, const KvEventGroup& group) const;

  PrefixCacheStats stats() const;
  // The tree's shape (RunTree::CheckInvariants), hash chains, one cache reference per block,
  // that the policy (plus the first-out tails) holds exactly the evictable leaves and that its
  // own books balance, and the pin counts behind pin_held(). `expected_locks` and
  // `expected_pins` (block -> count), when given, must equal every block's lock and pin counts.
  // Returns INTERNAL naming the first violation.
  absl::Status CheckInvariants(
      const absl::flat_hash_map<BlockId, uint32_t>* expected_locks = nullptr,
      const absl::flat_hash_map<BlockId, uint32_t>* expected_pins = nullptr) const;
  // Every cached block, its run and the event position in canonical text form (fail-clean tests
  // compare it); independent of which node slots the runs use.
  std::string DebugString() const;

 private:
  friend class EvictionPlanner;  // reads the tree, the tails and the policy; changes nothing

  // What the cache records per block it holds (the tree keeps the block's place and tokens),
  // packed so that publishing, releasing, planning or evicting a block touches one cache line of
  // it (two blocks a line). Indexed by BlockId; reset when the block is published. 32 bytes.
  struct Entry {
    uint64_t release_seq = 0;  // release_counter_ when it last became evictable
    int64_t released_ns = 0;   // and the time
    uint32_t lock = 0;         // sequences and pins following it
    uint32_t pins = 0;         // pins among its locks
    uint32_t hits = 0;         // adoptions since it was published
    int8_t priority = 0;
    uint8_t evictable : 1 = 0;    // ShouldBeEvictable() as last evaluated
    uint8_t retain : 1 = 0;       // a partial block someone asked to retain
    uint8_t pin_charged : 1 = 0;  // counted in pin_held_
    uint8_t in_tails : 1 = 0;     // a candidate on the first-out tail list
    uint8_t in_policy : 1 = 0;    // a candidate the policy holds
    uint8_t resume : 1 = 0;       // a resume point (MarkResumePoint)
    // EvictionPlanner's scratch: the plan must not take it (0 between plans).
    mutable uint8_t kept : 1 = 0;
    uint16_t share = 0;  // index into shares_ (0: the default share)
  };
  static_assert(sizeof(Entry) == 32);

  // An eviction share: its key and weight, its own policy instance, and its use.
  struct ShareSlot {
    uint64_t key = 0;
    uint32_t weight = 1;
    std::unique_ptr<EvictionPolicy> policy;
    int64_t evictable = 0;  // its evictable blocks (kept with shares on)
    int64_t charged = 0;    // ChargeShare()'s bytes
    uint64_t evicted = 0;
    // Its use in bytes with `planned` of its evictable blocks gone (ShareUse::bytes at 0).
    int64_t Bytes(int64_t block_bytes, int64_t planned = 0) const {
      return (evictable - planned) * block_bytes + charged;
    }
    // Its use per unit of weight: which share gives the next victim.
    double UsePerWeight(int64_t block_bytes, int64_t planned) const {
      return static_cast<double>(Bytes(block_bytes, planned)) / weight;
    }
  };

  ShareUse UseOf(const ShareSlot& s) const {
    return ShareUse{.key = s.key,
                    .weight = s.weight,
                    .evictable = s.evictable,
                    .charged = s.charged,
                    .bytes = s.Bytes(share_block_bytes_),
                    .evicted = s.evicted};
  }
  // The shares a cache starts with: the default one, ordered by `policy`.
  static std::vector<ShareSlot> FirstShare(std::unique_ptr<EvictionPolicy> policy);

  PrefixCache(const PrefixCacheOptions& options, BlockPool* pool,
              std::unique_ptr<EvictionPolicy> policy,
              std::function<std::unique_ptr<EvictionPolicy>()> make_policy,
              bool retain_partial_tails);

  static size_t Index(BlockId b) { return static_cast<size_t>(b.value()); }
  // The name the policy knows a block by.
  static NodeIndex Key(BlockId b) { return b.value(); }
  const Entry& entry(BlockId b) const { return entries_[Index(b)]; }
  Entry& entry(BlockId b) { return entries_[Index(b)]; }

  // Commit() without the retention mark.
  void CommitBlocks(NamespaceId ns, std::span<const int32_t> tokens, std::span<const BlockId> table,
                    int priority, CachePath* path, const TraceContext& ctx);
  // One full block of a commit at position (`root`, `at`): follows the cached block holding
  // `tokens`, widens the sequence's own partial block, or inserts `mine`. Returns the block the
  // path follows, or kInvalidBlock when `mine` is published elsewhere under other tokens. Sets
  // `fresh` when the block became full here.
  BlockId CommitFull(NodeIndex root, BlockId at, std::span<const int32_t> tokens, BlockId mine,
                     int priority, CachePath* path, bool* fresh, const TraceContext& ctx);
  // Its trailing partial `block`, held in the sequence's block `mine`, after position (`root`,
  // `at`): follows a sibling that covers it, widens the sequence's own block, or inserts one.
  void CommitPartial(NodeIndex root, BlockId at, std::span<const int32_t> block, BlockId mine,
                     int priority, CachePath* path, const TraceContext& ctx);
  // Publishes `block` (the caller's, ACTIVE) holding `tokens` below (`root`, `at`), locked once
  // by the committing sequence.
  void Insert(NodeIndex root, BlockId at, std::span<const int32_t> tokens, BlockId block,
              int priority, const TraceContext& ctx);
  // The cache's side of a published block: its state, locked once, and its pool reference.
  void Fill(BlockId block, int priority, uint16_t share, const TraceContext& ctx);
  // The share `ns`'s blocks are published into (0 with shares off).
  uint16_t ShareFor(NamespaceId ns) const {
    if (!shares_on_) return 0;
    auto it = share_of_ns_.find(ns);
    return it == share_of_ns_.end() ? 0 : it->second;
  }
  // The policy ordering `block` (its share's).
  EvictionPolicy& PolicyOf(BlockId block) const {
    return shares_on_ ? *shares_[entry(block).share].policy : *policy_;
  }
  // A block became, or stopped being, evictable: its share's count (with shares on).
  void CountEvictable(BlockId block, int64_t delta) {
    if (shares_on_) shares_[entry(block).share].evictable += delta;
  }
  // Publishes the full blocks `tokens` held in `table` as a run below (`root`, `at`), which has
  // no child, extending `path`, up to the first block the tree already holds. Returns how many.
  size_t AppendChain(NodeIndex root, BlockId at, std::span<const int32_t> tokens,
                     std::span<const BlockId> table, int priority, CachePath* path,
                     const TraceContext& ctx);
  // A block's class is at least its descendants' (the policy's leaf-first promise): raises
  // `block` and its ancestors to `priority`. They are locked by the committing sequence, so none
  // is in the policy's lists.
  void RaiseAncestors(BlockId block, int priority);
  // Extends partial `block` (the sequence's own) to `tokens`; one reaching a full block is
  // named and announced.
  void Widen(BlockId block, std::span<const int32_t> tokens);
  void MakeFull(BlockId block);
  // first_blocks_ upkeep: `block`, a full first block, was made (MakeFull, AppendChain) or is
  // being removed (Remove).
  void IndexFirstBlock(BlockId block);
  void UnindexFirstBlock(BlockId block);
  // Whether a namespace other than `ns` holds a full first block of exactly `block`.
  bool FirstBlockElsewhere(NamespaceId ns, std::span<const int32_t> block) const;
  // first_blocks_ holds exactly the full first blocks, each under its tokens' hash.
  absl::Status CheckFirstBlocks() const;
  // Removes unused partial siblings of `block` that it covers.
  void RemoveDominated(BlockId block, const TraceContext& ctx);
  // Removes an unlocked leaf and returns its cache reference. `offer_parent`: re-evaluate the
  // block it hung below, which may have become a candidate; false only when the caller removes
  // that block next (an evicted run), so it is never added to the policy just to be taken out.
  void Remove(BlockId block, const TraceContext& ctx, bool offer_parent = true);
  // Remove()'s last step: returns the block's cache reference. Defined inline in
  // prefix_cache_evict.cc (its callers: Remove and TrimRun).
  void Release(BlockId block, const TraceContext& ctx);
  // Evict() of victims[0] and the victims after it that are the blocks before it in its run, as
  // long as nothing is recorded per block and the next victim is the block's parent: the run
  // shrinks by that many at once. Returns how many (0 when victims[0] does not qualify).
  size_t TrimRun(std::span<const BlockId> victims, const TraceContext& ctx);
  // Lock() for a block a sequence reuses: also counts the hit and tells the policy.
  void LockHit(BlockId block);
  // Re-evaluates a block after its locks or its references changed. Defined inline in
  // prefix_cache.cc, whose functions are its only callers besides OnBlockRefsChanged.
  void UpdateEvictable(BlockId block);
  bool ShouldBeEvictable(BlockId block) const {
    return entry(block).lock == 0 && pool_->state(block) == BlockState::kCached;
  }
  // Puts `block` into, or takes it out of, the candidates (policy or first-out tails) as it is
  // or is not an evictable leaf.
  void UpdateCandidate(BlockId block);
  bool IsFirstOutTail(BlockId block) const {
    return (tree_.coverage(block) < block_size_ && !retain_partial_tails_ &&
            entry(block).retain == 0) ||
           Unresumable(block);
  }
  bool Unresumable(BlockId block) const { return unresumable_first_ && entry(block).resume == 0; }
  void TailPush(BlockId block);
  void TailRemove(BlockId block);
  void UpdatePinCharge(BlockId block);
  // The policy's Rank() of an evictable block, computed here when the policy ranks by release.
  EvictionRank RankOf(BlockId block) const {
    if (ranks_by_release_) {
      return EvictionRank{.priority = entry(block).priority, .order = entry(block).release_seq};
    }
    return PolicyOf(block).Rank(Key(block), Facts(block), now_ns_);
  }
  NodeFacts Facts(BlockId block) const {
    const Entry& s = entry(block);
    return NodeFacts{.fingerprint = hashes_on_ ? BlockFingerprint(hash_[Index(block)]) : 0,
                     .depth = tree_.depth(block),
                     .hits = s.hits,
                     .priority = s.priority,
                     .released_ns = s.released_ns,
                     .release_seq = s.release_seq};
  }
  BlockHash HashOf(BlockId block) const {
    return block == kInvalidBlock || !hashes_on_ ? BlockHash{} : hash_[Index(block)];
  }
  absl::Status CheckBlock(BlockId block, const absl::flat_hash_map<BlockId, uint32_t>* pins,
                          absl::flat_hash_map<NamespaceId, int64_t>* pin_held) const;
  absl::Status CheckCounts(int64_t blocks, int64_t full, int64_t evictable, int64_t pinned,
                           const absl::flat_hash_map<NamespaceId, int64_t>& pin_held) const;
  // Each share's count of evictable blocks (`evictable`, by share) and its policy's books; the
  // policies together hold the `in_policies` blocks marked in_policy.
  absl::Status CheckShares(int64_t in_policies, std::span<const int64_t> evictable) const;
  void Announce(std::span<const BlockId> chain);  // BlockStored for a chain, parents first
  // A full block leaves: events, Explain memory (with whether it was below the admission bar).
  void Forget(BlockId block, bool below_bar);
  void FlushRemoved();
  // A Stored event naming `chain` (full blocks, each the parent of the next), seq not set yet.
  KvEvent StoredEvent(std::span<const BlockId> chain,
                      const std::optional<KvEventGroup>& group) const;

  const int32_t block_size_;
  const size_t evicted_memory_;
  const bool retain_partial_tails_;
  bool unresumable_first_ = false;  // EvictUnresumableFirst
  const bool events_on_;
  const std::optional<KvEventGroup> event_group_;
  bool clearing_ = false;  // Clear() runs: components' removals are not announced
  const bool journal_on_;
  // Chained hashes are computed: events, the evicted-hash memory or the policy need them. Off,
  // hash_ stays empty and the fingerprints zero.
  const bool hashes_on_;
  BlockPool* const pool_;
  // Makes a policy for a share (PrefixCacheOptions::policy or policy_factory).
  const std::function<std::unique_ptr<EvictionPolicy>()> make_policy_;
  const int32_t max_shares_;
  const bool shares_on_;  // max_shares > 0
  const int64_t share_block_bytes_;
  std::vector<ShareSlot> shares_;                           // [0] the default share; never shrinks
  absl::flat_hash_map<NamespaceId, uint16_t> share_of_ns_;  // SetShare's, by namespace
  EvictionPolicy* const policy_;                            // shares_[0].policy
  const bool ranks_by_release_;  // policy_->ranks_by_release() (every share's policy alike)
  const bool hears_accesses_;    // policy_->hears_accesses()
  // Nothing is recorded per evicted block (no events, no policy hearing erasures, no memory of
  // evicted hashes): Evict() trims a run's inner blocks without Remove().
  const bool lean_evictions_;
  EventLog events_;
  std::function<void(BlockId, const TraceContext&)> on_remove_;  // SetOnRemove
  std::function<void(BlockId)> on_widen_;                        // SetOnWiden
  int64_t now_ns_ = 0;
  uint64_t release_counter_ = 0;

  internal::RunTree tree_;
  std::vector<Entry> entries_;      // by BlockId
  std::vector<BlockHash> hash_;     // by BlockId: full blocks' chained hashes, when hashes_on_
  std::vector<BlockId> tail_prev_;  // first-out tails: a FIFO threaded through the blocks
  std::vector<BlockId> tail_next_;

  // Recently evicted full blocks, for Explain().
  std::vector<BlockHash> evicted_ring_;
  size_t evicted_next_ = 0;
  // The hashes of evicted_ring_, each with whether the policy had it below its admission bar.
  absl::flat_hash_map<BlockHash, bool> evicted_set_;
  // The full first blocks of every namespace, by HashTokens of their tokens, each with its block:
  // tells a miss whose first block another namespace holds (ExplainStop) without a match per
  // namespace. Only ever counted: a match never leaves its namespace.
  absl::btree_set<std::pair<uint64_t, BlockId>> first_blocks_;

  std::vector<BlockHash> pending_removed_;  // batched into one BlockRemoved per call
  std::vector<PublishedBlock> published_;   // the journal, when on
  NamespaceId pending_removed_ns_;

  EvictionPlanner planner_;  // PlanEviction's, with its scratch

  BlockId tails_head_ = kInvalidBlock;
  BlockId tails_tail_ = kInvalidBlock;
  int64_t num_tails_ = 0;
  absl::flat_hash_map<NamespaceId, int64_t> pin_held_;  // CACHED pinned blocks by namespace
  // SetTally's: namespaces filed under a tally (> 0), and tally -> their pin_held_ summed.
  absl::flat_hash_map<NamespaceId, uint32_t> tally_of_;
  std::vector<int64_t> pin_held_by_tally_;

  int64_t num_blocks_ = 0;  // cached blocks
  int64_t num_full_ = 0;
  int64_t num_evictable_ = 0;
  int64_t pinned_blocks_ = 0;
  PrefixCacheStats counters_;
};

}  // namespace kvpool
