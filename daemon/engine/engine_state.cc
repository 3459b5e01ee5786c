#include "daemon/engine/engine_state.h"

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/fmt.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "xxhash.h"

namespace kvpool::daemon {

absl::StatusOr<std::unique_ptr<EngineState>> EngineState::Create(const EngineOptions& options,
                                                                 kernels::Device* device) {
  KVPOOL_RETURN_IF_ERROR(kernels::ValidateLayout(options.layout));
  if (options.layout.num_blocks <= 0) {
    return absl::InvalidArgumentError("the engine's layout has no blocks");
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Arena> arena,
                          device->CreateArena(options.layout.arena_bytes()));
  auto steps = std::make_unique<StepTimeline>(device);
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<KvCacheManager> cache,
                          KvCacheManager::Create({.block_size = options.layout.block_size,
                                                  .num_blocks = options.layout.num_blocks,
                                                  .max_blocks_per_seq = options.max_blocks_per_seq,
                                                  .trace_depth = options.trace_depth,
                                                  .clock = options.clock,
                                                  .fences = steps.get(),
                                                  .prefix_cache = options.prefix_cache,
                                                  .eviction_policy = options.eviction_policy,
                                                  .epoch = options.epoch,
                                                  .event_capacity = options.event_capacity}));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<GenerationTable> generations,
                          GenerationTable::Create(options.layout.num_blocks));
  return std::unique_ptr<EngineState>(new EngineState(options, device, std::move(arena),
                                                      std::move(steps), std::move(cache),
                                                      std::move(generations)));
}

EngineState::EngineState(const EngineOptions& options, kernels::Device* device,
                         std::unique_ptr<kernels::Arena> arena, std::unique_ptr<StepTimeline> steps,
                         std::unique_ptr<KvCacheManager> cache,
                         std::unique_ptr<GenerationTable> generations)
    : options_(options),
      device_(device),
      arena_(std::move(arena)),
      steps_(std::move(steps)),
      cache_(std::move(cache)),
      generations_(std::move(generations)),
      executor_(device, kernels::StreamId::kTransfer, kernels::KvPoolView{arena_->base(), layout()},
                options.fill_policy) {}

EngineState::~EngineState() {
  if (absl::Status s = device_->SynchronizeAll(); !s.ok()) {
    Logger("daemon").error("device at pool release: {}", s.ToString());
  }
}

absl::StatusOr<Fence> EngineState::Carry(const DevicePlan& plan) {
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
  return fence;
}

void EngineState::AppendTable(const Sequence& seq, int32_t offset, int64_t matched_tokens,
                              Tables* out) const {
  const int32_t size = static_cast<int32_t>(seq.table.size());
  out->slices.push_back({.sequence = seq.id,
                         .num_tokens = seq.num_tokens,
                         .matched_tokens = matched_tokens,
                         .table_offset = offset,
                         .length = size - offset});
  for (int32_t i = offset; i < size; ++i) {
    const BlockId b = seq.table[static_cast<size_t>(i)];
    out->blocks.push_back(b);
    out->generations.push_back(cache_->pool().generation(b));
  }
}

NamespaceId EngineState::NamespaceOf(std::string_view tenant, std::string_view model) const {
  // Length-prefixed parts: no choice of tenant and model strings makes two keys collide.
  const std::string key = fmt::format("{}:{}{}:{}{:016x}", tenant.size(), tenant, model.size(),
                                      model, options_.layout.Hash());
  const uint64_t h = XXH3_64bits(key.data(), key.size());
  return NamespaceId(h == 0 ? 1 : h);
}

std::shared_ptr<const Session> EngineState::Open(SessionSpec spec) {
  auto session = std::make_shared<Session>();
  session->id = SessionId(next_session_++);
  session->token = NewToken();
  session->ns = NamespaceOf(spec.tenant, spec.model);
  session->opened_ns = now();
  session->spec = std::move(spec);
  if (options_.session_quota_blocks > 0) {
    KVPOOL_CHECK_OK(cache_->SetSessionQuota(session->id, options_.session_quota_blocks));
  }
  live_.emplace(session->id, session);
  by_token_.emplace(session->token, session->id);
  ++session_counters.opened;
  return session;
}

absl::Status EngineState::CheckLive(SessionId id) const {
  if (live_.contains(id)) return absl::OkStatus();
  return absl::NotFoundError(fmt::format("session {} has ended", id.value()));
}

std::shared_ptr<const Session> EngineState::FindByToken(std::string_view token) const {
  auto it = by_token_.find(absl::string_view(token.data(), token.size()));
  return it == by_token_.end() ? nullptr : live_.at(it->second);
}

int64_t EngineState::End(SessionId id, SessionEnd how) {
  auto it = live_.find(id);
  if (it == live_.end()) return 0;
  by_token_.erase(it->second->token);
  live_.erase(it);
  const int64_t released = cache_->FreeSession(id);
  session_counters.sequences_released += static_cast<uint64_t>(released);
  switch (how) {
    case SessionEnd::kDetached:
      ++session_counters.detached;
      break;
    case SessionEnd::kConnectionLost:
      ++session_counters.lost;
      break;
    case SessionEnd::kShutdown:
      ++session_counters.shut_down;
      break;
  }
  return released;
}

}  // namespace kvpool::daemon
