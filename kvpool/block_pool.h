#pragma once

// BlockPool: the blocks of one KV pool as dense ids over per-block metadata records (DESIGN.md §4).
//
// Every block is in exactly one state:
//   FREE      refs == 0, on the free list (exactly once)
//   ACTIVE    refs  > 0, held by at least one sequence
//   CACHED    refs == 1 and that one reference is the prefix cache's (evictable)
//   RETIRING  refs == 0, released while device work touching it was in flight; it returns to the
//             free list only once that work's fences have passed, and is never handed out before
//
// The free list is LIFO (a just-freed block is warm in caches). Every hand-out bumps the block's
// generation so holders of (id, generation) can detect reuse. A release of a block with no
// reference is refused, reported (log + trace entry) and changes nothing: counts never wrap and a
// block never appears twice on the free list.
//
// The pool decides; it never touches KV memory. Hand-outs that cross namespaces are returned as
// fills with `scrub` set, for the caller to zero before the new owner can read them.
//
// Namespaces are registered into a small table of slots (at most max_namespaces at once). A slot
// is idle when no ACTIVE, CACHED or RETIRING block is owned by it and none of the caller's records
// names it (e.g. a sequence that holds no block; the caller counts them in, AddNamedBy); each slot
// keeps both counts, so the caller recycles idle slots when the table is full (IdleNamespaces,
// RecycleNamespaces) in O(slots), whatever the pool's size. A FREE block remembers the slot of its
// last owner and that slot's epoch then; recycling a slot bumps its epoch, so whichever namespace
// gets the slot next, handing the block out scrubs it. (Every 65,536th recycle of one slot its
// epoch wraps: its FREE blocks are then re-tagged kScrubOwner, one walk of the pool.)
//
// Tallies: the owner may file namespaces under a tally (SetTally, a small dense index it picks,
// e.g. one per quota group); the pool then keeps the ACTIVE blocks of each tally's namespaces
// summed as they change, so that a group's count costs one read however many namespaces it has.
// A namespace keeps its tally across slot recycling (it is filed by namespace, not by slot).
//
// Thread-compatible: the owner serializes calls (the daemon holds one coarse lock).

#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/block_residency.h"
#include "kvpool/block_trace.h"
#include "kvpool/fence.h"
#include "kvpool/util/histogram.h"
#include "kvpool/util/strong_id.h"

namespace kvpool {

enum class BlockState : uint8_t { kFree, kActive, kCached, kRetiring };

std::string_view BlockStateName(BlockState state);

// A namespace registered with the pool, as a small dense index (0 = no namespace).
using NamespaceSlot = StrongId<struct NamespaceSlotTag, uint16_t>;

// The most namespaces a pool can register at once: slots 1..65534 (0 means none; 65535 is
// kScrubOwner).
inline constexpr int32_t kMaxNamespaceSlots = 65534;

// A freshly handed-out block, to be filled by the caller before the new owner reads it.
struct BlockFill {
  BlockId block;
  // The previous owner was another namespace: the block must be zeroed whatever the fill policy
  // (DESIGN.md §4.6). Otherwise filling is optional (the policy decides).
  bool scrub = false;

  friend bool operator==(const BlockFill&, const BlockFill&) = default;
};

struct BlockPoolOptions {
  int32_t num_blocks = 0;   // blocks in the pool; > 0
  int32_t trace_depth = 8;  // operations remembered per block: 0 (off) or a power of 2
  // Namespaces registered at once (idle ones included until recycled); in
  // [1, kMaxNamespaceSlots]. Smaller only in tests.
  int32_t max_namespaces = kMaxNamespaceSlots;
  // Answers whether device work has completed. Needed only by MarkInFlight(); not owned, must
  // outlive the pool.
  const FenceObserver* fences = nullptr;
  // Share of hand-outs whose residency is followed (BlockResidency), in [0, 1]; 0: none. The
  // seed makes the picks reproducible.
  double residency_sample = 0;
  uint64_t residency_seed = 0;
};

// Buckets of BlockPoolStats::fence_wait (seconds): 100 us to 10 s.
inline constexpr double kFenceWaitBucketsSeconds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                      0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                      1,      2.5,     5,      10};

struct BlockPoolStats {
  // Gauges, in blocks. free + active + cached + retiring == num_blocks.
  int32_t num_blocks = 0;
  int32_t free = 0;
  int32_t active = 0;
  int32_t cached = 0;
  int32_t retiring = 0;
  // Counters since creation.
  uint64_t allocated = 0;      // hand-outs from the free list
  uint64_t freed = 0;          // returns to the free list, directly or after retiring
  uint64_t retired = 0;        // last releases that had to wait for a fence
  uint64_t scrubs = 0;         // hand-outs that crossed namespaces (must be zeroed)
  uint64_t over_releases = 0;  // refused releases of unreferenced blocks (caller bugs)
  // Namespaces: registered now (gauge); slots recycled since creation (counter).
  int32_t namespaces = 0;
  uint64_t namespaces_recycled = 0;
  // Time each reclaimed block spent RETIRING (its last release to the reclaim pass that found
  // its fences passed), seconds.
  Histogram fence_wait{kFenceWaitBucketsSeconds};
  // Sampled block residency (vLLM's kv_block_* histograms).
  BlockResidencyStats residency;
};

class BlockPool final {
 public:
  // Errors: INVALID_ARGUMENT for num_blocks <= 0, a trace_depth that is not 0 or a power of 2,
  // max_namespaces outside [1, kMaxNamespaceSlots], or residency_sample outside [0, 1].
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const BlockPoolOptions& options);

  // Returns the slot of `ns`, registering it on first use (in a recycled slot when there is one).
  // Idempotent.
  // Errors: INVALID_ARGUMENT (ns is kNoNamespace); RESOURCE_EXHAUSTED while max_namespaces are
  // registered (recycle idle ones first). On error nothing has changed.
  absl::StatusOr<NamespaceSlot> RegisterNamespace(NamespaceId ns);
  // The slot of a registered namespace; nullopt if it has none (never had, or it was recycled).
  std::optional<NamespaceSlot> FindNamespace(NamespaceId ns) const;
  // How many more namespaces can be registered without recycling any.
  int32_t namespaces_left() const;
  // Blocks that have become FREE so far (stats().freed): while it stands still, no block has
  // left any namespace.
  uint64_t freed() const { return freed_; }
  // Blocks visited so far by the namespace table's upkeep: only the walk of a recycle whose slot
  // epoch wrapped. Tests hold it to that bound.
  uint64_t blocks_swept() const { return blocks_swept_; }
  // IdleNamespaces calls so far (each O(slots)).
  uint64_t idle_sweeps() const { return idle_sweeps_.load(std::memory_order_relaxed); }
  // One past the highest slot ever handed out (the size of a per-slot array).
  int32_t namespace_slots() const { return static_cast<int32_t>(namespaces_.size()); }

  // `n` more (or fewer) of the caller's records name `slot` (a live sequence of its namespace):
  // while any does, the slot is not idle. REQUIRES: `slot` is registered; the count stays >= 0.
  void AddNamedBy(NamespaceSlot slot, int32_t n) { slots_books_[slot.value()].named_by += n; }
  int32_t named_by(NamespaceSlot slot) const { return slots_books_[slot.value()].named_by; }
  // The registered slots that are idle: no ACTIVE, CACHED or RETIRING block is owned by them,
  // no record names them (AddNamedBy), and `held` (indexed by slot; shorter is fine) does not
  // mark them: the caller marks the slots the call itself is about to use. Ascending. Changes
  // nothing. O(namespace_slots()).
  std::vector<NamespaceSlot> IdleNamespaces(std::span<const uint8_t> held) const;
  // Unregisters the namespaces of `slots` and makes the slots reusable. Each slot's epoch moves
  // on, so the FREE blocks whose last owner was one of them are scrubbed at their next hand-out,
  // whichever namespace gets the slot (DESIGN.md §4.6). O(slots), and O(num_blocks) once in
  // 65,536 recycles of one slot (its epoch wraps: its FREE blocks are re-tagged kScrubOwner).
  // REQUIRES: every slot is in IdleNamespaces() (for what the caller holds), listed once.
  void RecycleNamespaces(std::span<const NamespaceSlot> slots);

  // Hands out `n` blocks to namespace `slot`: ACTIVE, refs 1, generation bumped. Appends their
  // ids to `out` and, when `fills` is not null, one BlockFill each (pass null when the caller will
  // overwrite the whole block, e.g. a copy-on-write target).
  // Errors: INVALID_ARGUMENT (n < 0, unknown slot), RESOURCE_EXHAUSTED with the shortfall when
  // fewer than n blocks are free. On error nothing has changed.
  // Inline: this and Release() are the pool's hot path.
  absl::Status Allocate(int32_t n, NamespaceSlot slot, const TraceContext& ctx,
                        std::vector<BlockId>* out, std::vector<BlockFill>* fills,
                        std::source_location site = std::source_location::current());

  // Takes one more reference. CACHED becomes ACTIVE.
  // Errors: NOT_FOUND (no such block), FAILED_PRECONDITION (FREE or RETIRING block, or the count
  // would saturate). On error nothing has changed.
  // Inline: a prefix hit retains every block it adopts.
  absl::Status Retain(BlockId block, const TraceContext& ctx,
                      std::source_location site = std::source_location::current());

  // Drops one (non-cache) reference. At zero the block is FREE, or RETIRING while in flight; a
  // block left with only the cache's reference becomes CACHED.
  // Errors: NOT_FOUND; FAILED_PRECONDITION when the caller holds no reference (FREE, RETIRING,
  // or only the cache's reference left): logged with the block's trace, recorded as
  // OVER_RELEASE, nothing else changed.
  absl::Status Release(BlockId block, const TraceContext& ctx,
                       std::source_location site = std::source_location::current());

  // The prefix cache takes its single reference on an ACTIVE block.
  // Errors: NOT_FOUND; FAILED_PRECONDITION if the block is not ACTIVE or already cache-held.
  // Inline, as is DropCacheRef(): the cache calls them for every block it stores and evicts.
  absl::Status AddCacheRef(BlockId block, const TraceContext& ctx,
                           std::source_location site = std::source_location::current());

  // The prefix cache returns its reference (eviction). A block nobody else holds is freed (or
  // retires).
  // Errors: NOT_FOUND; FAILED_PRECONDITION if the cache holds no reference on it.
  absl::Status DropCacheRef(BlockId block, const TraceContext& ctx,
                            std::source_location site = std::source_location::current());

  // Records that device work touching `block` was queued up to `fence`. The block cannot become
  // FREE until that fence has passed.
  // Errors: NOT_FOUND; INVALID_ARGUMENT (timeline >= kMaxTimelines); FAILED_PRECONDITION (no
  // FenceObserver configured, or the block is FREE or RETIRING: no work may touch those).
  absl::Status MarkInFlight(BlockId block, Fence fence, const TraceContext& ctx,
                            std::source_location site = std::source_location::current());

  // The prefix cache served `block` to a new holder (a prefix hit): residency's access.
  // REQUIRES: Contains(block).
  void NoteCacheHit(BlockId block, const TraceContext& ctx) {
    if (ABSL_PREDICT_FALSE(residency_on_)) {
      residency_.OnAccess(block, meta_[Index(block)].generation, ctx.time_ns);
    }
  }

  // Moves every RETIRING block whose fences have passed to the free list, observing how long
  // each waited in fence_wait. Returns how many.
  int32_t ReclaimRetired(const TraceContext& ctx,
                         std::source_location site = std::source_location::current());

  // True when no device work recorded on `block` is still pending (it could be freed now).
  // REQUIRES: Contains(block).
  bool FencesPassed(BlockId block) const { return FencesPassed(Index(block)); }

  // Accessors. REQUIRES: Contains(block) for the per-block ones.
  bool Contains(BlockId block) const { return block.value() >= 0 && block.value() < num_blocks_; }
  BlockState state(BlockId block) const { return meta_[Index(block)].state; }
  uint32_t refs(BlockId block) const { return meta_[Index(block)].refs; }
  uint32_t generation(BlockId block) const { return meta_[Index(block)].generation; }
  bool cache_held(BlockId block) const { return meta_[Index(block)].cache_held != 0; }
  int64_t last_use(BlockId block) const { return meta_[Index(block)].last_use; }
  // The namespace the block was last handed to; kNoNamespace if never, or if that namespace's
  // slot has since been recycled.
  NamespaceId owner(BlockId block) const {
    const OwnerTag tag = meta_[Index(block)].owner;
    if (tag.slot >= namespaces_.size() || slot_epoch_[tag.slot] != tag.epoch) {
      return kNoNamespace;
    }
    return namespaces_[tag.slot];
  }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t num_retiring() const { return static_cast<int32_t>(retiring_.size()); }
  int32_t num_cached() const { return num_cached_; }
  int32_t num_active() const { return num_blocks_ - num_free() - num_retiring() - num_cached_; }
  // ACTIVE blocks whose owner is `slot` (what namespace quotas count).
  int32_t active_blocks(NamespaceSlot slot) const { return slots_books_[slot.value()].active; }

  // Files namespace `ns` under tally `tally` (0: none), registered or not: from now on its ACTIVE
  // blocks count in tally_active(tally), those it holds now included (moved from its old
  // tally's). It stays filed there while unregistered and when registered again. O(1) amortized;
  // the per-tally array grows to the largest tally used.
  void SetTally(NamespaceId ns, uint32_t tally);
  // The tally `ns` is filed under (0: none), and how many namespaces are filed under one.
  uint32_t tally_of(NamespaceId ns) const;
  size_t tallied_namespaces() const { return tally_of_.size(); }
  // ACTIVE blocks owned by the namespaces filed under `tally` (tally > 0). O(1).
  int64_t tally_active(uint32_t tally) const {
    return tally < active_by_tally_.size() ? active_by_tally_[tally] : 0;
  }
  BlockPoolStats stats() const;
  const BlockTrace& trace() const { return trace_; }

  // Checks every invariant of the class comment plus the bookkeeping that backs the accessors.
  // Returns INTERNAL naming the first violation. O(num_blocks).
  absl::Status CheckInvariants() const;

  // Every piece of state, in a canonical text form (tests compare it to prove a failed call
  // changed nothing; operators can dump it).
  std::string DebugString() const;

 private:
  friend class BlockPoolTestPeer;  // tests corrupt a pool on purpose to check CheckInvariants()

  // The owner slot of a FREE block whose last owner's slot wrapped its epoch (RecycleNamespaces):
  // never a registered slot, so handing the block out always scrubs it. Not 0: that means "never
  // handed out" (still zero).
  static constexpr uint16_t kScrubOwner = 0xFFFF;

  // A block's last owner: its slot, and the slot's epoch when the block was handed out (a FREE
  // block whose epoch is behind its slot's belonged to a namespace since recycled).
  struct OwnerTag {
    uint16_t slot = 0;  // 0: never handed out; or kScrubOwner
    uint16_t epoch = 0;
  };

  BlockPool(const BlockPoolOptions& options);

  absl::Status CheckNamespaces() const;
  absl::Status CheckTallies() const;
  // The free and retiring lists hold exactly the `free` FREE and `retiring` RETIRING blocks.
  absl::Status CheckLists(int32_t free, int32_t retiring) const;

  // `n` more (or fewer) ACTIVE blocks owned by `slot`: its count and its tally's. The branch
  // is as predictable as the pool's namespaces are (all tallied or not), and spares the pools
  // without quotas a store (BM_PoolAllocateFree measured it).
  void AddActive(uint16_t slot, int32_t n) {
    SlotBooks& books = slots_books_[slot];
    books.active += n;
    if (books.tally != 0) active_by_tally_[books.tally] += n;
  }

  // A count stops here: one more reference is refused rather than wrapping.
  static constexpr uint32_t kMaxRefs = 0xFFFFFFFEu;

  static size_t Index(BlockId block) { return static_cast<size_t>(block.value()); }
  bool FencesPassed(size_t i) const { return meta_[i].in_flight == 0 || PendingFencesPassed(i); }
  bool PendingFencesPassed(size_t i) const;
  // The error Retain() returns when its check fails.
  absl::Status RetainError(BlockId block) const;
  // The error Allocate() returns when its fast-path check fails.
  absl::Status AllocateError(int32_t n, NamespaceSlot slot) const;
  // AddCacheRef() and DropCacheRef() where the fast path does not apply: errors, or (a drop) a
  // block other holders keep or that must retire.
  absl::Status AddCacheRefError(BlockId block) const;
  absl::Status DropCacheRefSlow(BlockId block, const TraceContext& ctx,
                                const std::source_location& site);
  // Release() of a reference that leaves the block with other holders than the cache.
  absl::Status ReleaseSlow(BlockId block, const TraceContext& ctx,
                           const std::source_location& site);
  // Last reference gone: FREE, or RETIRING while in flight.
  void FreeOrRetire(BlockId block, const TraceContext& ctx, const std::source_location& site);
  void Retire(BlockId block, const TraceContext& ctx, const std::source_location& site);
  void PushFree(BlockId block) {
    const size_t i = Index(block);
    Meta& m = meta_[i];
    if (m.in_flight != 0) ClearFences(i);
    m.state = BlockState::kFree;
    --slots_books_[m.owner.slot].held;
    free_list_.push_back(block);
    ++freed_;
  }
  void ClearFences(size_t i);
  absl::Status ReportOverRelease(BlockId block, const TraceContext& ctx,
                                 const std::source_location& site, std::string_view why);

  const int32_t num_blocks_;
  const FenceObserver* const fences_;

  // A block's metadata, one record per block: every hot path (hand-out, release, the cache's
  // reference, eviction) reads and writes most of these fields for the same block together, so
  // one record costs one cache line where an array per field cost seven (replay at 16-token
  // blocks: the pool's stalls were those misses). 24 bytes.
  struct Meta {
    int64_t last_use = 0;     // time of the last hand-out or release (ns, pool clock)
    uint32_t refs = 0;        // includes the cache's reference
    uint32_t generation = 0;  // bumped on every hand-out
    OwnerTag owner;           // last owner
    BlockState state = BlockState::kFree;
    uint8_t cache_held = 0;  // 1 when one of refs is the prefix cache's
    uint8_t in_flight = 0;   // bit t: pending_[.][t] holds an unfinished fence
  };
  static_assert(sizeof(Meta) == 24);
  std::vector<Meta> meta_;         // by block id
  std::vector<uint64_t> pending_;  // [num_blocks][kMaxTimelines] latest fence value per timeline

  std::vector<BlockId> free_list_;  // LIFO
  std::vector<BlockId> retiring_;
  int32_t num_cached_ = 0;

  const int32_t max_namespaces_;
  absl::flat_hash_map<NamespaceId, uint16_t> slots_;
  std::vector<NamespaceId> namespaces_;  // slot -> namespace; kNoNamespace: [0] and free slots
  // Per slot: the ACTIVE blocks it owns, the tally its namespace is filed under (0: none; always
  // 0 for a free slot), the blocks it owns that are not FREE, and the caller's records that name
  // it (both 0: idle). One struct: the hot paths touch them together.
  struct SlotBooks {
    int32_t active = 0;
    uint32_t tally = 0;
    int32_t held = 0;
    int32_t named_by = 0;
  };
  std::vector<SlotBooks> slots_books_;
  std::vector<uint16_t> slot_epoch_;  // per slot: bumped by each recycle (read once per Allocate)
  // Tally -> ACTIVE blocks of its namespaces ([0] unused: slots of no tally).
  std::vector<int32_t> active_by_tally_;
  absl::flat_hash_map<NamespaceId, uint32_t> tally_of_;  // namespaces filed under a tally (> 0)
  std::vector<uint16_t> free_slots_;  // recycled slots, descending (lowest reused first)
  uint64_t namespaces_recycled_ = 0;
  uint64_t blocks_swept_ = 0;
  // Atomic: IdleNamespaces is const, and const calls may run concurrently (CheckInvariants).
  mutable std::atomic<uint64_t> idle_sweeps_ = 0;

  uint64_t allocated_ = 0;
  uint64_t freed_ = 0;
  uint64_t retired_ = 0;
  uint64_t scrubs_ = 0;
  uint64_t over_releases_ = 0;
  // Whether residency_ samples (residency_sample > 0): the hot paths test this flag, which sits
  // beside the counters they update, and touch residency_ only when it is set.
  const bool residency_on_;

  BlockTrace trace_;
  // Observability kept apart from the fields every call touches (after them, so that adding
  // it moved none of theirs).
  Histogram fence_wait_{kFenceWaitBucketsSeconds};
  BlockResidency residency_;
};

inline absl::Status BlockPool::Allocate(int32_t n, NamespaceSlot slot, const TraceContext& ctx,
                                        std::vector<BlockId>* out, std::vector<BlockFill>* fills,
                                        std::source_location site) {
  const uint16_t owner = slot.value();
  if (ABSL_PREDICT_FALSE(n < 0 || n > num_free() || owner == 0 || owner >= namespaces_.size() ||
                         namespaces_[owner] == kNoNamespace)) {
    return AllocateError(n, slot);
  }
  // The record array in a local: stores through its uint8_t fields would otherwise force the
  // compiler to reload every member after each one.
  Meta* const meta = meta_.data();
  SlotBooks& books = slots_books_[owner];
  const OwnerTag mine{owner, slot_epoch_[owner]};
  const uint32_t mine_bits = std::bit_cast<uint32_t>(mine);
  const size_t top = free_list_.size();
  const BlockId* const free_top = free_list_.data() + top;
  // Written in place, not pushed: no capacity check per block.
  out->resize(out->size() + static_cast<size_t>(n));
  BlockId* const out_end = out->data() + out->size() - n;
  BlockFill* fills_end = nullptr;
  if (fills != nullptr) {
    fills->resize(fills->size() + static_cast<size_t>(n));
    fills_end = fills->data() + fills->size() - n;
  }
  uint64_t scrubs = 0;
  for (int32_t k = 0; k < n; ++k) {
    const BlockId block = free_top[-1 - k];
    const size_t i = Index(block);
    Meta& m = meta[i];
    m.state = BlockState::kActive;
    m.refs = 1;
    m.last_use = ctx.time_ns;
    const uint32_t generation = ++m.generation;
    const uint32_t last = std::bit_cast<uint32_t>(m.owner);
    m.owner = mine;
    if (fills_end != nullptr) {
      // Handed out before (not 0), to another namespace or to this slot before it was recycled:
      // zeroed before it is read. (Slot and epoch compared at once.)
      const bool scrub = last != 0 && last != mine_bits;
      scrubs += scrub;
      fills_end[k] = BlockFill{block, scrub};
    }
    out_end[k] = block;
    trace_.Record(block, BlockOp::kAllocate, 1, generation, ctx, site);
  }
  free_list_.resize(top - static_cast<size_t>(n));
  if (ABSL_PREDICT_FALSE(residency_on_)) {
    residency_.OnHandOut({out_end, static_cast<size_t>(n)}, &meta[0].generation,
                         sizeof(Meta) / sizeof(uint32_t), ctx.time_ns);
  }
  scrubs_ += scrubs;
  books.held += n;
  AddActive(owner, n);
  allocated_ += static_cast<uint64_t>(n);
  return absl::OkStatus();
}

// Always inlined: the compiler otherwise calls it from PrefixCache::ReleasePath, once per block
// of every finished prompt.
ABSL_ATTRIBUTE_ALWAYS_INLINE inline absl::Status BlockPool::Release(BlockId block,
                                                                    const TraceContext& ctx,
                                                                    std::source_location site) {
  // Fast path: the last reference of an ACTIVE block with no device work in flight.
  if (ABSL_PREDICT_TRUE(Contains(block))) {
    Meta& m = meta_[Index(block)];
    if (ABSL_PREDICT_TRUE(m.state == BlockState::kActive && m.refs == 1 && m.in_flight == 0)) {
      const uint16_t owner = m.owner.slot;
      const uint32_t generation = m.generation;
      m.refs = 0;
      m.state = BlockState::kFree;
      m.last_use = ctx.time_ns;
      --slots_books_[owner].held;
      AddActive(owner, -1);
      free_list_.push_back(block);
      ++freed_;
      trace_.Record(block, BlockOp::kFree, 0, generation, ctx, site);
      return absl::OkStatus();
    }
    if (m.state == BlockState::kActive && m.refs == 1) {
      m.refs = 0;
      AddActive(m.owner.slot, -1);
      FreeOrRetire(block, ctx, site);
      return absl::OkStatus();
    }
    // A sequence's last reference of a block the prefix cache holds too: CACHED.
    if (m.state == BlockState::kActive && m.refs == 2 && m.cache_held != 0) {
      m.refs = 1;
      m.state = BlockState::kCached;
      ++num_cached_;
      AddActive(m.owner.slot, -1);
      m.last_use = ctx.time_ns;
      trace_.Record(block, BlockOp::kRelease, 1, m.generation, ctx, site);
      return absl::OkStatus();
    }
  }
  return ReleaseSlow(block, ctx, site);
}

inline absl::Status BlockPool::Retain(BlockId block, const TraceContext& ctx,
                                      std::source_location site) {
  if (ABSL_PREDICT_TRUE(Contains(block))) {
    Meta& m = meta_[Index(block)];
    const bool held = m.state == BlockState::kActive || m.state == BlockState::kCached;
    if (ABSL_PREDICT_TRUE(held && m.refs < kMaxRefs)) {
      if (m.state == BlockState::kCached) {
        m.state = BlockState::kActive;
        --num_cached_;
        AddActive(m.owner.slot, 1);
      }
      const uint32_t refs = ++m.refs;
      trace_.Record(block, BlockOp::kRetain, refs, m.generation, ctx, site);
      return absl::OkStatus();
    }
  }
  return RetainError(block);
}

inline absl::Status BlockPool::AddCacheRef(BlockId block, const TraceContext& ctx,
                                           std::source_location site) {
  if (ABSL_PREDICT_TRUE(Contains(block))) {
    Meta& m = meta_[Index(block)];
    if (ABSL_PREDICT_TRUE(m.state == BlockState::kActive && m.cache_held == 0 &&
                          m.refs < kMaxRefs)) {
      m.cache_held = 1;
      const uint32_t refs = ++m.refs;
      trace_.Record(block, BlockOp::kCacheRef, refs, m.generation, ctx, site);
      return absl::OkStatus();
    }
  }
  return AddCacheRefError(block);
}

inline absl::Status BlockPool::DropCacheRef(BlockId block, const TraceContext& ctx,
                                            std::source_location site) {
  // Fast path: an eviction, the cache's the only reference (CACHED) and no device work in flight.
  if (ABSL_PREDICT_TRUE(Contains(block))) {
    Meta& m = meta_[Index(block)];
    if (ABSL_PREDICT_TRUE(m.cache_held != 0 && m.refs == 1 && m.in_flight == 0)) {
      m.cache_held = 0;
      m.refs = 0;
      --num_cached_;
      m.last_use = ctx.time_ns;
      if (ABSL_PREDICT_FALSE(residency_on_)) residency_.OnEvict(block, m.generation, ctx.time_ns);
      PushFree(block);
      trace_.Record(block, BlockOp::kFree, 0, m.generation, ctx, site);
      return absl::OkStatus();
    }
  }
  return DropCacheRefSlow(block, ctx, site);
}

}  // namespace kvpool
