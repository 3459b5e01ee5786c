#include "model/local_engine.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::model {

namespace {

// The window group of `shape` (Options::window_blocks) for a model with sliding layers, unless
// its every attention layer slides (the main blocks must keep one). Errors: INVALID_ARGUMENT.
absl::Status AddWindowGroup(const ModelConfig& config, const LocalEngine::Options& options,
                            kernels::PoolLayout* shape) {
  if (options.window_blocks < -1) {
    return absl::InvalidArgumentError(
        fmt::format("window_blocks must be >= -1 (got {})", options.window_blocks));
  }
  const int32_t sliding = config.num_sliding_layers();
  if (options.window_blocks == -1 || sliding == 0 || sliding == shape->num_layers) {
    return absl::OkStatus();
  }
  shape->num_window_layers = sliding;
  if (options.window_blocks > 0) {
    shape->num_window_blocks = options.window_blocks;
    return absl::OkStatus();
  }
  const int64_t bs = options.block_size;
  const int64_t bound =
      (config.sliding_window + 2 * bs - 1) / bs + (config.sink_tokens + bs - 1) / bs;
  const int64_t quarter =
      options.pool_bytes / 4 / std::max<int64_t>(1, shape->window_block_bytes());
  shape->num_window_blocks = static_cast<int32_t>(
      std::clamp<int64_t>(quarter, bound, std::numeric_limits<int32_t>::max()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::Create(ModelWeights weights,
                                                                 const Options& options) {
  const ModelConfig config = weights.config;
  kernels::PoolLayout shape{.block_size = options.block_size,
                            .num_layers = config.pool_layers(),
                            .num_kv_heads = config.num_kv_heads,
                            .head_dim = config.head_dim,
                            .dtype = options.dtype};
  for (const kernels::LayerDTypes& d : options.layer_dtypes) {
    if (d.layer < 0 || d.layer >= config.pool_layers()) {
      return absl::InvalidArgumentError(fmt::format(
          "layer_dtypes: layer {} outside the pool's [0, {})", d.layer, config.pool_layers()));
    }
    shape.SetKvDType(d.layer, kernels::KvSide::kK, d.k);
    shape.SetKvDType(d.layer, kernels::KvSide::kV, d.v);
  }
  int32_t checkpoints = 0;  // of the state slots, those the prefix cache's checkpoints may hold
  if (config.state_bytes() > 0) {
    // Each sequence's state lives in the pool's state group (docs/hybrid-groups.md §3).
    shape.state_slot_bytes = (config.state_bytes() + 63) / 64 * 64;
    const int32_t working = options.state_slots > 0
                                ? options.state_slots
                                : static_cast<int32_t>(std::clamp<int64_t>(
                                      options.pool_bytes / 4 / shape.state_slot_bytes, 1, 64));
    if (options.checkpoint_slots < 0) {
      return absl::InvalidArgumentError(
          fmt::format("checkpoint_slots must be >= 0 (got {})", options.checkpoint_slots));
    }
    checkpoints = options.prefix_cache
                      ? (options.checkpoint_slots > 0 ? options.checkpoint_slots : working)
                      : 0;
    shape.num_state_slots = working + checkpoints;
  }
  KVPOOL_RETURN_IF_ERROR(AddWindowGroup(config, options, &shape));
  KVPOOL_ASSIGN_OR_RETURN(kernels::PoolLayout layout,
                          kernels::LayoutForBudget(shape, options.pool_bytes));
  std::unique_ptr<LocalEngine> e(new LocalEngine());
  KVPOOL_ASSIGN_OR_RETURN(e->device_,
                          kernels::CreateDevice({.kind = options.backend,
                                                 .device_ordinal = options.device_ordinal,
                                                 .cpu_threads = options.threads}));
  KVPOOL_ASSIGN_OR_RETURN(e->arena_, e->device_->CreateArena(layout.arena_bytes()));
  e->view_ = {e->arena_->base(), layout};
  KVPOOL_ASSIGN_OR_RETURN(
      e->cache_, KvCacheManager::Create({.block_size = layout.block_size,
                                         .num_blocks = layout.num_blocks,
                                         .max_blocks_per_seq = options.max_blocks_per_seq,
                                         .fences = e->device_.get(),
                                         .prefix_cache = options.prefix_cache,
                                         .state_slots = layout.num_state_slots,
                                         .checkpoint_slots = checkpoints,
                                         .checkpoint_interval = options.checkpoint_interval,
                                         .window_blocks = layout.num_window_blocks,
                                         .window_tokens = config.sliding_window,
                                         .sink_tokens = config.sink_tokens}));
  e->executor_ = std::make_unique<kernels::PlanExecutor>(
      e->device_.get(), kernels::StreamId::kTransfer, e->view_, kernels::FillPolicy::kNone);
  if (layout.num_state_slots > 0) {
    e->state_executor_ =
        std::make_unique<kernels::PlanExecutor>(e->device_.get(), kernels::StreamId::kTransfer,
                                                e->view_.StateSlots(), kernels::FillPolicy::kZero);
  }
  if (layout.num_window_layers > 0) {
    e->window_executor_ =
        std::make_unique<kernels::PlanExecutor>(e->device_.get(), kernels::StreamId::kTransfer,
                                                e->view_.Window(), kernels::FillPolicy::kNone);
  }
  KVPOOL_ASSIGN_OR_RETURN(
      e->model_, CreateStepModel(std::move(weights), layout, e->device_.get(), options.threads));
  return e;
}

LocalEngine::~LocalEngine() {
  if (device_) (void)device_->SynchronizeAll();
}

absl::Status LocalEngine::Carry(const DevicePlan& plan) {
  if (plan.empty()) return absl::OkStatus();
  absl::StatusOr<Fence> fence = executor_->Execute(plan);
  if (fence.ok() && state_executor_ != nullptr) {
    fence = state_executor_->Execute(kernels::PlanExecutor::StatePart(plan));
  }
  if (fence.ok() && window_executor_ != nullptr) {
    fence = window_executor_->Execute(kernels::PlanExecutor::WindowPart(plan));
  }
  if (!fence.ok()) return fence.status();
  return fence->value == 0 ? absl::OkStatus() : device_->Synchronize(*fence);
}

absl::StatusOr<std::vector<ItemResult>> LocalEngine::Run(const DevicePlan& plan,
                                                         std::vector<PlannedItem>& items,
                                                         const StepOptions& options) {
  const absl::Status carried = Carry(plan);
  absl::Status status = carried;
  std::vector<StepItem> step;
  std::vector<std::vector<StateCheckpoint>> checkpoints(items.size());
  const auto state_floats = static_cast<size_t>(model_->state_bytes() / sizeof(float));
  for (size_t i = 0; i < items.size(); ++i) {
    const PlannedItem& item = items[i];
    StepItem& it = step.emplace_back(item.AsStepItem());
    if (item.state_slot != kInvalidBlock) {
      it.state = {reinterpret_cast<float*>(view_.state(item.state_slot.value())), state_floats};
      StepCheckpoints(item, item.start, item.start + static_cast<int64_t>(item.tokens.size()),
                      view_, model_->state_bytes(), &checkpoints[i]);
      it.checkpoints = checkpoints[i];
    }
  }
  std::vector<ItemResult> results;
  if (status.ok()) status = model_->Step(view_, step, options, &results);
  if (!status.ok()) {
    // (Nothing else runs on this manager meanwhile: every undo succeeds.)
    for (const PlannedItem& item : items) {
      KVPOOL_CHECK_OK(UndoItem(*cache_, kSession, item, /*ran=*/carried.ok()));
    }
    return status;
  }
  for (const PlannedItem& item : items) KVPOOL_RETURN_IF_ERROR(FinishItem(*cache_, kSession, item));
  return results;
}

absl::StatusOr<LocalEngine::PrefillResult> LocalEngine::Prefill(SequenceId sequence,
                                                                std::span<const int32_t> tokens,
                                                                const StepOptions& options) {
  std::vector<PlannedItem> items(1);
  DevicePlan plan;
  KVPOOL_RETURN_IF_ERROR(PlanPrefill(*cache_, kSession, kNamespace, sequence, tokens,
                                     /*priority=*/0, Limits(), &items[0], &plan));
  KVPOOL_ASSIGN_OR_RETURN(std::vector<ItemResult> results, Run(plan, items, options));
  return PrefillResult{items[0].sequence, items[0].reused, std::move(results[0])};
}

absl::StatusOr<std::vector<ItemResult>> LocalEngine::Decode(std::span<const DecodeInput> inputs,
                                                            const StepOptions& options) {
  std::vector<PlannedItem> items;
  DevicePlan plan;
  KVPOOL_RETURN_IF_ERROR(PlanDecode(*cache_, kSession, inputs, Limits(), &items, &plan));
  return Run(plan, items, options);
}

absl::StatusOr<SequenceId> LocalEngine::Fork(SequenceId sequence) {
  DevicePlan plan;
  KVPOOL_ASSIGN_OR_RETURN(SequenceId child, cache_->Fork(kSession, sequence, &plan));
  KVPOOL_RETURN_IF_ERROR(Carry(plan));
  return child;
}

absl::Status LocalEngine::Free(SequenceId sequence, bool commit) {
  return cache_->Free(kSession, sequence, commit ? OnFree::kCommit : OnFree::kDiscard);
}

absl::Status LocalEngine::Truncate(SequenceId sequence, int64_t num_tokens) {
  DevicePlan plan;
  KVPOOL_RETURN_IF_ERROR(cache_->Truncate(kSession, sequence, num_tokens, &plan));
  if (absl::Status carried = Carry(plan); !carried.ok()) {
    KVPOOL_CHECK_OK(cache_->AdvanceState(kSession, sequence, -1));  // its state is undefined now
    return carried;
  }
  return absl::OkStatus();
}

std::vector<float> LocalEngine::state(SequenceId sequence) const {
  const Sequence* seq = cache_->Find(sequence);
  if (seq == nullptr || seq->state_slot == kInvalidBlock) return {};
  std::vector<float> out(static_cast<size_t>(model_->state_bytes() / sizeof(float)));
  const char* slot = view_.state(seq->state_slot.value());
  if (device_->host_visible()) {
    std::memcpy(out.data(), slot, out.size() * sizeof(float));
    return out;
  }
  const absl::StatusOr<Fence> copied = device_->CopyToHost(
      kernels::StreamId::kTransfer, out.data(), slot, static_cast<int64_t>(out.size() * 4));
  if (!copied.ok() || !device_->Synchronize(*copied).ok()) return {};
  return out;
}

}  // namespace kvpool::model
