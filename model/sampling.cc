#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "fmt/format.h"

namespace kvpool::model {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int32_t ArgMax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Penalizes `out` (a copy of the logits) for the tokens of `history`.
void Penalize(const SamplingParams& p, std::span<const int32_t> history, std::vector<float>* out) {
  const size_t vocab = out->size();
  // Counts in a second half of the scratch: one pass to count, one to apply.
  std::vector<float>& v = *out;
  v.resize(2 * vocab);
  std::fill(v.begin() + static_cast<ptrdiff_t>(vocab), v.end(), 0.0f);
  for (int32_t t : history) {
    if (t >= 0 && static_cast<size_t>(t) < vocab) v[vocab + static_cast<size_t>(t)] += 1;
  }
  for (size_t t = 0; t < vocab; ++t) {
    const float count = v[vocab + t];
    if (count > 0) v[t] -= p.presence_penalty + p.frequency_penalty * count;
  }
  v.resize(vocab);
}

}  // namespace

absl::Status CheckSampling(const SamplingParams& p, int32_t vocab) {
  auto bad = [](std::string_view what, float value, std::string_view range) {
    return absl::InvalidArgumentError(fmt::format("{} {} outside {}", what, value, range));
  };
  if (!(p.temperature >= 0 && p.temperature <= 2))
    return bad("temperature", p.temperature, "[0, 2]");
  if (!(p.top_p > 0 && p.top_p <= 1)) return bad("top_p", p.top_p, "(0, 1]");
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2)) {
    return bad("presence_penalty", p.presence_penalty, "[-2, 2]");
  }
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2)) {
    return bad("frequency_penalty", p.frequency_penalty, "[-2, 2]");
  }
  if (p.top_k < 0 || p.top_k > vocab) {
    return absl::InvalidArgumentError(
        fmt::format("sampling top_k {} outside [0, {}] (the vocabulary)", p.top_k, vocab));
  }
  return absl::OkStatus();
}

double UniformDraw(uint64_t seed, uint64_t position) {
  const uint64_t bits = SplitMix64(SplitMix64(seed) ^ position);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

int32_t SampleToken(std::span<const float> logits, const SamplingParams& p,
                    std::span<const int32_t> history, uint64_t position,
                    std::vector<float>* scratch) {
  if (p.greedy()) return ArgMax(logits);
  std::vector<float>& v = *scratch;
  v.assign(logits.begin(), logits.end());
  if (p.penalized()) Penalize(p, history, &v);
  if (p.temperature == 0) return ArgMax(v);
  const int32_t vocab = static_cast<int32_t>(v.size());
  // Candidates: every token in id order, or, when top_k or top_p cut them, the likeliest first
  // (the lowest id on a tie): top_k keeps k, top_p then the smallest prefix whose probability
  // mass reaches top_p.
  thread_local std::vector<int32_t> ids;
  ids.resize(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  const int32_t k = p.top_k > 0 ? p.top_k : vocab;
  if (k < vocab || p.top_p < 1) {
    auto likelier = [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), likelier);
  }
  float max = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < k; ++i) max = std::max(max, v[static_cast<size_t>(ids[i])]);
  const double inv_t = 1.0 / p.temperature;
  double total = 0;
  thread_local std::vector<double> weights;
  weights.resize(static_cast<size_t>(k));
  for (int32_t i = 0; i < k; ++i) {
    weights[i] = std::exp((static_cast<double>(v[ids[i]]) - max) * inv_t);
    total += weights[i];
  }
  int32_t keep = k;
  if (p.top_p < 1) {
    double mass = 0;
    for (int32_t i = 0; i < k; ++i) {
      mass += weights[i];
      if (mass >= p.top_p * total) {
        keep = i + 1;
        total = mass;
        break;
      }
    }
  }
  double target = UniformDraw(p.seed, position) * total;
  for (int32_t i = 0; i < keep; ++i) {
    target -= weights[i];
    if (target < 0) return ids[i];
  }
  return ids[keep - 1];  // rounding left a sliver past the last weight
}

}  // namespace kvpool::model
