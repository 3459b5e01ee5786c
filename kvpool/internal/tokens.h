#pragma once

// Token-run helpers shared by the prefix cache's lookup and update halves.

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// Copies one block's `n` tokens. The default block size (16) is copied with a fixed-size move
// the compiler inlines (two vector stores), not a call to memcpy: a fresh chain copies one block
// per node it stores.
inline void CopyBlockTokens(int32_t* dst, const int32_t* src, size_t n) {
  if (n == 16) {
    std::memcpy(dst, src, 16 * sizeof(int32_t));
  } else {
    std::memcpy(dst, src, n * sizeof(int32_t));
  }
}

// CopyBlockTokens() for the blocks a prompt publishes into a token array too large to
// stay cached (TokenStreamThreshold). A block of whole cache lines going to a line-aligned slot is
// written with non-temporal stores, which skip reading the destination's lines first: a slot was
// last touched when its block was last cached, long ago, so each line would be a miss, and the
// tokens are read again only when a later prompt matches them. Call StreamFence() after the last
// one, before anything reads them.
inline void StreamBlockTokens(int32_t* dst, const int32_t* src, size_t n) {
#if defined(__SSE2__)
  constexpr size_t kLine = 64;
  const size_t bytes = n * sizeof(int32_t);
  if (bytes % kLine == 0 && reinterpret_cast<uintptr_t>(dst) % kLine == 0) {
    auto* out = reinterpret_cast<__m128i*>(dst);
    const auto* in = reinterpret_cast<const __m128i*>(src);
    for (size_t v = 0; v < bytes / sizeof(__m128i); ++v) {
      _mm_stream_si128(out + v, _mm_loadu_si128(in + v));
    }
    return;
  }
#endif
  CopyBlockTokens(dst, src, n);
}

inline void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The token array size past which a tree publishes with StreamBlockTokens: twice the core's L2.
// Below it the array stays mostly cached (in L2, or the L3 behind it), and non-temporal stores,
// which write around the caches and evict the lines, only make the next match of those tokens a
// miss. kvpool-replay, block 512, synthetic trace, requests/s with plain stores over streamed
// ones, on a 2 MiB-L2 EPYC: 1.15-1.30 at 2 and 4 MB of tokens, 0.93-1.07 at 6, 10 and 20 MB.
inline int64_t TokenStreamThreshold() {
  static const int64_t threshold = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the system does not say
    return 2 * (l2 > 0 ? int64_t{l2} : int64_t{1} << 20);
  }();
  return threshold;
}

inline bool StartsWith(std::span<const int32_t> whole, std::span<const int32_t> prefix) {
  return whole.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), whole.begin());
}

}  // namespace kvpool::internal
