#pragma once

// CudaModel: the model step on a GPU, for pools whose arena is device memory (the CUDA backend).
// Same decoder and the same step as model::Model (model/model.h), operation for operation: the
// dense layers are cuBLAS SGEMMs over f32 weights uploaded to the device, the K/V write and the
// paged attention are the backend's own kernels (kernels/cuda), and RMSNorm, RoPE and SwiGLU are
// small kernels of ours (model_kernels.h), as are a state-space layer's conv, scan and gated
// norm (ssm_kernels.h). Only the logits come back to the host, where the greedy token and top-k
// log-probs are taken exactly as Model takes them (internal/logits.h).
//
// State-space layers: each item's StepItem::state is device memory (its slot in the pool's state
// group), read and advanced in place by the kernels, in the host model's layout and with its
// values (to rounding). State checkpoints (StepModel::Step's phases) are device-to-device copies
// on the model's stream.
//
// Streams: the model has its own non-blocking stream. Step uploads its block tables, slots and
// lengths on that stream ahead of the kernels that read them, and returns only once the stream
// is idle (also on error), so when Step returns the device no longer touches the step's blocks:
// the daemon's step fence is correct as it is on the host.
//
// Lives in the CUDA backend library (libkvpool_cuda.so); the daemon reaches it through
// model::CreateStepModel. Thread-compatible: one Step at a time.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device.h"
#include "model/cuda/cublas_api.h"
#include "model/internal/ssm_chunk.h"
#include "model/internal/step_layout.h"
#include "model/step_model.h"

namespace kvpool::model::cuda {

class CudaModel final : public StepModel {
 public:
  // Uploads `weights` to device `ordinal` (num_sms: its multiprocessors, for the decode plan).
  // REQUIRES: CheckModel(weights, layout).ok(). Errors: UNAVAILABLE without cuBLAS;
  // INVALID_ARGUMENT for a head_dim beyond the CUDA decode kernel's, or an SSM d_state or
  // head_dim beyond the scan kernel's (ssm_kernels.h); RESOURCE_EXHAUSTED when the weights do
  // not fit; INTERNAL for other CUDA failures (nothing is left allocated).
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(ModelWeights weights,
                                                           const kernels::PoolLayout& layout,
                                                           int ordinal, int num_sms,
                                                           std::string device_name);
  ~CudaModel() override;

  const ModelConfig& config() const override { return config_; }
  const kernels::PoolLayout& layout() const override { return layout_; }
  std::string where() const override { return where_; }
  int64_t weight_bytes() const override { return weight_bytes_; }

 protected:
  absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                       const StepOptions& options, std::vector<ItemResult>* results) override;
  absl::Status RunPhase(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                        std::span<const uint8_t> in_prefill, const StepOptions& options,
                        std::vector<ItemResult>* results) override;
  // Device-to-device copies on the model's stream (after the phase's kernels, which RunPhase
  // has waited for already), then waits for them: when Step returns nothing of it still runs.
  absl::Status CopyStates(std::span<const StateCopy> copies) override;

 private:
  using Buffer = std::unique_ptr<kernels::DeviceBuffer>;
  struct Layer {
    Buffer attn_norm, mlp_norm;  // [hidden]
    Buffer wqkv;                 // [q + 2 kv][hidden]
    Buffer wo;                   // [hidden][q]
    Buffer w_gate_up;            // [2 * intermediate][hidden] (up alone for squared ReLU)
    Buffer w_down;               // [hidden][intermediate]
    // State-space layers (LayerWeights' ssm_*; a bias absent from the model stays null).
    Buffer ssm_in, ssm_in_bias, ssm_conv, ssm_conv_bias, ssm_dt_bias, ssm_a_neg, ssm_d, ssm_norm,
        ssm_out, ssm_out_bias;
  };
  // Host memory the device copies to or from asynchronously (cudaMallocHost).
  struct Pinned {
    void* data = nullptr;
    int64_t bytes = 0;
  };

  CudaModel(const ModelConfig& config, const kernels::PoolLayout& layout, int ordinal, int num_sms,
            std::string where, const CublasApi* cublas);

  // Uploads `values` (synchronously) into a new buffer.
  absl::StatusOr<Buffer> Upload(const std::vector<float>& values);
  // Grows `buffer` to at least `bytes` (its contents are lost).
  absl::Status Reserve(Buffer& buffer, int64_t bytes);
  absl::Status Reserve(Pinned& pinned, int64_t bytes);
  // y[rows][out] = x[rows][in] · W[out][in]ᵀ (+ y when accumulate).
  absl::Status Gemm(const float* x, int32_t rows, const Buffer& w, int32_t out, int32_t in,
                    float* y, bool accumulate);
  // Sets offsets_ for the step laid out in step_ (num_items items).
  void LayInputs(int64_t num_items);
  // The step's launches, after its inputs were staged; RunStep synchronizes after them.
  absl::Status Launch(const kernels::KvPoolView& pool, int32_t num_tokens, int32_t num_items);
  // One layer's MLP (its norm, SwiGLU and down projection into the residual stream x_).
  absl::Status Mlp(const Layer& layer, int32_t num_tokens);
  // One layer's attention, after its K/V were written.
  absl::Status Attention(const kernels::KvPoolView& pool, int32_t layer);
  // Attention layer `layer`'s layer in the pool (with a window group, the sliding layers are the
  // pool's last, in its window region: ModelConfig::kv_layer).
  int32_t PoolLayer(int32_t layer) const {
    return config_.kv_layer(layer, layout_.num_window_layers > 0);
  }
  // cuda_model_ssm.cc: a state-space layer's weights onto the device.
  absl::Status UploadStateSpace(LayerWeights& weights, Layer* layer);
  // Reserves the step's SSM buffers and stages the device pointers of its states (sorted as the
  // rows); after Reserve(staged_) with the offsets set.
  absl::Status StageStates(std::span<const StepItem> items, int32_t num_tokens);
  // Layer `layer`'s mixer, a state-space one, into the residual stream x_.
  // `normed`: xn_ already holds the layer's normalized input (a parallel hybrid's attention
  // normalized it).
  absl::Status StateSpace(int32_t layer, int32_t num_tokens, bool normed);

  const ModelConfig config_;
  const kernels::PoolLayout layout_;
  const int ordinal_;
  const int num_sms_;
  const std::string where_;
  const CublasApi* const cublas_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  int64_t weight_bytes_ = 0;

  std::vector<Layer> layers_;
  Buffer embed_;  // [vocab][hidden] when untied; tied models read head_
  Buffer head_;   // [vocab][hidden]
  Buffer final_norm_;
  Buffer inv_freq_;  // [rotary() / 2]

  // Per step. The rows (decode items first) and the kernels' sequences, and the inputs staged
  // in pinned memory and copied in one piece: tokens, positions, slots, lengths, block tables,
  // prefill q_starts and the row of each item's last token (offsets below); with a window group
  // also the window slots and window tables the sliding layers read (empty without one).
  internal::StepLayout step_;
  Pinned staged_;
  Pinned logits_host_;
  Buffer inputs_;
  struct {
    int64_t tokens = 0, positions = 0, slots = 0, lens = 0, tables = 0, q_starts = 0, last_rows = 0,
            window_slots = 0, window_tables = 0, seq_starts = 0, state_ptrs = 0, chunk_rows = 0,
            seq_chunks = 0, end = 0;
  } offsets_;
  Buffer x_, xn_, qkv_, q_, attn_, k_, v_, gate_up_, act_, last_, logits_, workspace_;

  // State-space layers. The step's sequences in row order (as the host model's PlanStates):
  // seq_starts_ [seqs + 1] their rows, seq_items_ the item of each. The inputs hold seq_starts
  // and, per state layer, the device pointers of each sequence's conv carry and scan state in its
  // state slot (state_ptrs: [state layers][2][seqs]), advanced in place.
  std::vector<int32_t> seq_starts_;
  std::vector<size_t> seq_items_;
  Buffer ssm_proj_, ssm_xbc_, ssm_x_, ssm_b_, ssm_c_, ssm_dt_, ssm_y_;
  // A step with a sequence of more than kSsmChunkRows rows scans in chunks (ssm_kernels.h): its
  // plan (staged at chunk_rows and seq_chunks) and workspace.
  bool chunked_ = false;
  internal::SsmChunkPlan chunk_plan_;
  Buffer ssm_chunks_, ssm_decays_;
};

}  // namespace kvpool::model::cuda
