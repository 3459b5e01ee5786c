#pragma once

// TierSet: one pool's lower tiers (DESIGN.md §9): a host tier (L2, tier::HostBlockStore), a disk
// tier (tier::DiskBlockStore, survives a restart) and a remote tier (L3, tier::RedisBlockStore),
// any of them, and the two ways blocks move between them and the device pool.
//
// Down (write-through): every full block the pool publishes is copied to host memory on the
// transfer stream, after the compute stream's work so far, and the block is marked in flight
// with that copy's fence, so it cannot be reused before its bytes are out (Stage, under the
// engine's lock, in the same lock hold as the publish). A writer thread waits for each copy's
// fence and offers the bytes to L2, the disk and L3. Staged copies are bounded: past the bound a
// block is dropped and counted, never waited for.
//
// Up (load on a local miss): Lookup asks L2, then the disk, then L3, each from where the one
// before stopped, for the chained hashes
// after the locally cached prefix; the engine copies the hits into fresh device blocks of a
// loader sequence on the transfer stream and publishes them only after that copy's fence
// (Engine::LoadFromTiers), so no sequence ever sees a block whose bytes are not there yet.
//
// Thread-safe. Lock order: Engine::mu_ -> TierSet::mu_ -> the device's stream locks.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/device.h"
#include "kernels/pool_layout.h"
#include "kvpool/kv_cache_manager.h"
#include "tier/disk_block_store.h"
#include "tier/disk_tier_options.h"
#include "tier/host_block_store.h"
#include "tier/redis_tier_options.h"
#include "tier/remote_tier.h"
#include "tier/secret.h"

namespace kvpool::daemon {

struct LockOrderPeer;

// Redis lookups a promotion makes for a checkpoint, deepest hit block first, at most.
inline constexpr int kMaxRemoteCheckpointProbes = 8;
// Mixed into the layout fingerprint of a checkpoint's Redis key ("ckptstat").
inline constexpr uint64_t kCheckpointKeySalt = 0x636b707473746174;
// Mixed into the layout fingerprint of a window-group block's Redis key ("windblok").
inline constexpr uint64_t kWindowKeySalt = 0x77696e64626c6f6b;

// Host memory the copies waiting for the tier writer may take, whatever staged_blocks says.
inline constexpr int64_t kMaxStagedBytes = int64_t{256} << 20;

struct TierOptions {
  int64_t host_blocks = 0;  // L2 capacity in blocks; 0: no host tier
  // The disk tier; disk.directory empty: none. The engine gives each pool its own directory
  // below it (PoolState::Create).
  tier::DiskTierOptions disk;
  tier::RedisTierOptions redis;  // L3; redis.enabled false: none
  // Device -> host copies waiting for the writer, at most (and at most kMaxStagedBytes of them).
  int64_t staged_blocks = 1024;
  // Blocks all lookups in flight may hold at once: host-tier slots pinned until their copy ran,
  // and staging buffers for the disk and remote tiers (host memory, pinned on CUDA; at most
  // kMaxStagedBytes of them); a lookup past it asks for fewer blocks (counted).
  int64_t lookup_blocks = 512;
  // State checkpoints the host tier keeps beside its blocks (a pool with a state group and a host
  // tier; docs/hybrid-groups.md §4, Tiers): 0 one per checkpoint interval of host_blocks (what
  // PoolState::Create resolves it to), -1 none, N. TierSet::Create takes the resolved count.
  int64_t host_checkpoints = 0;
  // Window-group blocks the host tier keeps beside its blocks (a pool with a window group and a
  // host tier; docs/tiers.md, Window blocks): 0 as many per host block as the device pool has
  // window blocks per block (what PoolState::Create resolves it to), -1 none, N.
  int64_t host_window_blocks = 0;
  // With a disk tier: bytes of state-checkpoint and window-block records it keeps beside its
  // blocks, on top of disk.capacity_bytes, in directories of their own (PoolState::Create sizes
  // them in the host tier's proportions, DiskComponentBytes); 0: none.
  int64_t disk_checkpoint_bytes = 0;
  int64_t disk_window_bytes = 0;
  // Tenant shares of each host store's fair order (tier::HostBlockStore; 0: one LRU order; the
  // disk stores' is disk.tenant_shares). PoolState::Create sets both from
  // EngineOptions::eviction_shares, the pool's own.
  int32_t tenant_shares = tier::HostBlockStore::kDefaultShares;
  bool enabled() const { return host_blocks > 0 || disk.enabled() || redis.enabled; }
};

// Figures of one pool's tiers: moves between the device pool and the tiers, and each store's own.
struct TierStats {
  bool host = false;    // a host tier is configured
  bool remote = false;  // a remote tier is configured
  bool disk = false;    // a disk tier is configured and open
  int64_t host_capacity_blocks = 0;
  int64_t host_blocks = 0;        // blocks in the host tier now
  uint64_t host_evicted = 0;      // blocks the host tier dropped to make room
  uint64_t host_invalidated = 0;  // blocks the host tier dropped by invalidation
  tier::RemoteTierStats host_store;
  tier::RemoteTierStats disk_store;
  tier::DiskTierStats disk_tier;
  tier::RemoteTierStats remote_store;
  // Demotions: published blocks copied out of the device pool toward the tiers.
  uint64_t demoted = 0;
  uint64_t demoted_bytes = 0;
  int64_t demote_ns = 0;  // copy time summed (fence waits of the writer)
  // Blocks, checkpoints and window blocks not copied: the staging bound was reached, or they
  // came after Stop().
  uint64_t demote_dropped_full = 0;
  // Copies the device failed, or could not order after the compute stream (StreamWait).
  uint64_t demote_failed = 0;
  int64_t demote_queued = 0;  // staged now
  // Promotions: tier hits copied into fresh device blocks and published.
  uint64_t lookups = 0;               // local misses looked up in the tiers
  uint64_t promoted_from_host = 0;    // blocks
  uint64_t promoted_from_disk = 0;    // blocks
  uint64_t promoted_from_remote = 0;  // blocks
  uint64_t promoted_bytes = 0;
  int64_t promote_ns = 0;       // copy time summed (enqueue to fence)
  uint64_t promote_failed = 0;  // hits not promoted: no room, device failure
  // Lookups done again: an eviction shrank the local match while the tiers were asked.
  uint64_t promote_raced = 0;
  // Promotions held for their call (Promotion): adopted by its allocation, or let go unused (the
  // call failed, was cancelled or its session ended first).
  uint64_t promote_adopted = 0;
  uint64_t promote_unused = 0;
  uint64_t lookup_truncated = 0;  // lookups cut short: every lookup buffer was in use
  // State checkpoints (a pool with a state group): kept in the host tier beside their blocks,
  // copied down (each a checkpoint kept at a full block's end) and promoted with a prefix.
  int64_t host_checkpoint_capacity = 0;
  int64_t host_checkpoints = 0;
  uint64_t demoted_checkpoints = 0;
  uint64_t promoted_checkpoints = 0;
  // Window-group blocks (a pool with a window group): kept in the host tier beside their
  // blocks, copied down (each kept beside a full block) and promoted with a prefix.
  int64_t host_window_capacity = 0;
  int64_t host_window_blocks = 0;
  uint64_t demoted_window_blocks = 0;
  uint64_t promoted_window_blocks = 0;
  // Records the disk tier holds in its stores of checkpoints and of window blocks.
  int64_t disk_checkpoints = 0;
  int64_t disk_window_blocks = 0;
};

class TierSet final {
 public:
  // Errors: INVALID_ARGUMENT (options, the disk tier's included), RESOURCE_EXHAUSTED (host
  // arena); those of RedisBlockStore::Create. A disk tier whose directory cannot be opened (the
  // environment, not the config) is left out and logged: the pool serves without it. `device`
  // outlives the set. The Redis and disk tiers' keys and MACs are derived under (a copy of)
  // `secret`. `clock` (the engine's; outlives the set) times Flush and the stores' breakers.
  static absl::StatusOr<std::unique_ptr<TierSet>> Create(const TierOptions& options,
                                                         kernels::Device* device,
                                                         const kernels::PoolLayout& layout,
                                                         const tier::DeploymentSecret& secret,
                                                         const Clock* clock);
  // The stores a set is made over (Create opens them from its options). Any may be null.
  struct Stores {
    std::unique_ptr<kernels::DeviceBuffer> host_memory;  // host's slots, kept as long as it
    std::unique_ptr<tier::HostBlockStore> host;
    std::unique_ptr<tier::RemoteTier> remote;
    std::unique_ptr<tier::DiskBlockStore> disk;
    // The components beside the blocks (docs/tiers.md, State checkpoints, Window blocks): host
    // stores of the layout's state_slot_bytes and window_block_bytes() (over their memory),
    // and disk stores of them (under the layout fingerprint salted for each).
    std::unique_ptr<kernels::DeviceBuffer> checkpoint_memory;
    std::unique_ptr<tier::HostBlockStore> checkpoints;
    std::unique_ptr<kernels::DeviceBuffer> window_memory;
    std::unique_ptr<tier::HostBlockStore> windows;
    std::unique_ptr<tier::DiskBlockStore> disk_checkpoints;
    std::unique_ptr<tier::DiskBlockStore> disk_windows;
  };
  TierSet(kernels::Device* device, const kernels::PoolLayout& layout, const Clock* clock,
          Stores stores, int64_t staged_blocks,
          int64_t lookup_blocks = TierOptions{}.lookup_blocks);
  ~TierSet();  // stops the writer after the copies already staged
  TierSet(const TierSet&) = delete;
  TierSet& operator=(const TierSet&) = delete;

  // Under the engine's lock, in the lock hold that published them: copies `published` blocks out
  // of `view` (the pool's arena) and marks them in flight in `cache` until the copy has run.
  void Stage(KvCacheManager& cache, const kernels::KvPoolView& view,
             std::span<const PublishedBlock> published);

  // Under the engine's lock, with Stage: copies the state checkpoints `published` (kept at a
  // full block's end, KvCacheManager::TakePublishedCheckpoints) out of `view`'s state slots
  // toward the host tier's checkpoints, and marks their slots in flight until the copy has run.
  // A no-op without a checkpoint store.
  void StageCheckpoints(KvCacheManager& cache, const kernels::KvPoolView& view,
                        std::span<const PublishedCheckpoint> published);
  bool keeps_checkpoints() const {
    return checkpoints_ != nullptr || disk_checkpoints_ != nullptr || remote_checkpoints_;
  }

  // Under the engine's lock, with Stage: copies the window-group blocks `published` (kept beside
  // a full block, KvCacheManager::TakePublishedWindowBlocks) out of `view`'s window region toward
  // the host tier's window store and Redis, and marks them in flight until the copy has run.
  // A no-op without either.
  void StageWindowBlocks(KvCacheManager& cache, const kernels::KvPoolView& view,
                         std::span<const PublishedWindowBlock> published);
  bool keeps_window_blocks() const {
    return windows_ != nullptr || disk_windows_ != nullptr || remote_windows_;
  }

  struct Found {
    int64_t hits = 0;       // leading blocks found
    int64_t from_host = 0;  // of which the host tier had the first ones
    int64_t from_disk = 0;  // and the disk tier the next ones (the remote tier the rest)
    // Blocks [0, from_host) are read in place: the host tier's slots, pinned (no copy; the slots
    // are page-locked on CUDA). Block i >= from_host is buffers[i - from_host]'s first
    // block_bytes(): staging buffers, host memory pinned on CUDA. Both go back with Recycle.
    tier::HostBlockStore::Pins host;
    std::vector<std::unique_ptr<kernels::DeviceBuffer>> buffers;
    // With a checkpoint store (LookupCheckpoint): the deepest chain index in the range asked
    // whose block has a state checkpoint in the host tier (-1: none), and its slot, pinned.
    int64_t checkpoint = -1;
    tier::HostBlockStore::Pins checkpoint_pin;                 // when the host tier had it
    std::unique_ptr<kernels::DeviceBuffer> checkpoint_buffer;  // else Redis's, read into it
    // The checkpoint's bytes. REQUIRES: checkpoint >= 0.
    std::span<const std::byte> checkpoint_bytes(int64_t bytes) const;
    // With window blocks in a tier (LookupWindow): window_pins[i] holds the window block of
    // chain index window_from + i, pinned, where the promotion needs it and the host tier has
    // it (empty Pins elsewhere); else window_buffers[i], Redis's, read into a buffer (null
    // elsewhere).
    int64_t window_from = 0;
    std::vector<tier::HostBlockStore::Pins> window_pins;
    std::vector<std::unique_ptr<kernels::DeviceBuffer>> window_buffers;
    // Chain index `entry`'s window block. REQUIRES: LookupWindow pinned it (checked).
    std::span<const std::byte> window_block(int64_t entry) const;
    // The last queued copy that reads the blocks above (Promotion::CopyHits): Recycle lets the
    // pins and buffers go only once it has passed.
    Fence reads;
    // REQUIRES: i < hits (checked: an index from a stale match must never read past them).
    std::span<const std::byte> block(size_t i, int64_t bytes) const;
  };
  // Outside any lock: the longest leading run of `hashes` (a chain after `parent`) the tiers
  // hold, L2 first (its slots pinned, not copied), then the disk from where L2 stopped, then L3
  // from where the disk stopped (into staging buffers). Never fails: a tier down or corrupt misses
  // (and so does a run longer than lookup_blocks allows now: it bounds the pinned slots and
  // staging buffers of all lookups together).
  Found Lookup(NamespaceId ns, const BlockHash& parent, std::span<const BlockHash> hashes);
  // Outside any lock, after Lookup: the deepest i in [from, upto) whose block (chain[i], after
  // chain[i - 1]) has a checkpoint in the host tier, pinned into found->checkpoint_pin
  // (found->checkpoint = i), or else on the disk (every one asked: a miss is the index's), or
  // else in Redis (which of the kMaxRemoteCheckpointProbes deepest it has in one round trip, then
  // a GET of those, deepest first, until one passes its checks: one in all when it does), read into
  // found->checkpoint_buffer; none: -1. A no-op without any.
  // Checkpoint buffers of all lookups together take at most kMaxStagedBytes (at least one):
  // past that Redis is not asked (counted in lookup_truncated).
  void LookupCheckpoint(NamespaceId ns, std::span<const BlockHash> chain, size_t from, size_t upto,
                        Found* found);
  // What a window group reads when a prompt resumes after `blocks` full blocks: its sinks'
  // blocks and those from the one holding token blocks * block_size - W + 1 on (the pool's
  // KvCacheManager::WindowNeeds, in blocks).
  struct WindowReach {
    int64_t block_size = 0;
    int64_t window_tokens = 0;
    int64_t sink_blocks = 0;
    int64_t Start(int64_t blocks) const {
      return WindowStartBlock(blocks * block_size, window_tokens, block_size);
    }
    bool Needs(int64_t i, int64_t blocks) const {
      return i < blocks && (i < sink_blocks || i >= Start(blocks));
    }
  };
  // Outside any lock, after Lookup: the deepest resume point in (from, upto] (in blocks) at which
  // every block in [from, point) the window `reach`es has a window block in the host tier
  // (pinned into found->window_pins), the disk or Redis. The disk, then Redis, are asked for what
  // a candidate point's window reaches and the host tier lacks (one lookup per run of blocks in
  // each, read into found->window_buffers), the deepest candidate first, then each next one for
  // what it reaches that no earlier one did, for at most kMaxWindowRounds candidates. Window
  // buffers of all lookups together take at most kMaxStagedBytes, past which they are not asked,
  // counted in lookup_truncated. Returns the point, or `from` when there is none (or window
  // blocks are in no tier).
  size_t LookupWindow(NamespaceId ns, std::span<const BlockHash> chain, size_t from, size_t upto,
                      const WindowReach& reach, Found* found);
  static constexpr int kMaxWindowRounds = 4;
  // Outside any lock, after Lookup (hits up to `upto`): the deepest point in (from, upto] a prompt
  // can resume from with what the tiers hold. With `checkpoint` (a state group): a point whose
  // last block has a checkpoint (LookupCheckpoint). With `window` (a window group): one at which
  // its window's blocks are there (LookupWindow). With both: a checkpoint whose window is whole,
  // trying the next shallower checkpoint when it is not, at most kMaxResumeTries checkpoints.
  // Without either, `upto`. Returns `from` when there is none, holding nothing then.
  size_t LookupResume(NamespaceId ns, std::span<const BlockHash> chain, size_t from, size_t upto,
                      bool checkpoint, const WindowReach* window, Found* found);
  static constexpr int kMaxResumeTries = 4;
  // Offers the window blocks the disk or Redis gave for chain indexes [from, upto)
  // (found.window_buffers) to the host tier. REQUIRES: the engine's lock (tags_of).
  void KeepWindowsInHost(NamespaceId ns, std::span<const BlockHash> chain, size_t upto,
                         const Found& found);
  // Outside any lock: takes back a Lookup's pins and buffers, after waiting for found->reads (a
  // slot or buffer is never reused while a stream still reads it). When that wait fails (a
  // device error) the pins and buffers are kept for good, logged: leaked rather than reused.
  void Recycle(Found* found);

  // Offers a checkpoint Redis gave (found.checkpoint_buffer) to the host tier's checkpoints,
  // keyed as block `hash` after `parent`. REQUIRES: the engine's lock (tags_of).
  void KeepCheckpointInHost(NamespaceId ns, const BlockHash& parent, const BlockHash& hash,
                            const Found& found);

  // Offers found blocks [first, first + count) (promoted from the disk or the remote tier, so
  // their bytes are at hand) to the host tier; `parent` is block `first`'s parent. REQUIRES: the
  // engine's lock (the namespace's tags are looked up, set_tags_of).
  void KeepInHost(NamespaceId ns, const BlockHash& parent, std::span<const BlockHash> hashes,
                  const Found& found, size_t first);

  // Counts a promotion (the engine does the copying), `checkpoint` whether it brought one,
  // `window_blocks` the window-group blocks it brought.
  void CountPromotion(int64_t from_host, int64_t from_disk, int64_t from_remote, int64_t ns_spent,
                      bool failed, bool checkpoint = false, int64_t window_blocks = 0);

  // The tags of a namespace (NamespaceTable::TagsOf), which the host and disk tiers keep with
  // every block for invalidation; called under the engine's lock by Stage and KeepInHost. Set it
  // before Stage is called; unset, blocks are untagged.
  using TagsOf = std::function<tier::NamespaceTags(NamespaceId)>;
  void set_tags_of(TagsOf tags_of) { tags_of_ = std::move(tags_of); }
  // Drops every block of the host and disk tiers whose tags `filter` matches (their events
  // wait in TakeEvents). Returns how many. Redis cannot be asked to drop by tag (its keys are
  // MACs, its ACL allows no DEL or SCAN): the engine makes its entries unreachable instead
  // (docs/tiers.md, Invalidation).
  int64_t Invalidate(const tier::TagFilter& filter);
  // The weight of tenant tag `tenant`'s blocks in the host and disk stores' fair order
  // (tier::HostBlockStore::SetTenantWeight; TenantSpec.cache_weight). Past the stores' shares the
  // tenant stays in their default order. A no-op without a host or disk tier.
  void SetTenantWeight(uint64_t tenant, int32_t weight);
  // Tenant tag `tenant`'s own share of the host and disk block stores: blocks held now, and
  // blocks evicted from it, summed over both.
  struct TenantUse {
    int64_t blocks = 0;
    uint64_t evicted = 0;
    // Under the Redis tier's write budget: bytes written within the TTL (or queued), and writes
    // dropped past the tenant's share.
    int64_t remote_bytes = 0;
    uint64_t remote_over_budget = 0;
  };
  TenantUse UseOf(uint64_t tenant) const;
  // Counts a lookup done again because the local match shrank meanwhile.
  void CountRaced();
  // Counts the end of a promotion's hold: `adopted` by its call, or let go unused.
  void CountHoldEnd(bool adopted);

  // Host- and disk-tier events (BlockStored / BlockRemoved, medium host or disk) not yet taken,
  // oldest first. A window block's or checkpoint's names its group by kind alone
  // (KvCacheManager::AppendTierEvent gives it the pool's index).
  void TakeEvents(std::vector<KvEvent>* out);
  // Called by the writer thread, with no lock held, after it stored blocks whose events wait in
  // TakeEvents (the engine moves them into the pool's event log). Set it before Stage is called.
  void set_on_events(std::function<void()> on_events);

  // Offers what is staged to the stores, then stops the writer; later Stage calls only drop
  // (counted). Idempotent. The engine calls it before it goes, so on_events never runs late.
  void Stop();

  // Waits until every staged copy reached the stores and the remote wrote its queue, for at most
  // `timeout` on the set's clock. Errors: DEADLINE_EXCEEDED.
  absl::Status Flush(absl::Duration timeout);

  TierStats stats() const;

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc takes the locks in order
  struct Staged {
    tier::BlockSpace space;
    BlockHash hash;
    BlockHash parent;
    tier::NamespaceTags tags;
    // Host memory (pinned on CUDA): one block, one state checkpoint or one window block.
    std::unique_ptr<kernels::DeviceBuffer> bytes;
    Fence fence;
    int64_t staged_ns = 0;
    enum class Kind : uint8_t { kBlock, kCheckpoint, kWindow } kind = Kind::kBlock;
  };
  int64_t BytesOf(Staged::Kind kind) const {
    return kind == Staged::Kind::kBlock        ? block_bytes_
           : kind == Staged::Kind::kCheckpoint ? state_bytes_
                                               : window_bytes_;
  }
  // A component of a published block to copy out: the block it is keyed as, its bytes in the
  // pool, and its slot or window block there.
  struct ComponentCopy {
    const PublishedBlock* block = nullptr;
    const std::byte* src = nullptr;
    BlockId id = kInvalidBlock;
  };
  // Queues the copies out of `copies` (of `kind`, StageCheckpoints / StageWindowBlocks) for the
  // writer, after the compute stream's work; returns the ids copied and the last copy's fence,
  // for the caller to mark in flight. Each one not copied is counted, as Stage counts blocks.
  std::pair<std::vector<BlockId>, Fence> StageComponents(Staged::Kind kind,
                                                         std::span<const ComponentCopy> copies)
      ABSL_LOCKS_EXCLUDED(mu_);
  void WriterLoop();
  // Asks `store` for hashes [from, ...) after what the stores above found, into out[from, ...).
  // Returns its hits.
  static int64_t LookupBelow(tier::RemoteTier& store, const tier::BlockSpace& space,
                             const BlockHash& parent, std::span<const BlockHash> hashes,
                             std::span<const std::span<std::byte>> out, int64_t from);
  // Up to `want` of the lookup blocks (max_lookup_ over all lookups) for one lookup; counts a
  // truncation when it gets fewer.
  int64_t Reserve(int64_t want) ABSL_LOCKS_EXCLUDED(mu_);
  // A lookup buffer of one block (reserved already): a spare one, or a new one; null when none
  // can be had.
  std::unique_ptr<kernels::DeviceBuffer> TakeBuffer() ABSL_LOCKS_EXCLUDED(mu_);
  void GiveBack(std::unique_ptr<kernels::DeviceBuffer> buffer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An event of a store of `medium` holding `component`s: main blocks (no group: the pool's
  // main group), window blocks (kSlidingWindow) or checkpoints (kStateSpace), each named by the
  // hash of the block it sits beside. The pool numbers a component's group
  // (KvCacheManager::AppendTierEvent).
  void OnStoreChange(KvMedium medium, std::optional<KvGroupKind> component,
                     const tier::BlockSpace& space, const BlockHash& hash, const BlockHash& parent,
                     bool stored);

  kernels::Device* const device_;
  const Clock* const clock_;
  const int64_t block_bytes_;
  const int64_t state_bytes_;   // one checkpoint (the layout's state_slot_bytes)
  const int64_t window_bytes_;  // one window-group block (the layout's window_block_bytes())
  const int32_t block_size_;
  const uint64_t layout_fingerprint_;
  const int64_t max_staged_;
  const int64_t max_lookup_;
  // The host store's slots (pinned on CUDA); declared before host_, so it outlives the store.
  const std::unique_ptr<kernels::DeviceBuffer> host_memory_;
  const std::unique_ptr<tier::HostBlockStore> host_;
  const std::unique_ptr<tier::RemoteTier> remote_;
  const std::unique_ptr<tier::DiskBlockStore> disk_;
  // State checkpoints in host memory (slots of state_bytes_), over checkpoint_memory_.
  const std::unique_ptr<kernels::DeviceBuffer> checkpoint_memory_;
  const std::unique_ptr<tier::HostBlockStore> checkpoints_;
  // Checkpoints go to Redis too (a pool with a state group and a Redis tier), under
  // CheckpointSpace: keys and MACs no block's can match.
  const bool remote_checkpoints_;
  tier::BlockSpace CheckpointSpace(NamespaceId ns) const {
    return {ns, layout_fingerprint_ ^ kCheckpointKeySalt};
  }
  // Window-group blocks in host memory (slots of window_bytes_), over window_memory_.
  const std::unique_ptr<kernels::DeviceBuffer> window_memory_;
  const std::unique_ptr<tier::HostBlockStore> windows_;
  // Window blocks go to Redis too (a pool with a window group and a Redis tier), under
  // WindowSpace: keys and MACs no block's or checkpoint's can match.
  const bool remote_windows_;
  tier::BlockSpace WindowSpace(NamespaceId ns) const {
    return {ns, layout_fingerprint_ ^ kWindowKeySalt};
  }
  // The disk tier's stores of checkpoints and window blocks (their records keyed as the blocks,
  // under salted layout fingerprints of their own).
  const std::unique_ptr<tier::DiskBlockStore> disk_checkpoints_;
  const std::unique_ptr<tier::DiskBlockStore> disk_windows_;
  // Drops found's window blocks of chain index i (unpins, gives its buffer back).
  void DropWindowBlock(Found* found, size_t i);
  // Keeps only the window blocks found that a resume after `blocks` blocks needs; false (keeping
  // them all) when one it needs was not found.
  bool KeepWindowBlocks(size_t blocks, const WindowReach& reach, Found* found);
  // Reads `store`'s window blocks of chain indexes [first, end) (the disk's or Redis's) into
  // found->window_buffers, as many as the window buffers' bound allows; those past the leading
  // run it had are dropped. Returns that run's length; sets *starved when the bound cut it.
  size_t ReadWindows(tier::RemoteTier& store, NamespaceId ns, std::span<const BlockHash> chain,
                     size_t first, size_t end, Found* found, bool* starved);
  TagsOf tags_of_;  // set before the first Stage, read under the engine's lock

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::deque<Staged> queue_ ABSL_GUARDED_BY(mu_);
  int64_t staged_checkpoints_ ABSL_GUARDED_BY(mu_) = 0;  // of queue_ and in flight
  int64_t staged_windows_ ABSL_GUARDED_BY(mu_) = 0;      // the same for window blocks
  int64_t window_buffers_ ABSL_GUARDED_BY(mu_) = 0;      // Found::window_buffers held
  int64_t checkpoint_buffers_ ABSL_GUARDED_BY(mu_) = 0;  // Found::checkpoint_buffer held
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;           // taken by the writer, not yet offered
  // Lookup blocks held (pinned slots and buffers, until Recycle).
  int64_t lookup_held_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  TierStats counters_ ABSL_GUARDED_BY(mu_);
  std::vector<KvEvent> events_ ABSL_GUARDED_BY(mu_);
  // Staging buffers the writer is done with, for the next Stage (at most max_staged_ exist).
  std::vector<std::unique_ptr<kernels::DeviceBuffer>> spare_ ABSL_GUARDED_BY(mu_);
  // Lookups whose copies never completed (Recycle): their slots stay pinned and their buffers
  // held, and counted in lookup_held_, for the set's life. Declared after host_: released first.
  std::vector<Found> kept_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_events_ ABSL_GUARDED_BY(mu_);
  int64_t telling_ ABSL_GUARDED_BY(mu_) = 0;  // disk-tier calls of on_events_ running now
  std::thread writer_;
};

}  // namespace kvpool::daemon
