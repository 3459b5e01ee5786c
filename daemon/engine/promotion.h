#pragma once

// Promotion: a local prefix miss whose next blocks a lower tier holds (DESIGN.md §9), copied into
// fresh device blocks and handed to the call that asked. A small state machine the engine drives
// across two lock gaps, in the shape of Step (step.h):
//
//   Match    (engine lock)  the prompt's locally cached full blocks: `local`, cut where a
//                           window block or checkpoint is missing (resumable), and `attention`,
//                           not cut (the blocks the device holds)
//   Lookup   (no lock)      the tiers, for the chain of full blocks after `attention`
//                           (TierSet::Lookup: host-tier hits are pinned in their slots, lower
//                           tiers' read into staging buffers); with a state group, cut at the
//                           deepest checkpoint the tiers have past `local`; with a window group,
//                           at the deepest point whose window blocks past `local` they have
//                           (none: nothing to do)
//   Start    (engine lock)  re-validates what Match learned: a loader sequence (owned by no
//                           session: kTierLoader) over the prompt's first blocks up to that
//                           point adopts what is cached now (past the cut too: adopt_uncut)
//                           and takes fresh blocks for the rest; the hits are copied into the
//                           fresh ones on the transfer stream, straight from the host tier's
//                           slots (one copy per block), and so are the window blocks its resume
//                           point reads that the tree lacks (ImportWindow) and its checkpoint.
//                           When either match shrank during the gap (an eviction), what the
//                           tiers were asked for no longer joins the cached prefix: Start says
//                           so (kRaced) and the engine looks up again. When it grew, the hits
//                           it now covers are skipped.
//   Wait     (no lock)      the copies' fence
//   Publish  (engine lock)  the loader commits its blocks into the prefix cache and stays: the
//                           hold (PromotionHold) keeps every block of the prefix from eviction
//                           until the requesting call's allocation has adopted them, so no
//                           churn between promotion and adoption wastes the copy. The caller
//                           releases the hold in the lock hold that adopted the blocks (or when
//                           the call fails or is dropped).
//
// Nothing is published before its bytes are in the pool; a copy that fails or a device error
// leaves the pool as it was (the loader freed, counted).
//
// Thread-compatible: one thread drives a promotion; each method says which lock it REQUIRES.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/pool_state.h"
#include "daemon/engine/promotion_hold.h"
#include "daemon/engine/tiers.h"
#include "kernels/device.h"

namespace kvpool::daemon {

// Frees the hold's loader (its blocks stay in the prefix cache, evictable once no one else holds
// them) and counts whether its call `adopted` the blocks. REQUIRES: the engine lock; the hold was
// not released before.
void ReleaseHold(EngineState& state, const PromotionHold& hold, bool adopted);

class Promotion final {
 public:
  // A promotion of `prompt`'s full blocks in namespace `ns` of pool `pool`; `prompt` outlives it.
  Promotion(int32_t pool, NamespaceId ns, std::span<const int32_t> prompt, int32_t block_size);

  enum class Outcome : uint8_t {
    kNothing,  // nothing to promote: all cached, or the tiers had nothing after the match
    kRaced,    // the local match shrank during the lookup gap: look up again (Match first)
    kStarted,  // copies queued: Wait, then Publish
    kFailed,   // no room, a shared partial block, a copy not queued: counted, nothing changed
  };

  // REQUIRES: the engine lock. The local match; false when there is nothing to look up.
  bool Match(const EngineState& state);
  // REQUIRES: no lock. Asks the tiers for the chain after the local match.
  void Lookup(TierSet& tiers);
  // REQUIRES: the engine lock. `revalidate` false skips the re-validation of the local match (a
  // test shows with it what the re-validation prevents: the hits indexed from a stale match).
  Outcome Start(EngineState& state, kernels::Device& device, bool revalidate = true);
  // REQUIRES: no lock. The copies' fence. Errors: the device's.
  absl::Status Wait(kernels::Device& device) const;
  // REQUIRES: the engine lock; Start returned kStarted. Publishes the loader's blocks and returns
  // the hold; after a failed Wait (`copied`) or a failed commit, frees the loader (counted) and
  // returns nullopt.
  std::optional<PromotionHold> Publish(EngineState& state, const absl::Status& copied);
  // REQUIRES: no lock. Gives the lookup's pinned slots and buffers back to the tiers once the
  // copies that read them have run (safe to call at any point, more than once).
  void Recycle(TierSet& tiers);

  int64_t hits() const { return found_.hits; }

 private:
  // Copies the hits for blocks [from, upto_) of the loader's table on the transfer stream, after
  // `carried` (the loader's fills). REQUIRES: the engine lock.
  absl::StatusOr<Fence> CopyHits(PoolState& pool, kernels::Device& device, size_t from,
                                 Fence carried);
  // Copies the host tier's checkpoint (found_.checkpoint_pin) into state slot `slot` on the
  // transfer stream, after the hits. REQUIRES: the engine lock.
  absl::StatusOr<Fence> CopyCheckpoint(PoolState& pool, kernels::Device& device, BlockId slot);
  // Copies the host tier's window blocks into the loader's window blocks `imported` ((entry,
  // block), KvCacheManager::ImportWindow) on the transfer stream. REQUIRES: the engine lock.
  absl::StatusOr<Fence> CopyWindows(PoolState& pool, kernels::Device& device,
                                    std::span<const std::pair<int64_t, BlockId>> imported);

  const int32_t pool_;
  const NamespaceId ns_;
  const std::span<const int32_t> prompt_;
  const int32_t block_size_;
  const size_t full_;             // the prompt's full blocks
  std::vector<BlockHash> chain_;  // their chained hashes
  size_t local_ = 0;  // full blocks cached at Match (resumable: cut where a component is missing)
  // Full blocks the device held at Match, past a component's cut too (>= local_): the loader
  // adopts them, the tiers are asked for the blocks after them, the components from local_ on.
  size_t attention_ = 0;
  size_t upto_ = 0;                // local_ + hits: the loader's length in blocks
  bool needs_checkpoint_ = false;  // the pool has a state group: promote up to a checkpoint
  bool imported_ = false;          // the host tier's checkpoint is copied in with the blocks
  // The pool's window group (none without one): the window blocks a resume point reads.
  std::optional<TierSet::WindowReach> window_;
  int64_t windows_imported_ = 0;  // window blocks copied in with the blocks
  TierSet::Found found_;          // block i of found_ is the prompt's block attention_ + i
  SequenceId loader_;
  Fence copied_;
  int64_t started_ns_ = 0;
};

}  // namespace kvpool::daemon
