#include "model/cuda/cuda_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "fmt/format.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_memory.h"
#include "kernels/cuda/cuda_status.h"
#include "kvpool/util/status_macros.h"
#include "model/cuda/model_kernels.h"
#include "model/cuda/ssm_kernels.h"
#include "model/internal/logits.h"
#include "model/internal/step_layout.h"

namespace kvpool::model::cuda {
namespace {

using kernels::cuda::CudaStatus;

template <typename T>
T* At(const std::unique_ptr<kernels::DeviceBuffer>& buffer, int64_t offset = 0) {
  return reinterpret_cast<T*>(static_cast<char*>(buffer->data()) + offset);
}

int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The step's grid rows against the kernels' gridDim.y limit: the decode splits and the prefills
// (attention), and with `state_space` layers every item (LaunchSsmConv: a row each).
absl::Status CheckGrids(const internal::StepLayout& step, const kernels::cuda::DecodePlan& plan,
                        int64_t items, bool state_space) {
  if (plan.num_splits > kernels::cuda::kMaxGridYZ || step.num_prefill > kernels::cuda::kMaxGridYZ) {
    return absl::InvalidArgumentError(fmt::format(
        "step: {} prefills, sequences of {} tokens: beyond the attention kernels' grids",
        step.num_prefill, step.max_len));
  }
  if (state_space && items > kernels::cuda::kMaxGridYZ) {
    return absl::InvalidArgumentError(
        fmt::format("step: {} sequences: beyond the state-space kernels' grids", items));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(ModelWeights weights,
                                                             const kernels::PoolLayout& layout,
                                                             int ordinal, int num_sms,
                                                             std::string device_name) {
  const SsmConfig& ssm = weights.config.ssm;
  if (weights.config.num_state_layers() > 0 &&
      (ssm.d_state > kMaxSsmDState || ssm.head_dim > kMaxSsmHeadDim)) {
    return absl::InvalidArgumentError(
        fmt::format("SSM d_state {} / head_dim {} beyond the CUDA scan kernel's {} / {}",
                    ssm.d_state, ssm.head_dim, kMaxSsmDState, kMaxSsmHeadDim));
  }
  if (layout.head_dim > kernels::cuda::kMaxDecodeHeadDim) {
    return absl::InvalidArgumentError(fmt::format("head_dim {} > {} (the CUDA decode kernel's)",
                                                  layout.head_dim,
                                                  kernels::cuda::kMaxDecodeHeadDim));
  }
  KVPOOL_ASSIGN_OR_RETURN(const CublasApi* cublas, LoadCublas());
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  const ModelConfig& c = weights.config;
  std::unique_ptr<CudaModel> m(
      new CudaModel(c, layout, ordinal, num_sms, std::move(device_name), cublas));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags"));
  KVPOOL_RETURN_IF_ERROR(CublasStatus(*cublas, cublas->create(&m->handle_), "cublasCreate"));
  KVPOOL_RETURN_IF_ERROR(
      CublasStatus(*cublas, cublas->set_stream(m->handle_, m->stream_), "cublasSetStream"));

  // Stacked as on the host (model.cc): q, k, v as one matrix, gate over up as another.
  auto stacked = [](std::initializer_list<std::vector<float>*> parts) {
    std::vector<float> out;
    for (std::vector<float>* p : parts) {
      out.insert(out.end(), p->begin(), p->end());
      std::vector<float>().swap(*p);
    }
    return out;
  };
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    LayerWeights& L = weights.layers[l];
    Layer layer;
    KVPOOL_ASSIGN_OR_RETURN(layer.attn_norm, m->Upload(L.attn_norm));
    KVPOOL_ASSIGN_OR_RETURN(layer.mlp_norm, m->Upload(L.mlp_norm));
    if (c.has_state(static_cast<int32_t>(l))) {
      KVPOOL_RETURN_IF_ERROR(m->UploadStateSpace(L, &layer));
    }
    if (c.is_attention(static_cast<int32_t>(l))) {  // a parallel hybrid has both
      KVPOOL_ASSIGN_OR_RETURN(layer.wqkv, m->Upload(stacked({&L.wq, &L.wk, &L.wv})));
      KVPOOL_ASSIGN_OR_RETURN(layer.wo, m->Upload(L.wo));
    }
    KVPOOL_ASSIGN_OR_RETURN(layer.w_gate_up, m->Upload(stacked({&L.w_gate, &L.w_up})));
    KVPOOL_ASSIGN_OR_RETURN(layer.w_down, m->Upload(L.w_down));
    std::vector<float>().swap(L.wo);
    std::vector<float>().swap(L.w_down);
    m->layers_.push_back(std::move(layer));
  }
  KVPOOL_ASSIGN_OR_RETURN(m->head_,
                          m->Upload(c.tie_word_embeddings ? weights.embed : weights.lm_head));
  if (!c.tie_word_embeddings) {
    KVPOOL_ASSIGN_OR_RETURN(m->embed_, m->Upload(weights.embed));
  }
  KVPOOL_ASSIGN_OR_RETURN(m->final_norm_, m->Upload(weights.final_norm));
  std::vector<float> inv_freq;
  for (int32_t i = 0; i < c.rotary() / 2; ++i) {
    inv_freq.push_back(static_cast<float>(
        1.0 / std::pow(static_cast<double>(c.rope_theta), 2.0 * i / c.rotary())));
  }
  KVPOOL_ASSIGN_OR_RETURN(m->inv_freq_, m->Upload(inv_freq));
  // What a step streams: every matrix once (the host model's figure, for comparison).
  const int64_t h = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim,
                kv = int64_t{c.num_kv_heads} * c.head_dim, im = c.intermediate_size;
  const int64_t ssm_layer = ssm.in_proj_dim() * h + h * ssm.inner();
  const int64_t ssm_layers = c.num_state_layers();
  int64_t mlp_layers = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) mlp_layers += c.has_mlp(l) ? 1 : 0;
  m->weight_bytes_ = static_cast<int64_t>(sizeof(float)) *
                     (c.num_layers * 2 * h + mlp_layers * (c.mlp_in_rows() + im) * h +
                      c.num_kv_layers() * ((q + 2 * kv) * h + h * q) + ssm_layers * ssm_layer +
                      int64_t{c.vocab_size} * h + h);
  return m;
}

CudaModel::CudaModel(const ModelConfig& config, const kernels::PoolLayout& layout, int ordinal,
                     int num_sms, std::string where, const CublasApi* cublas)
    : config_(config),
      layout_(layout),
      ordinal_(ordinal),
      num_sms_(num_sms),
      where_(std::move(where)),
      cublas_(cublas) {}

CudaModel::~CudaModel() {
  cudaSetDevice(ordinal_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (handle_ != nullptr) cublas_->destroy(handle_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  for (Pinned* p : {&staged_, &logits_host_}) {
    if (p->data != nullptr) cudaFreeHost(p->data);
  }
  // Buffers free themselves (cudaFree waits for the device).
}

absl::StatusOr<CudaModel::Buffer> CudaModel::Upload(const std::vector<float>& values) {
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(float));
  KVPOOL_ASSIGN_OR_RETURN(Buffer buffer,
                          kernels::cuda::AllocateCudaBuffer(ordinal_, std::max<int64_t>(bytes, 4)));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(buffer->data(), values.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
      "cudaMemcpy (weights)"));
  return buffer;
}

absl::Status CudaModel::Reserve(Buffer& buffer, int64_t bytes) {
  if (buffer != nullptr && buffer->bytes() >= bytes) return absl::OkStatus();
  // Grow geometrically; the old buffer goes first (its cudaFree waits for the device).
  const int64_t want = std::max<int64_t>({bytes, buffer ? 2 * buffer->bytes() : 0, 4096});
  buffer.reset();
  KVPOOL_ASSIGN_OR_RETURN(buffer, kernels::cuda::AllocateCudaBuffer(ordinal_, want));
  return absl::OkStatus();
}

absl::Status CudaModel::Reserve(Pinned& pinned, int64_t bytes) {
  if (pinned.bytes >= bytes) return absl::OkStatus();
  const int64_t want = std::max<int64_t>({bytes, 2 * pinned.bytes, 4096});
  if (pinned.data != nullptr) cudaFreeHost(pinned.data);
  pinned = {};
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMallocHost(&pinned.data, static_cast<size_t>(want)), "cudaMallocHost"));
  pinned.bytes = want;
  return absl::OkStatus();
}

absl::Status CudaModel::Gemm(const float* x, int32_t rows, const Buffer& w, int32_t out, int32_t in,
                             float* y, bool accumulate) {
  // Row-major y[rows][out] is column-major yᵀ (out x rows) = W · xᵀ, and row-major W[out][in]
  // is column-major Wᵀ (in x out): so yᵀ = op(Wᵀ)ᵀ · xᵀ with A transposed and B as is.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return CublasStatus(*cublas_,
                      cublas_->sgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha,
                                     At<float>(w), in, x, in, &beta, y, out),
                      "cublasSgemm");
}

// Where each of the step's inputs lies in staged_ and inputs_ (offsets_), 256-byte aligned.
void CudaModel::LayInputs(int64_t ni) {
  const ModelConfig& c = config_;
  const internal::StepLayout& L = step_;
  const int64_t n = L.num_tokens;
  const int64_t seqs = int64_t{L.num_decode} + L.num_prefill;
  offsets_.tokens = 0;
  offsets_.positions = Align(offsets_.tokens + 4 * n);
  offsets_.slots = Align(offsets_.positions + 4 * n);
  offsets_.lens = Align(offsets_.slots + 8 * n);
  offsets_.tables = Align(offsets_.lens + 4 * seqs);
  offsets_.q_starts = Align(offsets_.tables + 4 * seqs * L.stride);
  offsets_.last_rows = Align(offsets_.q_starts + 4 * (int64_t{L.num_prefill} + 1));
  // The window group's slots and tables (empty without one).
  offsets_.window_slots = Align(offsets_.last_rows + 4 * ni);
  offsets_.window_tables =
      Align(offsets_.window_slots + 8 * static_cast<int64_t>(L.window_slots.size()));
  // State-space layers: the sequences' rows and, per state layer, 2 pointers per sequence.
  const int64_t ssm_seqs = c.num_state_layers() > 0 ? ni : 0;
  offsets_.seq_starts =
      Align(offsets_.window_tables + 4 * static_cast<int64_t>(L.window_tables.size()));
  offsets_.state_ptrs = Align(offsets_.seq_starts + 4 * (ssm_seqs + 1));
  // At most n / kSsmChunkRows + 1 chunks per sequence's share (PlanSsmChunks).
  const int64_t max_chunks = ssm_seqs > 0 ? n / kSsmChunkRows + ssm_seqs : 0;
  offsets_.chunk_rows = Align(offsets_.state_ptrs + static_cast<int64_t>(sizeof(float*)) * 2 *
                                                        c.num_state_layers() * ssm_seqs);
  offsets_.seq_chunks = Align(offsets_.chunk_rows + 4 * (max_chunks + 1));
  offsets_.end = Align(offsets_.seq_chunks + 4 * (ssm_seqs + 1));
}

absl::Status CudaModel::RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                                const StepOptions& options, std::vector<ItemResult>* results) {
  return RunPhase(pool, items, {}, options, results);
}

absl::Status CudaModel::CopyStates(std::span<const StateCopy> copies) {
  if (copies.empty()) return absl::OkStatus();
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
  absl::Status copied = absl::OkStatus();
  for (const StateCopy& copy : copies) {
    copied = CudaStatus(cudaMemcpyAsync(copy.to.data(), copy.from.data(), copy.from.size_bytes(),
                                        cudaMemcpyDeviceToDevice, stream_),
                        "cudaMemcpyAsync (state checkpoint)");
    if (!copied.ok()) break;
  }
  // Wait whatever happened, as RunPhase does: nothing of the step runs once Step returns.
  const absl::Status synced =
      CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (state checkpoints)");
  KVPOOL_RETURN_IF_ERROR(copied);
  return synced;
}

absl::Status CudaModel::RunPhase(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                                 std::span<const uint8_t> in_prefill, const StepOptions& options,
                                 std::vector<ItemResult>* results) {
  const ModelConfig& c = config_;
  const int32_t bs = layout_.block_size;
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));

  // The step's rows as on the host (internal/step_layout.h): decode items first, each a
  // sequence of the decode kernel; then prefill items, sequences of the prefill kernel.
  internal::PlanStepLayout(items, in_prefill, bs, /*window_group=*/layout_.num_window_layers > 0,
                           &step_);
  const internal::StepLayout& L = step_;
  const int64_t n = L.num_tokens;
  const int64_t ni = static_cast<int64_t>(items.size());
  const int64_t seqs = int64_t{L.num_decode} + L.num_prefill;
  if (seqs * std::max(L.stride, 1) > INT32_MAX) {
    return absl::InvalidArgumentError(fmt::format("step: {} tokens is too many", n));
  }
  LayInputs(ni);
  KVPOOL_RETURN_IF_ERROR(Reserve(staged_, offsets_.end));
  char* host = static_cast<char*>(staged_.data);
  auto stage = [host](int64_t offset, const auto& values) {
    std::memcpy(host + offset, values.data(), values.size() * sizeof(values[0]));
  };
  stage(offsets_.tokens, L.tokens);
  stage(offsets_.positions, L.positions);
  stage(offsets_.slots, L.slots);
  stage(offsets_.lens, L.lens);
  stage(offsets_.tables, L.tables);
  stage(offsets_.q_starts, L.q_starts);
  stage(offsets_.last_rows, L.last_rows);
  stage(offsets_.window_slots, L.window_slots);
  stage(offsets_.window_tables, L.window_tables);
  KVPOOL_RETURN_IF_ERROR(StageStates(items, static_cast<int32_t>(n)));

  // Scratch for the widest step so far.
  const int64_t h = c.hidden_size, qd = int64_t{c.num_heads} * c.head_dim,
                kvd = int64_t{c.num_kv_heads} * c.head_dim, im = c.intermediate_size;
  const kernels::cuda::DecodePlan plan =
      L.num_decode > 0
          ? kernels::cuda::PlanDecode(layout_, L.num_decode, c.num_heads, L.max_len, num_sms_)
          : kernels::cuda::DecodePlan{};
  KVPOOL_RETURN_IF_ERROR(CheckGrids(L, plan, ni, /*state_space=*/c.num_state_layers() > 0));
  KVPOOL_RETURN_IF_ERROR(Reserve(inputs_, offsets_.end));
  KVPOOL_RETURN_IF_ERROR(Reserve(x_, 4 * n * h));
  KVPOOL_RETURN_IF_ERROR(Reserve(xn_, 4 * n * h));
  KVPOOL_RETURN_IF_ERROR(Reserve(qkv_, 4 * n * (qd + 2 * kvd)));
  KVPOOL_RETURN_IF_ERROR(Reserve(q_, 4 * n * qd));
  KVPOOL_RETURN_IF_ERROR(Reserve(attn_, 4 * n * qd));
  KVPOOL_RETURN_IF_ERROR(Reserve(k_, 4 * n * kvd));
  KVPOOL_RETURN_IF_ERROR(Reserve(v_, 4 * n * kvd));
  KVPOOL_RETURN_IF_ERROR(Reserve(gate_up_, 4 * n * 2 * im));
  KVPOOL_RETURN_IF_ERROR(Reserve(act_, 4 * n * im));
  KVPOOL_RETURN_IF_ERROR(Reserve(last_, 4 * ni * h));
  KVPOOL_RETURN_IF_ERROR(Reserve(logits_, 4 * ni * c.vocab_size));
  KVPOOL_RETURN_IF_ERROR(Reserve(workspace_, plan.workspace_bytes));
  KVPOOL_RETURN_IF_ERROR(Reserve(logits_host_, 4 * ni * c.vocab_size));

  // Everything from here is on the stream; wait for it whatever happens, so no kernel of this
  // step still runs when the caller releases its blocks.
  absl::Status launched = Launch(pool, static_cast<int32_t>(n), static_cast<int32_t>(ni));
  const absl::Status synced =
      CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (model step)");
  KVPOOL_RETURN_IF_ERROR(launched);
  KVPOOL_RETURN_IF_ERROR(synced);

  results->clear();
  results->resize(static_cast<size_t>(ni));
  const auto* logits = static_cast<const float*>(logits_host_.data);
  for (int64_t i = 0; i < ni; ++i) {
    internal::FillResult(logits + i * c.vocab_size, c.vocab_size, options,
                         items[static_cast<size_t>(i)], &(*results)[static_cast<size_t>(i)]);
  }
  return absl::OkStatus();
}

// Decode items through the decode kernel, prefill items through the tiled prefill kernel (rows
// as internal/step_layout.h lays them out), on the model's stream.
absl::Status CudaModel::Attention(const kernels::KvPoolView& pool, int32_t layer) {
  const internal::StepLayout& L = step_;
  const ModelConfig& c = config_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const int64_t qd = int64_t{c.num_heads} * c.head_dim;
  const auto* lens = At<int32_t>(inputs_, offsets_.lens);
  const int32_t kv_layer = PoolLayer(layer);
  // A window layer of a pool with a window group reads its region through the window tables.
  const auto* tables = At<int32_t>(
      inputs_, layout_.is_window_layer(kv_layer) ? offsets_.window_tables : offsets_.tables);
  if (L.num_decode > 0) {
    const kernels::cuda::DecodePlan plan =
        kernels::cuda::PlanDecode(layout_, L.num_decode, c.num_heads, L.max_len, num_sms_);
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        kernels::cuda::LaunchPagedAttentionDecode(pool,
                                                  {.layer = kv_layer,
                                                   .num_seqs = L.num_decode,
                                                   .num_q_heads = c.num_heads,
                                                   .scale = scale,
                                                   .q = At<float>(q_),
                                                   .out = At<float>(attn_),
                                                   .block_tables = tables,
                                                   .table_stride = L.stride,
                                                   .seq_lens = lens,
                                                   .max_seq_len = L.max_len,
                                                   .window = c.window(layer),
                                                   .workspace = workspace_->data(),
                                                   .workspace_bytes = workspace_->bytes()},
                                                  plan, stream_),
        "paged decode attention kernel"));
  }
  if (L.num_prefill > 0) {
    const int64_t first = L.num_decode;
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(kernels::cuda::LaunchPagedAttentionPrefill(
                       pool,
                       {.layer = kv_layer,
                        .num_seqs = L.num_prefill,
                        .num_q_heads = c.num_heads,
                        .scale = scale,
                        .q = At<float>(q_) + first * qd,
                        .out = At<float>(attn_) + first * qd,
                        .q_starts = At<int32_t>(inputs_, offsets_.q_starts),
                        .block_tables = tables + first * L.stride,
                        .table_stride = L.stride,
                        .seq_lens = lens + first,
                        .max_seq_len = L.max_len,
                        .max_q_len = L.max_q_len,
                        .window = c.window(layer)},
                       kernels::cuda::PlanPrefill(layout_, c.num_heads, L.max_q_len), stream_),
                   "paged prefill attention kernel"));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Mlp(const Layer& L, int32_t n) {
  const ModelConfig& c = config_;
  const int32_t h = c.hidden_size, im = c.intermediate_size;
  float* x = At<float>(x_);
  float* xn = At<float>(xn_);
  KVPOOL_RETURN_IF_ERROR(CudaStatus(
      LaunchRmsNorm(x, nullptr, n, h, At<float>(L.mlp_norm), c.rms_norm_eps, xn, stream_),
      "RMSNorm kernel"));
  KVPOOL_RETURN_IF_ERROR(Gemm(xn, n, L.w_gate_up, c.mlp_in_rows(), h, At<float>(gate_up_), false));
  if (c.gated_mlp()) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchSiluMul(At<float>(gate_up_), n, im, At<float>(act_), stream_), "SwiGLU kernel"));
  } else {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchReluSquared(At<float>(gate_up_), int64_t{n} * im, At<float>(act_), stream_),
        "squared ReLU kernel"));
  }
  return Gemm(At<float>(act_), n, L.w_down, h, im, x, true);
}

absl::Status CudaModel::Launch(const kernels::KvPoolView& pool, int32_t n, int32_t ni) {
  const ModelConfig& c = config_;
  const int32_t h = c.hidden_size, hd = c.head_dim;
  const int32_t qd = c.num_heads * hd, kvd = c.num_kv_heads * hd;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(inputs_->data(), staged_.data, static_cast<size_t>(offsets_.end),
                                 cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (step inputs)"));
  const auto* tokens = At<int32_t>(inputs_, offsets_.tokens);
  const auto* positions = At<int32_t>(inputs_, offsets_.positions);
  const auto* slots = At<int64_t>(inputs_, offsets_.slots);
  const auto* window_slots = At<int64_t>(inputs_, offsets_.window_slots);
  const auto* last_rows = At<int32_t>(inputs_, offsets_.last_rows);
  float* x = At<float>(x_);
  float* xn = At<float>(xn_);

  KVPOOL_RETURN_IF_ERROR(CudaStatus(
      LaunchEmbed(At<float>(c.tie_word_embeddings ? head_ : embed_), tokens, n, h, x, stream_),
      "embedding kernel"));
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    if (!c.is_attention(l)) {
      if (c.has_state(l)) KVPOOL_RETURN_IF_ERROR(StateSpace(l, n, /*normed=*/false));
      if (c.has_mlp(l)) KVPOOL_RETURN_IF_ERROR(Mlp(L, n));
      continue;
    }
    // Attention.
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchRmsNorm(x, nullptr, n, h, At<float>(L.attn_norm), c.rms_norm_eps, xn, stream_),
        "RMSNorm kernel"));
    KVPOOL_RETURN_IF_ERROR(Gemm(xn, n, L.wqkv, qd + 2 * kvd, h, At<float>(qkv_), false));
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(LaunchRopeSplit(At<float>(qkv_), positions, At<float>(inv_freq_), n, c.num_heads,
                                   c.num_kv_heads, hd, c.rotary(), At<float>(q_), At<float>(k_),
                                   At<float>(v_), stream_),
                   "RoPE kernel"));
    // Every new token's K/V goes in before any query reads (stream order); a window layer's
    // into its window blocks.
    const int32_t kv_layer = PoolLayer(l);
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(kernels::cuda::LaunchWriteKv(
                       pool,
                       {.layer = kv_layer,
                        .num_tokens = n,
                        .k = At<float>(k_),
                        .v = At<float>(v_),
                        .slots = layout_.is_window_layer(kv_layer) ? window_slots : slots},
                       stream_),
                   "WriteKv kernel"));
    KVPOOL_RETURN_IF_ERROR(Attention(pool, l));
    KVPOOL_RETURN_IF_ERROR(Gemm(At<float>(attn_), n, L.wo, h, qd, x, true));
    // A parallel hybrid's mixer reads the same normalized input (xn_ is still it).
    if (c.has_state(l)) KVPOOL_RETURN_IF_ERROR(StateSpace(l, n, /*normed=*/true));
    if (c.has_mlp(l)) KVPOOL_RETURN_IF_ERROR(Mlp(L, n));
  }
  // The prediction after each item's last token.
  KVPOOL_RETURN_IF_ERROR(CudaStatus(LaunchRmsNorm(x, last_rows, ni, h, At<float>(final_norm_),
                                                  c.rms_norm_eps, At<float>(last_), stream_),
                                    "RMSNorm kernel"));
  KVPOOL_RETURN_IF_ERROR(
      Gemm(At<float>(last_), ni, head_, c.vocab_size, h, At<float>(logits_), false));
  return CudaStatus(cudaMemcpyAsync(logits_host_.data, logits_->data(),
                                    static_cast<size_t>(ni) * c.vocab_size * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_),
                    "cudaMemcpyAsync (logits)");
}

}  // namespace kvpool::model::cuda
