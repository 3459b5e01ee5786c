#pragma once

// Token runs for the core's tests: what a prompt is made of when only its identity matters.

#include <cstdint>
#include <numeric>
#include <vector>

namespace kvpool::test_tokens {

// `n` tokens counting up from `start`: two runs share a prefix exactly where their counts agree.
inline std::vector<int32_t> Tokens(int32_t start, int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

}  // namespace kvpool::test_tokens
