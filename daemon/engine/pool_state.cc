#include "daemon/engine/pool_state.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/engine/promotion_hold.h"
#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::daemon {

int32_t PoolCheckpointInterval(const EngineOptions& options, const kernels::PoolLayout& layout) {
  if (layout.num_state_slots == 0 || options.checkpoint_interval < 0) return 0;
  if (options.checkpoint_interval > 0) return options.checkpoint_interval;
  return DefaultCheckpointInterval(layout.state_slot_bytes, layout.block_bytes());
}

int64_t HostCheckpoints(const EngineOptions& options, const PoolOptions& pool) {
  const kernels::PoolLayout& layout = pool.layout;
  const int64_t asked = options.tiers.host_checkpoints;
  if (asked < 0 || options.tiers.host_blocks == 0 || pool.checkpoint_slots == 0 ||
      layout.num_state_slots == 0) {
    return 0;
  }
  if (asked > 0) return asked;
  const int64_t interval = std::max(1, PoolCheckpointInterval(options, layout));
  return std::max<int64_t>(1, options.tiers.host_blocks / interval);
}

int64_t HostWindowBlocks(const EngineOptions& options, const kernels::PoolLayout& layout) {
  const int64_t asked = options.tiers.host_window_blocks;
  if (asked < 0 || options.tiers.host_blocks == 0 || layout.num_window_layers == 0 ||
      layout.num_window_blocks == 0 || layout.num_blocks == 0) {
    return 0;
  }
  if (asked > 0) return asked;
  // The device pool's proportion: what its operator sized the window group to keep.
  const auto share = static_cast<double>(layout.num_window_blocks) / layout.num_blocks;
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(static_cast<double>(options.tiers.host_blocks) * share)));
}

std::pair<int64_t, int64_t> DiskComponentBytes(const EngineOptions& options,
                                               const PoolOptions& pool) {
  const kernels::PoolLayout& layout = pool.layout;
  if (!options.tiers.disk.enabled()) return {0, 0};
  const auto record = [](int64_t bytes) { return (bytes + 4095) / 4096 * 4096; };
  const int64_t blocks = options.tiers.disk.capacity_bytes / record(layout.block_bytes());
  int64_t checkpoints = 0;
  if (layout.num_state_slots > 0 && pool.checkpoint_slots != 0) {
    const int64_t interval = std::max(1, PoolCheckpointInterval(options, layout));
    checkpoints = std::max<int64_t>(1, blocks / interval) * record(layout.state_slot_bytes);
  }
  int64_t windows = 0;
  if (layout.num_window_layers > 0 && layout.num_window_blocks > 0 && layout.num_blocks > 0) {
    const auto share = static_cast<double>(layout.num_window_blocks) / layout.num_blocks;
    windows = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(blocks * share))) *
              record(layout.window_block_bytes());
  }
  return {checkpoints, windows};
}

absl::StatusOr<std::unique_ptr<PoolState>> PoolState::Create(const PoolOptions& pool,
                                                             const EngineOptions& options,
                                                             kernels::Device* device,
                                                             const tier::DeploymentSecret& secret) {
  const kernels::PoolLayout& layout = pool.layout;
  KVPOOL_RETURN_IF_ERROR(kernels::ValidateLayout(layout));
  if (layout.num_blocks <= 0) {
    return absl::InvalidArgumentError(fmt::format("pool {} has no blocks", pool.name));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Arena> arena,
                          device->CreateArena(layout.arena_bytes()));
  auto steps = std::make_unique<StepTimeline>(device);
  // Quotas charge every group its bytes (a quota of N blocks is N main blocks' bytes).
  const int64_t block_bytes = layout.block_bytes();
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<KvCacheManager> cache,
      KvCacheManager::Create({.block_size = layout.block_size,
                              .num_blocks = layout.num_blocks,
                              .max_blocks_per_seq = options.max_blocks_per_seq,
                              .trace_depth = options.trace_depth,
                              .residency_sample = options.block_residency_sample,
                              .residency_seed = options.epoch,
                              .clock = options.clock,
                              .fences = steps.get(),
                              .prefix_cache = options.prefix_cache,
                              .eviction_policy = options.eviction_policy,
                              .eviction_shares = options.eviction_shares,
                              .epoch = options.epoch,
                              .event_capacity = options.event_capacity,
                              .publish_journal = options.tiers.enabled() && options.prefix_cache,
                              .event_capacity_bytes = options.event_capacity_bytes,
                              .max_sequences_per_session = options.limits.sequences_per_session,
                              .state_slots = layout.num_state_slots,
                              .checkpoint_slots = pool.checkpoint_slots,
                              .checkpoint_interval = PoolCheckpointInterval(options, layout),
                              .checkpoint_eviction = options.checkpoint_eviction,
                              .window_blocks = layout.num_window_blocks,
                              .window_tokens = options.window_tokens,
                              .sink_tokens = options.sink_tokens,
                              .block_bytes = block_bytes,
                              .window_block_bytes = block_bytes > 0 && layout.num_window_blocks > 0
                                                        ? layout.window_block_bytes()
                                                        : 0,
                              .state_bytes = block_bytes > 0 ? layout.state_slot_bytes : 0}));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<GenerationTable> generations,
                          GenerationTable::Create(layout.num_blocks));
  std::unique_ptr<TierSet> tiers;
  if (options.tiers.enabled() && options.prefix_cache) {
    TierOptions tier_options = options.tiers;
    if (tier_options.disk.enabled()) tier_options.disk.directory += "/" + pool.name;  // its own
    tier_options.host_checkpoints = HostCheckpoints(options, pool);
    tier_options.host_window_blocks = HostWindowBlocks(options, layout);
    tier_options.tenant_shares = std::max(0, options.eviction_shares);  // -1: off
    tier_options.disk.tenant_shares = tier_options.tenant_shares;
    tier_options.redis.tenant_shares = tier_options.tenant_shares;
    std::tie(tier_options.disk_checkpoint_bytes, tier_options.disk_window_bytes) =
        DiskComponentBytes(options, pool);
    KVPOOL_ASSIGN_OR_RETURN(tiers,
                            TierSet::Create(tier_options, device, layout, secret, options.clock));
  }
  auto state = std::unique_ptr<PoolState>(
      new PoolState(pool.name, layout, options.fill_policy, device, std::move(arena),
                    std::move(steps), std::move(cache), std::move(generations), std::move(tiers)));
  state->tenant_counters = TenantCounterTable(options.max_tenant_labels);
  return state;
}

PoolState::PoolState(std::string name, const kernels::PoolLayout& layout, kernels::FillPolicy fill,
                     kernels::Device* device, std::unique_ptr<kernels::Arena> arena,
                     std::unique_ptr<StepTimeline> steps, std::unique_ptr<KvCacheManager> cache,
                     std::unique_ptr<GenerationTable> generations, std::unique_ptr<TierSet> tiers)
    : name_(std::move(name)),
      layout_(layout),
      device_(device),
      arena_(std::move(arena)),
      steps_(std::move(steps)),
      cache_(std::move(cache)),
      generations_(std::move(generations)),
      executor_(device, kernels::StreamId::kTransfer, kernels::KvPoolView{arena_->base(), layout_},
                fill),
      tiers_(std::move(tiers)) {
  if (layout_.num_state_slots > 0) {
    // A state slot is zeroed whatever the fill policy: zeros are the state of no tokens.
    state_executor_ = std::make_unique<kernels::PlanExecutor>(
        device, kernels::StreamId::kTransfer, view().StateSlots(), kernels::FillPolicy::kZero);
  }
  if (layout_.num_window_layers > 0) {
    window_executor_ = std::make_unique<kernels::PlanExecutor>(device, kernels::StreamId::kTransfer,
                                                               view().Window(), fill);
  }
}

void PoolState::StagePublished(std::span<const BlockHash> skip) {
  if (!tiers_) return;
  cache_->TakePublished(&published_);
  // Taken whether or not the tiers keep checkpoints and window blocks: the journals never grow.
  cache_->TakePublishedCheckpoints(&published_checkpoints_);
  cache_->TakePublishedWindowBlocks(&published_windows_);
  if (!skip.empty()) {
    // A promotion of n blocks publishes those n, in chain order, as `skip` lists them: matched
    // in step, with a sorted copy (kept for the next call) for any out of step. Never a scan of
    // `skip` per block, O(n^2) under the engine's lock.
    size_t next = 0;
    bool sorted = false;
    auto by_value = [](const BlockHash& a, const BlockHash& b) {
      return std::tie(a.lo, a.hi) < std::tie(b.lo, b.hi);
    };
    auto promoted = [&](const BlockHash& hash) {
      if (next < skip.size() && skip[next] == hash) {
        ++next;
        return true;
      }
      if (!sorted) {
        sorted_skip_.assign(skip.begin(), skip.end());
        std::sort(sorted_skip_.begin(), sorted_skip_.end(), by_value);
        sorted = true;
      }
      return std::binary_search(sorted_skip_.begin(), sorted_skip_.end(), hash, by_value);
    };
    std::erase_if(published_, [&](const PublishedBlock& p) { return promoted(p.hash); });
    next = 0;
    std::erase_if(published_checkpoints_,
                  [&](const PublishedCheckpoint& c) { return promoted(c.block.hash); });
    next = 0;
    std::erase_if(published_windows_,
                  [&](const PublishedWindowBlock& w) { return promoted(w.block.hash); });
  }
  tiers_->Stage(*cache_, view(), published_);
  tiers_->StageCheckpoints(*cache_, view(), published_checkpoints_);
  tiers_->StageWindowBlocks(*cache_, view(), published_windows_);
  DrainTierEvents();
}

void PoolState::DrainTierEvents() {
  if (!tiers_) return;
  tiers_->TakeEvents(&tier_events_);
  // The tiers keep components only for the groups this pool has (TierSet's stores follow its
  // layout).
  for (KvEvent& e : tier_events_) KVPOOL_CHECK_OK(cache_->AppendTierEvent(std::move(e)));
}

PoolState::~PoolState() {
  if (tiers_) {
    // What was published last still goes down (bounded: the copies are queued already).
    tiers_->Flush(absl::Seconds(5)).IgnoreError();
  }
  if (absl::Status s = device_->SynchronizeAll(); !s.ok()) {
    Logger("daemon").error("device at pool {}'s release: {}", name_, s.ToString());
  }
}

absl::StatusOr<Fence> PoolState::Carry(const DevicePlan& plan) {
  if (plan.empty()) return Fence{};
  // Blocks handed out (fresh ones and copy targets) have new generations: publish them (clients
  // learn of the blocks only from the reply, after the work below has run; a plan that fails is
  // undone, and its blocks keep the generation they were handed out with).
  for (const BlockFill& f : plan.fills) {
    generations_->Publish(f.block, cache_->pool().generation(f.block));
  }
  for (const BlockCopy& c : plan.copies) {
    generations_->Publish(c.dst, cache_->pool().generation(c.dst));
  }
  const absl::StatusOr<Fence> fence = executor_.Execute(plan);
  // Blocks under work that was queued (all of it, or what got queued before a failure) stay out
  // of the free list until it has run.
  const Fence queued = fence.ok() ? *fence : executor_.pending();
  if (queued.value != 0) {
    KVPOOL_CHECK_OK(cache_->MarkInFlight(kernels::PlanExecutor::TouchedBlocks(plan), queued));
  }
  if (!fence.ok()) return fence;
  Fence last = *fence;
  if (!plan.state_copies.empty() || !plan.state_zeros.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(last,
                            CarryGroup(*state_executor_, kernels::PlanExecutor::StatePart(plan),
                                       &KvCacheManager::MarkStatesInFlight, last));
  }
  if (!plan.window_copies.empty() || !plan.window_fills.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(last,
                            CarryGroup(*window_executor_, kernels::PlanExecutor::WindowPart(plan),
                                       &KvCacheManager::MarkWindowInFlight, last));
  }
  return last;
}

absl::StatusOr<Fence> PoolState::CarryGroup(kernels::PlanExecutor& executor, const DevicePlan& part,
                                            MarkGroup mark, Fence before) {
  const absl::StatusOr<Fence> fence = executor.Execute(part);
  const Fence queued = fence.ok() ? *fence : executor.pending();
  if (queued.value != 0) {
    KVPOOL_CHECK_OK((cache_.get()->*mark)(kernels::PlanExecutor::TouchedBlocks(part), queued));
  }
  if (!fence.ok()) return fence;
  return fence->value != 0 ? *fence : before;  // one stream: the later covers both
}

namespace {

// The released run of `seq`'s window table, [begin, end) in table entries: a window table is its
// sinks' entries (the blocks overlapping [0, sink_tokens), never released), then released ones,
// then live ones (KvCacheManager::CheckInvariants holds that shape), so the run's end is found by
// a binary search past the sinks. (0, 0) when nothing is released.
std::pair<int32_t, int32_t> ReleasedRun(const Sequence& seq, int32_t sink_tokens,
                                        int32_t block_size) {
  const std::vector<BlockId>& w = seq.window_table;
  const auto sinks = std::min<size_t>(w.size(), static_cast<size_t>(sink_tokens + block_size - 1) /
                                                    static_cast<size_t>(block_size));
  const auto end = std::partition_point(w.begin() + static_cast<ptrdiff_t>(sinks), w.end(),
                                        [](BlockId b) { return b == kInvalidBlock; });
  if (end == w.begin() + static_cast<ptrdiff_t>(sinks)) return {0, 0};
  return {static_cast<int32_t>(sinks), static_cast<int32_t>(end - w.begin())};
}

}  // namespace

void PoolState::AppendTable(const Sequence& seq, int32_t offset, int64_t matched_tokens,
                            Tables* out) const {
  const int32_t size = static_cast<int32_t>(seq.table.size());
  out->slices.push_back({.sequence = seq.id,
                         .num_tokens = seq.num_tokens,
                         .matched_tokens = matched_tokens,
                         .table_offset = offset,
                         .length = size - offset,
                         .state_slot = seq.state_slot});
  for (int32_t i = offset; i < size; ++i) {
    const BlockId b = seq.table[static_cast<size_t>(i)];
    out->blocks.push_back(b);
    out->generations.push_back(cache_->pool().generation(b));
  }
  const BlockPool* window = cache_->window();
  if (window == nullptr) return;
  const auto [begin, end] = ReleasedRun(seq, cache_->sink_tokens(), cache_->block_size());
  out->slices.back().window_released_begin = begin;
  out->slices.back().window_released_end = end;
  // (Entries past the window table: not allocated yet, KvCacheManager::ExtendWindow.)
  const auto allocated = static_cast<int32_t>(seq.window_table.size());
  for (int32_t i = offset; i < size; ++i) {
    const BlockId b = i < allocated ? seq.window_table[static_cast<size_t>(i)] : kInvalidBlock;
    out->window_blocks.push_back(b);
    out->window_generations.push_back(b == kInvalidBlock ? 0 : window->generation(b));
  }
}

absl::Status PoolState::CheckInvariants() const {
  KVPOOL_RETURN_IF_ERROR(cache_->CheckInvariants());
  int64_t loaders = 0;
  cache_->ForEachSequence([&](const Sequence& seq) { loaders += seq.session == kTierLoader; });
  if (loaders != this->loaders) {
    return absl::InternalError(fmt::format("pool {}: {} loader sequences, {} promotions alive",
                                           name_, loaders, this->loaders));
  }
  const BlockPool& pool = cache_->pool();
  for (int32_t b = 0; b < layout_.num_blocks; ++b) {
    const uint32_t shared = generations_->Get(BlockId(b));
    if (shared != pool.generation(BlockId(b))) {
      return absl::InternalError(
          fmt::format("pool {}: block {} has generation {} but clients see {}", name_, b,
                      pool.generation(BlockId(b)), shared));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::daemon
