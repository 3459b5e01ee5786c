#pragma once

// StepModel: one model step over the paged pool, wherever it runs. Two implementations: Model
// (model.h: the host, the CPU backend's pool) and the CUDA backend's model (model/cuda: cuBLAS
// and our kernels on the GPU that holds the pool), made by CreateDeviceModel.
//
// Step checks its arguments here, the same for both, and only then hands them to the
// implementation: an argument error never reaches a device and leaves the pool unchanged.
//
// Thread-compatible: one Step at a time.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device.h"
#include "kernels/pool_layout.h"
#include "model/sampling.h"
#include "model/weights.h"

namespace kvpool::model {

// A copy of an item's state to take during the step (docs/hybrid-groups.md §4: checkpoints).
struct StateCheckpoint {
  int64_t offset = 0;      // after this many of the item's tokens: in [1, tokens.size()]
  std::span<float> state;  // where: state_bytes() / 4 floats, device memory where the pool is
};

// One sequence's part of a step.
struct StepItem {
  std::span<const int32_t> tokens;       // the new tokens (at least one)
  int64_t start = 0;                     // position of tokens[0]: tokens already in the pool
  std::span<const int32_t> block_table;  // covers start + tokens.size() tokens
  // How the next token is chosen (sampling.h); null: greedy. Not owned; outlives the step.
  const SamplingParams* sampling = nullptr;
  // The tokens its penalties count (the sequence's last kPenaltyWindow, this step's included).
  std::span<const int32_t> history;
  // The sequence's state-space state (docs/hybrid-groups.md §3: its slot in the pool's state
  // group, KvPoolView::state): ModelConfig::state_bytes() / 4 floats in device memory where the
  // pool is (host memory on the CPU device), every state-space layer's in layer order, the state
  // after the sequence's first `start` tokens; the step advances it in place to start +
  // tokens.size(). Zeros are the state of no tokens. Two items never share one. Ignored (may be
  // empty) for a model without state-space layers.
  std::span<float> state;
  // The sequence's table in the pool's window group (docs/hybrid-groups.md §3), when the pool has
  // one (PoolLayout::num_window_layers > 0; ignored otherwise): window block ids, covering the
  // blocks block_table covers, where the sliding layers' K/V of the same tokens lives. Entries of
  // blocks the window no longer reaches may be released (< 0, kInvalidBlock); every block the
  // step writes or reads must be a window block: the new tokens' blocks, the blocks overlapping
  // the first new token's window [start + 1 - sliding_window, start + tokens.size()) (clipped
  // at 0) and the sink blocks.
  std::span<const int32_t> window_table;
  // Copies of the state to take inside the step, strictly ascending offsets (empty: none). After
  // the step each one's `state` holds the item's state after its first start + offset tokens,
  // what a step ending there would leave; the step's results, K/V and `state` are what they are
  // without checkpoints. Only for a model with state-space layers; a checkpoint overlaps no other
  // one and no item's state. Last member, so that aggregate initializers need not name it.
  std::span<const StateCheckpoint> checkpoints;
};

struct StepOptions {
  int32_t top_k = 0;         // also return the k most likely next tokens with log-probs
  bool keep_logits = false;  // also return the full logits of each item's last token
  bool logprobs = false;     // also return the chosen token's log-probability
};

struct TokenLogProb {
  int32_t token = 0;
  float logprob = 0;
};

// What a step produces for one item: the prediction after its last token.
struct ItemResult {
  int32_t next_token = 0;         // greedy (argmax; the lowest id on a tie), or as sampled
  float logprob = 0;              // of next_token under the model's distribution (logprobs)
  std::vector<TokenLogProb> top;  // top_k entries, most likely first
  std::vector<float> logits;      // [vocab] when keep_logits
};

class StepModel {
 public:
  virtual ~StepModel() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const kernels::PoolLayout& layout() const = 0;
  // Where the step runs: "cpu", "cuda:0".
  virtual std::string where() const = 0;
  // Weight bytes one step reads (f32): the figure decode bandwidth is measured against.
  virtual int64_t weight_bytes() const = 0;
  // Bytes of one sequence's state (StepItem::state); 0 without state-space layers.
  int64_t state_bytes() const { return config().state_bytes(); }

  // Runs one step: writes the K/V of every new token into `pool` and returns one result per
  // item, in order; updates every item's state in place (models with state-space layers) and
  // fills its checkpoints. Items must name disjoint blocks for their new tokens (two sequences
  // never write the same slot).
  //
  // A step with checkpoints runs in phases: every item is cut at its checkpoint offsets into
  // pieces, phase j runs the j-th piece of every item that has one (one RunPhase, all of them
  // batched), then copies the states of the items whose piece ended at a checkpoint into it
  // (CopyStates). Its cost: one more pass over the weights (a RunPhase) per checkpoint before
  // the end of the item that has most of them, and a state-sized copy per checkpoint. On the host
  // model (with AVX2 or AVX-512: docs/hybrid-groups.md §6) the results, K/V and states equal the
  // step's without checkpoints bit for bit, and each checkpoint the state a step ending there
  // leaves; on a GPU they are not promised bit for bit (cuBLAS picks its kernels by shape, the
  // chunked scan cuts each piece into its own chunks).
  //
  // Errors: INVALID_ARGUMENT (empty step or item, a token outside the vocabulary, a table too
  // short, a block outside the pool, with a window group a window table too short or an entry
  // the step reads or writes that is not a window block, a layout other than the model's, top_k
  // outside [0, vocab], sampling parameters out of range, a state of the wrong size or shared by
  // two items, checkpoint offsets not strictly ascending in [1, tokens], a checkpoint of the wrong
  // size or overlapping a state or another checkpoint, checkpoints for a model without state-space
  // layers), checked before anything is written; nothing in the pool, the states or the
  // checkpoints changes then. UNIMPLEMENTED, also before anything runs, when the model cannot
  // copy states (CopyStates). INTERNAL when the device fails (the pool's blocks, the states and
  // the checkpoints of the step are then undefined).
  absl::Status Step(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                    const StepOptions& options, std::vector<ItemResult>* results);

 protected:
  // One state copy: `to` and `from` are state_bytes() / 4 floats, device memory where the pool is.
  struct StateCopy {
    std::span<const float> from;
    std::span<float> to;
  };

  // Step after its checks passed, for items without checkpoints.
  virtual absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                               const StepOptions& options, std::vector<ItemResult>* results) = 0;
  // One phase of a step with checkpoints: RunStep, except that an item whose `in_prefill` entry
  // is nonzero is a piece of a longer prefill and runs as prefill items do even when it has one
  // token (a one-token item otherwise goes through the decode kernel, which sums in another order
  // than the prefill kernel a step ending there uses). The default is RunStep. (The defaults
  // are inline: the CUDA backend's library links no step_model.cc.)
  virtual absl::Status RunPhase(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                                std::span<const uint8_t> /*in_prefill*/, const StepOptions& options,
                                std::vector<ItemResult>* results) {
    return RunStep(pool, items, options, results);
  }
  // Copies each `from` into its `to`, ordered after everything the model ran before, and returns
  // once the copies are done. No copies: OK when the model can copy states (Step asks so before
  // a step with checkpoints runs anything). The default refuses (UNIMPLEMENTED): every model that
  // runs state-space layers overrides it.
  virtual absl::Status CopyStates(std::span<const StateCopy> /*copies*/) {
    return absl::UnimplementedError("this model cannot copy states: it takes no state checkpoints");
  }

 private:
  // Step's phases for items with checkpoints.
  absl::Status StepInPhases(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                            const StepOptions& options, std::vector<ItemResult>* results);
};

// What every implementation checks at creation: a sane config, weights of the config's sizes,
// and a pool layout whose num_layers, num_kv_heads and head_dim are the model's (any KV dtypes),
// and whose window group, if it has one, holds exactly the model's sliding layers
// (num_window_layers == num_sliding_layers()).
// Errors: INVALID_ARGUMENT naming the field or tensor.
absl::Status CheckModel(const ModelWeights& weights, const kernels::PoolLayout& layout);

// The step model for `device`: Model on a host-visible device (threads: its kernel threads, 0 =
// hardware concurrency), else the device's backend model (CUDA: weights uploaded to the GPU,
// matrix products through cuBLAS). Errors: CheckModel's; UNAVAILABLE when the backend cannot run
// a model (no cuBLAS, say, with why); INVALID_ARGUMENT for a shape the device's kernels do not
// take; RESOURCE_EXHAUSTED when the weights do not fit.
absl::StatusOr<std::unique_ptr<StepModel>> CreateStepModel(ModelWeights weights,
                                                           const kernels::PoolLayout& layout,
                                                           kernels::Device* device, int threads);

}  // namespace kvpool::model
