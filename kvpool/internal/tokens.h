#pragma once

// Token-run helpers shared by the prefix cache's lookup and update halves.

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
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

// The working set past which a tree publishes with StreamBlockTokens: twice the core's L2.
// Below it the tokens stay mostly cached (in L2, or the L3 behind it), and non-temporal stores,
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

// What each pool block keeps beside its tokens that every publish and eviction touches, and that
// competes with the tokens for the same cache: the pool's record (24 bytes), the cache's entry
// (32), the tree's place (16), the chained hash (16), the run and list links.
inline constexpr int64_t kBlockBookkeepingBytes = 128;

// The bytes a tree of `num_blocks` blocks of `block_size` tokens works over: it streams its tokens
// when this is past TokenStreamThreshold(). The bookkeeping counts for blocks whose tokens are no
// larger than it. There it is most of the working set, and each slot is a line or two whose plain
// store is an isolated read miss: 1,000 512-token blocks' worth of 16-token blocks (2 MB of
// tokens, about 4 MB of bookkeeping) ran 1.06-1.09x streamed (kvpool-replay, both traces, 12-16
// alternating rounds, an EPYC whose getconf LEVEL2_CACHE_SIZE is 1 MiB, so the threshold is
// 2 MiB). A larger block's slot is a run of lines the prefetcher reads ahead of plain stores, and
// its bookkeeping a small share (6 % at 512 tokens): counted, it tipped 1,000 512-token blocks (2
// MB of tokens, just under the 2 MiB threshold) into streaming, at 0.80-0.88x.
inline int64_t TokenWorkingSet(int32_t block_size, int32_t num_blocks) {
  const int64_t token_bytes = int64_t{block_size} * int64_t{sizeof(int32_t)};
  const int64_t bookkeeping = token_bytes <= kBlockBookkeepingBytes ? kBlockBookkeepingBytes : 0;
  return int64_t{num_blocks} * (token_bytes + bookkeeping);
}

// A token array of `n` tokens, cache-line aligned so that a block of whole lines streams into its
// slot (StreamBlockTokens), and zeroed now: touched at creation, not at each page's first publish,
// where that page fault would land inside a caller's Commit, under the cache's lock (on a fresh
// cache, a fifth of kvpool-replay's timed work at block size 512).
struct FreeLineAligned {
  void operator()(int32_t* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
using LineAlignedTokens = std::unique_ptr<int32_t[], FreeLineAligned>;
inline LineAlignedTokens MakeLineAlignedTokens(size_t n) {
  LineAlignedTokens tokens(
      static_cast<int32_t*>(::operator new[](n * sizeof(int32_t), std::align_val_t{64})));
  std::memset(tokens.get(), 0, n * sizeof(int32_t));
  return tokens;
}

inline bool StartsWith(std::span<const int32_t> whole, std::span<const int32_t> prefix) {
  return whole.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), whole.begin());
}

}  // namespace kvpool::internal
