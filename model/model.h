#pragma once

// Model: a Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) whose
// attention runs through the paged pool: new tokens' K/V go into their blocks with WriteKv, then
// the queries attend over their sequences' block tables.
//
// One Step carries any mix of sequences and token counts: a decode item has one new token, a
// prefill item the tokens the prefix cache did not match. The tokens of all items go through the
// dense layers together ([tokens][hidden] · Wᵀ, one cblas_sgemm per projection), so a step of
// eight sequences reads each weight once, not eight times. Attention runs after every new
// token's K/V has been written: decode items through PagedAttentionDecode, prefill items through
// PagedAttentionPrefill (a token at position p attends to positions [0, p] of its own table;
// tiles of tokens read each K/V chunk once). internal/step_layout.h orders the rows for that.
//
// Runs on the host (the CPU backend): matrix products through internal/skinny_matmul.h (decode
// steps) and internal/gemm.h (larger ones; OpenBLAS without AVX2), the KV kernels are
// kernels::cpu. The pool memory must be host-visible.
//
// State-space layers (LayerKind::kStateSpace, Mamba-2) replace attention by a mixer whose
// history is one state per sequence, kept by the caller (StepItem::state) and advanced in place;
// parallel hybrid layers (LayerKind::kParallelHybrid, Falcon-H1) run both on one norm.
//
// Thread-compatible: one Step at a time (the daemon runs steps in order on its runner thread).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/pool_layout.h"
#include "kernels/thread_pool.h"
#include "model/internal/huge_pages.h"
#include "model/step_model.h"
#include "model/weights.h"

namespace kvpool::model {

class Model final : public StepModel {
 public:
  struct Options {
    int threads = 0;  // attention worker threads (0: hardware concurrency)
  };

  // The model runs over pools laid out as `layout` (num_layers, num_kv_heads and head_dim must
  // be the model's; any KV dtypes, per layer and for K and V apart). Errors: INVALID_ARGUMENT (bad
  // config, weights of the wrong size, a layout that does not fit the model, naming the field,
  // or more query heads or a wider head than the CPU attention kernels serve).
  static absl::StatusOr<std::unique_ptr<Model>> Create(ModelWeights weights,
                                                       const kernels::PoolLayout& layout,
                                                       const Options& options);
  ~Model();

  const ModelConfig& config() const override { return config_; }
  const kernels::PoolLayout& layout() const override { return layout_; }
  std::string where() const override { return "cpu"; }
  int64_t weight_bytes() const override;
  // What the step buffers hold now (they shrink back some steps after an oversized step).
  int64_t scratch_bytes() const;

 private:
  struct Scratch;
  Model(ModelWeights weights, const kernels::PoolLayout& layout, const Options& options);

  absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                       const StepOptions& options, std::vector<ItemResult>* results) override;
  absl::Status RunPhase(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                        std::span<const uint8_t> in_prefill, const StepOptions& options,
                        std::vector<ItemResult>* results) override;
  // A memcpy each: the states are host memory.
  absl::Status CopyStates(std::span<const StateCopy> copies) override;
  // y[rows][out] = x[rows][in] · W[out][in]ᵀ (+ y when accumulate).
  void Linear(const float* x, int64_t rows, const internal::HugeVector& w, int32_t out, int32_t in,
              float* y, bool accumulate = false);
  void Layer(int32_t layer, const kernels::KvPoolView& pool, int64_t num_tokens);
  // An attention layer's mixer: q, k, v, the K/V write, attention, o_proj into the residual.
  // `normed`: the scratch's xn already holds the layer's normalized input (a parallel hybrid).
  void SelfAttention(int32_t layer, const kernels::KvPoolView& pool, int64_t num_tokens,
                     bool normed);
  void Attention(int32_t layer, const kernels::KvPoolView& pool);
  // Attention layer `layer`'s layer in the pool (ModelConfig::kv_layer: with a window group, the
  // sliding layers are the pool's last, in its window region).
  int32_t PoolLayer(int32_t layer) const {
    return config_.kv_layer(layer, layout_.num_window_layers > 0);
  }
  // A state-space layer's mixer (instead of attention, or beside it): adds its output to the
  // residual stream and advances every sequence's state. `normed`: as SelfAttention's.
  void StateSpace(int32_t layer, int64_t num_tokens, bool normed);
  // Fills packed_.
  void PackForDecode();
  // Where each sequence's rows and state are, for the scan.
  void PlanStates(std::span<const StepItem> items);

  const ModelConfig config_;
  const kernels::PoolLayout layout_;
  ModelWeights weights_;
  // The matrices a step streams, on huge pages (internal/huge_pages.h); the originals in
  // weights_ are dropped. Per layer: q, k and v projections stacked ([q + 2 kv][hidden]) and gate
  // over up ([2 * intermediate][hidden]; up alone for squared ReLU), so each is one matrix
  // product; wo and w_down. Empty where the layer has no such part.
  std::vector<internal::HugeVector> wqkv_;
  std::vector<internal::HugeVector> w_gate_up_;
  std::vector<internal::HugeVector> wo_;
  std::vector<internal::HugeVector> w_down_;
  // State-space layers (empty for attention ones): in_proj, out_proj, and A = -exp(A_log).
  std::vector<internal::HugeVector> ssm_in_;
  std::vector<internal::HugeVector> ssm_out_;
  std::vector<std::vector<float>> ssm_a_neg_;
  // With state-space layers every product sums each output in the order of k whatever the rows
  // (internal::Gemm's vector path, and for decode-sized products internal::OrderedMatMul over
  // the k-major copies in packed_, never SkinnyMatMul): a sequence computed in chunks equals one
  // computed at once, bit for bit (AVX2 or AVX-512; without them every product is OpenBLAS's).
  bool rows_independent_ = false;
  // PackOrdered copies of every matrix above, by the address of its data (rows_independent_ with
  // AVX2 or AVX-512 only; the row-major originals serve Gemm).
  absl::flat_hash_map<const float*, internal::HugeVector> packed_;
  // The output head ([vocab][hidden]): lm_head, or embed when tied (token embeddings are then
  // read from here too).
  internal::HugeVector head_;
  std::vector<float> inv_freq_;  // [head_dim / 2] RoPE frequencies
  kernels::ThreadPool threads_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace kvpool::model
