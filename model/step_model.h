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
  // item, in order; updates every item's state in place (models with state-space layers). Items
  // must name disjoint blocks for their new tokens (two sequences never write the same slot).
  // Errors: INVALID_ARGUMENT (empty step or item, a token outside the vocabulary, a table too
  // short, a block outside the pool, a layout other than the model's, top_k outside [0, vocab],
  // sampling parameters out of range, a state of the wrong size or shared by two items), checked
  // before anything is written; nothing in the pool or the states changes then. INTERNAL when
  // the device fails (the pool's blocks and the states of the step are then undefined).
  absl::Status Step(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                    const StepOptions& options, std::vector<ItemResult>* results);

 protected:
  // Step after its checks passed.
  virtual absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                               const StepOptions& options, std::vector<ItemResult>* results) = 0;
};

// What every implementation checks at creation: a sane config, weights of the config's sizes,
// and a pool layout whose num_layers, num_kv_heads and head_dim are the model's (any KV dtypes).
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
