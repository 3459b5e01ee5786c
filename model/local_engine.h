#pragma once

// LocalEngine: one process's pool and model, without the daemon: a device (the CPU's by default,
// or the CUDA backend's) and its arena, a KvCacheManager over it, the plan executor, and the
// step model for that device (CreateStepModel), driven through the step planner exactly as
// kvpoold drives them (minus RPC, sessions and cross-client batching). Tests hold the daemon's
// results, and the GPU's, to it; benchmarks measure the daemon against it.
//
// A model with sliding-window layers keeps their K/V in the pool's window group, as kvpoold does
// (Options::window_blocks): each step's window blocks, and after it SlideWindow releases those
// that left the window (docs/hybrid-groups.md §3), so a sequence holds a bounded number of them;
// a prompt resumes a cached prefix only where the window group still holds its window.
//
// A model with state-space layers keeps each sequence's state in the pool's state group, as
// kvpoold does (docs/hybrid-groups.md §3; Options::state_slots): zeroed with the sequence (or
// copied from the checkpoint its prompt resumes from), copied by Fork, released fenced by Free
// (a committed one's state becomes the checkpoint at its end). Its steps take the checkpoints
// the core plans (§4). It cannot rewind below the tokens it knows (Truncate refuses).
//
// All sequences belong to one session in one namespace. Thread-compatible.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

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
    // Models with state-space layers: sequences alive at once (each has a slot in the pool's
    // state group), out of pool_bytes. 0: as many as a quarter of pool_bytes holds, 1 to 64.
    int32_t state_slots = 0;
    // And slots for the prefix cache's state checkpoints on top (KvCacheOptions::
    // checkpoint_slots; none without the prefix cache). 0: as many as state_slots.
    int32_t checkpoint_slots = 0;
    int32_t checkpoint_interval = 4;  // KvCacheOptions::checkpoint_interval
    // Models with sliding-window layers: blocks of the pool's window group (its own region, the
    // sliding layers' K/V: docs/hybrid-groups.md §2-§3), paid for out of pool_bytes first. 0: a
    // quarter of pool_bytes' worth (at least WindowBound() blocks); -1: no window group, the
    // sliding layers keep every token in the main blocks (as a model whose every attention
    // layer slides always does: the main blocks must keep one layer).
    int32_t window_blocks = 0;
    int threads = 0;  // kernel threads (0: hardware concurrency)
    kernels::BackendKind backend = kernels::BackendKind::kCpu;
    int device_ordinal = 0;
  };

  // With state-space layers a prompt resumes a cached prefix only from a state checkpoint.
  // Errors: INVALID_ARGUMENT (a model the options' layout cannot hold, a budget
  // below the state slots and one block), RESOURCE_EXHAUSTED; CreateDevice's and
  // CreateStepModel's (UNAVAILABLE for CUDA without a GPU).
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
  // Rewinds `sequence` to `num_tokens` (KvCacheManager::Truncate: with state-space layers below
  // the tokens it knows only to a state checkpoint the tree keeps there, whose state is copied
  // back, or to 0; FAILED_PRECONDITION otherwise). Nothing changes on error.
  absl::Status Truncate(SequenceId sequence, int64_t num_tokens);
  // A copy of the sequence's state (every state-space layer's, StepItem::state's layout), read
  // from its slot in the pool's state group once the device is idle; empty for an unknown
  // sequence or a model without state-space layers.
  std::vector<float> state(SequenceId sequence) const;

  KvCacheManager& cache() { return *cache_; }
  StepModel& model() { return *model_; }
  kernels::Device& device() { return *device_; }
  const kernels::KvPoolView& pool() const { return view_; }

 private:
  LocalEngine() = default;
  TokenLimits Limits() const {
    return {model_->config().vocab_size, model_->config().max_position};
  }
  // Enqueues `plan`'s device work (blocks, then states) and waits for it.
  absl::Status Carry(const DevicePlan& plan);
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
  std::unique_ptr<kernels::PlanExecutor> state_executor_;   // null without state-space layers
  std::unique_ptr<kernels::PlanExecutor> window_executor_;  // null without a window group
  std::unique_ptr<StepModel> model_;
};

}  // namespace kvpool::model
