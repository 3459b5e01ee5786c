#pragma once

// Host launchers of the CUDA model's state-space (Mamba-2) kernels: the depthwise causal conv
// with its carried inputs, the split into the scan's operands, the per-token scan (decode) and
// the chunked one (long prefills), the gated RMSNorm and a bias add. The projections around them
// are cuBLAS (cuda_model.cc). Each kernel's arithmetic is model/internal/ssm_math.h, the host
// model's own, and ssm_chunk.h (tests/model/ssm_math_test.cc runs both in these kernels'
// decomposition on the CPU); what only a GPU can check is the launch geometry and the memory
// movement of ssm_kernels.cu.
//
// Plain C++: cuda_model.cc includes this without nvcc. Each launcher enqueues on `stream` and
// returns the launch error; none allocates or synchronizes. Every pointer is device memory.
// `starts` ([num_seqs + 1], nondecreasing) gives each sequence's rows of the step, and each
// sequence's state is the caller's: `carries[s]` its conv inputs ([conv_width - 1][conv_dim]),
// `states[s]` its scan state ([num_heads][d_state][head_dim]), both advanced in place.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "model/internal/ssm_chunk.h"
#include "model/internal/ssm_math.h"

namespace kvpool::model::cuda {

// The scan keeps a column of a head's state per thread: d_state values.
inline constexpr int32_t kMaxSsmDState = 256;
inline constexpr int32_t kMaxSsmHeadDim = 1024;

// y[r][i] += bias[i] for r in [0, rows), i in [0, dim); rows are `stride` floats apart.
cudaError_t LaunchAddBias(float* y, int32_t rows, int64_t dim, int64_t stride, const float* bias,
                          cudaStream_t stream);

// out[r][ch] = SsmConvAt over each sequence's rows of `in` (row r at in + r * in_stride: the
// x, B, C part of the projection), then SsmCarryShift of each sequence's carry. bias may be
// null. One thread per (sequence, channel) runs the sequence's rows in order.
cudaError_t LaunchSsmConv(const internal::SsmDims& m, int32_t num_seqs, const int32_t* starts,
                          const float* in, int64_t in_stride, const float* w, const float* bias,
                          float* const* carries, float* out, cudaStream_t stream);

// SsmSplitAt for every token and element: x, b, c and dt from the conv output and projection.
cudaError_t LaunchSsmSplit(const internal::SsmDims& m, int32_t num_tokens, const float* xbc,
                           const float* proj, const float* dt_bias, float* x, float* b, float* c,
                           float* dt, cudaStream_t stream);

// The recurrence (kernel_args.h SsmScanArgs' meaning): per sequence and head, every token in
// order through SsmScanToken; a_neg = -exp(A_log), d the skip weights. One CTA per (sequence,
// head), a thread per column of the head's state (kept in registers), each token's B and C rows
// staged in shared memory. REQUIRES: d_state <= kMaxSsmDState, head_dim <= kMaxSsmHeadDim.
cudaError_t LaunchSsmScan(const internal::SsmDims& m, int32_t num_seqs, const int32_t* starts,
                          const float* x, const float* dt, const float* a_neg, const float* b,
                          const float* c, const float* d, float* const* states, float* y,
                          cudaStream_t stream);

// The same recurrence for long prefills, in chunks of at most kSsmChunkRows rows that run in
// parallel (internal/ssm_chunk.h: each chunk from a zero state, then one pass per sequence over
// its chunks' states, then each chunk's outputs from its incoming state). chunk_rows and
// seq_chunks: internal::PlanSsmChunks of the sequences' rows. Workspace: `chunks` num_chunks *
// num_heads * d_state * head_dim floats, `decays` num_chunks * num_heads. Three launches; the
// states are left as LaunchSsmScan leaves them (to rounding). REQUIRES: as LaunchSsmScan.
inline constexpr int32_t kSsmChunkRows = 128;
cudaError_t LaunchSsmChunkedScan(const internal::SsmDims& m, int32_t num_seqs,
                                 const int32_t* seq_chunks, int32_t num_chunks,
                                 const int32_t* chunk_rows, const float* x, const float* dt,
                                 const float* a_neg, const float* b, const float* c, const float* d,
                                 float* const* states, float* chunks, float* decays, float* y,
                                 cudaStream_t stream);

// out[r] = the gated RMSNorm of y[r] with gate z[r] (rows z_stride apart): one CTA per (row,
// norm group), a block reduction for the group's sum of squares. With no weight (nullptr), the
// gated values alone (a mixer without the norm).
cudaError_t LaunchSsmGatedNorm(const internal::SsmDims& m, int32_t rows, const float* y,
                               const float* z, int64_t z_stride, const float* weight, float eps,
                               float* out, cudaStream_t stream);

}  // namespace kvpool::model::cuda
