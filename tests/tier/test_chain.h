#pragma once

// Deterministic block chains for the tier tests and benchmark: chained hashes computed the
// way the prefix cache computes them (PrefixChainHash over 16-token blocks) and payload bytes
// that differ per namespace, block and seed.

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kvpool/prefix_cache.h"
#include "tier/redis_block_store.h"

namespace kvpool::tier::testing {

struct TestChain {
  BlockSpace space;
  std::vector<BlockHash> hashes;               // [n] hashes[i] is the parent of hashes[i + 1]
  std::vector<std::vector<std::byte>> blocks;  // [n][block_bytes]

  // Puts every block (parent zero for the first), tagged `tags`. Returns how many were queued.
  int Put(RemoteTier& store, NamespaceTags tags = {}) const {
    int queued = 0;
    for (size_t i = 0; i < hashes.size(); ++i) {
      queued += store.Put(space, {.hash = hashes[i],
                                  .parent = i == 0 ? BlockHash{} : hashes[i - 1],
                                  .coverage = 16,
                                  .bytes = blocks[i],
                                  .tags = tags})
                    ? 1
                    : 0;
    }
    return queued;
  }
};

inline TestChain MakeChain(BlockSpace space, int n, int64_t block_bytes, uint32_t seed) {
  TestChain chain{.space = space};
  std::mt19937 rng(seed);
  BlockHash parent;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> tokens(16);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 32000);
    parent = PrefixChainHash(parent, space.ns, tokens);
    chain.hashes.push_back(parent);
    std::vector<std::byte> bytes(static_cast<size_t>(block_bytes));
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
    chain.blocks.push_back(std::move(bytes));
  }
  return chain;
}

// Output buffers for a Lookup of `n` blocks of `block_bytes`, and the spans over them.
struct LookupBuffers {
  LookupBuffers(int n, int64_t block_bytes)
      : storage(n, std::vector<std::byte>(static_cast<size_t>(block_bytes))) {
    for (auto& s : storage) spans.emplace_back(s);
  }
  std::vector<std::vector<std::byte>> storage;
  std::vector<std::span<std::byte>> spans;
};

}  // namespace kvpool::tier::testing
