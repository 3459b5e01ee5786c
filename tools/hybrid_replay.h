#pragma once

// The replay of a hybrid model (attention + state-space layers; docs/hybrid-groups.md §5): the
// same trace, at the same bytes of cache, through two layouts of one core (KvCacheManager):
//
// - hybrid (kvpool's): small attention blocks plus a state group whose checkpoints sit in the
//   prefix tree (§4); a prompt resumes at the deepest checkpoint its match reaches. Requests
//   follow a serving engine's protocol: Allocate, PlanCheckpoints, AdvanceState, Commit, Free
//   with OnFree::kCommit (the working state becomes the checkpoint at the prompt's end).
// - hash-chain (vLLM v1's hybrid allocator, the baseline): one page size for every group. The
//   attention block size B is raised until one layer's attention page holds one layer's state;
//   every cached B-token block keeps a state page in every state group (mamba_cache_mode "all"),
//   and a prefix hits in whole B-token blocks only.
//
// No bytes move: slots and blocks are accounting, their sizes come from the layer layout.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/kv_cache_manager.h"
#include "tools/replay.h"
#include "workload/mooncake_trace.h"

namespace kvpool::tools {

// A model's cache-bearing layers and their sizes.
struct LayerLayout {
  std::string name;  // the preset's name, or the pattern as given
  int32_t attention_layers = 0;
  int32_t state_layers = 0;
  int64_t kv_bytes_per_token = 0;  // one attention layer's K+V for one token
  int64_t state_bytes = 0;         // one state layer's state (conv + SSM)

  int64_t kv_bytes_per_token_all() const { return attention_layers * kv_bytes_per_token; }
  int64_t state_bytes_all() const { return state_layers * state_bytes; }
};

// The presets (bf16 K/V and states, as vLLM holds them by default):
//   bamba-9b      32 layers, attention at 9, 18, 27 (8 KV heads of 128: 4,096 B/token/layer),
//                 29 Mamba-2 layers (128 heads of 64, d_state 128, 1 group, conv 4: 2,147,840 B)
//   nemotron-h-8b 4 attention layers (8 KV heads of 128), 24 Mamba-2 layers (128 heads of 64,
//                 d_state 128, 8 groups, conv 4: 2,158,592 B); its 24 MLP layers hold no cache
//   falcon-h1-0.5b 36 layers, each attention (2 KV heads of 64: 512 B/token) and a Mamba-2
//                 mixer (24 heads of 64, d_state 128, 1 group, conv 4: 403,968 B) side by side
inline constexpr int64_t kDefaultKvBytesPerToken = 4096;
inline constexpr int64_t kDefaultStateBytes = 2'147'840;

// `spec` is a preset's name or a pattern of layers, one letter each: A or F (attention), M or S
// (state space), P (both side by side, Falcon-H1), X (neither, e.g. an MLP layer), commas and
// spaces ignored ("SSFS", "M,M,A,M").
// A pattern's sizes are `kv_bytes_per_token` and `state_bytes` (0: kDefault*); a preset's are its
// own unless those are non-zero. Errors: INVALID_ARGUMENT for an unknown letter (naming it and
// its position), a layout without attention or without state layers, or a non-positive size.
absl::StatusOr<LayerLayout> ParseLayers(std::string_view spec, int64_t kv_bytes_per_token = 0,
                                        int64_t state_bytes = 0);

// vLLM v1's layout of the same layers (vllm/platforms/interface.py, the hybrid block-size
// alignment; vllm/v1/core/kv_cache_utils.py, the uniform-page-size groups):
//   B = a * ceil(state_bytes / (a * kv_bytes_per_token)), a = 16 (FlashAttention's kernel block
//   alignment), the smallest such multiple whose attention page holds a state (the rule without
//   prefix caching and in mamba_cache_mode "align"; "all" rounds up to the Mamba chunk size
//   instead, a larger B). One layer's page is B * kv_bytes_per_token; the state is padded to it.
//   Layers are grouped `group_size` to a group (the fewest layers of one kind, or the most when
//   the kinds differ by under 25 %), a group's block is group_size pages, one block id per group
//   and per cached block; the pool is num_blocks ids of group_size pages each.
struct HashChainLayout {
  int32_t block_size = 0;  // B
  int32_t group_size = 0;
  int32_t attention_groups = 0;
  int32_t state_groups = 0;
  int64_t page_bytes = 0;         // one layer's page
  int64_t kv_block_bytes = 0;     // a cached block's attention pages (attention_groups groups)
  int64_t state_block_bytes = 0;  // its state pages (state_groups groups, mode "all")
  int64_t block_bytes() const { return kv_block_bytes + state_block_bytes; }
};
HashChainLayout HashChain(const LayerLayout& layers, int32_t alignment = 16);

// The capacities for kvpool-replay --layers_sweep.
inline constexpr std::array<int64_t, 3> kLayersCapacities = {1000, 2000, 5000};

// HybridReplayOptions::checkpoint_interval: DefaultCheckpointInterval(state_bytes_all(),
// block_size * kv_bytes_per_token_all()), as kvpoold takes it.
inline constexpr int32_t kDefaultInterval = -1;

struct HybridReplayOptions {
  LayerLayout layers;
  // Memory: this many 512-token blocks of the attention group's K/V (capacity_blocks * 512 *
  // kv_bytes_per_token_all() bytes), for both layouts. > 0.
  int64_t capacity_blocks = 0;
  // kvpool's layout: block size (divides 512), the share of the memory given to state slots
  // (the working state and checkpoints) in [0, 1), the checkpoint interval in blocks (0: only
  // branch points, the prefill's last block boundary and the end of each prompt;
  // kDefaultInterval: DefaultCheckpointInterval of the layers). The defaults go together: at
  // three times the break-even interval a cached prefix's checkpoints take a third of the bytes
  // of its K/V, so a quarter of the memory holds them.
  int32_t block_size = 16;
  double state_share = 1.0 / 4.0;
  int32_t checkpoint_interval = kDefaultInterval;
  // The order kvpool evicts cached checkpoints in (KvCacheOptions::checkpoint_eviction).
  KvCacheOptions::CheckpointEviction checkpoint_eviction =
      KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved;
  // Blocks past a path's last checkpoint go first (KvCacheOptions::evict_unresumable_first).
  bool evict_unresumable_first = true;
  std::string policy = "lru";  // both layouts (vLLM's is LRU)
};

// What one layout held and hit.
struct LayoutResult {
  ReplayResult replay;              // hits (trace blocks and tokens), requests, evictions
  int32_t block_size = 0;           // tokens per block
  int64_t num_blocks = 0;           // attention blocks in the pool
  int64_t state_slots = 0;          // kvpool: working + checkpoint slots; hash-chain: 0 (per block)
  int32_t checkpoint_interval = 0;  // kvpool: in blocks, kDefaultInterval resolved
  int64_t memory_bytes = 0;         // what the layout uses of the budget (<= budget)
  double mean_kv_bytes = 0;         // cached attention K/V bytes, mean after each request
  double mean_state_bytes = 0;      // cached state bytes (checkpoints / state pages), same
  double mean_cached_tokens = 0;    // tokens the cached blocks cover, same
  int64_t checkpoints_kept = 0;     // kvpool: checkpoints put into the tree
  int64_t checkpoints_evicted = 0;
  int64_t checkpoints_resumed = 0;  // prompts that resumed from one
  int64_t cut_no_checkpoint = 0;    // tokens the attention match found but no state reached
  // kvpool: resumes per checkpoint kept by CheckpointKind at the end (KvCacheStats::checkpoints).
  std::array<double, kNumCheckpointKinds> resume_rate{};

  double token_hit_rate() const {
    return replay.prompt_tokens == 0
               ? 0
               : static_cast<double>(replay.hit_tokens) / static_cast<double>(replay.prompt_tokens);
  }
  double bytes_per_cached_token() const {
    return mean_cached_tokens > 0 ? (mean_kv_bytes + mean_state_bytes) / mean_cached_tokens : 0;
  }
};

struct HybridReplayResult {
  int64_t budget_bytes = 0;
  HashChainLayout hash_chain;
  LayoutResult hybrid;    // kvpool's
  LayoutResult baseline;  // hash-chain
};

// Replays `trace` through both layouts of every configuration, in one pass (each request's
// tokens expanded once). Errors: INVALID_ARGUMENT for a non-positive capacity, a block size not
// dividing 512, a state share outside [0, 1), a negative interval, a bad policy, or a budget
// that holds not one block of a layout (naming which).
absl::StatusOr<std::vector<HybridReplayResult>> ReplayHybrid(
    const std::vector<workload::TraceRequest>& trace, std::span<const HybridReplayOptions> configs);

}  // namespace kvpool::tools
