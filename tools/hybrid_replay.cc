#include "tools/hybrid_replay.h"

#include <algorithm>
#include <limits>
#include <memory>

#include "fmt/format.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::tools {
namespace {

using workload::ExpandTokens;
using workload::kTraceBlockTokens;

constexpr SessionId kSession(1);
constexpr NamespaceId kNs(1);

struct Preset {
  std::string_view name;
  std::string_view pattern;
  int64_t kv_bytes_per_token;
  int64_t state_bytes;
};
// Bamba-9B: 32 layers, attention at 9, 18 and 27. Nemotron-H-8B: 52 layers, 4 attention, 24
// Mamba-2, 24 MLP (the counts are the model's; where each sits changes no cache size).
// Falcon-H1-0.5B: 36 parallel hybrid layers.
constexpr Preset kPresets[] = {
    {"bamba-9b", "MMMMMMMMMAMMMMMMMMAMMMMMMMMAMMMM", 4096, 2'147'840},
    {"nemotron-h-8b", "MXMXMXMXMXMXAMXMXMXMXMXMXAMXMXMXMXMXMXAMXMXMXMXMXMXA", 4096, 2'158'592},
    {"falcon-h1-0.5b", "PPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPPP", 512, 403'968},
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One layout's manager and tallies.
struct Layout {
  std::unique_ptr<KvCacheManager> cache;
  bool hash_chain = false;
  int64_t kv_bytes_per_block = 0;
  int64_t state_bytes_per_unit = 0;  // per checkpoint (kvpool) or per cached block (hash chain)
  LayoutResult result;
  double kv_sum = 0, state_sum = 0, tokens_sum = 0;
};

struct Pair {
  Layout hybrid;
  Layout baseline;
  HybridReplayResult result;
};

absl::StatusOr<std::unique_ptr<KvCacheManager>> MakeCache(const KvCacheOptions& options) {
  absl::StatusOr<std::unique_ptr<KvCacheManager>> cache = KvCacheManager::Create(options);
  if (!cache.ok()) {
    return absl::InvalidArgumentError(fmt::format("policy '{}': {}", options.eviction_policy,
                                                  std::string(cache.status().message())));
  }
  return cache;
}

absl::Status Validate(const HybridReplayOptions& o) {
  if (o.capacity_blocks <= 0) return absl::InvalidArgumentError("capacity_blocks must be > 0");
  if (o.block_size <= 0 || kTraceBlockTokens % o.block_size != 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size {} does not divide {}", o.block_size, kTraceBlockTokens));
  }
  if (!(o.state_share >= 0 && o.state_share < 1)) {
    return absl::InvalidArgumentError(fmt::format("state_share {} not in [0, 1)", o.state_share));
  }
  if (o.checkpoint_interval < 0 && o.checkpoint_interval != kDefaultInterval) {
    return absl::InvalidArgumentError("checkpoint_interval must be >= 0 (or kDefaultInterval)");
  }
  if (o.layers.kv_bytes_per_token <= 0 || o.layers.state_bytes <= 0 ||
      o.layers.attention_layers <= 0 || o.layers.state_layers <= 0) {
    return absl::InvalidArgumentError("the layer layout needs attention and state layers");
  }
  return absl::OkStatus();
}

absl::StatusOr<Pair> MakePair(const HybridReplayOptions& o, int64_t longest, const Clock* clock) {
  KVPOOL_RETURN_IF_ERROR(Validate(o));
  Pair pair;
  const int64_t budget = o.capacity_blocks * kTraceBlockTokens * o.layers.kv_bytes_per_token_all();
  pair.result.budget_bytes = budget;
  // kvpool's: the state share buys whole state slots (one is the working state of the one
  // sequence in flight), the rest attention blocks.
  Layout& h = pair.hybrid;
  h.kv_bytes_per_block = o.block_size * o.layers.kv_bytes_per_token_all();
  h.state_bytes_per_unit = o.layers.state_bytes_all();
  // At least the working state's slot, whatever the share.
  const int64_t slots =
      std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(budget) * o.state_share) /
                               h.state_bytes_per_unit);
  const int64_t blocks = (budget - slots * h.state_bytes_per_unit) / h.kv_bytes_per_block;
  const int64_t max_int = std::numeric_limits<int32_t>::max();
  const int32_t interval =
      o.checkpoint_interval == kDefaultInterval
          ? DefaultCheckpointInterval(h.state_bytes_per_unit, h.kv_bytes_per_block)
          : o.checkpoint_interval;
  if (blocks < 1 || blocks > max_int || slots > max_int) {
    return absl::InvalidArgumentError(
        fmt::format("kvpool layout: {} bytes buy {} blocks", budget, blocks));
  }
  KVPOOL_ASSIGN_OR_RETURN(
      h.cache,
      MakeCache({.block_size = o.block_size,
                 .num_blocks = static_cast<int32_t>(blocks),
                 .max_blocks_per_seq = static_cast<int32_t>(CeilDiv(longest, o.block_size) + 1),
                 .trace_depth = 0,
                 .clock = clock,
                 .eviction_policy = o.policy,
                 .cache_events = false,
                 .evicted_memory = 0,
                 .state_slots = static_cast<int32_t>(slots),
                 .checkpoint_slots = static_cast<int32_t>(slots - 1),
                 .checkpoint_interval = interval,
                 .checkpoint_eviction = o.checkpoint_eviction,
                 .evict_unresumable_first = o.evict_unresumable_first}));
  h.result.block_size = o.block_size;
  h.result.checkpoint_interval = interval;
  h.result.num_blocks = blocks;
  h.result.state_slots = slots;
  h.result.memory_bytes = blocks * h.kv_bytes_per_block + slots * h.state_bytes_per_unit;
  // vLLM's: one page size; every cached block carries its attention and its state pages.
  const HashChainLayout chain = HashChain(o.layers);
  pair.result.hash_chain = chain;
  Layout& b = pair.baseline;
  b.hash_chain = true;
  b.kv_bytes_per_block = chain.kv_block_bytes;
  b.state_bytes_per_unit = chain.state_block_bytes;
  const int64_t chain_blocks = budget / chain.block_bytes();
  if (chain_blocks < 1 || chain_blocks > max_int) {
    return absl::InvalidArgumentError(
        fmt::format("hash-chain layout: {} bytes buy {} blocks of {} bytes", budget, chain_blocks,
                    chain.block_bytes()));
  }
  KVPOOL_ASSIGN_OR_RETURN(
      b.cache,
      MakeCache({.block_size = chain.block_size,
                 .num_blocks = static_cast<int32_t>(chain_blocks),
                 .max_blocks_per_seq = static_cast<int32_t>(CeilDiv(longest, chain.block_size) + 1),
                 .trace_depth = 0,
                 .clock = clock,
                 .eviction_policy = o.policy,
                 .cache_events = false,
                 .evicted_memory = 0}));
  b.result.block_size = chain.block_size;
  b.result.num_blocks = chain_blocks;
  b.result.memory_bytes = chain_blocks * chain.block_bytes();
  return pair;
}

// A trace block counts as a hit when every token of it matched (as Replay counts).
void Tally(const TraceRequest& request, int64_t n, int64_t matched, ReplayResult* result) {
  result->hit_tokens += matched;
  for (int64_t b = 0; b < static_cast<int64_t>(request.hash_ids.size()); ++b) {
    if (matched >= std::min(n, (b + 1) * kTraceBlockTokens)) ++result->hit_blocks;
  }
}

// kvpool's protocol for one prompt (model/step_planner.cc's prefill): resume at the match (cut
// at the deepest checkpoint), plan the step's checkpoints, run it (the state advances), commit
// its full blocks, free with kCommit (its state becomes the checkpoint at the prompt's end).
absl::StatusOr<int64_t> ServeHybrid(std::span<const int32_t> tokens, KvCacheManager& cache) {
  const auto n = static_cast<int64_t>(tokens.size());
  DevicePlan plan;
  KVPOOL_ASSIGN_OR_RETURN(
      const AllocateResult r,
      cache.Allocate(kSession, {.ns = kNs, .num_tokens = n, .prompt = tokens}, &plan));
  if (r.matched_tokens < n) {
    std::vector<PlannedCheckpoint> planned;
    KVPOOL_RETURN_IF_ERROR(
        cache.PlanCheckpoints(kSession, r.sequence, r.matched_tokens, n, true, &planned));
    KVPOOL_RETURN_IF_ERROR(cache.AdvanceState(kSession, r.sequence, n));
    const size_t known = std::min(cache.Find(r.sequence)->tokens.size(), tokens.size());
    const int64_t bs = cache.block_size();
    KVPOOL_RETURN_IF_ERROR(cache.Commit(kSession, r.sequence, n / bs * bs, tokens.subspan(known)));
  }
  KVPOOL_RETURN_IF_ERROR(cache.Free(kSession, r.sequence, OnFree::kCommit));
  return r.matched_tokens;
}

// vLLM's: only full B-token blocks are hashed and cached (each with its state pages); a prefix
// hits in whole blocks.
absl::StatusOr<int64_t> ServeHashChain(std::span<const int32_t> tokens, KvCacheManager& cache) {
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t bs = cache.block_size();
  DevicePlan plan;
  KVPOOL_ASSIGN_OR_RETURN(
      const AllocateResult r,
      cache.Allocate(kSession, {.ns = kNs, .num_tokens = n, .prompt = tokens}, &plan));
  const size_t known = std::min(cache.Find(r.sequence)->tokens.size(), tokens.size());
  KVPOOL_RETURN_IF_ERROR(cache.Commit(kSession, r.sequence, n / bs * bs, tokens.subspan(known)));
  KVPOOL_RETURN_IF_ERROR(cache.Free(kSession, r.sequence, OnFree::kDiscard));
  return r.matched_tokens / bs * bs;
}

absl::Status Serve(const TraceRequest& request, std::span<const int32_t> tokens, Layout* l) {
  ReplayResult& result = l->result.replay;
  const auto n = static_cast<int64_t>(tokens.size());
  ++result.requests;
  result.prompt_tokens += n;
  result.prompt_blocks += static_cast<int64_t>(request.hash_ids.size());
  const absl::StatusOr<int64_t> matched =
      l->hash_chain ? ServeHashChain(tokens, *l->cache) : ServeHybrid(tokens, *l->cache);
  if (!matched.ok()) {
    if (!absl::IsResourceExhausted(matched.status())) return matched.status();
    ++result.skipped;  // larger than the whole pool
  } else {
    Tally(request, n, *matched, &result);
  }
  const KvCacheStats stats = l->cache->stats();
  const auto nodes = static_cast<double>(stats.cache.nodes);
  l->kv_sum += nodes * static_cast<double>(l->kv_bytes_per_block);
  l->state_sum += static_cast<double>(l->state_bytes_per_unit) *
                  (l->hash_chain ? nodes : static_cast<double>(stats.checkpoints.cached));
  l->tokens_sum += nodes * l->cache->block_size();
  return absl::OkStatus();
}

void Finish(Layout* l) {
  LayoutResult& r = l->result;
  const KvCacheStats stats = l->cache->stats();
  const auto requests = static_cast<double>(std::max<int64_t>(r.replay.requests, 1));
  r.mean_kv_bytes = l->kv_sum / requests;
  r.mean_state_bytes = l->state_sum / requests;
  r.mean_cached_tokens = l->tokens_sum / requests;
  r.replay.evictions = stats.evictions;
  r.checkpoints_kept = static_cast<int64_t>(stats.checkpoints.kept);
  r.checkpoints_evicted = static_cast<int64_t>(stats.checkpoints.evicted);
  r.checkpoints_resumed = static_cast<int64_t>(stats.checkpoints.resumed);
  r.cut_no_checkpoint = static_cast<int64_t>(stats.missed_no_checkpoint);
  r.resume_rate = stats.checkpoints.resume_rate;
}

}  // namespace

absl::StatusOr<LayerLayout> ParseLayers(std::string_view spec, int64_t kv_bytes_per_token,
                                        int64_t state_bytes) {
  LayerLayout layout{.name = std::string(spec),
                     .kv_bytes_per_token = kDefaultKvBytesPerToken,
                     .state_bytes = kDefaultStateBytes};
  std::string_view pattern = spec;
  for (const Preset& p : kPresets) {
    if (spec == p.name) {
      pattern = p.pattern;
      layout.kv_bytes_per_token = p.kv_bytes_per_token;
      layout.state_bytes = p.state_bytes;
    }
  }
  if (kv_bytes_per_token < 0 || state_bytes < 0) {
    return absl::InvalidArgumentError("layer sizes must be positive (0: the default)");
  }
  if (kv_bytes_per_token > 0) layout.kv_bytes_per_token = kv_bytes_per_token;
  if (state_bytes > 0) layout.state_bytes = state_bytes;
  for (size_t i = 0; i < pattern.size(); ++i) {
    switch (pattern[i]) {
      case 'A':
      case 'F':
        ++layout.attention_layers;
        break;
      case 'M':
      case 'S':
        ++layout.state_layers;
        break;
      case 'P':  // both side by side (Falcon-H1)
        ++layout.attention_layers;
        ++layout.state_layers;
        break;
      case 'X':
      case ',':
      case ' ':
        break;
      default:
        return absl::InvalidArgumentError(fmt::format(
            "layers '{}': '{}' at {} is no layer kind (A/F attention, M/S state space, P both, X "
            "neither) nor a preset (bamba-9b, nemotron-h-8b, falcon-h1-0.5b)",
            spec, pattern[i], i));
    }
  }
  if (layout.attention_layers == 0 || layout.state_layers == 0) {
    return absl::InvalidArgumentError(
        fmt::format("layers '{}': a hybrid layout needs attention and state layers ({} and {})",
                    spec, layout.attention_layers, layout.state_layers));
  }
  return layout;
}

HashChainLayout HashChain(const LayerLayout& layers, int32_t alignment) {
  HashChainLayout c;
  c.block_size = static_cast<int32_t>(
      alignment * CeilDiv(layers.state_bytes, alignment * layers.kv_bytes_per_token));
  c.page_bytes = c.block_size * layers.kv_bytes_per_token;
  const int32_t fewest = std::min(layers.attention_layers, layers.state_layers);
  const int32_t most = std::max(layers.attention_layers, layers.state_layers);
  c.group_size = most * 4 < fewest * 5 ? most : fewest;  // most < 1.25 * fewest
  c.attention_groups = static_cast<int32_t>(CeilDiv(layers.attention_layers, c.group_size));
  c.state_groups = static_cast<int32_t>(CeilDiv(layers.state_layers, c.group_size));
  c.kv_block_bytes = int64_t{c.attention_groups} * c.group_size * c.page_bytes;
  c.state_block_bytes = int64_t{c.state_groups} * c.group_size * c.page_bytes;
  return c;
}

absl::StatusOr<std::vector<HybridReplayResult>> ReplayHybrid(
    const std::vector<TraceRequest>& trace, std::span<const HybridReplayOptions> configs) {
  int64_t longest = 1;
  for (const TraceRequest& r : trace) longest = std::max(longest, r.input_length);
  ManualClock clock;
  std::vector<Pair> pairs;
  for (const HybridReplayOptions& o : configs) {
    KVPOOL_ASSIGN_OR_RETURN(Pair pair, MakePair(o, longest, &clock));
    pairs.push_back(std::move(pair));
  }
  for (const TraceRequest& request : trace) {
    clock.Set(request.timestamp_ms * 1'000'000);
    const std::vector<int32_t> tokens = ExpandTokens(request);
    for (Pair& pair : pairs) {
      KVPOOL_RETURN_IF_ERROR(Serve(request, tokens, &pair.hybrid));
      KVPOOL_RETURN_IF_ERROR(Serve(request, tokens, &pair.baseline));
    }
  }
  std::vector<HybridReplayResult> results;
  for (Pair& pair : pairs) {
    for (Layout* l : {&pair.hybrid, &pair.baseline}) {
      KVPOOL_RETURN_IF_ERROR(l->cache->CheckInvariants());
      Finish(l);
    }
    pair.result.hybrid = std::move(pair.hybrid.result);
    pair.result.baseline = std::move(pair.baseline.result);
    results.push_back(std::move(pair.result));
  }
  return results;
}

}  // namespace kvpool::tools
