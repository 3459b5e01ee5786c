#pragma once

// What a step returns for one item, from its logits: the next token (greedy, the lowest id on a
// tie, or sampled as the item asks: sampling.h), the chosen token's and the top-k
// log-probabilities and, when asked, the logits themselves. Header-only: both step
// models use it, the host's and the CUDA backend's (a separate library).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "model/sampling.h"
#include "model/step_model.h"

namespace kvpool::model::internal {

// REQUIRES: vocab >= 1, 0 <= options.top_k <= vocab, the item's sampling checked.
inline void FillResult(const float* logits, int32_t vocab, const StepOptions& options,
                       const StepItem& item, ItemResult* r) {
  const int32_t argmax = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  r->next_token = argmax;
  if (item.sampling != nullptr && !item.sampling->greedy()) {
    thread_local std::vector<float> scratch;
    const uint64_t position = static_cast<uint64_t>(item.start) + item.tokens.size();
    r->next_token = SampleToken(std::span(logits, static_cast<size_t>(vocab)), *item.sampling,
                                item.history, position, &scratch);
  }
  if (options.keep_logits) r->logits.assign(logits, logits + vocab);
  r->top.clear();
  if (options.top_k <= 0 && !options.logprobs) return;
  double sum = 0;
  const float top = logits[argmax];
  for (int32_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v] - top));
  const float lse = top + static_cast<float>(std::log(sum));
  r->logprob = logits[r->next_token] - lse;
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + options.top_k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int32_t k = 0; k < options.top_k; ++k) {
    const int32_t id = ids[static_cast<size_t>(k)];
    r->top.push_back({id, logits[id] - lse});
  }
}

}  // namespace kvpool::model::internal
