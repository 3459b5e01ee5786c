#pragma once

// DenseReference: the same Llama model written the plain way, as the oracle the paged model is
// held to. One sequence, its K and V in contiguous arrays, every product a textbook loop in
// double precision, attention by the book (max, exp, sum) over all earlier positions. Nothing
// is shared with model.cc but the weights. K and V are rounded through the pool's dtype when
// stored, as the pool stores them, so the only differences left are float vs double arithmetic.
// (8-bit dtypes are kept unrounded: their per-block scales are the pool's business.)
// State-space layers keep their conv inputs and scan state in double, one token at a time; a
// parallel hybrid layer (Falcon-H1) adds both mixers' outputs, each from the one norm.
//
// Copyable (a copy is a fork of the sequence).

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/dtype.h"
#include "model/local_engine.h"
#include "model/weights.h"

namespace kvpool::model {

// Falcon-H1's muP multipliers, applied where transformers' FalconH1 applies them (written here
// from its modeling code, independently of the loader, which folds them into the weights).
struct ReferenceMultipliers {
  double embedding = 1.0;                     // the embeddings
  double lm_head = 1.0;                       // the logits
  double attention_in = 1.0;                  // attention's input
  double key = 1.0;                           // k, before RoPE
  double attention_out = 1.0;                 // attention's output
  double ssm_in = 1.0;                        // the mixer's input
  double ssm[5] = {1.0, 1.0, 1.0, 1.0, 1.0};  // in_proj's outputs (bias included): z, x, B, C, dt
  double ssm_out = 1.0;                       // the mixer's output
  double mlp_gate = 1.0;                      // gate_proj's output, before the SiLU
  double mlp_down = 1.0;                      // down_proj's output
};

class DenseReference {
 public:
  // `weights` must outlive the reference.
  DenseReference(const ModelWeights& weights, kernels::DType kv_dtype,
                 const ReferenceMultipliers& multipliers = {});

  // Appends `tokens` (computing each in turn) and returns the logits after the last one.
  std::vector<float> Extend(std::span<const int32_t> tokens);
  int64_t size() const { return length_; }
  // Every state-space layer's state, in StepItem::state's layout, rounded to float.
  std::vector<float> State() const;

 private:
  std::vector<float> Forward(int32_t token);
  // Layer l's mixer output (added to the residual stream) for the normalized input xn.
  std::vector<double> AttentionMixer(size_t l, const std::vector<double>& xn, int64_t pos);
  std::vector<double> StateMixer(size_t l, const std::vector<double>& xn);

  const ModelWeights* w_;
  kernels::DType dtype_;
  ReferenceMultipliers mult_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> k_;      // [layer][position][kv_heads][head_dim]
  std::vector<std::vector<float>> v_;      // same
  std::vector<std::vector<double>> conv_;  // [layer][conv_width - 1][conv_dim], oldest first
  std::vector<std::vector<double>> ssm_;   // [layer][ssm heads][d_state][head_dim]
};

int32_t Argmax(std::span<const float> logits);

// What the paged-vs-reference tests share.
// A small untied model: 2 layers, hidden 128, 4 query / 2 KV heads of 32, vocabulary 256.
ModelConfig SmallTestConfig();
// SmallTestConfig with a sliding layer (window `window`, `sinks` sink tokens) first and a full one
// after it.
ModelConfig WindowedTestConfig(int32_t window, int32_t sinks);
std::vector<int32_t> RandomTokens(size_t n, int32_t vocab, uint32_t seed);
// The largest difference relative to the reference's scale (at least 1); infinite on a NaN or
// a size mismatch.
double RelError(std::span<const float> got, std::span<const float> want);
// The host model's bound against the reference or a recomputation: f32 K/V leaves only
// float-vs-double arithmetic (and sums grouped differently); bf16 K/V also leaves rounding of
// values the two sides computed slightly differently before rounding.
double HostTolerance(kernels::DType dtype);
// A LocalEngine on the host over a 16 MiB pool with two kernel threads. Aborts if it cannot be
// made (the arguments are the tests' own).
std::unique_ptr<LocalEngine> MakeTestEngine(const ModelWeights& w, int32_t block_size,
                                            kernels::DType dtype, bool prefix_cache);
// A prefill of `prompt_tokens` random tokens (seed `seed`) and then `decodes` greedy decodes
// through MakeTestEngine(w, 16, dtype, no prefix cache), each step's logits within
// HostTolerance(dtype) of `ref`'s for the same tokens, and the sequence's state within
// `state_tolerance` of ref.State() at the end (a tenth of it after the prefill). `ref` starts
// empty; it may hold other weights than `w` (the same model in another form).
void ExpectEngineFollowsReference(const ModelWeights& w, DenseReference& ref, kernels::DType dtype,
                                  size_t prompt_tokens, uint32_t seed, int decodes,
                                  double state_tolerance);

}  // namespace kvpool::model
