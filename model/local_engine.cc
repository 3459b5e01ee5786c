#include "model/local_engine.h"

#include "fmt/format.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::model {

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::Create(ModelWeights weights,
                                                                 const Options& options) {
  const ModelConfig config = weights.config;
  if (config.num_state_layers() > 0 && options.prefix_cache) {
    return absl::InvalidArgumentError(
        "prefix_cache with state-space layers: a cached prefix has no state to resume from (no "
        "checkpoints yet, docs/hybrid-groups.md §4); set prefix_cache = false");
  }
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
  KVPOOL_ASSIGN_OR_RETURN(kernels::PoolLayout layout,
                          kernels::LayoutForBudget(shape, options.pool_bytes));
  std::unique_ptr<LocalEngine> e(new LocalEngine());
  KVPOOL_ASSIGN_OR_RETURN(e->device_,
                          kernels::CreateDevice({.kind = options.backend,
                                                 .device_ordinal = options.device_ordinal,
                                                 .cpu_threads = options.threads}));
  KVPOOL_ASSIGN_OR_RETURN(e->arena_, e->device_->CreateArena(layout.arena_bytes()));
  e->view_ = {e->arena_->base(), layout};
  KVPOOL_ASSIGN_OR_RETURN(e->cache_,
                          KvCacheManager::Create({.block_size = layout.block_size,
                                                  .num_blocks = layout.num_blocks,
                                                  .max_blocks_per_seq = options.max_blocks_per_seq,
                                                  .fences = e->device_.get(),
                                                  .prefix_cache = options.prefix_cache}));
  e->executor_ = std::make_unique<kernels::PlanExecutor>(
      e->device_.get(), kernels::StreamId::kTransfer, e->view_, kernels::FillPolicy::kNone);
  KVPOOL_ASSIGN_OR_RETURN(
      e->model_, CreateStepModel(std::move(weights), layout, e->device_.get(), options.threads));
  return e;
}

LocalEngine::~LocalEngine() {
  if (device_) (void)device_->SynchronizeAll();
}

absl::StatusOr<std::vector<ItemResult>> LocalEngine::Run(const DevicePlan& plan,
                                                         std::vector<PlannedItem>& items,
                                                         const StepOptions& options) {
  absl::Status status = absl::OkStatus();
  if (!plan.empty()) {
    absl::StatusOr<Fence> fence = executor_->Execute(plan);
    status = fence.ok() ? device_->Synchronize(*fence) : fence.status();
  }
  std::vector<StepItem> step;
  const int64_t state_floats = model_->state_bytes() / static_cast<int64_t>(sizeof(float));
  for (const PlannedItem& item : items) {
    StepItem& it = step.emplace_back(item.AsStepItem());
    if (state_floats == 0) continue;
    // A sequence this step creates starts from the state of no tokens.
    if (item.created) states_[item.sequence].assign(static_cast<size_t>(state_floats), 0.0f);
    const auto found = states_.find(item.sequence);
    if (found == states_.end() && status.ok()) {
      status = absl::FailedPreconditionError(fmt::format(
          "sequence {} has no state (it was not made by this engine)", item.sequence.value()));
    }
    if (found != states_.end()) it.state = found->second;
  }
  std::vector<ItemResult> results;
  if (status.ok()) status = model_->Step(view_, step, options, &results);
  if (!status.ok()) {
    for (const PlannedItem& item : items) {
      UndoItem(*cache_, kSession, item);
      if (item.created) states_.erase(item.sequence);
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
  if (const auto parent = states_.find(sequence); parent != states_.end()) {
    std::vector<float> copy = parent->second;
    states_[child] = std::move(copy);
  }
  if (!plan.empty()) {
    KVPOOL_ASSIGN_OR_RETURN(Fence fence, executor_->Execute(plan));
    KVPOOL_RETURN_IF_ERROR(device_->Synchronize(fence));
  }
  return child;
}

absl::Status LocalEngine::Free(SequenceId sequence, bool commit) {
  KVPOOL_RETURN_IF_ERROR(
      cache_->Free(kSession, sequence, commit ? OnFree::kCommit : OnFree::kDiscard));
  states_.erase(sequence);
  return absl::OkStatus();
}

absl::Status LocalEngine::Truncate(SequenceId sequence, int64_t num_tokens) {
  if (model_->state_bytes() > 0) {
    const Sequence* seq = cache_->Find(sequence);
    if (seq != nullptr && seq->session == kSession && seq->num_tokens != num_tokens) {
      return absl::FailedPreconditionError(fmt::format(
          "sequence {} cannot be truncated from {} to {} tokens: its state-space layers hold "
          "the state after token {} only, and no checkpoint of an earlier state exists",
          sequence.value(), seq->num_tokens, num_tokens, seq->num_tokens));
    }
  }
  return cache_->Truncate(kSession, sequence, num_tokens);
}

std::span<const float> LocalEngine::state(SequenceId sequence) const {
  const auto found = states_.find(sequence);
  if (found == states_.end()) return {};
  return found->second;
}

}  // namespace kvpool::model
