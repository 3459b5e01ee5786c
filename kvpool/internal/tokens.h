#pragma once

// Token-run helpers shared by the prefix cache's lookup and update halves.

#include <algorithm>
#include <cstdint>
#include <span>

#include "xxhash.h"

namespace kvpool::internal {

// xxh3-64 of a block's tokens: the child-index key (the chained 128-bit hash names blocks for
// events; this one only finds a child of a known parent quickly).
inline uint64_t HashTokens(std::span<const int32_t> tokens) {
  return XXH3_64bits(tokens.data(), tokens.size_bytes());
}

inline int32_t CommonPrefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  const auto mismatch = std::mismatch(a.begin(), a.begin() + static_cast<ptrdiff_t>(n), b.begin());
  return static_cast<int32_t>(mismatch.first - a.begin());
}

inline bool StartsWith(std::span<const int32_t> whole, std::span<const int32_t> prefix) {
  return whole.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), whole.begin());
}

}  // namespace kvpool::internal
