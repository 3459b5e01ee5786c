// CudaModel's state-space layers (cuda_model.h): their weights on the device, the step's states
// staged to and from the items' slots, and the mixer as the host model computes it
// (model.cc: Model::StateSpace), launch for launch.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_status.h"
#include "kvpool/util/status_macros.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/model_kernels.h"
#include "model/cuda/ssm_kernels.h"
#include "model/internal/ssm_mixer.h"

namespace kvpool::model::cuda {
namespace {

using kernels::cuda::CudaStatus;

template <typename T>
T* At(const std::unique_ptr<kernels::DeviceBuffer>& buffer, int64_t offset = 0) {
  return reinterpret_cast<T*>(static_cast<char*>(buffer->data()) + offset);
}

// A buffer that may be absent (a bias the model does not have): null then.
const float* Optional(const std::unique_ptr<kernels::DeviceBuffer>& buffer) {
  return buffer != nullptr ? At<float>(buffer) : nullptr;
}

}  // namespace

absl::Status CudaModel::UploadStateSpace(LayerWeights& w, Layer* layer) {
  std::vector<float> a_neg;  // -exp(A_log), as the host model keeps it
  for (float a_log : w.ssm_a_log) a_neg.push_back(-std::exp(a_log));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_in, Upload(w.ssm_in));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_conv, Upload(w.ssm_conv));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_dt_bias, Upload(w.ssm_dt_bias));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_a_neg, Upload(a_neg));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_d, Upload(w.ssm_d));
  KVPOOL_ASSIGN_OR_RETURN(layer->ssm_out, Upload(w.ssm_out));
  for (auto [values, buffer] : {std::pair(&w.ssm_in_bias, &layer->ssm_in_bias),
                                {&w.ssm_norm, &layer->ssm_norm},  // absent: gated, no norm
                                {&w.ssm_conv_bias, &layer->ssm_conv_bias},
                                {&w.ssm_out_bias, &layer->ssm_out_bias}}) {
    if (!values->empty()) {
      KVPOOL_ASSIGN_OR_RETURN(*buffer, Upload(*values));
    }
  }
  for (std::vector<float>* v : {&w.ssm_in, &w.ssm_conv, &w.ssm_out}) std::vector<float>().swap(*v);
  return absl::OkStatus();
}

absl::Status CudaModel::StageStates(std::span<const StepItem> items, int32_t num_tokens) {
  const ModelConfig& c = config_;
  if (c.num_state_layers() == 0) return absl::OkStatus();
  const SsmConfig& m = c.ssm;
  // The sequences in row order: each item's rows are consecutive (internal/step_layout.h).
  std::vector<std::pair<int32_t, size_t>> first;
  for (size_t i = 0; i < items.size(); ++i) {
    first.emplace_back(step_.last_rows[i] - static_cast<int32_t>(items[i].tokens.size()) + 1, i);
  }
  std::sort(first.begin(), first.end());
  seq_starts_.clear();
  seq_items_.clear();
  for (const auto& [row, i] : first) {
    seq_starts_.push_back(row);
    seq_items_.push_back(i);
  }
  seq_starts_.push_back(num_tokens);

  const int64_t seqs = static_cast<int64_t>(items.size());

  char* host = static_cast<char*>(staged_.data);
  std::memcpy(host + offsets_.seq_starts, seq_starts_.data(), seq_starts_.size() * sizeof(int32_t));
  // Per state layer: each sequence's conv carry, then each one's scan state, in place in the
  // sequence's state slot (device memory: the pool's state group, StepItem::state).
  auto* ptrs = reinterpret_cast<float**>(host + offsets_.state_ptrs);
  int64_t offset = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    if (!c.has_state(l)) continue;
    for (int64_t q = 0; q < seqs; ++q) {
      float* state = items[seq_items_[static_cast<size_t>(q)]].state.data();
      ptrs[q] = state + offset;
      ptrs[seqs + q] = state + offset + m.conv_state_floats();
    }
    ptrs += 2 * seqs;
    offset += m.state_floats();
  }

  // Long prefills scan in chunks.
  int32_t longest = 0;
  for (size_t q = 0; q + 1 < seq_starts_.size(); ++q) {
    longest = std::max(longest, seq_starts_[q + 1] - seq_starts_[q]);
  }
  chunked_ = longest > kSsmChunkRows;
  if (chunked_) {
    chunk_plan_ = internal::PlanSsmChunks(seq_starts_, kSsmChunkRows);
    const std::vector<int32_t>& rows = chunk_plan_.chunk_rows;
    const std::vector<int32_t>& per_seq = chunk_plan_.seq_chunks;
    std::memcpy(host + offsets_.chunk_rows, rows.data(), rows.size() * sizeof(int32_t));
    std::memcpy(host + offsets_.seq_chunks, per_seq.data(), per_seq.size() * sizeof(int32_t));
    const int64_t chunks = static_cast<int64_t>(rows.size()) - 1;
    KVPOOL_RETURN_IF_ERROR(
        Reserve(ssm_chunks_, 4 * chunks * m.num_heads * m.d_state * int64_t{m.head_dim}));
    KVPOOL_RETURN_IF_ERROR(Reserve(ssm_decays_, 4 * chunks * m.num_heads));
  }

  const int64_t n = num_tokens, bc = int64_t{m.num_groups} * m.d_state;
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_proj_, 4 * n * m.in_proj_dim()));
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_xbc_, 4 * n * m.conv_dim()));
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_x_, 4 * n * m.inner()));
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_b_, 4 * n * bc));
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_c_, 4 * n * bc));
  KVPOOL_RETURN_IF_ERROR(Reserve(ssm_dt_, 4 * n * m.num_heads));
  return Reserve(ssm_y_, 4 * n * m.inner());
}

absl::Status CudaModel::StateSpace(int32_t layer, int32_t n, bool normed) {
  const ModelConfig& c = config_;
  const SsmConfig& m = c.ssm;
  const internal::SsmDims dims = internal::SsmDimsOf(m);
  const Layer& L = layers_[static_cast<size_t>(layer)];
  const int32_t h = c.hidden_size, seqs = static_cast<int32_t>(seq_items_.size());
  const auto proj = static_cast<int32_t>(m.in_proj_dim()), inner = static_cast<int32_t>(m.inner());
  int32_t index = 0;  // of this layer among those with a state
  for (int32_t l = 0; l < layer; ++l) index += c.has_state(l) ? 1 : 0;
  const auto* starts = At<int32_t>(inputs_, offsets_.seq_starts);
  float* const* carries = At<float*>(inputs_, offsets_.state_ptrs) + int64_t{2} * index * seqs;
  float* const* states = carries + seqs;
  float* x = At<float>(x_);
  float* xn = At<float>(xn_);
  float* p = At<float>(ssm_proj_);

  if (!normed) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchRmsNorm(x, nullptr, n, h, At<float>(L.attn_norm), c.rms_norm_eps, xn, stream_),
        "RMSNorm kernel"));
  }
  KVPOOL_RETURN_IF_ERROR(Gemm(xn, n, L.ssm_in, proj, h, p, false));
  if (L.ssm_in_bias != nullptr) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchAddBias(p, n, proj, proj, At<float>(L.ssm_in_bias), stream_), "bias kernel"));
  }
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(LaunchSsmConv(dims, seqs, starts, p + inner, proj, At<float>(L.ssm_conv),
                               Optional(L.ssm_conv_bias), carries, At<float>(ssm_xbc_), stream_),
                 "SSM conv kernel"));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(
      LaunchSsmSplit(dims, n, At<float>(ssm_xbc_), p, At<float>(L.ssm_dt_bias), At<float>(ssm_x_),
                     At<float>(ssm_b_), At<float>(ssm_c_), At<float>(ssm_dt_), stream_),
      "SSM split kernel"));
  if (chunked_) {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(
        LaunchSsmChunkedScan(dims, seqs, At<int32_t>(inputs_, offsets_.seq_chunks),
                             static_cast<int32_t>(chunk_plan_.chunk_rows.size()) - 1,
                             At<int32_t>(inputs_, offsets_.chunk_rows), At<float>(ssm_x_),
                             At<float>(ssm_dt_), At<float>(L.ssm_a_neg), At<float>(ssm_b_),
                             At<float>(ssm_c_), At<float>(L.ssm_d), states, At<float>(ssm_chunks_),
                             At<float>(ssm_decays_), At<float>(ssm_y_), stream_),
        "SSM chunked scan kernels"));
  } else {
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(LaunchSsmScan(dims, seqs, starts, At<float>(ssm_x_), At<float>(ssm_dt_),
                                 At<float>(L.ssm_a_neg), At<float>(ssm_b_), At<float>(ssm_c_),
                                 At<float>(L.ssm_d), states, At<float>(ssm_y_), stream_),
                   "SSM scan kernel"));
  }
  // Gate and norm (if the mixer has one) into ssm_x_ (free now), then out_proj into the residual
  // stream.
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(LaunchSsmGatedNorm(dims, n, At<float>(ssm_y_), p, proj, Optional(L.ssm_norm),
                                    c.rms_norm_eps, At<float>(ssm_x_), stream_),
                 "SSM gated norm kernel"));
  KVPOOL_RETURN_IF_ERROR(Gemm(At<float>(ssm_x_), n, L.ssm_out, h, inner, x, true));
  if (L.ssm_out_bias != nullptr) {
    KVPOOL_RETURN_IF_ERROR(
        CudaStatus(LaunchAddBias(x, n, h, h, At<float>(L.ssm_out_bias), stream_), "bias kernel"));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::model::cuda
