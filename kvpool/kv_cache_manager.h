#pragma once

// KvCacheManager: sequences (block tables) over a BlockPool, owned by sessions, grouped into
// namespaces, with quotas. It decides and returns DevicePlans (blocks to copy and fill); the
// caller carries them out. It never touches KV memory.
//
// Contracts every mutating call keeps (DESIGN.md §4):
//  - Fail clean: every precondition (arguments, existence, ownership, table bound, quotas, free
//    blocks) is checked before anything changes. On error the state is exactly as before, except
//    for housekeeping any call may do first: RETIRING blocks whose fences have passed may have
//    been reclaimed, and pins whose time is up released (ExpirePins). RESOURCE_EXHAUSTED carries
//    the shortfall (kvpool/util/errors.h).
//  - Grow by delta: a sequence of n tokens owns exactly ceil(n / block_size) blocks, never more
//    than max_blocks_per_seq; growing to a size it already has is a no-op.
//  - Copy-on-write: a sequence only writes into a block no other sequence holds, and never below
//    the tokens the prefix cache has published from it. Growing into such a block (after a
//    Truncate into a block a fork shares, or after adopting a partially matched cached block)
//    first moves the sequence onto a private copy, returned as a BlockCopy. Fork copies the
//    parent's partial last block the same way at once, since both will write to it.
//  - Prefix cache (DESIGN.md §5): Allocate with a prompt adopts the longest cached prefix in its
//    namespace; Commit publishes a sequence's blocks; cached blocks nobody holds are evicted,
//    leaves only, in the order the eviction policy gives (KvCacheOptions::eviction_policy,
//    docs/eviction.md), when a call needs their space. Evictions a call needs are planned during
//    its checks and only carried out once it cannot fail.
//  - Pins (retention hints): a session may pin a cached prefix, or what one of its sequences
//    published, for a bounded time and with a priority class. A pinned block is never evicted
//    while the pin lasts; pins expire on their own by the injected Clock (checked at the start of
//    every mutating call, or by ExpirePins()), end with Unpin or when their session is freed, and
//    are listed by ListPins. A pin that cannot be honoured is refused whole.
//
// Quotas: a namespace quota bounds the ACTIVE blocks the namespace owns plus the CACHED blocks
// only its pins hold (physical blocks; shared ones count once). With KvCacheOptions::block_bytes
// it bounds bytes: a quota of N blocks is N blocks' bytes, and the namespace's ACTIVE window-group
// blocks and its live sequences' state slots are charged their own bytes beside its blocks
// (cached ones, checkpoints included, are evictable and charged to no one, as cached blocks).
// Namespaces may share one quota
// (a quota group, e.g. every model of one tenant): then the bound is on their sum. A quota's use
// is a running total kept as blocks change hands, so checking it costs O(1) however many
// namespaces share it (each cache salt is a namespace: a group may have tens of thousands).
// A session quota bounds the block references its sequences hold (table entries; a block two of its
// sequences share counts twice). Sequences per session are bounded too, zero-token ones included
// (they cost no block, so no quota would stop them).
//
// Namespace slots (BlockPool): when the pool's table is full, an Allocate that needs a new
// namespace first recycles every idle one (no block owned, no live sequence in it), once it is
// sure the call succeeds. Quotas are kept by namespace id, so a recycled namespace keeps its
// quota when it comes back.
//
// Thread-compatible: the owner serializes calls. Pointers and spans returned by accessors are
// valid until the next mutating call.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/block_pool.h"
#include "kvpool/internal/greedy_dual.h"
#include "kvpool/internal/stamped_lru.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/strong_id.h"

namespace kvpool {

inline constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

// A retention pin (KvCacheManager::PinPrefix). Assigned by the manager, never reused.
using PinId = StrongId<struct PinIdTag, uint64_t>;

// Copy every byte of block `src` into block `dst` (copy-on-write, tier moves).
struct BlockCopy {
  BlockId src;
  BlockId dst;

  friend bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

// A state checkpoint a step is to take (KvCacheManager::PlanCheckpoints): the state after the
// sequence's first `position` tokens, written into state slot `slot`.
struct PlannedCheckpoint {
  int64_t position = 0;
  BlockId slot = kInvalidBlock;
  // Filled from outside (a lower tier, ImportCheckpoint), not by the sequence's steps: it goes
  // into the tree at Commit wherever the sequence's path reaches, whatever its state holds.
  bool imported = false;
  // A decode's checkpoint at the last block boundary it reached (PlanCheckpoints): one per
  // sequence, moved on (its slot rewritten) at each boundary, kept only when the sequence ends.
  bool rolling = false;

  friend bool operator==(const PlannedCheckpoint&, const PlannedCheckpoint&) = default;
};

// Why a state checkpoint was taken (KvCacheOptions::kByExpectedTokensSaved weighs each kind by
// how often the workload resumes from it). A checkpoint once resumed from is kResumed.
enum class CheckpointKind : uint8_t {
  kInterval,     // on the checkpoint interval
  kBranch,       // where a prompt left the cached prefix
  kPrefillEnd,   // a prefill's last block boundary
  kSequenceEnd,  // a committed sequence's end (its working state)
  kRolling,      // a decode's rolling checkpoint, kept at its sequence's end
  kImported,     // from a lower tier (ImportCheckpoint)
  kResumed,      // resumed from at least once since it was kept
};
inline constexpr int kNumCheckpointKinds = 7;
std::string_view CheckpointKindName(CheckpointKind kind);

// How often cached checkpoints of one kind are resumed from (KvCacheManager::
// CheckpointKindRates): counts decayed by half every so many keeps, so the rates follow the
// workload. A resume is counted for a checkpoint evicted before it too (its "ghost", while its
// tree block stays cached): a kind evicted early would otherwise look unused because it was
// evicted.
struct CheckpointKindRate {
  // The weight is the rate in 1/256ths, in [1/256, 64]: a kind never resumed from still orders
  // its checkpoints by the tokens they save, and one resumed from many times a keep cannot make
  // the priorities outgrow the order's rebase.
  static constexpr uint32_t kOne = 256;
  static constexpr double kMaxRate = 64;

  double kept = 0;     // kept into the tree (decayed)
  double resumed = 0;  // resumed from, or passed by a prompt while evicted (decayed)

  // (resumed + 1) / (kept + 1): 1 with nothing counted.
  double rate() const { return std::clamp((resumed + 1) / (kept + 1), 1.0 / kOne, kMaxRate); }
  // The eviction order's weight, kOne = 1.
  uint32_t weight() const { return static_cast<uint32_t>(rate() * kOne); }
};

// A state checkpoint kept at the end of a full cached block (TakePublishedCheckpoints): the
// block as a lower tier keys it, and the state slot holding the checkpoint.
struct PublishedCheckpoint {
  PublishedBlock block;
  BlockId slot = kInvalidBlock;
};

// A window-group block kept beside a full cached block (TakePublishedWindowBlocks): the block as a
// lower tier keys it, and the window block holding its tokens for the window layers.
struct PublishedWindowBlock {
  PublishedBlock block;
  BlockId window = kInvalidBlock;
};

// Device work a call requires before the sequences it changed may be written or read. The caller
// enqueues it in order (copies first; fills touch other blocks) and marks the blocks it touches
// in flight before the next call, so no source can be reused under a pending copy.
struct DevicePlan {
  std::vector<BlockCopy> copies;
  std::vector<BlockFill> fills;  // freshly handed-out blocks (not copy targets)
  // The same for the state group's slots (KvCacheOptions::state_slots): a forked sequence's
  // state copied from its parent's, and a new sequence's state zeroed (the state of no tokens,
  // whatever the fill policy).
  std::vector<BlockCopy> state_copies;
  std::vector<BlockId> state_zeros;
  // The same for the window group's blocks (KvCacheOptions::window_blocks): copy-on-write and
  // fork copies, and fresh blocks under the same fill policy as `fills`.
  std::vector<BlockCopy> window_copies;
  std::vector<BlockFill> window_fills;

  bool empty() const {
    return copies.empty() && fills.empty() && state_copies.empty() && state_zeros.empty() &&
           window_copies.empty() && window_fills.empty();
  }
};

struct KvCacheOptions {
  int32_t block_size = 16;             // tokens per block; > 0
  int32_t num_blocks = 0;              // blocks in the pool; > 0
  int32_t max_blocks_per_seq = 0;      // bound on every block table; > 0
  int32_t trace_depth = 8;             // operations remembered per block: 0 (off) or a power of 2
  double residency_sample = 0;         // BlockPoolOptions::residency_sample: share followed
  uint64_t residency_seed = 0;         // its picks' seed
  const Clock* clock = Clock::Real();  // not owned; outlives the manager
  const FenceObserver* fences = nullptr;  // not owned; see BlockPoolOptions
  bool prefix_cache = true;               // share prefixes; off: Commit only records tokens
  // Eviction spec (ParseEvictionSpec): "lru", "reuse", "+admit", "+notail", "default".
  std::string eviction_policy = std::string(kDefaultEvictionSpec);
  int64_t eviction_history_blocks = 0;  // hashes the policies remember; 0: 4 per pool block
  // When set, makes the eviction ordering policy instead of the spec (tests inject theirs).
  std::function<std::unique_ptr<EvictionPolicy>()> eviction_policy_factory;
  // Eviction shares SetEvictionShare() may create besides the default one (fair eviction by
  // tenant, docs/eviction.md); 0: one share, no fairness. In [0, 65534].
  int32_t eviction_shares = 0;
  uint64_t epoch = 0;             // stamped on every cache event (daemon start)
  size_t event_capacity = 65536;  // cache events kept for replay; > 0
  bool cache_events = true;       // record cache events at all (PrefixCacheOptions::events)
  bool publish_journal = false;   // journal newly cached full blocks (TakePublished)
  size_t evicted_memory = 65536;  // evicted block hashes kept for ExplainMatch (0: none)
  // Bytes those events may take (each event's struct plus its hash and token vectors); the
  // oldest are dropped past it, as past event_capacity. > 0.
  size_t event_capacity_bytes = kDefaultEventLogBytes;
  // Live sequences one session may hold, zero-token ones included; 0: unlimited.
  int64_t max_sequences_per_session = 0;
  // Namespaces registered at once, in [1, kMaxNamespaceSlots] (BlockPoolOptions); idle ones are
  // recycled when the table is full. Smaller only in tests.
  int32_t max_namespaces = kMaxNamespaceSlots;
  // Pins: at most this many at once (all sessions); each for at most max_pin_ttl_ns; at most
  // max_pinned_blocks distinct blocks pinned at once (0: half the pool).
  int32_t max_pins = 4096;
  int64_t max_pin_ttl_ns = 3'600'000'000'000;  // one hour
  int64_t max_pinned_blocks = 0;
  // The state group (docs/hybrid-groups.md §3), for models with state-space layers: this many
  // slots, one per live sequence (its working state), handed out by Allocate and Fork and
  // released, fenced like a block, by Free, and the state checkpoints below. 0: no state group.
  // With one, a prompt resumes a cached prefix only where the tree keeps a checkpoint of the state
  // (the tokens the attention match found past it count as missed_no_checkpoint), and Truncate
  // never rewinds below the sequence's known tokens.
  int32_t state_slots = 0;
  // Of state_slots, how many may hold state checkpoints (docs/hybrid-groups.md §4): copies of a
  // sequence's state at exact token positions, kept beside the tree's blocks so that a prompt
  // resumes from the deepest one its match reaches. A new sequence's working slot may evict
  // cached checkpoints (in checkpoint_eviction's order), never the other way round. 0: none (a
  // prompt then resumes no cached prefix). In [0, state_slots).
  int32_t checkpoint_slots = 0;
  // Checkpoints are taken every this many blocks, on block boundaries (0: none by interval), at
  // branch points (where a prompt left the cached prefix), at a prefill's last block boundary,
  // and at the end of a sequence freed with OnFree::kCommit (its working state itself). >= 0.
  // DefaultCheckpointInterval() is the spacing a deployment should start from.
  int32_t checkpoint_interval = 4;
  // The order cached checkpoints are evicted in when a new one or a working state needs a slot.
  // kByTokensSaved (GreedyDual-Size, internal::GreedyDualOrder): a checkpoint is worth the tokens
  // a prompt resuming from it does not compute that it would without it (those between it and
  // the next cached checkpoint up its path, or all before it), as of its last keep or use, and
  // ages as others are evicted: one far past the last checkpoint outlives one close behind
  // another, used as recently. kByExpectedTokensSaved: the same, with those tokens weighed by
  // how often checkpoints of its kind (CheckpointKind: taken on the interval, at a branch point,
  // at a prefill's last boundary, at a sequence's end, ...) are resumed from, measured as the
  // pool runs (CheckpointKindRates): a kind the workload never comes back to (a prompt's end,
  // when no prompt extends another) gives way before a kind it does, however deep. With nothing
  // measured yet every kind weighs 1, the kByTokensSaved order. kLeastRecentlyUsed: by last use
  // alone.
  enum class CheckpointEviction : uint8_t {
    kByTokensSaved,
    kLeastRecentlyUsed,
    kByExpectedTokensSaved
  };
  CheckpointEviction checkpoint_eviction = CheckpointEviction::kByExpectedTokensSaved;
  // With checkpoint_slots: the prefix cache evicts first the blocks no prompt can resume at or
  // beyond (a leaf without a checkpoint, PrefixCache::EvictUnresumableFirst), before any block
  // its eviction policy orders. A prompt's match is cut at the deepest checkpoint it reaches, so
  // the K/V past a path's last checkpoint is never reused: a prompt that follows it computes it
  // again. false: the policy orders them with the rest (a lower tier's checkpoint may make them
  // worth keeping; docs/hybrid-groups.md §4).
  bool evict_unresumable_first = true;
  // The sliding-window group (docs/hybrid-groups.md §3), for models with sliding-window attention
  // layers: its own pool of this many blocks, of block_size tokens each (its bytes per block are
  // its own), one entry per entry of every block table (Sequence::window_table). A sequence
  // keeps only the entries its window still reads (SlideWindow releases the rest, fenced) plus
  // its sinks; the tree keeps the window blocks of published blocks while they are live, and a
  // prompt resumes only where the window group still holds its last window_tokens tokens. 0: no
  // window group (everything as without one). >= 0.
  int32_t window_blocks = 0;
  // W: a query at position p reads keys [p - W + 1, p] (plus the sinks). > 0 with a window group.
  int32_t window_tokens = 0;
  // S: the first S tokens every query also reads (attention sinks); their blocks are never
  // released while the sequence lives. >= 0.
  int32_t sink_tokens = 0;
  // What a namespace quota charges (docs/hybrid-groups.md §4): the bytes of one block (every
  // full-attention layer), of one window-group block and of one state slot. With block_bytes > 0
  // a quota of N blocks bounds N * block_bytes bytes, of which each ACTIVE window block and each
  // live sequence's state slot takes its own bytes. 0: quotas count blocks only (the other groups
  // are not charged). >= 0; window_block_bytes and state_bytes only with block_bytes.
  int64_t block_bytes = 0;
  int64_t window_block_bytes = 0;
  int64_t state_bytes = 0;
};

// The checkpoint interval, in blocks, at which a cached prefix's checkpoints take as many bytes as
// its K/V (docs/hybrid-groups.md §4): ceil(state_bytes / block_bytes), at least 1, where
// `state_bytes` is one checkpoint (a sequence's state in every state-space layer) and
// `block_bytes` one block of K/V (every attention layer). Denser, checkpoints crowd out the K/V
// they are meant to resume (and one another, in their eviction order); sparser, a prompt that
// shares a prefix with a single earlier one resumes far before the end of the prefix. 0 when either
// is <= 0 (no state group).
int32_t BreakEvenCheckpointInterval(int64_t state_bytes, int64_t block_bytes);

// The interval kvpoold and kvpool-replay take by default: three times the break-even one, where a
// cached prefix's checkpoints take a third of the bytes of its K/V (and a quarter of the memory
// the two share). Replayed on both Mooncake traces for Bamba-9B, Nemotron-H-8B, tiny-hybrid and
// Falcon-H1-0.5B at 1k/2k/5k blocks with checkpoints weighed by kind (kByExpectedTokensSaved), it
// beat twice the break-even interval at a third in 23 of 24 cells, by up to 12 % (6 % on
// geometric mean), and lost 0.2 % in the other (docs/hybrid-groups.md §4).
// Saturates at INT32_MAX; 0 as BreakEvenCheckpointInterval.
int32_t DefaultCheckpointInterval(int64_t state_bytes, int64_t block_bytes);

// The checkpoint eviction order a config or flag names: "expected_tokens_saved",
// "tokens_saved" or "lru"; nullopt for anything else.
std::optional<KvCacheOptions::CheckpointEviction> ParseCheckpointEviction(std::string_view name);

// The first block a sliding window of `window_tokens` reads, past its sinks, for a query at
// position `tokens` (the one holding token tokens - W + 1), with blocks of `block_size` tokens.
inline int64_t WindowStartBlock(int64_t tokens, int64_t window_tokens, int64_t block_size) {
  return std::max<int64_t>(0, tokens - window_tokens + 1) / block_size;
}

struct Sequence {
  SequenceId id;
  SessionId session;
  NamespaceId ns;
  NamespaceSlot slot;
  int64_t num_tokens = 0;
  std::vector<BlockId> table;  // token t lives in table[t / block_size], slot t % block_size
  // With a window group: the window group's block holding the same tokens as table[i], or
  // kInvalidBlock once released (left the window). No longer than `table`: entries past its end
  // are not allocated yet (AllocateRequest::window_ahead, ExtendWindow). The sinks' entries
  // first, then the released ones (if any), then live ones up to the end.
  std::vector<BlockId> window_table;
  NamespaceSlot window_slot;  // its namespace's slot in the window group's pool
  // Its window entries past its match were filled from outside (ImportWindow): each holds the
  // window of exactly the tokens its prompt names there, so Commit keeps it beside the tree's
  // block for them even where that block is not its own (the tree had them already).
  bool window_imported = false;
  std::vector<int32_t> tokens;         // the token ids known so far (<= num_tokens of them)
  int priority = 0;                    // prefix-cache priority class of what it publishes
  bool retain_tail = false;            // keep its partial tail in the cache after it ends
  CachePath path;                      // its place in the prefix tree (locked nodes)
  BlockId state_slot = kInvalidBlock;  // its slot in the state group (kInvalidBlock: none)
  // Tokens its working state has consumed (AdvanceState; the checkpoint it resumed from); -1:
  // unknown (a rewind below it), and then no checkpoint is taken from it.
  int64_t state_tokens = 0;
  // Its working state holds tokens it no longer has (LoseState: a step that moved it was taken
  // back): no step may start from it until a Truncate restores it (state_tokens is -1).
  bool state_lost = false;
  int64_t branch_at = 0;  // where its prompt left the cached prefix: a checkpoint is wanted there
  // Checkpoints planned for its steps and not yet in the tree (each holds its slot).
  std::vector<PlannedCheckpoint> checkpoints;
  BlockId resumed_from = kInvalidBlock;  // the cached checkpoint its state was copied from (held)
  uint64_t batch_mark = 0;               // KvCacheManager's scratch: finds a sequence listed twice
};

struct AllocateRequest {
  NamespaceId ns;                   // != kNoNamespace
  int64_t num_tokens = 0;           // >= prompt.size(): room for the prompt and what follows
  std::span<const int32_t> prompt;  // matched against the prefix cache; may be empty
  int priority = 0;                 // in [0, kNumPriorities): cache class of its blocks
  // Keep the partial last block it publishes once it ends, even under a "+notail" policy (a
  // rewind endpoint the client will come back to).
  bool retain_tail = false;
  // With a window group: window blocks only for the first matched_tokens + window_ahead tokens
  // (what the first step computes; ExtendWindow adds the rest step by step, so that a long
  // prefill in chunks never holds more than about its chunk plus a window of them). -1: for
  // all num_tokens. Ignored without a window group.
  int64_t window_ahead = -1;
  // With a window or state group: adopt the whole attention match, not cut where a window block
  // or a checkpoint is missing (a tier loader, which imports those itself: ImportWindow,
  // ImportCheckpoint). Its window table starts empty and its state from nothing (state_tokens
  // -1); it is not to be stepped. Ignored without either group.
  bool adopt_uncut = false;
};

struct AllocateResult {
  SequenceId sequence;
  // Leading prompt tokens whose KV is already in the sequence's blocks (a prefix hit). The
  // caller computes tokens [matched_tokens, prompt.size()).
  int64_t matched_tokens = 0;
};

// What Free does with the sequence's tokens first.
enum class OnFree : uint8_t {
  kDiscard,  // release only
  kCommit,   // publish every known token into the prefix cache, then release
};

struct GrowRequest {
  SequenceId sequence;
  int64_t num_tokens = 0;  // the new length; <= the current length is a no-op
  // With a window group: window blocks only up to the current length + window_ahead tokens
  // (AllocateRequest::window_ahead); -1: up to num_tokens.
  int64_t window_ahead = -1;
};

// What a Grow did to one sequence's table (GrowBatch reports one per request, in order): which
// entries a client must re-read, and enough to revert the grow (RevertGrow).
struct TableChange {
  SequenceId sequence;
  int64_t old_num_tokens = 0;
  // Entries before this one are as they were; from it on the table is new: appended blocks and,
  // after a copy-on-write, the private copy now at `first_changed`. The table's size when the
  // grow changed nothing.
  int32_t first_changed = 0;
  BlockId replaced = kInvalidBlock;  // copy-on-write: the block entry `first_changed` held before
  // The same for window_table (the window group decides its copy-on-write on its own: either
  // group's copy makes `first_changed` that entry).
  BlockId window_replaced = kInvalidBlock;
  // window_table's size before the grow: where it stopped short of the old length, the entries
  // from here on may be new too (AllocateRequest::window_ahead).
  int32_t window_entries = 0;
};

// A pin as ListPins reports it.
struct PinInfo {
  PinId id;
  SessionId session;  // the owner
  NamespaceId ns;
  SequenceId sequence{0};  // the sequence whose published blocks it pins; 0 for a prefix pin
  int priority = 0;        // class the pinned blocks were raised to
  int64_t tokens = 0;      // tokens pinned (the prefix length)
  int64_t blocks = 0;      // cached blocks it holds
  int64_t created_ns = 0;  // Clock reading when made (or last renewed)
  int64_t expires_ns = 0;  // Clock reading at which it ends by itself

  friend bool operator==(const PinInfo&, const PinInfo&) = default;
};

// What one session holds in a KvCacheManager (KvCacheManager::HoldingsOf): its live sequences and
// its pins, and how many of each are in every namespace it holds one in. The manager files each
// sequence and pin here as it is made (Allocate, Fork; PinPrefix, PinSequence) and unfiles it as
// it ends (Free, FreeSession; Unpin, expiry), so that what one session holds is found in O(1) and
// listed in the time of its own holdings, never of the pool's. A session's entry stays, emptied
// or not, until FreeSession (as its quota does): one that takes and frees a sequence at a time
// allocates nothing for it.
struct SessionHoldings {
  struct InNamespace {
    int64_t sequences = 0;  // live sequences
    int64_t pins = 0;       // pins, those whose time is up but that no call has expired included

    friend bool operator==(const InNamespace&, const InNamespace&) = default;
  };
  absl::flat_hash_set<SequenceId> sequences;  // its live sequences (unordered)
  absl::flat_hash_set<PinId> pins;            // its pins (unordered; as InNamespace::pins)
  // Each namespace it holds a sequence or a pin in; none holds zero of both.
  absl::flat_hash_map<NamespaceId, InNamespace> namespaces;

  bool empty() const { return sequences.empty() && pins.empty(); }
  friend bool operator==(const SessionHoldings&, const SessionHoldings&) = default;
};

struct KvCacheStats {
  BlockPoolStats pool;
  int64_t sequences = 0;  // live sequences
  int64_t sessions = 0;   // sessions holding at least one sequence
  // Counters since creation (calls, successful or not).
  uint64_t allocate_calls = 0;
  uint64_t grow_calls = 0;
  uint64_t truncate_calls = 0;
  uint64_t fork_calls = 0;
  uint64_t free_calls = 0;
  uint64_t commit_calls = 0;
  uint64_t cow_copies = 0;     // copy-on-write block copies planned
  uint64_t exhausted = 0;      // calls refused with RESOURCE_EXHAUSTED
  uint64_t prompt_tokens = 0;  // prompt tokens looked up by Allocate
  uint64_t hit_tokens = 0;     // of which found in the prefix cache
  // The others (prompt_tokens - hit_tokens), by why the match stopped where it did
  // (PrefixCache::ExplainStop at plan time):
  uint64_t missed_not_cached = 0;  // nothing cached there (no namespace tree, no child, diverged)
  uint64_t missed_evicted = 0;     // the next full block was cached and has been evicted
  // nothing cached here, but another namespace holds the prompt's first block
  uint64_t missed_another_namespace = 0;
  // ... evicted while below the admission bar (AdmissionFilter probation): never admitted
  uint64_t missed_below_admission_bar = 0;
  uint64_t missed_coverage = 0;  // a cached block agrees but covers too few of the tokens
  // cached for full attention, but the state group has no checkpoint there (hybrid models)
  uint64_t missed_no_checkpoint = 0;
  // cached for full attention, but a window block the resumed window needs is gone (evicted, or
  // released before it was published)
  uint64_t missed_window_evicted = 0;
  uint64_t evictions = 0;     // cached blocks evicted to make room (or on request)
  int64_t pins = 0;           // live pins
  int64_t pinned_blocks = 0;  // distinct blocks they hold
  uint64_t pins_made = 0;     // successful PinPrefix/PinSequence calls
  uint64_t pins_expired = 0;  // pins that ran out of time
  PrefixCacheStats cache;
  BlockPoolStats states;  // the state group's slots (num_blocks 0 without one)
  struct Checkpoints {
    int64_t cached = 0;      // in the tree now
    int64_t pending = 0;     // planned for steps, not yet in the tree
    uint64_t planned = 0;    // PlanCheckpoints handed out a slot
    uint64_t kept = 0;       // put into the tree (the end of a committed sequence included)
    uint64_t redundant = 0;  // not kept: the tree had one as deep in that block already
    uint64_t skipped = 0;    // wanted, but no slot could be spared
    uint64_t rolled = 0;     // a decode's rolling checkpoint moved on to its next block boundary
    uint64_t evicted = 0;    // cached ones dropped (for room, or with their block)
    uint64_t resumed = 0;    // sequences whose state started from one
    // By CheckpointKind: resumes per checkpoint kept, decayed (CheckpointKindRate::weight() /
    // kOne), what kByExpectedTokensSaved weighs each kind's tokens by; 0 without checkpoint slots.
    std::array<double, kNumCheckpointKinds> resume_rate{};
  } checkpoints;
  // Of evictions, those an admin asked for (EvictCached, ClearCache).
  uint64_t admin_evictions = 0;
  BlockPoolStats window;  // the window group's blocks (num_blocks 0 without one)
  struct Windows {
    int64_t cached = 0;     // window blocks the tree keeps now (beside their primary blocks)
    uint64_t kept = 0;      // put into the tree by Commit / Free(kCommit)
    uint64_t evicted = 0;   // dropped from the tree (window pressure, or with their block)
    uint64_t released = 0;  // table entries released by SlideWindow (they left the window)
  } windows;
};

class KvCacheManager final {
 public:
  // Errors: INVALID_ARGUMENT for a non-positive block_size, num_blocks, max_blocks_per_seq or
  // event_capacity_bytes, a trace_depth that is not 0 or a power of 2, a negative
  // max_sequences_per_session, max_namespaces out of range, or a null clock; a negative
  // window_blocks or sink_tokens, or a window group without window_tokens > 0 (each message
  // names the field).
  static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(const KvCacheOptions& options);

  // Bounds the blocks namespace `ns` may hold (ACTIVE plus pin-held CACHED, see Quotas above; with
  // KvCacheOptions::block_bytes, `max_blocks` blocks' bytes, its other groups' included).
  // With `group` 0 the bound is the namespace's own. Otherwise `ns` joins quota group `group`
  // (leaving any quota it had) and the bound is on the sum over the group's namespaces: it
  // becomes the group's bound for all of them (the last one set wins). kUnlimited lifts `ns`'s
  // quota: it leaves its group, whose other namespaces keep theirs. A quota below the current
  // use refuses further growth; it takes nothing away. Nothing is registered in the pool.
  // O(1) amortized, whatever the size of the groups `ns` leaves and joins.
  // Errors: INVALID_ARGUMENT (negative quota, ns 0); nothing has changed.
  absl::Status SetNamespaceQuota(NamespaceId ns, int64_t max_blocks, uint64_t group = 0);
  // Bounds the block references session `session`'s sequences may hold (kUnlimited to lift it).
  // With `group` != 0 the session also joins reference group `group` (once, at its first call
  // with a group; it stays there until FreeSession), whose members' references are bounded
  // together by SetRefGroupQuota: a sequence's known tokens never outnumber its references times
  // block_size, so this bounds what a set of sessions (a peer uid's) can make the manager hold,
  // forks and shared prefixes included. Errors: INVALID_ARGUMENT (negative quota, another group
  // than the session's); nothing has changed.
  absl::Status SetSessionQuota(SessionId session, int64_t max_block_refs, uint64_t group = 0);
  // Bounds the block references of reference group `group`'s sessions together (kUnlimited to
  // lift it). A quota below the current use refuses further references; it takes nothing away.
  // The group is forgotten, quota included, when its last session is freed.
  // Errors: INVALID_ARGUMENT (negative quota, group 0).
  absl::Status SetRefGroupQuota(uint64_t group, int64_t max_block_refs);
  // With a state group: bounds the state slots (one per live sequence) reference group
  // `group`'s sessions hold together (kUnlimited to lift it), so that one peer cannot take every
  // slot with sequences that hold no block. A no-op without a state group. Forgotten with the
  // group. Errors: INVALID_ARGUMENT (negative bound, group 0).
  absl::Status SetRefGroupStateSlots(uint64_t group, int64_t max_state_slots);
  // Fair eviction by tenant (docs/eviction.md): the blocks `ns` publishes from now on belong to
  // eviction share `share` (0: the default share) with weight `weight`; under pressure the next
  // victim comes from the share whose cached bytes per unit of weight are the most: its
  // evictable blocks plus the window blocks and checkpoints kept beside them (with
  // KvCacheOptions::block_bytes, each group's bytes). Errors: INVALID_ARGUMENT (ns 0, weight 0 or
  // above PrefixCache::kMaxShareWeight), RESOURCE_EXHAUSTED (eviction_shares shares exist, or 0),
  // FAILED_PRECONDITION (no prefix cache); nothing has changed.
  absl::Status SetEvictionShare(NamespaceId ns, uint64_t share, uint32_t weight = 1);
  // Every eviction share's use (PrefixCache::Shares), the default one first; empty without a
  // prefix cache.
  std::vector<ShareUse> EvictionShares() const;
  // The share `ns` publishes into; nullopt without shares (eviction_shares 0, no prefix cache).
  std::optional<ShareUse> EvictionShareOf(NamespaceId ns) const;

  // What the quota `ns` counts against holds now, and its bound, in its units: bytes with
  // KvCacheOptions::block_bytes, else blocks. nullopt when `ns` has no quota.
  struct QuotaUse {
    int64_t used = 0;
    int64_t bound = 0;
    bool bytes = false;  // in bytes (KvCacheOptions::block_bytes), else in blocks
  };
  std::optional<QuotaUse> QuotaOf(NamespaceId ns) const;

  // Creates a sequence of `num_tokens` tokens owned by `caller` in the request's namespace.
  // Errors: INVALID_ARGUMENT (session 0, namespace 0, negative count), RESOURCE_EXHAUSTED
  // (table bound, quota or pool, with the shortfall in blocks; max_sequences_per_session; the
  // namespace table, full even after recycling the idle namespaces).
  // With a prompt, the longest cached prefix of it is adopted (blocks shared by reference; a
  // partially matched block is copied first when the sequence will write into it).
  absl::StatusOr<AllocateResult> Allocate(SessionId caller, const AllocateRequest& request,
                                          DevicePlan* plan);
  // All-or-nothing: creates every sequence or none. Appends to `results` in request order.
  // Errors: as Allocate, plus INVALID_ARGUMENT for an empty batch.
  absl::Status AllocateBatch(SessionId caller, std::span<const AllocateRequest> requests,
                             std::vector<AllocateResult>* results, DevicePlan* plan);

  // Grows `sequence` to `num_tokens` tokens, appending only the missing blocks.
  // Errors: NOT_FOUND (no such sequence), PERMISSION_DENIED (another session's),
  // INVALID_ARGUMENT (negative count), RESOURCE_EXHAUSTED (table bound, quota or pool).
  absl::Status Grow(SessionId caller, SequenceId sequence, int64_t num_tokens, DevicePlan* plan);
  // One scheduler step: grows every listed sequence or none. When `changes` is given, appends one
  // TableChange per request, in order.
  // Errors: as Grow, plus INVALID_ARGUMENT for an empty batch or a sequence listed twice.
  absl::Status GrowBatch(SessionId caller, std::span<const GrowRequest> requests, DevicePlan* plan,
                         std::vector<TableChange>* changes = nullptr);
  // Undoes a GrowBatch whose device work could not be carried out (a copy-on-write target that was
  // never written must not stand in for its source): every sequence goes back to its old length
  // and table, the blocks the grow took go back to the pool.
  // REQUIRES: `changes` are what GrowBatch reported for `caller`, and nothing has changed those
  // sequences or the replaced blocks since (the caller reverts at once, under the same lock).
  void RevertGrow(SessionId caller, std::span<const TableChange> changes);

  // Rewinds `sequence` to `num_tokens` tokens, releasing the blocks past the new end (and the
  // checkpoints planned past it). With a state group, below the tokens the sequence knows its
  // state goes back only to a checkpoint the tree keeps at exactly `num_tokens` on its path: then
  // `plan` (required for that) copies the checkpoint into its working state. A lost state
  // (LoseState) is restored the same way wherever such a checkpoint is (zeroed at 0 tokens), and
  // otherwise stays lost.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (negative, or longer than the
  // sequence), FAILED_PRECONDITION (a state group, fewer tokens than the sequence knows, and no
  // checkpoint there or no `plan`: the message names the nearest checkpoint on its path at or
  // below `num_tokens`, a point it can rewind to; a window group, and the window of `num_tokens`
  // tokens, [num_tokens - W + 1, num_tokens) plus the sinks, needs an entry SlideWindow released:
  // the message names the lowest length it can go back to).
  absl::Status Truncate(SessionId caller, SequenceId sequence, int64_t num_tokens,
                        DevicePlan* plan = nullptr);
  // Takes back a growth whose device work ran but whose caller never learned of it (a call given
  // up): Truncate to `num_tokens`, the length before it, and the window entries from
  // `window_entries` on, the window table's size before it (a grow fills every entry below the
  // old length a window_ahead left out: GrowRequest::window_ahead). Errors: as Truncate.
  absl::Status TakeBackGrowth(SessionId caller, SequenceId sequence, int64_t num_tokens,
                              int32_t window_entries, DevicePlan* plan = nullptr);

  // A new sequence of the same session and namespace sharing every full block of `sequence` by
  // reference; a partial last block is copied (the BlockCopy is in `plan`).
  // Errors: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED (quota, pool or
  // max_sequences_per_session).
  absl::StatusOr<SequenceId> Fork(SessionId caller, SequenceId sequence, DevicePlan* plan);

  // Publishes the first `num_tokens` tokens of `sequence` into the prefix cache: full blocks,
  // and a trailing partial block with its coverage (a rewind endpoint). `new_tokens` extends the
  // tokens the cache knows for the sequence (the prompt given at Allocate, plus earlier
  // commits); together they must cover `num_tokens`. The caller asserts that the KV of those
  // tokens is in the sequence's blocks.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (num_tokens negative or past the
  // sequence's length, too few tokens known, or known tokens beyond its length),
  // FAILED_PRECONDITION (the tokens contradict what the cache published for one of the
  // sequence's blocks: a client wrote into a block another sequence shares, e.g. two forks of a
  // block-aligned sequence that both wrote past the fork point).
  absl::Status Commit(SessionId caller, SequenceId sequence, int64_t num_tokens,
                      std::span<const int32_t> new_tokens = {});

  // Releases every block of `sequence` and forgets it; with OnFree::kCommit, publishes its
  // known tokens first (and, with checkpoints, keeps its state as the checkpoint at their end
  // when it holds exactly them).
  // Errors: NOT_FOUND, PERMISSION_DENIED, FAILED_PRECONDITION (kCommit: as Commit).
  absl::Status Free(SessionId caller, SequenceId sequence, OnFree on_free = OnFree::kDiscard);
  // Frees every listed sequence, in order, or none.
  // Errors: as Free, plus INVALID_ARGUMENT for an empty batch or a sequence listed twice, and
  // FAILED_PRECONDITION (kCommit) when two listed sequences claim different tokens for a block
  // they share.
  absl::Status FreeBatch(SessionId caller, std::span<const SequenceId> sequences,
                         OnFree on_free = OnFree::kDiscard);

  // Frees every sequence of `session` (its client went away), by id, and ends its pins. Returns
  // how many sequences. The session's quota setting is forgotten too. Costs what the session
  // holds, not what the pool does (SessionHoldings).
  int64_t FreeSession(SessionId session);

  // Records that device work queued up to `fence` touches `blocks` (the caller has just enqueued
  // a plan, a kernel or a copy over them): none of them returns to the free list before the fence
  // has passed. All-or-nothing.
  // Errors: as BlockPool::MarkInFlight; nothing is marked on error.
  absl::Status MarkInFlight(std::span<const BlockId> blocks, Fence fence);
  // The same for slots of the state group (a step's states and checkpoints, a plan's state copies
  // and zeros; a cached checkpoint a plan copies from).
  // Errors: NOT_FOUND (no state group, or no such slot), FAILED_PRECONDITION (a FREE or RETIRING
  // slot); nothing is marked on error.
  absl::Status MarkStatesInFlight(std::span<const BlockId> slots, Fence fence);
  // The same for blocks of the window group (a step's window blocks, a plan's window copies).
  // Errors: NOT_FOUND (no window group, or no such block), FAILED_PRECONDITION (a FREE or
  // RETIRING block); nothing is marked on error.
  absl::Status MarkWindowInFlight(std::span<const BlockId> blocks, Fence fence);

  // The window group (KvCacheOptions::window_blocks; kv_cache_manager_window.cc).
  //
  // `sequence`'s first `computed_tokens` tokens are computed: no later step reads a key before
  // computed_tokens - W + 1 (the next query, at position computed_tokens, reads [p - W + 1, p]
  // plus the sinks), so every window_table entry wholly before that, sinks excepted, is released
  // (fenced: a block a step still reads stays RETIRING until its fence passes). vLLM's
  // remove_skipped_blocks(num_computed_tokens). Call it after every step (prefill chunk or
  // decode). The bound: after SlideWindow(n) on a sequence of n tokens it holds at most
  // WindowBound() = ceil((W + block_size) / block_size) + ceil(S / block_size) live entries, and
  // a Grow by k tokens adds at most ceil(k / block_size) + 1 more before the next slide. A no-op
  // without a window group.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (outside [0, its length]); nothing
  // has changed.
  absl::Status SlideWindow(SessionId caller, SequenceId sequence, int64_t computed_tokens);
  // Allocates `sequence`'s window blocks for its first `tokens` tokens where they are not yet
  // (AllocateRequest::window_ahead): before a step computes tokens past its window table.
  // Fresh blocks go to `plan->window_fills`; cached window blocks give way, least recently used
  // first. A no-op without a window group.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (outside [0, its length]),
  // RESOURCE_EXHAUSTED (Resource::kWindowBlocks); nothing has changed.
  absl::Status ExtendWindow(SessionId caller, SequenceId sequence, int64_t tokens,
                            DevicePlan* plan);
  // The bound above (0 without a window group).
  int64_t WindowBound() const;
  // Window blocks for what `sequence`'s window reads at its whole length, for the caller to fill
  // from outside (a tier loader: a lower tier's copies of window blocks kept earlier, not its
  // steps, write them). Releases the window table's entries before that window (as
  // SlideWindow(num_tokens) would), then appends every entry the window table lacks: the window
  // block the tree keeps beside the entry's block where there is one (a full one), else a fresh
  // block where the window reads it, none (released) where it does not. Returns the fresh
  // blocks as (entry, block), in order; the caller copies their bytes in and marks them in flight
  // (MarkWindowInFlight) before anything reads them. A match that ended inside a block leaves
  // that block's window entry as adopted, the rest of it unwritten: import onto block-aligned
  // matches (the engine promotes nothing over a partly cached block). Not for a sequence that
  // steps afterwards: from here on its commits keep its window blocks beside the tree's blocks
  // whatever its own table holds (Sequence::window_imported). A no-op without a window group.
  // Errors: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED (Resource::kWindowBlocks, or the
  // namespace's quota); nothing has changed.
  absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> ImportWindow(SessionId caller,
                                                                        SequenceId sequence);

  // State checkpoints (KvCacheOptions::checkpoint_slots; kv_cache_manager_checkpoints.cc).
  //
  // The checkpoints a step of `sequence` that advances its state from `from` to `to` tokens is to
  // take: the positions in (from, to] on the checkpoint interval, its branch point, (a
  // `prefill`) its last block boundary before `to`, and (a decode that ends on a block boundary)
  // its rolling checkpoint there. Each gets a state slot, appended to `out` by position; the
  // sequence holds them until Commit or Free puts them into the tree (once its state has passed
  // them, AdvanceState) or a rewind drops them. The rolling one is the sequence's checkpoint at
  // the last block boundary its decodes reached: one slot per sequence (a quarter of the
  // checkpoint slots for all), rewritten at each boundary, kept only by Free with commit. A
  // sequence's end is rarely a block boundary and lower tiers key checkpoints by full blocks, so
  // it bounds what a conversation that comes back from a tier recomputes to one block, however
  // long its last answer was. The step must write every one
  // (the model's StepItem::checkpoints) and the caller marks their slots in flight with the
  // step's. A position no slot can be spared for is skipped (counted). Nothing is planned without
  // checkpoint slots or when `from` is not the tokens the sequence's state holds.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (not 0 <= from < to <= its length).
  absl::Status PlanCheckpoints(SessionId caller, SequenceId sequence, int64_t from, int64_t to,
                               bool prefill, std::vector<PlannedCheckpoint>* out);

  // How often each CheckpointKind is resumed from, by CheckpointKind's value
  // (KvCacheOptions::kByExpectedTokensSaved weighs the eviction order with them; measured in the
  // other orders too).
  const std::array<CheckpointKindRate, kNumCheckpointKinds>& CheckpointKindRates() const {
    return kind_rates_;
  }
  // A checkpoint of the state after `sequence`'s first `position` tokens that the caller fills
  // from outside (a lower tier's copy of a checkpoint taken earlier): a state slot for it, held by
  // the sequence like a planned one and put into the tree by Commit at the block `position` ends
  // (PlannedCheckpoint::imported). The caller copies the state in and marks the slot in flight
  // before it commits. Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (`position` not a
  // block boundary in (0, its length], or one planned already), FAILED_PRECONDITION (no
  // checkpoint slots), RESOURCE_EXHAUSTED (kStateSlots: none can be spared now); nothing has
  // changed.
  absl::StatusOr<BlockId> ImportCheckpoint(SessionId caller, SequenceId sequence, int64_t position);
  // `sequence`'s working state now holds its first `tokens` tokens (a step computed them); -1:
  // it holds something no checkpoint may be taken from.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (outside [-1, its length]).
  absl::Status AdvanceState(SessionId caller, SequenceId sequence, int64_t tokens);
  // A step that moved `sequence`'s working state was taken back (its caller gave up after it ran,
  // or it failed midway): the state holds tokens the sequence no longer has, and no state can be
  // moved back. No checkpoint is taken from it and no step may start from it (CheckStateUsable)
  // until a Truncate to a checkpoint on its path, or to 0 tokens, restores it. Nothing without a
  // state group. Errors: NOT_FOUND, PERMISSION_DENIED.
  absl::Status LoseState(SessionId caller, SequenceId sequence);
  // FAILED_PRECONDITION when `seq`'s state was lost (LoseState), naming the nearest checkpoint on
  // its path it can be truncated to; OK otherwise.
  absl::Status CheckStateUsable(const Sequence& seq) const;

  // Moves RETIRING blocks (and state slots) whose fences have passed to the free list. Returns
  // how many.
  int32_t ReclaimRetired();

  // Pins (retention hints; kv_cache_manager_pins.cc). A pin locks tree nodes: while it lasts its
  // blocks are never evicted, and those only it holds (CACHED) count against the namespace's
  // quota. It raises their priority class to at least `priority` for good (the order among
  // evictable blocks once it ends). It ends at `ttl_ns` after it was made (by the Clock), by
  // Unpin, or when its session is freed.
  //
  // Pins the cached prefix `tokens` of `ns` (e.g. a system prompt), all of it.
  // Errors: INVALID_ARGUMENT (session 0, namespace 0, no tokens, ttl_ns <= 0 or above
  // max_pin_ttl_ns, priority outside [0, kNumPriorities)); FAILED_PRECONDITION (prefix cache
  // off); NOT_FOUND (not all of `tokens` is cached: the message says how much is);
  // RESOURCE_EXHAUSTED (max_pins reached; namespace quota or max_pinned_blocks, with the
  // shortfall). On error nothing has changed.
  absl::StatusOr<PinId> PinPrefix(SessionId caller, NamespaceId ns, std::span<const int32_t> tokens,
                                  int64_t ttl_ns, int priority);
  // Pins what `sequence` has published so far (its path in the tree), so that it outlives the
  // sequence (e.g. an agent waiting for a tool call frees its sequence and comes back).
  // Errors: as PinPrefix, plus NOT_FOUND / PERMISSION_DENIED for the sequence and
  // FAILED_PRECONDITION when it has published nothing.
  absl::StatusOr<PinId> PinSequence(SessionId caller, SequenceId sequence, int64_t ttl_ns,
                                    int priority);
  // Restarts the pin's time: it now ends `ttl_ns` from now.
  // Errors: NOT_FOUND (no such pin, or it has ended), PERMISSION_DENIED (another session's),
  // INVALID_ARGUMENT (ttl_ns as above).
  absl::Status RenewPin(SessionId caller, PinId pin, int64_t ttl_ns);
  // Ends the pin now. Errors: NOT_FOUND, PERMISSION_DENIED.
  absl::Status Unpin(SessionId caller, PinId pin);
  // Live pins (of `session`, or of all sessions for kNoSession), by id. Pins whose time is up
  // but which no call has expired yet are left out. For one session it costs that session's
  // pins, not the pool's (SessionHoldings).
  std::vector<PinInfo> ListPins(SessionId session = kNoSession) const;
  // The pin `pin` (its time may be up, if no call has expired it yet); null when it has ended or
  // never was. O(1).
  const PinInfo* FindPin(PinId pin) const;
  // Ends every pin whose time is up (at the Clock's reading). Returns how many.
  int64_t ExpirePins();

  // Prefix cache, for routers and operators. Both change nothing. With a state group MatchPrefix
  // is what a prompt resumes (cut at the deepest state checkpoint), and the explanation says so
  // beside what full attention has cached (MatchExplanation::resumable_tokens).
  int64_t MatchPrefix(NamespaceId ns, std::span<const int32_t> tokens) const;
  MatchExplanation ExplainMatch(NamespaceId ns, std::span<const int32_t> tokens) const;
  // Evicts up to `blocks` cached blocks nobody holds. Returns how many.
  int64_t EvictCached(int64_t blocks);
  // Empties the prefix cache: one AllBlocksCleared (every medium, every group), then the lower
  // tiers' blocks told again (they stay). Errors: FAILED_PRECONDITION while sequences hold
  // cached blocks.
  absl::Status ClearCache();
  // The cache's event log (null with the prefix cache off) and a snapshot for late consumers.
  const EventLog* events() const { return cache_ ? &cache_->events() : nullptr; }
  // Records an event of a lower tier in the pool's event log (numbered with the pool's events).
  // One without a group is of main blocks; a window block's or a checkpoint's names its group by
  // kind (KvGroupKind::kSlidingWindow, kStateSpace) and is given the pool's group, as the
  // device's own events of that component are. Errors: INVALID_ARGUMENT for a component this
  // pool has no group for (nothing recorded).
  absl::Status AppendTierEvent(KvEvent event);
  // The full blocks cached since the last call, oldest first (KvCacheOptions::publish_journal;
  // always empty without it). Their bytes stay put while they are cached or held.
  void TakePublished(std::vector<PublishedBlock>* out) {
    if (cache_) {
      cache_->TakePublished(out);
    } else {
      out->clear();
    }
  }
  // With the journal and checkpoint slots: the checkpoints put into the tree at a full block's
  // last token since the last call, still kept there, oldest first (what a lower tier stores
  // beside the block). Their slots' bytes stay put while they are kept.
  void TakePublishedCheckpoints(std::vector<PublishedCheckpoint>* out);
  // With the journal and a window group: the window blocks kept beside full blocks since the
  // last call, still kept there, oldest first (what a lower tier stores beside the block). Their
  // bytes stay put while they are kept.
  void TakePublishedWindowBlocks(std::vector<PublishedWindowBlock>* out);
  // Stored events (seq 0) of everything the log has told of and not withdrawn: the tree's full
  // blocks (parents first), the components kept beside them, then the lower tiers' blocks
  // (TierEventView). A consumer that applies them after clearing its view, then reads from
  // `*resume_seq`, misses nothing.
  std::vector<KvEvent> SnapshotEvents(uint64_t* resume_seq) const;

  // Accessors.
  const Sequence* Find(SequenceId sequence) const;
  void ForEachSequence(absl::FunctionRef<void(const Sequence&)> fn) const;
  const BlockPool& pool() const { return *pool_; }
  // The state group's slots; null without one.
  const BlockPool* states() const { return states_.get(); }
  // The window group's blocks; null without one.
  const BlockPool* window() const { return window_.get(); }
  int32_t window_tokens() const { return window_tokens_; }
  int32_t sink_tokens() const { return sink_tokens_; }
  const PrefixCache* cache() const { return cache_.get(); }
  int32_t block_size() const { return block_size_; }
  int32_t max_blocks_per_seq() const { return max_blocks_per_seq_; }
  // Live sequences of `session` (0 for an unknown one).
  int64_t session_sequences(SessionId session) const;
  // What `session` holds now; null when it holds no sequence and no pin. O(1).
  const SessionHoldings* HoldingsOf(SessionId session) const;
  // What `session` holds in namespace `ns` (zeros: nothing). O(1).
  SessionHoldings::InNamespace HeldIn(SessionId session, NamespaceId ns) const;
  KvCacheStats stats() const;

  // The pool's and the prefix cache's invariants, plus: every block's reference count equals the
  // table entries that name it plus the cache's reference; tables hold only ACTIVE blocks and
  // exactly ceil(num_tokens / block_size) of them, within max_blocks_per_seq; every tree node is
  // locked once per sequence whose path holds it and once per pin; pins are within their limits
  // and each has its deadline queued; per-session usage matches and is within
  // max_sequences_per_session; each session's holdings (SessionHoldings) are its sequences and
  // pins, by namespace; every sequence's namespace is registered at its slot; the quota
  // groups and their members agree. Per group (state, window): free + active + cached +
  // retiring == num_blocks. The window group: every window table as long as its table, sinks
  // never released, released entries one run after them, live entries ACTIVE, each block's
  // references = table entries naming it + the tree's, every cached window block kept for a
  // block the tree holds.
  // Returns INTERNAL naming the first violation.
  absl::Status CheckInvariants() const;

  // All state in canonical text form (pool, sequences by id, sessions, quotas, pins).
  std::string DebugString() const;

 private:
  // Tests lower the checkpoints' rebase point, which real runs reach only past 2^62 tokens of
  // floor (tests/kvpool/kv_cache_manager_test_peer.h).
  friend class KvCacheManagerTestPeer;

  // One session's entry (sessions_): from its first sequence, pin or quota setting until
  // FreeSession, so that one taking and freeing a sequence at a time allocates nothing for it,
  // and each call finds all it keeps of the session with one lookup.
  struct SessionUsage {
    int64_t block_refs = 0;
    int64_t sequences = 0;
    int64_t quota = kUnlimited;
    uint64_t group = 0;    // its reference group; 0: none
    SessionHoldings held;  // what it holds (HoldingsOf)

    // Whether it has anything to show (DebugString): usage or a setting; an emptied entry
    // is one for its holdings' sake.
    bool shown() const { return sequences > 0 || quota != kUnlimited || group != 0; }
  };
  struct RefGroup {
    int64_t block_refs = 0;  // summed over its sessions
    int64_t quota = kUnlimited;
    int64_t sessions = 0;
    int64_t sequences = 0;                 // live, summed over its sessions
    int64_t max_state_slots = kUnlimited;  // with a state group: bound on `sequences`
  };
  // Adds `delta` live sequences to `session`'s usage and its group's.
  void AddSequences(SessionUsage& usage, int64_t delta);
  // Adds `delta` block references to `session`'s usage and its group's.
  void AddRefs(SessionId session, int64_t delta);
  void AddRefs(SessionUsage& usage, int64_t delta);
  // Each reference group counts exactly its sessions and their references.
  absl::Status CheckRefGroups() const;
  // File `seq` (of the session `usage` is) or `pin` in its session's holdings, or take it out;
  // a sequence also names its namespace's slots (BlockPool::AddNamedBy), which keeps them busy.
  // (kv_cache_manager_holdings.cc)
  void HoldSequence(SessionUsage& usage, const Sequence& seq);
  void UnholdSequence(SessionUsage& usage, const Sequence& seq);
  void HoldPin(const PinInfo& pin);
  void UnholdPin(const PinInfo& pin);
  // Each session's holdings, and each slot's count of the sequences that name it, are what a
  // recount of sequences_ and pins_ gives.
  absl::Status CheckHoldings() const;
  absl::Status CheckNamedSlots() const;

  struct Pin {
    PinInfo info;
    std::vector<BlockId> blocks;  // cached blocks, root first, each pinned once
  };

  // Whose quota a namespace counts against: a group's (SetNamespaceQuota's `group`) or its own
  // (`group` false, `id` the namespace).
  struct QuotaKey {
    uint64_t id = 0;
    bool group = false;

    friend bool operator==(const QuotaKey&, const QuotaKey&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const QuotaKey& k) {
      return H::combine(std::move(h), k.id, k.group);
    }
  };
  // A quota's usage is kept as running totals, so that checking it costs the same however many
  // namespaces share it: its members are filed under its tally in pool_, window_ and cache_
  // (BlockPool::SetTally, PrefixCache::SetTally), which sum their ACTIVE and pin-held blocks as
  // they change, and state_slots sums states_by_ns_ over them here.
  struct Quota {
    int64_t max_blocks = kUnlimited;
    absl::flat_hash_set<NamespaceId> members;  // at least one
    uint32_t tally = 0;                        // > 0, this quota's alone while it exists
    int64_t state_slots = 0;                   // states_by_ns_ summed over the members
  };
  // What a call adds to a namespace's quota beside its main blocks: window-group blocks it turns
  // ACTIVE (fresh ones and cached ones it adopts) and state slots it takes.
  struct GroupCharge {
    NamespaceId ns;
    int64_t window_blocks = 0;
    int64_t state_slots = 0;
  };
  static void AddCharge(std::vector<GroupCharge>* charges, NamespaceId ns, int64_t window_blocks,
                        int64_t state_slots);

  // What one sequence's growth needs, worked out before anything changes.
  struct GrowPlan {
    Sequence* sequence = nullptr;
    int64_t num_tokens = 0;
    int32_t new_blocks = 0;         // appended to the table
    bool cow = false;               // the block being written is shared: move onto a private copy
    bool window_cow = false;        // the same for its window block
    int32_t window_new_blocks = 0;  // appended to the window table (GrowRequest::window_ahead)
  };
  // What one Allocate request needs (see AllocateBatch).
  struct AllocatePlan {
    PrefixMatch match;
    bool copy_partial = false;               // the partially matched block is copied, not shared
    MatchStop stop = MatchStop::kPromptEnd;  // why the match stopped (prompt tokens missed)
    bool below_admission_bar = false;        // kEvicted: MatchExplanation's
    bool first_block_elsewhere = false;      // not cached here: MatchExplanation's
    int64_t no_checkpoint = 0;       // tokens the attention match found, cut for want of a state
    BlockId resume = kInvalidBlock;  // the checkpoint the match was cut at (its state is copied)
    // The deepest evicted checkpoint the cut passed (CheckpointGhost): counted as resumed from.
    std::optional<std::pair<BlockId, CheckpointKind>> ghost;
    int64_t branch_at = 0;             // the attention match's length, before the cut
    int64_t window_evicted = 0;        // tokens cut for want of a window block
    bool window_copy_partial = false;  // the partially matched block's window block is copied
    int32_t new_blocks = 0;
    int32_t window_new_blocks = 0;  // fresh window blocks (AllocateRequest::window_ahead)
    bool uncut = false;             // AllocateRequest::adopt_uncut, with a group it applies to
  };
  // Blocks a batch has already claimed to write into, and by how many holders.
  using WriteClaims = std::vector<std::pair<BlockId, uint32_t>>;
  // What an Allocate batch needs in all, summed as each request is planned.
  struct AllocateTally {
    std::vector<std::pair<NamespaceId, int64_t>> by_ns;  // ACTIVE blocks added, by namespace
    std::vector<BlockId> keep;         // matched blocks: never evicted to make room for this call
    std::vector<BlockId> adopted;      // cached blocks the batch turns ACTIVE (counted once each)
    WriteClaims joined;                // partially matched blocks shared by writers of the batch
    int64_t refs = 0;                  // block references the new sequences will hold
    int64_t blocks = 0;                // fresh blocks: new ones and copies of partial matches
    std::vector<BlockId> window_keep;  // window blocks the batch shares: never evicted for it
    WriteClaims window_joined;         // partially matched window blocks shared by writers
    int64_t window_blocks = 0;         // fresh window blocks
    std::vector<BlockId> window_adopted;  // cached window blocks the batch turns ACTIVE
    std::vector<GroupCharge> groups;      // window blocks and state slots added, by namespace
  };

  KvCacheManager(const KvCacheOptions& options, std::unique_ptr<BlockPool> pool,
                 std::unique_ptr<PrefixCache> cache, std::unique_ptr<BlockPool> states,
                 std::unique_ptr<BlockPool> window);

  int64_t BlocksFor(int64_t num_tokens) const {
    return num_tokens / block_size_ + (num_tokens % block_size_ != 0 ? 1 : 0);
  }
  TraceContext Context(SessionId session, SequenceId sequence) const {
    return TraceContext{session, sequence, clock_->NowNanos()};
  }
  // What every mutating call does first: one clock reading, given to the prefix cache, and the
  // pins whose time is up expired (housekeeping).
  TraceContext BeginCall(SessionId session, SequenceId sequence);
  // Expires pins whose deadline is <= now_ns.
  int64_t ExpirePinsAt(int64_t now_ns);
  // Checks and makes a pin over cached `blocks` (a root-first path) for `tokens` tokens.
  absl::StatusOr<PinId> MakePin(SessionId caller, NamespaceId ns, SequenceId sequence,
                                std::vector<BlockId> blocks, int64_t tokens, int64_t ttl_ns,
                                int priority, int64_t now_ns);
  absl::Status CheckTtl(int64_t ttl_ns) const;
  absl::StatusOr<Pin*> OwnedPin(SessionId caller, PinId pin);
  void ReleasePin(PinId pin);
  absl::Status CheckPins(absl::flat_hash_map<BlockId, uint32_t>* locks,
                         absl::flat_hash_map<BlockId, uint32_t>* pins) const;
  // The sequence, if `caller` owns it. Errors: NOT_FOUND, PERMISSION_DENIED.
  absl::StatusOr<Sequence*> Owned(SessionId caller, SequenceId sequence);
  // A sequence's token vector holding `tokens`, in a freed sequence's buffer when one is big
  // enough (spare_tokens_); RecycleTokens keeps a freed one's (and leaves `tokens` empty).
  std::vector<int32_t> TokensOf(std::span<const int32_t> tokens) {
    return tokens.empty() ? std::vector<int32_t>() : SpareTokensOf(tokens);
  }
  void RecycleTokens(std::vector<int32_t>& tokens) {
    if (tokens.capacity() != 0) KeepSpareTokens(tokens);
  }
  std::vector<int32_t> SpareTokensOf(std::span<const int32_t> tokens);
  void KeepSpareTokens(std::vector<int32_t>& tokens);
  // Whether writing token slot `slot` of `block` must first move the writer onto a copy:
  // another sequence holds it (`other_holders` counts them, writes already claimed in this
  // batch included), or the prefix cache published that slot.
  bool MustCopy(BlockId block, int32_t slot, uint32_t other_holders) const;
  // Records one more claim on `block` in this batch; returns how many came before.
  static uint32_t Claim(WriteClaims* claims, BlockId block);
  // Checks the table bound and works out the blocks a growth needs. `claims` records the
  // copy-on-writes planned earlier in the batch (each takes a holder off its block).
  absl::Status PlanGrow(Sequence* sequence, int64_t num_tokens, WriteClaims* claims,
                        GrowPlan* plan) const;
  // Checks namespace quotas for the ACTIVE blocks a call adds (`by_ns`, each namespace once;
  // namespaces of one quota group are summed) and the session quota for `refs` more references
  // held by `session`.
  // `groups` lists what the call adds in the window and state groups, charged their bytes.
  absl::Status CheckCapacity(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                             SessionId session, int64_t refs, std::string_view what,
                             std::span<const GroupCharge> groups = {});
  absl::Status CheckQuotas(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                           std::span<const GroupCharge> groups, std::string_view what) const;
  // What a quota's namespaces hold, in quota units (bytes with KvCacheOptions::block_bytes,
  // else blocks): ACTIVE blocks plus those only pins hold, ACTIVE window blocks, state slots.
  int64_t QuotaUsage(const Quota& quota) const;
  // A quota's bound in those units (saturated).
  int64_t QuotaBound(const Quota& quota) const;
  // "u of b blocks in use" or its bytes' wording.
  std::string QuotaText(int64_t used, const Quota& quota) const;
  // `ns` leaves the quota it counts against, if any (an emptied quota is dropped, its tally
  // freed). O(1) amortized.
  void LeaveQuota(NamespaceId ns);
  // Files `ns` under `tally` (0: none) wherever its usage is summed (pool_, window_, cache_).
  void FileUnder(NamespaceId ns, uint32_t tally);
  // The live sequences of `ns` (each holds a state slot) change by `delta`, and so does the
  // state-slot total of its quota.
  void AddStateSlots(NamespaceId ns, int64_t delta);
  absl::Status CheckQuotaBooks() const;
  // Each quota's running totals are what a walk over its members gives.
  absl::Status CheckQuotaTotals() const;
  // While nothing has been freed since a refused sweep, a sweep finds no more idle slots than it
  // did (what FullTable refuses by).
  absl::Status CheckFullTables() const;
  // RESOURCE_EXHAUSTED when `session` would hold more than max_sequences_per_session with
  // `more` new ones.
  absl::Status CheckSequences(SessionId session, int64_t more, std::string_view what) const;
  // Checks that the namespaces of `by_ns` fit the pool's table. When the table is too full, finds
  // the idle namespaces (no block owned, no live sequence, not in `by_ns`) to recycle into
  // `recycle`, for the caller to hand to BlockPool::RecycleNamespaces once nothing can fail.
  // A sweep costs O(slots); while nothing has been freed since a sweep that could not make room,
  // a call needing more than it found is refused without one (FullTable).
  absl::Status PlanNamespaces(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                              std::vector<NamespaceSlot>* recycle, std::string_view what) const;
  // What the last sweep of a namespace table that could not make room found. A slot goes idle
  // only when a block leaves it (BlockPool::freed()) or a sequence is freed; until then no sweep
  // finds more than `idle`: those it found, plus the slots the refused call kept as its own (a
  // call's namespaces are never recycled under it; another call's may be).
  struct FullTable {
    uint64_t blocks_freed = 0;
    uint64_t sequences_freed = 0;
    int64_t idle = -1;  // -1: no refused sweep to go by

    // Whether `fresh` new namespaces with `left` free slots are refused with no sweep.
    bool Refuses(const BlockPool& pool, uint64_t sequences, int64_t fresh, int64_t left) const {
      return idle >= 0 && blocks_freed == pool.freed() && sequences_freed == sequences &&
             fresh > left + idle;
    }
  };
  // The sweep behind PlanNamespaces and PlanWindowNamespaces: whether `pool`'s table (the pool's
  // or the window group's, whose FullTable is `table`) has room for `fresh` new namespaces once
  // its idle slots, into `recycle`, are recycled; `namespaces`' own slots are never among them.
  // A sweep that finds too few is noted in `table`, and `recycle` is left empty.
  bool FindRoom(const BlockPool& pool, FullTable* table,
                std::span<const std::pair<NamespaceId, int64_t>> namespaces, int64_t fresh,
                std::vector<NamespaceSlot>* recycle) const;
  // Checks there are `slots` free state slots (reclaiming retired ones first, then evicting
  // cached checkpoints not in `keep`, in checkpoint_order_, once it is sure there are
  // enough: the call's last check). OK without a state group.
  absl::Status CheckStateRoom(int64_t slots, std::string_view what,
                              std::span<const BlockId> keep = {});
  // Hands `seq` a state slot: zeroed, or a copy of `copy_of`'s. REQUIRES: CheckStateRoom.
  void TakeStateSlot(Sequence* seq, BlockId copy_of, const TraceContext& ctx, DevicePlan* plan);
  absl::Status CheckStates() const;
  absl::Status CheckCheckpoints() const;
  // The tree's side of CheckCheckpoints: each cached checkpoint where it says (counting the
  // tree's reference to its slot into `refs`), the resume points it marks, the remembered ones.
  absl::Status CheckCachedCheckpoints(std::vector<uint32_t>* refs) const;

  // Checkpoints (kv_cache_manager_checkpoints.cc). Where a checkpoint is kept, by state slot.
  struct CheckpointSlot {
    BlockId block = kInvalidBlock;  // the tree block it belongs to; invalid: not a cached one
    int32_t offset = 0;             // the state after this many of the block's tokens
    internal::GreedyDualOrder<BlockId>::Key key;      // its place in checkpoint_order_
    CheckpointKind kind = CheckpointKind::kInterval;  // why it was taken (set when planned)
  };
  // A cached checkpoint evicted for room, remembered while its tree block stays cached: a prompt
  // whose match passes it counts a resume for its kind (CheckpointKindRate).
  struct CheckpointGhost {
    int32_t offset = 0;
    CheckpointKind kind = CheckpointKind::kInterval;
  };
  // Cuts `match` at the deepest checkpoint on its blocks at or below its end and returns that
  // checkpoint's slot; empties it (kInvalidBlock) when there is none.
  // `ghost` (optional): the kind of the deepest evicted checkpoint (checkpoint_ghosts_) the cut
  // passes, and its block, unless *ghost is set already.
  BlockId CutToCheckpoint(PrefixMatch* match,
                          std::optional<std::pair<BlockId, CheckpointKind>>* ghost = nullptr) const;
  // A slot for a new checkpoint within checkpoint_slots: free, or freed by evicting the cached
  // checkpoint checkpoint_order_ puts first. kInvalidBlock when none can be spared.
  BlockId TakeCheckpointSlot(const TraceContext& ctx);
  // Each eviction share's charged bytes are those of the components kept beside its blocks.
  absl::Status CheckShareCharges() const;
  // Of `eligible` (components the manager keeps beside tree blocks, each with that block, in
  // their eviction order), the first `want` in the order fair eviction takes them (docs/
  // eviction.md, Fair by tenant): each from the eviction share using the most per unit of weight,
  // counting a component taken as `unit` bytes less, in their eviction order within a share.
  // Without shares besides the default one, the first `want`. O(n + want * shares).
  std::vector<BlockId> FairComponentVictims(std::span<const std::pair<BlockId, BlockId>> eligible,
                                            int64_t want, int64_t unit) const;
  // Evicts the cached checkpoint not in `keep` whose slot nobody holds (`passed`: and whose
  // fences have passed) that fair eviction takes first: the first in checkpoint_order_, of the
  // share using the most. Returns false when there is none.
  bool EvictFirstCheckpoint(std::span<const BlockId> keep, bool passed, const TraceContext& ctx);
  // The tree block and offset holding the state after `seq`'s first `position` tokens, on its
  // path (kInvalidBlock when its path does not reach there).
  std::pair<BlockId, int32_t> PathPlace(const Sequence& seq, int64_t position) const;
  // `slot` (one reference held by the caller, which passes) becomes the checkpoint at `offset` of
  // tree block `block`, unless the block has one as deep (then the slot is released).
  void KeepCheckpoint(BlockId block, int32_t offset, BlockId slot, CheckpointKind kind,
                      const TraceContext& ctx);
  // Counts a checkpoint of `kind` kept (CheckpointKindRate), halving every count once 4 x
  // checkpoint_slots + 256 keeps have passed since the last halving.
  void CountKept(CheckpointKind kind);
  // Counts a resume of a checkpoint of `*kind`, which from then on counts as kResumed.
  void CountResume(CheckpointKind* kind);
  // A prompt passed the evicted checkpoint at tree block `block` (if it is still remembered).
  void CountGhost(BlockId block);
  // `tokens` (TokensSaved) weighed by `kind`'s rate under kByExpectedTokensSaved.
  uint64_t Worth(uint64_t tokens, CheckpointKind kind) const;
  // Puts `seq`'s planned checkpoints its state has passed, and its path reaches, into the tree;
  // its rolling one only `at_end` (Free with commit).
  void KeepPlanned(Sequence* seq, bool at_end, const TraceContext& ctx);
  // Moves `seq`'s rolling checkpoint to `position` (its slot, or a new one within the rolling
  // share of the checkpoint slots), appending it to `out`; counts it skipped when there is none.
  void PlanRolling(Sequence* seq, int64_t position, std::vector<PlannedCheckpoint>* out,
                   const TraceContext& ctx);
  // Releases `seq`'s planned checkpoints past `position`.
  void DropPlanned(Sequence* seq, int64_t position, const TraceContext& ctx);
  // The checkpoint `seq` rewinds to at `position` (> 0): the tree's, exactly there on its path.
  // FAILED_PRECONDITION naming the nearest one at or below when there is none (or `can_copy` is
  // false: the caller gave no plan to copy it with).
  absl::StatusOr<BlockId> RewindPoint(const Sequence& seq, int64_t position, bool can_copy) const;
  // The position of the nearest checkpoint on `seq`'s path at or below `position` (0: none).
  int64_t NearestCheckpoint(const Sequence& seq, int64_t position) const;
  // Drops the cached checkpoint in `slot`; `victim`: evicted for room (it ages the rest,
  // GreedyDualOrder::Evict), not dropped with its block or for a deeper one.
  void DropCheckpoint(BlockId slot, const TraceContext& ctx, bool victim = false);
  // What keeping a checkpoint at `offset` tokens into tree block `block` is worth in the eviction
  // order (KvCacheOptions::CheckpointEviction::kByTokensSaved): the tokens between it and the
  // next cached checkpoint up its path (all before it where there is none), what a prompt
  // resuming from it does not compute that it would without it; 0 least recently used.
  uint64_t TokensSaved(BlockId block, int32_t offset) const;   // a cached one
  uint64_t TokensBefore(BlockId block, int32_t offset) const;  // tokens [0, the checkpoint)
  void TouchCheckpoint(BlockId slot);                          // a cached one, just resumed
  // Everything a sequence holds in the state group, on its way out (Free).
  void ReleaseStates(Sequence* seq, bool commit, const TraceContext& ctx);

  // The window group (kv_cache_manager_window.cc). Where a window block is kept in the tree.
  struct WindowRecord {
    BlockId primary = kInvalidBlock;  // the tree block it holds the tokens of; invalid: none
    uint64_t stamp = 0;               // its key in window_lru_
    int32_t covered = 0;  // the tokens of `primary` it holds; block_size: a Stored event named it
  };
  int64_t SinkBlocks() const { return BlocksFor(sink_tokens_); }
  // The first table entry a sequence of `n` computed tokens still reads past its sinks: the one
  // holding token n - W + 1.
  int64_t WindowStart(int64_t n) const { return WindowStartBlock(n, window_tokens_, block_size_); }
  // Whether a sequence whose next query is at position `n` reads entry `index`.
  bool WindowNeeds(int64_t index, int64_t n) const {
    return index < BlocksFor(n) && (index < SinkBlocks() || index >= WindowStart(n));
  }
  // Cuts `match` to the longest prefix that every group can resume from: the window group holds
  // the window blocks it needs, the state group a checkpoint exactly there. Returns the
  // checkpoint (kInvalidBlock: none, or no state group) and adds the tokens each group cut.
  BlockId CutResumable(PrefixMatch* match, int64_t* no_checkpoint, int64_t* window_evicted,
                       std::optional<std::pair<BlockId, CheckpointKind>>* ghost = nullptr) const;
  // Cuts `match` at the deepest prefix whose needed window blocks the tree keeps. Returns whether
  // it cut anything.
  bool CutToWindow(PrefixMatch* match) const;
  // Whether writing token slot `slot` of window block `block` must go to a copy.
  bool WindowMustCopy(BlockId block, int32_t slot, uint32_t other_holders) const;
  // The window side of PlanGrow (after it), with the batch's window claims.
  void PlanWindowGrow(const Sequence& seq, int64_t window_ahead, WriteClaims* claims,
                      GrowPlan* plan) const;
  // Whether the window entry of the block `seq` ends inside is allocated (and so live).
  bool WindowPartialLive(const Sequence& seq) const {
    return seq.num_tokens % block_size_ != 0 &&
           static_cast<int64_t>(seq.window_table.size()) > seq.num_tokens / block_size_;
  }
  // The window side of PlanAllocate: which matched window blocks the sequence shares, and whether
  // it copies the partially matched one.
  void PlanWindowAllocate(const AllocateRequest& r, AllocateTally* tally, AllocatePlan* p) const;
  // Checks there are `blocks` free window blocks (reclaiming retired ones, then planning to evict
  // cached window blocks not in `keep`, least recently used first, into `victims`).
  absl::Status CheckWindowRoom(int64_t blocks, std::span<const BlockId> keep,
                               std::vector<BlockId>* victims, std::string_view what);
  // Checks the window group's namespace table has room for `namespaces`' slots; idle slots to
  // recycle go to `recycle`.
  absl::Status PlanWindowNamespaces(std::span<const std::pair<NamespaceId, int64_t>> namespaces,
                                    std::vector<NamespaceSlot>* recycle,
                                    std::string_view what) const;
  void EvictWindowPlanned(std::span<const BlockId> victims, const TraceContext& ctx);
  // The window side of ApplyGrow, AllocateBatch and Fork.
  void ApplyWindowGrow(const GrowPlan& plan, const TraceContext& ctx, DevicePlan* device_plan,
                       TableChange* change);
  void AdoptWindow(Sequence* seq, const AllocatePlan& p, int64_t num_tokens,
                   const TraceContext& ctx, DevicePlan* plan);
  void ForkWindow(const Sequence& parent, Sequence* child, const TraceContext& ctx,
                  DevicePlan* plan);
  // FAILED_PRECONDITION when `seq` cannot be truncated to `n` tokens: the window of n needs an
  // entry already released (the message names the lengths it can go back to).
  absl::Status CheckWindowTruncate(const Sequence& seq, int64_t n) const;
  // Releases window_table entries past `keep` (with ReleaseTail).
  void ReleaseWindowTail(Sequence* seq, size_t keep, const TraceContext& ctx);
  // Releases `seq`'s window entries a sequence of `computed` tokens no longer reads (SlideWindow).
  void ReleaseBeforeWindow(Sequence* seq, int64_t computed, const TraceContext& ctx);
  // Gives the tree the live window blocks of the published blocks of `seq` that have none, after
  // a Commit of its first `committed` tokens (those its window blocks hold).
  void KeepWindowBlocks(Sequence* seq, int64_t committed, const TraceContext& ctx);
  void DropWindowBlock(BlockId block, const TraceContext& ctx);  // a cached one
  void TouchWindowBlock(BlockId block);                          // a cached one, just matched
  absl::Status CheckWindows() const;
  absl::Status CheckWindowRefs() const;
  void WindowDebugString(std::string* out) const;
  // The cached checkpoints in eviction order, the floor and the kinds' rates (DebugString).
  void CheckpointDebugString(std::string* out) const;
  void SequenceWindowDebugString(const Sequence& seq, std::string* out) const;
  // Checks there is room for `blocks` new blocks: free ones, retired ones that can be reclaimed
  // (reclaimed now: housekeeping), then cached ones to evict (never the nodes in `keep`). The
  // evictions are planned into `victims`, for the caller to carry out once nothing can fail.
  absl::Status CheckRoom(int64_t blocks, std::span<const BlockId> keep,
                         std::vector<BlockId>* victims, std::string_view what);
  void EvictPlanned(std::span<const BlockId> victims, const TraceContext& ctx);
  TableChange ApplyGrow(const GrowPlan& plan, const TraceContext& ctx, DevicePlan* device_plan);
  // A new sequence's blocks, window blocks and state slot from its request's plan (AllocateBatch
  // once nothing can fail).
  void AdoptMatch(Sequence* seq, const AllocateRequest& r, const AllocatePlan& p,
                  const TraceContext& ctx, DevicePlan* plan);
  // Checks one Allocate request, matches its prompt and works out what it needs, adding that to
  // `tally`. Changes nothing.
  absl::Status PlanAllocate(const AllocateRequest& request, AllocateTally* tally,
                            AllocatePlan* plan) const;
  // Retain/Release through the pool, keeping the prefix cache's view of evictability current.
  void RetainBlock(BlockId block, const TraceContext& ctx);
  void ReleaseBlock(BlockId block, const TraceContext& ctx);
  // Releases table entries past `keep`, deepest first, unlocking tree nodes on the way.
  void ReleaseTail(Sequence* sequence, size_t keep, const TraceContext& ctx);
  // Adds `tokens` prompt tokens the prefix cache did not have to the counter of why `p`'s match
  // stopped.
  void CountMissed(const AllocatePlan& p, uint64_t tokens);
  absl::Status CountExhausted(absl::Status status);
  // Tokens each block of a batch is said to hold, by the sequences publishing it.
  using PublishClaims = absl::flat_hash_map<BlockId, std::vector<int32_t>>;
  // FAILED_PRECONDITION when publishing the first `num_tokens` of `seq`'s tokens (its known ones
  // followed by `extra`) would contradict the prefix cache (PrefixCache::Agrees) or, with
  // `claims`, another sequence of the same batch. Records this sequence's claims.
  absl::Status CheckPublish(const Sequence& seq, std::span<const int32_t> extra, int64_t num_tokens,
                            PublishClaims* claims) const;
  // Free() after its checks: publishes (kCommit), releases and forgets the sequence, at the call's
  // one clock reading `now_ns` (BeginCall's).
  void FreeChecked(Sequence* seq, OnFree on_free, int64_t now_ns);

  const int32_t block_size_;
  const int32_t max_blocks_per_seq_;
  const Clock* const clock_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<PrefixCache> cache_;  // null with the prefix cache off
  // The state group's slots (null without one). Every slot is zeroed or copied over whole when
  // it is handed out, so no bytes cross from one owner to the next: one namespace serves all.
  std::unique_ptr<BlockPool> states_;
  NamespaceSlot state_owner_;
  const int32_t checkpoint_slots_;
  const int32_t checkpoint_interval_;
  std::vector<CheckpointSlot> checkpoint_at_;            // by state slot
  absl::flat_hash_map<BlockId, BlockId> checkpoint_of_;  // tree block -> its checkpoint's slot
  // The cached ones, the next to evict first (KvCacheOptions::checkpoint_eviction).
  internal::GreedyDualOrder<BlockId> checkpoint_order_;
  const bool checkpoints_by_tokens_saved_;  // kByTokensSaved or kByExpectedTokensSaved
  const bool checkpoints_by_kind_;          // kByExpectedTokensSaved
  std::array<CheckpointKindRate, kNumCheckpointKinds> kind_rates_;
  double kept_since_decay_ = 0;
  absl::flat_hash_map<BlockId, CheckpointGhost> checkpoint_ghosts_;  // by tree block
  int64_t planned_checkpoints_ = 0;  // held by sequences (Sequence::checkpoints)
  int64_t rolling_checkpoints_ = 0;  // of those, rolling ones (at most checkpoint_slots_ / 4)
  // Checkpoints kept at a full block's end since TakePublishedCheckpoints (with the journal).
  const bool journal_checkpoints_;
  std::vector<PublishedCheckpoint> published_checkpoints_;
  // The window group's blocks (null without one), one namespace slot per sequence namespace as
  // in pool_ (a block crossing namespaces is scrubbed).
  std::unique_ptr<BlockPool> window_;
  const int32_t window_tokens_;
  const int32_t sink_tokens_;
  // The layer groups as events name them (KvEvent::group): all absent in a pool of one group.
  struct EventGroups {
    std::optional<KvEventGroup> main;
    std::optional<KvEventGroup> window;
    std::optional<KvEventGroup> state;
  };
  static EventGroups EventGroupsOf(const KvCacheOptions& options);
  const EventGroups event_groups_;
  // The lower tiers' blocks as the event log told them (AppendTierEvent), for SnapshotEvents and
  // for what ClearCache tells again after its AllBlocksCleared.
  TierEventView tier_events_;
  std::vector<WindowRecord> window_at_;              // by window block
  absl::flat_hash_map<BlockId, BlockId> window_of_;  // tree block -> its window block
  internal::StampedLru<BlockId> window_lru_;         // (stamp, window block) of those kept: O(1)
  std::vector<BlockId>
      widened_;  // tree blocks widened by the Commit under way (PrefixCache::Widen)
  uint64_t window_clock_ = 0;
  // Window blocks kept beside a full block since TakePublishedWindowBlocks (with the journal).
  const bool journal_windows_;
  std::vector<PublishedWindowBlock> published_windows_;

  absl::flat_hash_map<SequenceId, Sequence> sequences_;
  // Token buffers of freed sequences, for the next ones' (at most kSpareTokenBuffers, the largest
  // kept). Without them every long prompt's vector comes from fresh pages: malloc hands the top of
  // its heap back to the kernel when the freed sequence's buffer leaves it free, and the next
  // prompt's copy faults each page in again (a third of the copy's time at 512-token blocks).
  // Newest last, and taken first: the buffer freed last is the likeliest to be still cached, so
  // the next prompt's copy into it misses least.
  static constexpr size_t kSpareTokenBuffers = 16;
  std::vector<std::vector<int32_t>> spare_tokens_;
  absl::flat_hash_map<SessionId, SessionUsage> sessions_;
  absl::flat_hash_map<uint64_t, RefGroup> ref_groups_;
  const int64_t max_sequences_per_session_;              // 0: unlimited
  absl::flat_hash_map<NamespaceId, QuotaKey> quota_of_;  // namespaces that have a quota
  absl::flat_hash_map<QuotaKey, Quota> quotas_;
  // Tallies of dropped quotas, for the next new one; tallies are dense, 1 .. next_tally_ - 1.
  std::vector<uint32_t> free_tallies_;
  uint32_t next_tally_ = 1;
  // What a quota charges one block, one window block and one state slot (KvCacheOptions::
  // block_bytes; 1, 0, 0 without it, quota_bytes_ false).
  const bool quota_bytes_;
  const int64_t unit_block_;
  const int64_t unit_window_;
  const int64_t unit_state_;
  // With a state group: the live sequences (each holds one state slot) of each namespace that
  // has any.
  absl::flat_hash_map<NamespaceId, int64_t> states_by_ns_;
  const int32_t max_pins_;
  const int64_t max_pin_ttl_ns_;
  const int64_t max_pinned_blocks_;
  absl::flat_hash_map<PinId, Pin> pins_;
  absl::btree_set<std::pair<int64_t, PinId>> deadlines_;  // (expires_ns, pin) of every pin
  uint64_t next_pin_id_ = 1;
  uint64_t next_sequence_id_ = 1;
  uint64_t batch_serial_ = 0;  // stamps Sequence::batch_mark

  KvCacheStats counters_;  // only the call counters are kept here; the rest is computed
  // Sequences and pins that calls listing them have walked (ForEachSequence, ListPins,
  // FreeSession), and quota members walked (only CheckInvariants' recount of the quota totals):
  // what a call costs in entries it was not asked about shows here. Atomic: const
  // calls run concurrently. Read by tests (KvCacheManagerTestPeer::Visited).
  mutable std::atomic<uint64_t> visited_ = 0;
  uint64_t sequences_freed_ = 0;
  // The pool's and the window group's (PlanNamespaces, PlanWindowNamespaces); mutable: a refused
  // call changes nothing but what it learnt of the table.
  mutable FullTable full_table_;
  mutable FullTable full_window_table_;
};

}  // namespace kvpool
