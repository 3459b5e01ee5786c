#pragma once

// KvCacheManager: sequences (block tables) over a BlockPool, owned by sessions, grouped into
// namespaces, with quotas. It decides and returns DevicePlans (blocks to copy and fill); the
// caller carries them out. It never touches KV memory.
//
// Contracts every mutating call keeps (DESIGN.md §4):
//  - Fail clean: every precondition (arguments, existence, ownership, table bound, quotas, free
//    blocks) is checked before anything changes. On error the state is exactly as before, except
//    that RETIRING blocks whose fences have passed may have been reclaimed (housekeeping any call
//    may do). RESOURCE_EXHAUSTED carries the shortfall (kvpool/util/errors.h).
//  - Grow by delta: a sequence of n tokens owns exactly ceil(n / block_size) blocks, never more
//    than max_blocks_per_seq; growing to a size it already has is a no-op.
//  - Copy-on-write: a sequence only writes into a block it holds alone. Growing into a shared
//    block (after Truncate into a block a fork shares, say) first moves the sequence onto a
//    private copy, returned as a BlockCopy. Fork copies the parent's partial last block the same
//    way at once, since both will write to it.
//
// Quotas: a namespace quota bounds the ACTIVE blocks the namespace owns (physical blocks; shared
// ones count once); a session quota bounds the block references its sequences hold (table
// entries; a block two of its sequences share counts twice).
//
// Thread-compatible: the owner serializes calls. Pointers and spans returned by accessors are
// valid until the next mutating call.

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/block_pool.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/strong_id.h"

namespace kvpool {

inline constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

// Copy every byte of block `src` into block `dst` (copy-on-write, tier moves).
struct BlockCopy {
  BlockId src;
  BlockId dst;

  friend bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

// Device work a call requires before the sequences it changed may be written or read. The caller
// enqueues it in order (copies first; fills touch other blocks) and marks the blocks it touches
// in flight before the next call, so no source can be reused under a pending copy.
struct DevicePlan {
  std::vector<BlockCopy> copies;
  std::vector<BlockFill> fills;  // freshly handed-out blocks (not copy targets)

  bool empty() const { return copies.empty() && fills.empty(); }
};

struct KvCacheOptions {
  int32_t block_size = 16;             // tokens per block; > 0
  int32_t num_blocks = 0;              // blocks in the pool; > 0
  int32_t max_blocks_per_seq = 0;      // bound on every block table; > 0
  int32_t trace_depth = 8;             // operations remembered per block: 0 (off) or a power of 2
  const Clock* clock = Clock::Real();  // not owned; outlives the manager
  const FenceObserver* fences = nullptr;  // not owned; see BlockPoolOptions
};

struct Sequence {
  SequenceId id;
  SessionId session;
  NamespaceId ns;
  NamespaceSlot slot;
  int64_t num_tokens = 0;
  std::vector<BlockId> table;  // token t lives in table[t / block_size], slot t % block_size
  uint64_t batch_mark = 0;     // KvCacheManager's scratch: finds a sequence listed twice
};

struct AllocateRequest {
  NamespaceId ns;          // != kNoNamespace
  int64_t num_tokens = 0;  // >= 0
};

struct GrowRequest {
  SequenceId sequence;
  int64_t num_tokens = 0;  // the new length; <= the current length is a no-op
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
  uint64_t cow_copies = 0;  // copy-on-write block copies planned
  uint64_t exhausted = 0;   // calls refused with RESOURCE_EXHAUSTED
};

class KvCacheManager final {
 public:
  // Errors: INVALID_ARGUMENT for a non-positive block_size, num_blocks or max_blocks_per_seq, a
  // trace_depth that is not 0 or a power of 2, or a null clock.
  static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(const KvCacheOptions& options);

  // Bounds the ACTIVE blocks namespace `ns` may own (kUnlimited to lift it). A quota below the
  // current use refuses further growth; it takes nothing away.
  // Errors: INVALID_ARGUMENT (negative quota, ns 0), RESOURCE_EXHAUSTED (namespace table full).
  absl::Status SetNamespaceQuota(NamespaceId ns, int64_t max_blocks);
  // Bounds the block references session `session`'s sequences may hold (kUnlimited to lift it).
  // Errors: INVALID_ARGUMENT (negative quota).
  absl::Status SetSessionQuota(SessionId session, int64_t max_block_refs);

  // Creates a sequence of `num_tokens` tokens owned by `caller` in the request's namespace.
  // Errors: INVALID_ARGUMENT (session 0, namespace 0, negative count), RESOURCE_EXHAUSTED
  // (table bound, quota, pool or namespace table, with the shortfall in blocks).
  absl::StatusOr<SequenceId> Allocate(SessionId caller, const AllocateRequest& request,
                                      DevicePlan* plan);
  // All-or-nothing: creates every sequence or none. Appends ids to `ids` in request order.
  // Errors: as Allocate, plus INVALID_ARGUMENT for an empty batch.
  absl::Status AllocateBatch(SessionId caller, std::span<const AllocateRequest> requests,
                             std::vector<SequenceId>* ids, DevicePlan* plan);

  // Grows `sequence` to `num_tokens` tokens, appending only the missing blocks.
  // Errors: NOT_FOUND (no such sequence), PERMISSION_DENIED (another session's),
  // INVALID_ARGUMENT (negative count), RESOURCE_EXHAUSTED (table bound, quota or pool).
  absl::Status Grow(SessionId caller, SequenceId sequence, int64_t num_tokens, DevicePlan* plan);
  // One scheduler step: grows every listed sequence or none.
  // Errors: as Grow, plus INVALID_ARGUMENT for an empty batch or a sequence listed twice.
  absl::Status GrowBatch(SessionId caller, std::span<const GrowRequest> requests, DevicePlan* plan);

  // Rewinds `sequence` to `num_tokens` tokens, releasing the blocks past the new end.
  // Errors: NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT (negative, or longer than the
  // sequence).
  absl::Status Truncate(SessionId caller, SequenceId sequence, int64_t num_tokens);

  // A new sequence of the same session and namespace sharing every full block of `sequence` by
  // reference; a partial last block is copied (the BlockCopy is in `plan`).
  // Errors: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED (quota or pool).
  absl::StatusOr<SequenceId> Fork(SessionId caller, SequenceId sequence, DevicePlan* plan);

  // Releases every block of `sequence` and forgets it.
  // Errors: NOT_FOUND, PERMISSION_DENIED.
  absl::Status Free(SessionId caller, SequenceId sequence);

  // Frees every sequence of `session` (its client went away). Returns how many. The session's
  // quota setting is forgotten too.
  int64_t FreeSession(SessionId session);

  // Records that device work queued up to `fence` touches `blocks` (the caller has just enqueued
  // a plan, a kernel or a copy over them): none of them returns to the free list before the fence
  // has passed. All-or-nothing.
  // Errors: as BlockPool::MarkInFlight; nothing is marked on error.
  absl::Status MarkInFlight(std::span<const BlockId> blocks, Fence fence);

  // Moves RETIRING blocks whose fences have passed to the free list. Returns how many.
  int32_t ReclaimRetired();

  // Accessors.
  const Sequence* Find(SequenceId sequence) const;
  void ForEachSequence(absl::FunctionRef<void(const Sequence&)> fn) const;
  const BlockPool& pool() const { return *pool_; }
  int32_t block_size() const { return block_size_; }
  int32_t max_blocks_per_seq() const { return max_blocks_per_seq_; }
  KvCacheStats stats() const;

  // The pool's invariants, plus: every block's reference count equals the table entries that
  // name it plus the cache's reference; tables hold only ACTIVE blocks and exactly
  // ceil(num_tokens / block_size) of them, within max_blocks_per_seq; per-session usage matches.
  // Returns INTERNAL naming the first violation.
  absl::Status CheckInvariants() const;

  // All state in canonical text form (pool, sequences by id, sessions, quotas).
  std::string DebugString() const;

 private:
  struct SessionUsage {
    int64_t block_refs = 0;
    int64_t sequences = 0;
    int64_t quota = kUnlimited;
  };

  // What one sequence's growth needs, worked out before anything changes.
  struct GrowPlan {
    Sequence* sequence = nullptr;
    int64_t num_tokens = 0;
    int32_t new_blocks = 0;  // appended to the table
    bool cow = false;        // the block being written is shared: move onto a private copy
  };

  KvCacheManager(const KvCacheOptions& options, std::unique_ptr<BlockPool> pool);

  int64_t BlocksFor(int64_t num_tokens) const {
    return num_tokens / block_size_ + (num_tokens % block_size_ != 0 ? 1 : 0);
  }
  TraceContext Context(SessionId session, SequenceId sequence) const {
    return TraceContext{session, sequence, clock_->NowNanos()};
  }
  // The sequence, if `caller` owns it. Errors: NOT_FOUND, PERMISSION_DENIED.
  absl::StatusOr<Sequence*> Owned(SessionId caller, SequenceId sequence);
  // Checks the table bound and works out the blocks a growth needs. `cow_taken` counts the
  // references that copy-on-writes planned earlier in the same batch will drop.
  absl::Status PlanGrow(Sequence* sequence, int64_t num_tokens,
                        std::vector<std::pair<BlockId, uint32_t>>* cow_taken, GrowPlan* plan) const;
  // Checks quotas and free blocks for new blocks charged to namespaces (`by_ns`, each listed
  // once) and `refs` more references held by `session`. Reclaims retired blocks if short.
  absl::Status CheckCapacity(std::span<const std::pair<NamespaceId, int64_t>> by_ns,
                             SessionId session, int64_t refs, std::string_view what);
  void ApplyGrow(const GrowPlan& plan, const TraceContext& ctx, DevicePlan* device_plan);
  void ReleaseTail(Sequence* sequence, size_t keep, const TraceContext& ctx);
  absl::Status CountExhausted(absl::Status status);

  const int32_t block_size_;
  const int32_t max_blocks_per_seq_;
  const Clock* const clock_;
  std::unique_ptr<BlockPool> pool_;

  absl::flat_hash_map<SequenceId, Sequence> sequences_;
  absl::flat_hash_map<SessionId, SessionUsage> sessions_;
  std::vector<int64_t> ns_quota_;  // by namespace slot
  uint64_t next_sequence_id_ = 1;
  uint64_t batch_serial_ = 0;  // stamps Sequence::batch_mark

  KvCacheStats counters_;  // only the call counters are kept here; the rest is computed
};

}  // namespace kvpool
