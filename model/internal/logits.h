#pragma once

// What a step returns for one item, from its logits: the greedy token (the lowest id on a tie),
// the top-k log-probabilities and, when asked, the logits themselves. Header-only: both step
// models use it, the host's and the CUDA backend's (a separate library).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "model/step_model.h"

namespace kvpool::model::internal {

// REQUIRES: vocab >= 1, 0 <= options.top_k <= vocab.
inline void FillResult(const float* logits, int32_t vocab, const StepOptions& options,
                       ItemResult* r) {
  r->next_token = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  if (options.keep_logits) r->logits.assign(logits, logits + vocab);
  r->top.clear();
  if (options.top_k <= 0) return;
  double sum = 0;
  const float top = logits[r->next_token];
  for (int32_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v] - top));
  const float lse = top + static_cast<float>(std::log(sum));
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
