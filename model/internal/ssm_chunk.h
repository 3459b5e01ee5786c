#pragma once

// The chunked state-space scan for long prefills on the GPU (model/cuda/ssm_kernels.h,
// LaunchSsmChunkedScan): a sequence's tokens are cut into chunks that run in parallel instead
// of one after another. Per (head, state column p):
//   1. each chunk runs its tokens from a zero state: its own contribution to the state, and the
//      product of its tokens' decays (SsmChunkLocal);
//   2. one pass per sequence over its chunks in order turns those into each chunk's incoming
//      state and leaves the sequence's state after its last token (SsmChunkCarry);
//   3. each chunk runs its tokens again from its incoming state, giving their outputs
//      (SsmChunkOutputs).
// The same recurrence as SsmScanToken, regrouped: state after the chunk = decays * incoming +
// local, exactly in real arithmetic, to rounding in f32. Every function is one thread's work,
// shared by the kernels and tests/model/ssm_math_test.cc, which runs them in the kernels'
// decomposition on the CPU.
//
// Layouts. Operands as SsmScanArgs (x [tokens][heads][head_dim], dt [tokens][heads], b and c
// [tokens][groups][d_state]). A chunk's column of state lives in `chunks`
// ([chunk][heads][d_state][head_dim]), its decay product in `decays` ([chunk][heads]); chunks
// are numbered across the step's sequences in row order.

#include <cstdint>
#include <span>
#include <vector>

#include "model/internal/ssm_math.h"

namespace kvpool::model::internal {

// The chunks of a step's sequences (sequence s: rows [starts[s], starts[s + 1])), each cut
// into chunks of at most `rows` rows: chunk_rows ([chunks + 1]) their row boundaries in row
// order, seq_chunks ([sequences + 1]) each sequence's chunks. Host only.
struct SsmChunkPlan {
  std::vector<int32_t> chunk_rows;
  std::vector<int32_t> seq_chunks;
};
inline SsmChunkPlan PlanSsmChunks(std::span<const int32_t> starts, int32_t rows) {
  SsmChunkPlan plan;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    plan.seq_chunks.push_back(static_cast<int32_t>(plan.chunk_rows.size()));
    for (int32_t t = starts[s]; t < starts[s + 1]; t += rows) plan.chunk_rows.push_back(t);
  }
  plan.seq_chunks.push_back(static_cast<int32_t>(plan.chunk_rows.size()));
  plan.chunk_rows.push_back(starts.empty() ? 0 : starts.back());
  return plan;
}

// col[n] = decay * col[n] + (dt * b[n]) * x: SsmScanToken's update without the output.
KVPOOL_HOST_DEVICE inline void SsmScanUpdate(float* col, int32_t d_state, float decay, float dt,
                                             float x, const float* b) {
  for (int32_t n = 0; n < d_state; ++n) col[n] = decay * col[n] + (dt * b[n]) * x;
}

// Index of column p, entry n, of head h's state within chunk k's ([heads][d_state][head_dim]).
KVPOOL_HOST_DEVICE inline int64_t SsmChunkAt(const SsmDims& m, int64_t k, int32_t h, int32_t n,
                                             int32_t p) {
  return ((k * m.num_heads + h) * m.d_state + n) * m.head_dim + p;
}

// Pass 1, chunk k = rows [t0, t1), head h, column p: runs the rows from a zero state into
// `chunks` (col: [d_state] scratch) and writes the product of their decays (thread p == 0).
KVPOOL_HOST_DEVICE inline void SsmChunkLocal(const SsmDims& m, int64_t k, int64_t t0, int64_t t1,
                                             int32_t h, int32_t p, const float* x, const float* dt,
                                             float a_neg, const float* b, float* col, float* chunks,
                                             float* decays) {
  const int32_t g = h / (m.num_heads / m.num_groups);
  float product = 1.0f;
  for (int32_t n = 0; n < m.d_state; ++n) col[n] = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    const float step = dt[t * m.num_heads + h];
    const float decay = SsmDecay(step, a_neg);
    product *= decay;
    SsmScanUpdate(col, m.d_state, decay, step, x[(t * m.num_heads + h) * m.head_dim + p],
                  b + (t * m.num_groups + g) * m.d_state);
  }
  for (int32_t n = 0; n < m.d_state; ++n) chunks[SsmChunkAt(m, k, h, n, p)] = col[n];
  if (p == 0) decays[k * m.num_heads + h] = product;
}

// Pass 2, a sequence's chunks [k0, k1), head h, column p of its `state` ([heads][d_state]
// [head_dim], the state before its first row): each chunk's entry in `chunks` becomes its
// incoming state, and `state` the state after the last chunk.
KVPOOL_HOST_DEVICE inline void SsmChunkCarry(const SsmDims& m, int64_t k0, int64_t k1, int32_t h,
                                             int32_t p, const float* decays, float* chunks,
                                             float* state) {
  for (int32_t n = 0; n < m.d_state; ++n) {
    float* s = state + (static_cast<int64_t>(h) * m.d_state + n) * m.head_dim + p;
    float running = *s;
    for (int64_t k = k0; k < k1; ++k) {
      float& entry = chunks[SsmChunkAt(m, k, h, n, p)];
      const float local = entry;
      entry = running;
      running = decays[k * m.num_heads + h] * running + local;
    }
    *s = running;
  }
}

// Pass 3, chunk k = rows [t0, t1), head h, column p: the rows' outputs y ([tokens][heads]
// [head_dim]) from the chunk's incoming state (col: [d_state] scratch); d: the skip weights.
KVPOOL_HOST_DEVICE inline void SsmChunkOutputs(const SsmDims& m, int64_t k, int64_t t0, int64_t t1,
                                               int32_t h, int32_t p, const float* x,
                                               const float* dt, float a_neg, const float* b,
                                               const float* c, const float* d, const float* chunks,
                                               float* col, float* y) {
  const int32_t g = h / (m.num_heads / m.num_groups);
  for (int32_t n = 0; n < m.d_state; ++n) col[n] = chunks[SsmChunkAt(m, k, h, n, p)];
  for (int64_t t = t0; t < t1; ++t) {
    const float step = dt[t * m.num_heads + h];
    const int64_t at = (t * m.num_heads + h) * m.head_dim + p;
    y[at] = SsmScanToken(col, m.d_state, SsmDecay(step, a_neg), step, x[at],
                         b + (t * m.num_groups + g) * m.d_state,
                         c + (t * m.num_groups + g) * m.d_state, d[h]);
  }
}

}  // namespace kvpool::model::internal
