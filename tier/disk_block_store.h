#pragma once

// DiskBlockStore: the disk tier (DESIGN.md §9, docs/tiers.md), a content-addressed block store in
// a directory on a local file system, with a byte budget, between the host tier and Redis. The
// daemon writes every published block behind the host tier (Put, write-behind, never blocks) and
// reads it on a local miss after the host tier (Lookup); what it holds survives a restart: Open
// rebuilds the index from the directory, so the first request after a restart that shares a
// prefix with requests from before it finds the prefix here.
//
// Format: disk_format.h (a superblock, fixed record slots of the block's bytes padded to 4096,
// and a 128-byte index entry per slot carrying the block's names, tags and a Poly1305 tag under
// the deployment secret). I/O: whole blocks, with runs of adjacent slots as one preadv / pwritev,
// O_DIRECT where the file system allows it, from the caller's thread for lookups and from one
// writer thread for writes (docs/tiers.md has the measurements behind that choice).
//
// Guarantees:
// - Never a wrong byte: a block is returned only after its entry's tag verified over the bytes
//   just read, for the asking namespace, layout, chained hash and parent; anything else (a torn
//   or truncated slot, a slot overwritten after its entry was written, another layout's, model's
//   or secret's file, bytes written without the secret) is a miss, counted in `corrupt` (and in
//   `forged` when the tag fails) and dropped.
// - A full or failing disk (ENOSPC, EIO, EROFS) is a miss or a dropped write, counted; enough
//   failures in a row open a breaker (DiskTierOptions), after which lookups miss and writes drop
//   at once until a probe succeeds. Put never blocks: a full write queue drops and counts.
// - The least recently used record makes room once the budget is full (a hit or a write makes a
//   record the most recent; the order survives a restart by each entry's write sequence).
// - Open starts empty, and says why (disk_stats().started_empty, logged), when the directory was
//   written by another format version, under another deployment secret, for another layout or
//   another model; damaged index entries are dropped one by one.
//
// Thread-safe: any number of threads may call Lookup / Put / Flush / Invalidate / stats at once.
// One mutex guards the index; no lock is held across I/O. Lookups read on their caller's thread.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/util/clock.h"
#include "tier/circuit_breaker.h"
#include "tier/disk_format.h"
#include "tier/disk_tier_options.h"
#include "tier/internal/disk_file.h"
#include "tier/internal/fair_slot_lru.h"
#include "tier/remote_tier.h"
#include "tier/secret.h"

namespace kvpool::tier {

// The disk tier's figures beyond RemoteTierStats.
struct DiskTierStats {
  int64_t capacity_blocks = 0;  // record slots the budget gives
  int64_t blocks = 0;           // records held now
  uint64_t evicted = 0;         // records dropped to make room
  uint64_t invalidated = 0;     // records dropped by Invalidate (queued writes included)
  uint64_t read_errors = 0;     // reads that failed (I/O errors): misses
  uint64_t write_errors = 0;    // batches whose write failed (full or failing disk)
  bool direct_io = false;       // O_DIRECT is in use
  // The rebuild at Open.
  int64_t recovered_blocks = 0;  // records found in the index and kept
  int64_t scan_dropped = 0;      // damaged or duplicate index entries dropped
  int64_t scan_ns = 0;           // time Open took to rebuild the index
  std::string started_empty;     // why Open discarded what it found ("" when it did not)
};

class DiskBlockStore final : public RemoteTier {
 public:
  // Opens (or makes) the store in options.directory for blocks of `block_bytes` of the layout
  // `layout_fingerprint`, rebuilds the index from what is there, and starts the writer. Records
  // are sealed under (a copy of) `secret`; its fingerprint, never the secret, is written.
  // Errors: INVALID_ARGUMENT naming the bad option; the errno of a file operation that failed
  // (the directory cannot be made or opened, the files cannot be sized). REQUIRES: `clock`
  // outlives the store (it times the breaker and Flush).
  static absl::StatusOr<std::unique_ptr<DiskBlockStore>> Open(const DiskTierOptions& options,
                                                              const DeploymentSecret& secret,
                                                              uint64_t layout_fingerprint,
                                                              int64_t block_bytes,
                                                              const Clock* clock = Clock::Real());
  // Writes what is queued (the queue is bounded), then stops the writer.
  ~DiskBlockStore() override;
  DiskBlockStore(const DiskBlockStore&) = delete;
  DiskBlockStore& operator=(const DiskBlockStore&) = delete;

  // Told of every record stored (stored true) and every record dropped (to make room, by
  // Invalidate, or found damaged: false), with no lock held, on the thread that caused it.
  using Listener = std::function<void(const BlockSpace& space, const BlockHash& hash,
                                      const BlockHash& parent, bool stored)>;
  // REQUIRES: no Put, Lookup or Invalidate has run yet.
  void set_listener(Listener listener) { listener_ = std::move(listener); }
  // Tells the listener of every record held now (stored: true): those found at start, which
  // nothing else announces. In the order written, but each after its parent where that is held
  // too. REQUIRES: as set_listener, called once after it.
  void TellRecords() const;

  // RemoteTier (remote_tier.h). Put copies the block into the write queue and returns at once;
  // false (counted) when the queue is full or the block is not block_bytes long or of another
  // layout. While the breaker is open the writer drops what is queued (dropped_breaker_open).
  bool Put(const BlockSpace& space, const BlockToStore& block) override;
  // Waits until every block queued before the call was written or dropped, and the index
  // entries of dropped records (evicted, invalidated, failed) were cleared on disk. Errors:
  // DEADLINE_EXCEEDED after `timeout`; UNAVAILABLE when the writes are done but the breaker is
  // open with entries still to clear (the writer clears them once the disk takes writes again).
  // Either way the queue keeps draining.
  absl::Status Flush(absl::Duration timeout) override;
  RemoteTierStats stats() const override;
  DiskTierStats disk_stats() const;

  // Drops every record (and queued write) whose tags `filter` matches; their index entries are
  // cleared on disk by the writer. Returns how many records and queued writes were dropped.
  int64_t Invalidate(const TagFilter& filter);

  // The weight of tenant tag `tenant`'s records in the fair order (as the host tier's,
  // HostBlockStore::SetTenantWeight, with options.tenant_shares shares). Errors: INVALID_ARGUMENT
  // (weight not in [1, 10^6], or tenant 0), RESOURCE_EXHAUSTED (every share is taken).
  absl::Status SetTenantWeight(uint64_t tenant, int32_t weight) override;
  // Records of `tenant`'s own share now, and those evicted from it to make room.
  int64_t stored_by(uint64_t tenant) const;
  uint64_t evicted_from(uint64_t tenant) const;

  // The index, the free slots and the LRU order agree; the queue's accounting balances.
  absl::Status CheckInvariants() const;

 protected:
  LookupResult LookupChecked(const BlockSpace& space, const BlockHash& parent,
                             std::span<const BlockHash> hashes,
                             std::span<const std::span<std::byte>> out) override;

 private:
  struct Key {
    uint64_t ns = 0;
    BlockHash hash;
    friend bool operator==(const Key&, const Key&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.ns, k.hash);
    }
  };
  enum class SlotState : uint8_t { kFree, kWriting, kStored };
  struct Slot {
    IndexEntry entry;  // kStored: what the slot holds; kWriting: what it is being written with
    // kStored: in lru_, in its share's list; kWriting: in lru_, counted but out of the list.
    SlotState state = SlotState::kFree;
  };
  struct QueuedWrite {
    IndexEntry entry;
    internal::AlignedBuffer bytes;  // slot_bytes_, the block first
  };
  // A block a lookup found in the index, to read.
  struct Planned {
    int32_t slot = 0;
    IndexEntry entry;
  };
  // A change for the listener, told once the lock is released.
  struct Change {
    IndexEntry entry;
    bool stored = false;
  };
  struct Files {
    internal::DiskFile meta;
    internal::DiskFile data;
    internal::DiskFile index;
  };

  DiskBlockStore(const DiskTierOptions& options, const DeploymentSecret& secret,
                 uint64_t layout_fingerprint, int64_t block_bytes, int64_t slots, Files files,
                 const Clock* clock);
  // Opening, in steps (disk_block_store_open.cc).
  Superblock Wanted() const;  // what this store writes in its superblock
  absl::Status Prepare();
  absl::Status Reset();  // empties the directory's files, then writes Wanted()
  absl::Status Rebuild(int64_t old_slots);
  // Takes the index entry of `slot` read at start into the index (or drops it, counted).
  void AdoptEntry(int32_t slot, std::span<const std::byte> bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Tell(const std::vector<Change>& changes) const;
  // Takes `slot` out of the index and the LRU list and frees it; its entry is cleared on disk.
  void DropStored(int32_t slot, std::vector<Change>* changes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A free slot, or the least recently used record's; -1 when every slot is being written.
  int32_t TakeSlot(uint64_t tenant, std::vector<Change>* changes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Planned> PlanLookup(const BlockSpace& space, const BlockHash& parent,
                                  std::span<const BlockHash> hashes) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks [begin, end) of a plan in adjacent slots: one read, then each block's tag.
  struct Piece {
    size_t begin = 0;
    size_t end = 0;
    bool direct = false;  // read into the caller's buffers (else through a bounce buffer)
    absl::Status io;      // the read's outcome
    size_t verified = 0;  // blocks [begin, verified) passed their tags
  };
  static constexpr int kReadPieceBlocks = 16;  // blocks per read, at most
  static constexpr size_t kReadThreads = 4;    // pieces read at once, the caller's thread included
  void ReadPiece(std::span<const Planned> plan, std::span<const std::span<std::byte>> out,
                 Piece* piece) const;
  // Reads the planned slots into `out` (or bounce buffers) and verifies them; returns how many
  // leading ones verified.
  int64_t ReadVerified(std::span<const Planned> plan, std::span<const std::span<std::byte>> out);
  // `planned` failed its tag: counted corrupt and forged, and dropped, when its slot still holds
  // that record; a slot freed or rewritten since the plan is only a miss.
  void DropIfUnchanged(const Planned& planned) ABSL_LOCKS_EXCLUDED(mu_);

  void WriterLoop();
  void WriteBatch(std::vector<QueuedWrite>& batch, const std::vector<int32_t>& erased);
  // Zeroes the index entries of `slots`, in order; *cleared: how many before an error. Errors:
  // the failed write's (the rest are not tried).
  absl::Status ClearEntries(const std::vector<int32_t>& slots, size_t* cleared) const;
  // Records the batch's written slots (or frees them after a failed write), counts, and reports
  // to the breaker.
  void FinishBatch(const std::vector<QueuedWrite>& batch, const std::vector<int32_t>& slots,
                   const absl::Status& io, std::vector<Change>* changes) ABSL_LOCKS_EXCLUDED(mu_);
  // The batch's bytes in runs of adjacent slots, a sync as the policy says, then their entries.
  absl::Status WriteRecords(const std::vector<QueuedWrite>& batch,
                            const std::vector<int32_t>& slots) ABSL_LOCKS_EXCLUDED(mu_);
  bool SyncDue() ABSL_LOCKS_EXCLUDED(mu_);

  const DiskTierOptions options_;
  const DeploymentSecret secret_;
  const uint64_t layout_fingerprint_;
  const int64_t block_bytes_;
  const int64_t slot_bytes_;
  const int64_t slots_count_;
  const Files files_;
  const Clock* const clock_;
  CircuitBreaker breaker_;
  Listener listener_;

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, int32_t> index_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // popped from the back: lowest first
  internal::FairSlotLru lru_ ABSL_GUARDED_BY(mu_);  // the stored slots, by tenant share
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<QueuedWrite> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;   // writes ever queued
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;  // of those, written or dropped
  // Free slots whose entry still names a record on disk, to clear (a slot taken for a new
  // record leaves it: the new entry overwrites the old).
  absl::flat_hash_set<int32_t> erase_ ABSL_GUARDED_BY(mu_);
  int64_t erasing_ ABSL_GUARDED_BY(mu_) = 0;  // of erase_, taken by the writer's current batch
  // Invalidations while a batch was being written: its records are checked against them.
  std::vector<TagFilter> filters_in_batch_ ABSL_GUARDED_BY(mu_);
  int64_t last_sync_ns_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  RemoteTierStats counters_ ABSL_GUARDED_BY(mu_);
  DiskTierStats disk_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;
};

}  // namespace kvpool::tier
