#pragma once

// HostBlockStore: the host tier (L2, DESIGN.md §9), a fixed arena of block-sized slots in host
// memory, content-addressed like the Redis tier (namespace, layout, chained hash) and evicting
// least recently used slots when full. The daemon writes every block the device pool publishes
// through to it (an inclusive cache, SGLang HiCache's write-through policy) and looks it up,
// before Redis, on a local miss; a hit is copied into a fresh device block that its sequence
// sees only after the copy's fence (daemon/engine/tiers.h).
//
// Every slot remembers its block's parent hash and coverage, and Lookup follows the chain: a
// block whose stored parent is not the one asked for is a miss, so a hash collision cannot splice
// two chains. Payload lengths are the store's fixed block size; a Put of another size is refused.
//
// Thread-safe (one mutex; a Put or Lookup holds it for its memcpy, a few microseconds per block).
// The daemon places the slots in page-locked memory on CUDA (the second Create); tests and the
// replay let the store allocate its own.
//
// Pinned reads (LookupPinned): the daemon's promotions copy a hit straight from its slot into the
// device pool (one copy, on the transfer stream), so the slot must keep its bytes until that copy
// has run. A pinned slot is out of the LRU list: no Put evicts or overwrites it, an Invalidate
// drops it from the index but frees it only when the last pin goes, and a Put of its key only
// counts already_present. When every slot is pinned, a Put of a new block is dropped (counted in
// dropped_queue_full: the store has no room now).
//
// Fair by tenant: each tenant's blocks (by their tenant tag) are a share with its own LRU order,
// and a full store makes room in the share with the most blocks per unit of weight
// (internal::FairSlotLru; SetTenantWeight). A tenant that floods the tier evicts its own blocks,
// not another tenant's prefix. Blocks without a tenant tag share one order, as do tenants past
// `max_shares`; with max_shares 0 the store is one LRU order.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tier/internal/fair_slot_lru.h"
#include "tier/remote_tier.h"

namespace kvpool::tier {

class HostBlockStore final : public RemoteTier {
 public:
  // Tenant shares by default: the pool's own default (EngineOptions::eviction_shares).
  static constexpr int32_t kDefaultShares = 16;

  // `blocks` slots of `block_bytes` each, at most `max_shares` tenant shares (0: one LRU order
  // for all). Errors: INVALID_ARGUMENT (sizes not positive, the arena would pass 2^46 bytes, or
  // max_shares negative), RESOURCE_EXHAUSTED (the arena cannot be allocated).
  static absl::StatusOr<std::unique_ptr<HostBlockStore>> Create(
      int64_t blocks, int64_t block_bytes, int32_t max_shares = kDefaultShares);
  // The same over `memory` the caller owns (blocks * block_bytes bytes at least, outliving the
  // store): page-locked memory on CUDA (Device::AllocateHostBuffer), so copies to and from the
  // device run at full speed. Errors: INVALID_ARGUMENT (sizes, or no memory).
  static absl::StatusOr<std::unique_ptr<HostBlockStore>> Create(
      int64_t blocks, int64_t block_bytes, std::byte* memory, int32_t max_shares = kDefaultShares);

  // The weight of the blocks tagged `tenant` (NamespaceTags::tenant) in the fair order: a tenant
  // of weight 3 keeps about three times the blocks of one of weight 1 when both fill the store.
  // Errors: INVALID_ARGUMENT (weight not in [1, 10^6], or tenant 0), RESOURCE_EXHAUSTED (every
  // share is taken: its blocks stay in the default share, weight 1); nothing changed.
  absl::Status SetTenantWeight(uint64_t tenant, int32_t weight) override;
  // Blocks of `tenant`'s own share now, and those evicted from it to make room.
  int64_t stored_by(uint64_t tenant) const;
  uint64_t evicted_from(uint64_t tenant) const;
  // The fair order is well formed and agrees with the slots. O(capacity).
  absl::Status CheckInvariants() const;

  // Told of every block stored (stored true) and every block dropped, to make room or by
  // Invalidate (false),
  // after the store's lock is released, on the thread that called Put.
  using Listener = std::function<void(const BlockSpace& space, const BlockHash& hash,
                                      const BlockHash& parent, bool stored)>;
  // REQUIRES: no Put has run yet (the listener is read without a lock).
  void set_listener(Listener listener) { listener_ = std::move(listener); }

  // Copies the block into a slot at once (the least recently used one when full) and returns
  // true; false (counted in dropped_write_errors) when its size is not block_bytes(). A block
  // already stored is only touched (already_present).
  bool Put(const BlockSpace& space, const BlockToStore& block) override;
  absl::Status Flush(absl::Duration) override { return absl::OkStatus(); }  // Put is synchronous
  RemoteTierStats stats() const override;

  // Drops every block whose tags `filter` matches (an invalidation; the listener hears each as
  // dropped). Returns how many. O(capacity).
  int64_t Invalidate(const TagFilter& filter);

  // Slots pinned by LookupPinned: move-only; their bytes stay as they are until Release (or
  // destruction). REQUIRES at Release: nothing still reads them (the daemon waits for its copies'
  // fence first, TierSet::Recycle). The store outlives its pins.
  class Pins final {
   public:
    Pins() = default;
    Pins(Pins&& other) noexcept
        : store_(std::exchange(other.store_, nullptr)), slots_(std::move(other.slots_)) {}
    Pins& operator=(Pins&& other) noexcept;
    Pins(const Pins&) = delete;
    Pins& operator=(const Pins&) = delete;
    ~Pins() { Release(); }

    int64_t size() const { return static_cast<int64_t>(slots_.size()); }
    // Pinned block i's bytes (block_bytes() of them). REQUIRES: i < size() (checked).
    std::span<const std::byte> block(size_t i) const;
    // Unpins every slot; idempotent.
    void Release();

   private:
    friend class HostBlockStore;
    HostBlockStore* store_ = nullptr;
    std::vector<int32_t> slots_;
  };

  // Lookup without a copy: pins the slots of the longest leading run of `hashes` (a chain after
  // `parent`) the store holds, and touches them as a Lookup does. Counted as a Lookup. Never
  // fails: a mismatch ends the run.
  Pins LookupPinned(const BlockSpace& space, const BlockHash& parent,
                    std::span<const BlockHash> hashes);

  int64_t capacity() const { return capacity_; }
  int64_t pinned() const;  // slots pinned now (each counted once, however many pins it has)
  int64_t block_bytes() const { return block_bytes_; }
  int64_t stored() const;    // blocks held now
  uint64_t evicted() const;  // blocks dropped to make room, since creation

 protected:
  LookupResult LookupChecked(const BlockSpace& space, const BlockHash& parent,
                             std::span<const BlockHash> hashes,
                             std::span<const std::span<std::byte>> out) override;

 private:
  struct Key {
    uint64_t ns = 0;
    uint64_t layout = 0;
    BlockHash hash;
    friend bool operator==(const Key&, const Key&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine(std::move(h), k.ns, k.layout, k.hash);
    }
  };
  struct Slot {
    Key key;
    BlockHash parent;
    uint32_t coverage = 0;
    NamespaceTags tags;
    bool used = false;  // holds an indexed block (and is in lru_: in its list unless pinned)
    int32_t pins = 0;   // LookupPinned holds; > 0: out of the LRU list, never reused
  };

  HostBlockStore(int64_t blocks, int64_t block_bytes, std::byte* arena,
                 std::unique_ptr<std::byte[]> owned, int32_t max_shares);
  std::byte* SlotBytes(int32_t slot) const {
    return arena_ + static_cast<size_t>(slot) * static_cast<size_t>(block_bytes_);
  }
  // The slot a new block goes to, and the key it drops to make room (from the share the fair
  // order picks); -1 when every slot is pinned.
  int32_t TakeSlot(std::optional<Key>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot holding `hash` when it continues the chain after `parent`, else -1 (counted corrupt
  // when another chain holds the hash). `previous`: the slot of the chain's block before, or -1.
  int32_t FindInChain(const BlockSpace& space, const BlockHash& parent, const BlockHash& hash,
                      int32_t previous) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unpin(std::span<const int32_t> slots) ABSL_LOCKS_EXCLUDED(mu_);

  const int64_t capacity_;
  const int64_t block_bytes_;
  std::byte* const arena_;
  const std::unique_ptr<std::byte[]> owned_;  // arena_, when the store allocated it
  Listener listener_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Key, int32_t> index_ ABSL_GUARDED_BY(mu_);
  internal::FairSlotLru lru_ ABSL_GUARDED_BY(mu_);  // the used slots, by tenant share
  int32_t unused_ ABSL_GUARDED_BY(mu_) = 0;         // slots [unused_, capacity) never used yet
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // slots emptied by Invalidate
  RemoteTierStats stats_ ABSL_GUARDED_BY(mu_);
  uint64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pinned_ ABSL_GUARDED_BY(mu_) = 0;  // slots with pins > 0
};

}  // namespace kvpool::tier
