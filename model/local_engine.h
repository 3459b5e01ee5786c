#pragma once

// LocalEngine: one process's pool and model, without the daemon: a device (the CPU's by default,
// or the CUDA backend's) and its arena, a KvCacheManager over it, the plan executor, and the
// step model for that device (CreateStepModel), driven through the step planner exactly as
// kvpoold drives them (minus RPC, sessions and cross-client batching). Tests hold the daemon's
// results, and the GPU's, to it; benchmarks measure the daemon against it.
//
// A model with state-space layers gets one state slot per sequence (StepItem::state), made with
// the sequence, copied by Fork and dropped by Free: docs/hybrid-groups.md §6 step 1, over a pool
// that still keeps every token. Without checkpoints such a model has no prefix cache and cannot
// rewind (Create and Truncate refuse).
//
// All sequences belong to one session in one namespace. Thread-compatible.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/plan_executor.h"
#include "kvpool/kv_cache_manager.h"
#include "model/step_model.h"
#include "model/step_planner.h"

namespace kvpool::model {

class LocalEngine final {
 public:
  struct Options {
    int32_t block_size = 16;
    kernels::DType dtype = kernels::DType::kBF16;    // K and V of every layer not listed below
    std::vector<kernels::LayerDTypes> layer_dtypes;  // per-layer K and V dtypes
    int64_t pool_bytes = int64_t{64} << 20;
    int32_t max_blocks_per_seq = 4096;
    bool prefix_cache = true;
    int threads = 0;  // kernel threads (0: hardware concurrency)
    kernels::BackendKind backend = kernels::BackendKind::kCpu;
    int device_ordinal = 0;
  };

  // Errors: INVALID_ARGUMENT (a model the options' layout cannot hold, prefix_cache with
  // state-space layers: a cached prefix has no state to resume from until checkpoints exist),
  // RESOURCE_EXHAUSTED; CreateDevice's and CreateStepModel's (UNAVAILABLE for CUDA without a GPU).
  static absl::StatusOr<std::unique_ptr<LocalEngine>> Create(ModelWeights weights,
                                                             const Options& options);
  ~LocalEngine();

  struct PrefillResult {
    SequenceId sequence;
    int64_t reused = 0;  // prompt tokens served by the prefix cache
    ItemResult result;   // the first generated token
  };
  // See PlanPrefill: SequenceId(0) starts a new sequence. Errors as PlanPrefill and Model::Step;
  // nothing changes on error.
  absl::StatusOr<PrefillResult> Prefill(SequenceId sequence, std::span<const int32_t> tokens,
                                        const StepOptions& options = {});
  // One step for every input (one batched model step). Errors as PlanDecode and Model::Step.
  absl::StatusOr<std::vector<ItemResult>> Decode(std::span<const DecodeInput> inputs,
                                                 const StepOptions& options = {});
  // Errors as KvCacheManager::Fork / Free. Fork copies the sequence's state.
  absl::StatusOr<SequenceId> Fork(SequenceId sequence);
  absl::Status Free(SequenceId sequence, bool commit);
  // Rewinds `sequence` to `num_tokens` (KvCacheManager::Truncate). With state-space layers only
  // its current length is accepted: FAILED_PRECONDITION for any other (the state of an earlier
  // token is gone: no checkpoint exists). Errors as KvCacheManager::Truncate; nothing changes on
  // error.
  absl::Status Truncate(SequenceId sequence, int64_t num_tokens);
  // The sequence's state (every state-space layer's, StepItem::state's layout); empty for an
  // unknown sequence or a model without state-space layers.
  std::span<const float> state(SequenceId sequence) const;

  KvCacheManager& cache() { return *cache_; }
  StepModel& model() { return *model_; }
  kernels::Device& device() { return *device_; }
  const kernels::KvPoolView& pool() const { return view_; }

 private:
  LocalEngine() = default;
  TokenLimits Limits() const {
    return {model_->config().vocab_size, model_->config().max_position};
  }
  // Carries out `plan`, runs the step, then finishes (or undoes) every item.
  absl::StatusOr<std::vector<ItemResult>> Run(const DevicePlan& plan,
                                              std::vector<PlannedItem>& items,
                                              const StepOptions& options);

  static constexpr SessionId kSession{1};
  static constexpr NamespaceId kNamespace{1};

  std::unique_ptr<kernels::Device> device_;
  std::unique_ptr<kernels::Arena> arena_;
  kernels::KvPoolView view_;
  std::unique_ptr<KvCacheManager> cache_;
  std::unique_ptr<kernels::PlanExecutor> executor_;
  std::unique_ptr<StepModel> model_;
  // One state per live sequence (models with state-space layers), state_bytes() / 4 floats.
  absl::flat_hash_map<SequenceId, std::vector<float>> states_;
};

}  // namespace kvpool::model
