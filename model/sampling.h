#pragma once

// Choosing a step's next token from its logits (issue 30): greedy, or sampled with the OpenAI
// parameters (temperature, top_p, top_k, presence and frequency penalties, seed).
//
// Order, as vLLM and llama.cpp apply them: penalties on the raw logits (presence: minus p for
// every token seen; frequency: minus f times its count; "seen" is the history the caller passes,
// the sequence's last kPenaltyWindow tokens, prompt included), then temperature, then top_k, then
// top_p over what is left, then one draw. Temperature 0 is the argmax of the penalized logits
// (the lowest id on a tie).
//
// Deterministic: the draw for a token is a function of (seed, position) alone (a counter-based
// generator, SplitMix64), so a sequence samples the same tokens whatever it is batched with and
// on whichever backend produced the same logits. Thread-compatible; no allocation beyond the
// caller's scratch.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace kvpool::model {

// The history penalties look at: a sequence's last this many tokens.
inline constexpr int64_t kPenaltyWindow = 4096;

struct SamplingParams {
  float temperature = 0;        // [0, 2]; 0: greedy
  float top_p = 1;              // (0, 1]: the smallest set of likeliest tokens holding this mass
  int32_t top_k = 0;            // [0, vocab]; 0: no cut
  float presence_penalty = 0;   // [-2, 2]
  float frequency_penalty = 0;  // [-2, 2]
  uint64_t seed = 0;            // the generator's key (a caller with none draws one)

  bool penalized() const { return presence_penalty != 0 || frequency_penalty != 0; }
  // Nothing but the argmax of the raw logits.
  bool greedy() const { return temperature == 0 && !penalized(); }
};

// INVALID_ARGUMENT naming the parameter outside its range (above), for a vocabulary of `vocab`.
absl::Status CheckSampling(const SamplingParams& params, int32_t vocab);

// The token drawn from `logits` ([vocab]) at sequence position `position` (the index the new
// token will have). `history` holds the tokens the penalties count. `scratch` is reused across
// calls. REQUIRES: CheckSampling(params, logits.size()) is OK; logits not empty.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params,
                    std::span<const int32_t> history, uint64_t position,
                    std::vector<float>* scratch);

// A uniform double in [0, 1) from (seed, position): the draw SampleToken makes.
double UniformDraw(uint64_t seed, uint64_t position);

}  // namespace kvpool::model
