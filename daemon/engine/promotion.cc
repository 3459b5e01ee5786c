#include "daemon/engine/promotion.h"

#include <algorithm>
#include <utility>

#include "kvpool/util/check.h"

namespace kvpool::daemon {

namespace {

void FreeLoader(PoolState& pool, SequenceId loader) {
  // The loader belongs to no session: nothing but the promotion that made it frees it.
  KVPOOL_CHECK_OK(pool.cache().Free(kTierLoader, loader));
  --pool.loaders;
}

}  // namespace

void ReleaseHold(EngineState& state, const PromotionHold& hold, bool adopted) {
  PoolState& pool = state.pool(hold.pool);
  FreeLoader(pool, hold.loader);
  pool.tiers()->CountHoldEnd(adopted);
}

Promotion::Promotion(int32_t pool, NamespaceId ns, std::span<const int32_t> prompt,
                     int32_t block_size)
    : pool_(pool),
      ns_(ns),
      prompt_(prompt),
      block_size_(block_size),
      full_(prompt.size() / static_cast<size_t>(block_size)) {
  chain_.resize(full_);
  BlockHash parent;
  for (size_t i = 0; i < full_; ++i) {
    chain_[i] = parent = PrefixChainHash(parent, ns, prompt.subspan(i * block_size, block_size));
  }
}

bool Promotion::Match(const EngineState& state) {
  const PoolState& pool = state.pool(pool_);
  const int64_t matched = pool.cache().MatchPrefix(ns_, prompt_);
  local_ = static_cast<size_t>(matched / block_size_);
  needs_checkpoint_ = pool.layout().num_state_slots > 0;
  if (pool.cache().window() != nullptr) {
    const KvCacheManager& cache = pool.cache();
    window_ = TierSet::WindowReach{
        .block_size = block_size_,
        .window_tokens = cache.window_tokens(),
        .sink_blocks = (cache.sink_tokens() + int64_t{block_size_} - 1) / block_size_};
  }
  // With a group whose component cut the match, the device may hold blocks past the cut: the
  // loader adopts them (AllocateRequest::adopt_uncut), and the tiers are asked only for the
  // blocks after them, and for the components from the cut on.
  attention_ = local_;
  if (needs_checkpoint_ || window_) {
    attention_ = std::clamp(pool.cache().cache()->Match(ns_, prompt_).full.size(), local_, full_);
  }
  return local_ < full_;
}

void Promotion::Lookup(TierSet& tiers) {
  tiers.Recycle(&found_);
  found_ = tiers.Lookup(ns_, attention_ == 0 ? BlockHash{} : chain_[attention_ - 1],
                        std::span(chain_).subspan(attention_));
  upto_ = attention_ + static_cast<size_t>(found_.hits);
  if (upto_ > local_) {
    // With a state group a prompt resumes only from a checkpoint, with a window group only where
    // its window's blocks are there (MatchPrefix cut the local match so): the prefix is worth
    // promoting up to the deepest point past the cut the tiers can resume from, and not at all
    // without one. (What is found past it goes with Recycle.)
    upto_ = tiers.LookupResume(ns_, chain_, local_, upto_, needs_checkpoint_,
                               window_ ? &*window_ : nullptr, &found_);
  }
  found_.hits = upto_ > attention_ ? static_cast<int64_t>(upto_ - attention_) : 0;
}

void Promotion::Recycle(TierSet& tiers) { tiers.Recycle(&found_); }

Promotion::Outcome Promotion::Start(EngineState& state, kernels::Device& device, bool revalidate) {
  if (upto_ <= local_) return Outcome::kNothing;
  PoolState& pool = state.pool(pool_);
  KvCacheManager& cache = pool.cache();
  // What Match learned may be stale: blocks of the local prefix evicted (or new ones published)
  // while the lookup ran without the lock.
  const std::span<const int32_t> prompt = prompt_.first(upto_ * block_size_);
  const int64_t matched_now = cache.MatchPrefix(ns_, prompt);
  if (revalidate && static_cast<size_t>(matched_now / block_size_) < local_) {
    return Outcome::kRaced;  // the hits no longer join the cached prefix
  }
  // Uncut, the loader adopts the blocks the device holds past a component's cut too: those the
  // tiers were not asked for must still be there.
  const bool uncut = needs_checkpoint_ || window_;
  int64_t adopting = matched_now;
  if (uncut) {
    const PrefixMatch m = cache.cache()->Match(ns_, prompt);
    if (revalidate && m.full.size() < std::min(attention_, upto_)) return Outcome::kRaced;
    adopting = m.matched_tokens;
  }
  if (adopting % block_size_ != 0) return Outcome::kFailed;  // a partly cached block: shared
  DevicePlan plan;
  absl::StatusOr<AllocateResult> made =
      cache.Allocate(kTierLoader,
                     {.ns = ns_,
                      .num_tokens = static_cast<int64_t>(upto_) * block_size_,
                      .prompt = prompt,
                      // Its window blocks come from the tree or the tier, for what its
                      // window reads alone.
                      .window_ahead = window_ ? 0 : -1,
                      .adopt_uncut = uncut},
                     &plan);
  if (!made.ok()) return Outcome::kFailed;  // no room (or the namespace's quota)
  loader_ = made->sequence;
  ++pool.loaders;
  KVPOOL_CHECK(made->matched_tokens == adopting);  // the same match, in the same lock hold
  // Its window: what the tree keeps of the window at its end, the tier's copies of the rest
  // (LookupWindow pinned every one past the cut), none for what it does not read. Never left
  // unfilled for the tree to keep.
  std::vector<std::pair<int64_t, BlockId>> windows;
  if (window_) {
    absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> imported =
        cache.ImportWindow(kTierLoader, loader_);
    if (!imported.ok()) {
      FreeLoader(pool, loader_);
      return Outcome::kFailed;  // no room in the window group (or the namespace's quota)
    }
    windows = *std::move(imported);
    if (!windows.empty() && static_cast<size_t>(windows.front().first) < local_) {
      FreeLoader(pool, loader_);  // one the tree kept before the cut went during the lookup
      return Outcome::kRaced;
    }
  }
  // The tiers' checkpoint at the end of the last hit goes in with the blocks (a pool with a
  // state group; Lookup cut the hits there). Without a slot for it the blocks still go in.
  BlockId checkpoint = kInvalidBlock;
  if (found_.checkpoint >= 0) {
    const absl::StatusOr<BlockId> slot =
        cache.ImportCheckpoint(kTierLoader, loader_, (found_.checkpoint + 1) * block_size_);
    if (slot.ok()) checkpoint = *slot;
  }
  absl::StatusOr<Fence> fence = pool.Carry(plan);
  if (fence.ok()) {
    fence = CopyHits(pool, device, static_cast<size_t>(made->matched_tokens / block_size_), *fence);
  }
  if (fence.ok() && checkpoint != kInvalidBlock) fence = CopyCheckpoint(pool, device, checkpoint);
  imported_ = fence.ok() && checkpoint != kInvalidBlock;
  if (fence.ok() && !windows.empty()) fence = CopyWindows(pool, device, windows);
  windows_imported_ = fence.ok() ? static_cast<int64_t>(windows.size()) : 0;
  if (!fence.ok()) {
    FreeLoader(pool, loader_);  // what was queued keeps its blocks in flight (CopyHits)
    return Outcome::kFailed;
  }
  copied_ = *fence;
  started_ns_ = state.now();
  return Outcome::kStarted;
}

absl::StatusOr<Fence> Promotion::CopyHits(PoolState& pool, kernels::Device& device, size_t from,
                                          Fence carried) {
  const int64_t block_bytes = pool.layout().block_bytes();
  const Sequence& seq = *pool.cache().Find(loader_);
  std::vector<BlockId> targets;
  absl::StatusOr<Fence> fence = carried;
  // Host-tier hits whose slot and pool block both follow the previous one's go in one copy (a
  // prefix stored at once sits in consecutive slots, and fresh blocks are often consecutive).
  // Only within the host tier's arena and the pool's: staging buffers are allocations of their
  // own, and a copy never spans two.
  std::byte* run_dst = nullptr;
  const std::byte* run_src = nullptr;
  int64_t run_bytes = 0;
  bool run_in_host = false;
  auto flush = [&] {
    if (run_bytes > 0 && fence.ok()) {
      fence = device.CopyToDevice(kernels::StreamId::kTransfer, run_dst, run_src, run_bytes);
    }
    run_bytes = 0;
  };
  for (size_t i = from; fence.ok() && i < upto_; ++i) {
    const BlockId block = seq.table[i];
    std::byte* dst = static_cast<std::byte*>(pool.view().base) + block.value() * block_bytes;
    // Block i of the prompt is hit i - attention_: `from` >= attention_ once re-validated.
    const size_t hit = i - attention_;
    const std::byte* src = found_.block(hit, block_bytes).data();
    const bool in_host = hit < static_cast<size_t>(found_.from_host);
    if (!in_host || !run_in_host || dst != run_dst + run_bytes || src != run_src + run_bytes) {
      flush();
      run_dst = dst;
      run_src = src;
      run_in_host = in_host;
    }
    run_bytes += block_bytes;
    targets.push_back(block);
  }
  flush();
  // Whatever was queued keeps its blocks out of the free list, and the tier slots and buffers it
  // reads pinned (found_.reads, TierSet::Recycle), until it has run.
  const Fence queued = fence.ok() ? *fence : device.LastFence(kernels::StreamId::kTransfer);
  if (!targets.empty()) {
    KVPOOL_CHECK_OK(pool.cache().MarkInFlight(targets, queued));
    found_.reads = queued;
  }
  return fence;
}

absl::StatusOr<Fence> Promotion::CopyCheckpoint(PoolState& pool, kernels::Device& device,
                                                BlockId slot) {
  const std::span<const std::byte> src = found_.checkpoint_bytes(pool.layout().state_slot_bytes);
  absl::StatusOr<Fence> fence =
      device.CopyToDevice(kernels::StreamId::kTransfer, pool.view().state(slot.value()), src.data(),
                          static_cast<int64_t>(src.size()));
  // Whatever was queued keeps the slot out of the free list and the host slot pinned until it
  // has run (the loader's Free, should it come first, releases the slot fenced).
  const Fence queued = fence.ok() ? *fence : device.LastFence(kernels::StreamId::kTransfer);
  KVPOOL_CHECK_OK(pool.cache().MarkStatesInFlight(std::span(&slot, 1), queued));
  found_.reads = queued;
  return fence;
}

absl::StatusOr<Fence> Promotion::CopyWindows(
    PoolState& pool, kernels::Device& device,
    std::span<const std::pair<int64_t, BlockId>> imported) {
  const kernels::KvPoolView region = pool.view().Window();
  const int64_t bytes = pool.layout().window_block_bytes();
  absl::StatusOr<Fence> fence = device.LastFence(kernels::StreamId::kTransfer);
  std::vector<BlockId> targets;
  for (size_t i = 0; fence.ok() && i < imported.size(); ++i) {
    const auto [entry, block] = imported[i];
    // Only entries past the cut are imported (Start), and the lookup found every one the window
    // reads there.
    const std::span<const std::byte> src = found_.window_block(entry);
    fence = device.CopyToDevice(kernels::StreamId::kTransfer,
                                static_cast<std::byte*>(region.base) + block.value() * bytes,
                                src.data(), bytes);
    targets.push_back(block);
  }
  // Whatever was queued keeps the blocks out of the free list and the host slots pinned until
  // it has run (the loader's Free, should it come first, releases them fenced).
  const Fence queued = fence.ok() ? *fence : device.LastFence(kernels::StreamId::kTransfer);
  KVPOOL_CHECK_OK(pool.cache().MarkWindowInFlight(targets, queued));
  found_.reads = queued;
  return fence;
}

absl::Status Promotion::Wait(kernels::Device& device) const { return device.Synchronize(copied_); }

std::optional<PromotionHold> Promotion::Publish(EngineState& state, const absl::Status& copied) {
  PoolState& pool = state.pool(pool_);
  TierSet& tiers = *pool.tiers();
  const int64_t from_host = std::min<int64_t>(found_.from_host, found_.hits);
  const int64_t from_disk = std::min<int64_t>(found_.from_disk, found_.hits - from_host);
  const int64_t from_remote = found_.hits - from_host - from_disk;
  const PromotionHold hold{
      .pool = pool_, .loader = loader_, .tokens = static_cast<int64_t>(upto_) * block_size_};
  // The loader is no client's: only this engine frees it, so it is still there. The commit
  // publishes only what the prompt says the blocks hold (they were filled from blocks stored
  // under exactly these chained hashes).
  if (!copied.ok() || !pool.cache().Commit(kTierLoader, loader_, hold.tokens, {}).ok()) {
    FreeLoader(pool, loader_);
    tiers.CountPromotion(from_host, from_disk, from_remote, 0, /*failed=*/true);
    return std::nullopt;
  }
  pool.StagePublished(std::span(chain_).first(upto_));  // already in a tier: not staged again
  if (windows_imported_ > 0) {  // the window blocks the disk or Redis gave go there too
    tiers.KeepWindowsInHost(ns_, chain_, upto_, found_);
  }
  if (imported_) {  // a checkpoint Redis gave goes into the host tier too
    const auto at = static_cast<size_t>(found_.checkpoint);
    tiers.KeepCheckpointInHost(ns_, at == 0 ? BlockHash{} : chain_[at - 1], chain_[at], found_);
  }
  tiers.CountPromotion(from_host, from_disk, from_remote, state.now() - started_ns_,
                       /*failed=*/false, imported_, windows_imported_);
  if (from_disk + from_remote > 0) {  // what the disk or Redis had goes into the host tier too
    const size_t first_below = attention_ + static_cast<size_t>(from_host);
    tiers.KeepInHost(
        ns_, first_below == 0 ? BlockHash{} : chain_[first_below - 1],
        std::span(chain_).subspan(first_below, static_cast<size_t>(from_disk + from_remote)),
        found_, static_cast<size_t>(from_host));
  }
  // The Keep*InHost calls' host-store puts told their events (Stored, Removed for what they
  // evicted) to the tier set, which calls on_events only for the disk tier's: into the pool's log
  // now, not at some unrelated later drain (in an idle pool, never).
  pool.DrainTierEvents();
  return hold;
}

}  // namespace kvpool::daemon
