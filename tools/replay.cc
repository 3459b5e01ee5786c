#include "tools/replay.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "fmt/format.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/clock.h"
#include "kvpool/util/status_macros.h"
#include "tier/host_block_store.h"

namespace kvpool::tools {
namespace {

using workload::ExpandTokens;
using workload::kTraceBlockTokens;

// ReplayOptions::memory_floor's cache: slots of block_size tokens, each holding the block of one
// key (the trace block's prefix hash id and the block's index inside it), handed out in a ring.
struct Floor {
  int32_t block_size = 0;
  internal::LineAlignedTokens tokens;  // [slots][block_size]
  std::vector<int64_t> key_of;         // by slot: the key it holds, or -1
  std::vector<int64_t> slot_of;        // by key: the slot holding it, or -1
  // Keys are numbered densely as they first appear (outside the clock, like the tokens'
  // expansion), so that the timed lookups are array reads, not hashing.
  absl::flat_hash_map<uint64_t, int64_t> key_number;
  std::vector<int64_t> keys;  // the request's, one per full block
  int64_t next = 0;           // the next slot handed out (oldest first)
  bool stream = false;        // the array is past TokenStreamThreshold
  std::vector<int32_t> copy;  // the sequence's copy of its prompt
};

// One configuration's manager and tallies.
struct Run {
  std::unique_ptr<Floor> floor;  // with options.memory_floor, instead of a manager
  std::unique_ptr<KvCacheManager> cache;
  std::unique_ptr<tier::HostBlockStore> host;  // with options.host_blocks
  std::vector<PublishedBlock> published;       // scratch
  ReplayResult result;
};

constexpr SessionId kSession(1);
constexpr SessionId kLoader(2);
constexpr NamespaceId kNs(1);
// A replay moves no bytes: the host tier stores one byte per block.
constexpr std::byte kNoBytes[1] = {};

absl::StatusOr<Run> MakeRun(const ReplayOptions& options, int64_t all_blocks, int64_t longest,
                            const Clock* clock) {
  if (options.block_size <= 0 || kTraceBlockTokens % options.block_size != 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size {} does not divide {}", options.block_size, kTraceBlockTokens));
  }
  if (options.capacity_blocks < 0) {
    return absl::InvalidArgumentError("capacity_blocks must be >= 0 (0: unlimited)");
  }
  if (options.host_blocks < 0) {
    return absl::InvalidArgumentError("host_blocks must be >= 0 (0: no host tier)");
  }
  const int64_t per_trace_block = kTraceBlockTokens / options.block_size;
  // Unlimited: room for every block of every prompt, so nothing is ever evicted.
  const int64_t capacity = options.capacity_blocks > 0 ? options.capacity_blocks : all_blocks;
  const int64_t num_blocks = std::max<int64_t>(1, capacity * per_trace_block);
  if (num_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("capacity too large for one pool");
  }
  Run run;
  if (options.memory_floor) {
    auto floor = std::make_unique<Floor>();
    floor->block_size = options.block_size;
    const size_t tokens = static_cast<size_t>(num_blocks) * static_cast<size_t>(options.block_size);
    floor->tokens = internal::MakeLineAlignedTokens(tokens);  // as the pool's array is
    floor->key_of.assign(static_cast<size_t>(num_blocks), -1);
    // It keeps no other per-block state its stores compete with: its tokens alone decide.
    floor->stream =
        static_cast<int64_t>(tokens * sizeof(int32_t)) > internal::TokenStreamThreshold();
    run.floor = std::move(floor);
    return run;
  }
  absl::StatusOr<std::unique_ptr<KvCacheManager>> cache =
      KvCacheManager::Create({.block_size = options.block_size,
                              .num_blocks = static_cast<int32_t>(num_blocks),
                              .max_blocks_per_seq = static_cast<int32_t>(std::max<int64_t>(
                                  1, (longest + options.block_size - 1) / options.block_size)),
                              .trace_depth = options.trace_depth,
                              .clock = clock,
                              .eviction_policy = options.policy,
                              .cache_events = options.cache_events,
                              .publish_journal = options.host_blocks > 0,
                              .evicted_memory = options.cache_events ? size_t{65536} : 0});
  if (!cache.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("policy '{}': {}", options.policy, std::string(cache.status().message())));
  }
  run.cache = std::move(*cache);
  if (options.host_blocks > 0) {
    KVPOOL_ASSIGN_OR_RETURN(run.host, tier::HostBlockStore::Create(
                                          options.host_blocks * per_trace_block, sizeof(kNoBytes)));
  }
  return run;
}

// The daemon's promotion (Engine::LoadFromTiers) without bytes: the prompt's full blocks after
// the pool's match that the host tier holds are allocated to a loader sequence and published.
void Promote(std::span<const int32_t> tokens, Run* run) {
  KvCacheManager& cache = *run->cache;
  const size_t bs = static_cast<size_t>(cache.block_size());
  const size_t full = tokens.size() / bs;
  const size_t local = static_cast<size_t>(cache.MatchPrefix(kNs, tokens)) / bs;
  if (local >= full) return;
  std::vector<BlockHash> chain(full);
  BlockHash parent;
  for (size_t i = 0; i < full; ++i) {
    chain[i] = parent = PrefixChainHash(parent, kNs, tokens.subspan(i * bs, bs));
  }
  std::vector<std::byte> sink(full - local);
  std::vector<std::span<std::byte>> out;
  for (std::byte& b : sink) out.emplace_back(&b, 1);
  const tier::BlockSpace space{kNs, 0};
  const absl::StatusOr<tier::LookupResult> found = run->host->Lookup(
      space, local == 0 ? BlockHash{} : chain[local - 1], std::span(chain).subspan(local), out);
  if (!found.ok() || found->hits == 0) return;
  const size_t upto = local + static_cast<size_t>(found->hits);
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> loader = cache.Allocate(
      kLoader,
      {.ns = kNs, .num_tokens = static_cast<int64_t>(upto * bs), .prompt = tokens.first(upto * bs)},
      &plan);
  if (!loader.ok()) return;  // no room: a miss, as in the daemon
  const bool whole = loader->matched_tokens % static_cast<int64_t>(bs) == 0;
  KVPOOL_CHECK_OK(
      cache.Free(kLoader, loader->sequence, whole ? OnFree::kCommit : OnFree::kDiscard));
  if (whole) run->result.host_hit_blocks += found->hits;
}

// Writes what the pool just published through to the host tier.
void WriteThrough(Run* run) {
  run->cache->TakePublished(&run->published);
  const tier::BlockSpace space{kNs, 0};
  for (const PublishedBlock& p : run->published) {
    run->host->Put(space, {.hash = p.hash, .parent = p.parent, .coverage = 0, .bytes = kNoBytes});
  }
}

void CountHits(const TraceRequest& request, int64_t n, int64_t matched, ReplayResult* result) {
  result->hit_tokens += matched;
  // A trace block counts as a hit when every token of it matched.
  for (int64_t b = 0; b < static_cast<int64_t>(request.hash_ids.size()); ++b) {
    if (matched >= std::min(n, (b + 1) * kTraceBlockTokens)) ++result->hit_blocks;
  }
}

// Numbers the keys of the request's full blocks for the memory floor (untimed): the trace
// block's prefix hash id and the block's index inside it.
void NumberFloorKeys(const TraceRequest& request, size_t num_tokens, Floor* f) {
  const size_t bs = static_cast<size_t>(f->block_size);
  const size_t per_trace_block = static_cast<size_t>(kTraceBlockTokens) / bs;
  f->keys.clear();
  for (size_t b = 0; b < num_tokens / bs; ++b) {
    const uint64_t key =
        static_cast<uint64_t>(request.hash_ids[b / per_trace_block]) * per_trace_block +
        b % per_trace_block;
    const auto [it, added] =
        f->key_number.try_emplace(key, static_cast<int64_t>(f->key_number.size()));
    if (added) f->slot_of.push_back(-1);
    f->keys.push_back(it->second);
  }
}

// Serves one request to the memory floor (its keys numbered): returns the tokens matched.
int64_t ServeFloor(std::span<const int32_t> tokens, Floor* f) {
  const size_t bs = static_cast<size_t>(f->block_size);
  f->copy.assign(tokens.begin(), tokens.end());
  const int64_t slots = static_cast<int64_t>(f->key_of.size());
  size_t matched = 0;
  bool matching = true;
  for (size_t b = 0; b < f->keys.size(); ++b) {
    const int64_t key = f->keys[b];
    const int32_t* const prompt = f->copy.data() + b * bs;
    int64_t& slot = f->slot_of[static_cast<size_t>(key)];
    if (matching && slot >= 0) {
      KVPOOL_CHECK(std::memcmp(f->tokens.get() + static_cast<size_t>(slot) * bs, prompt,
                               bs * sizeof(int32_t)) == 0);
      ++matched;
      continue;
    }
    matching = false;
    if (slot >= 0) continue;  // cached, past a miss: not stored twice
    slot = f->next;
    f->next = (f->next + 1) % slots;
    int64_t& old = f->key_of[static_cast<size_t>(slot)];
    if (old >= 0) f->slot_of[static_cast<size_t>(old)] = -1;
    old = key;
    int32_t* const dst = f->tokens.get() + static_cast<size_t>(slot) * bs;
    if (f->stream) {
      internal::StreamBlockTokens(dst, prompt, bs);
    } else {
      internal::CopyBlockTokens(dst, prompt, bs);
    }
  }
  if (f->stream) internal::StreamFence();
  return static_cast<int64_t>(matched * bs);
}

// Serves one request (its tokens already expanded) to one configuration.
absl::Status Serve(const TraceRequest& request, const std::vector<int32_t>& tokens, Run* run) {
  ReplayResult& result = run->result;
  const int64_t n = static_cast<int64_t>(tokens.size());
  ++result.requests;
  result.prompt_tokens += n;
  result.prompt_blocks += static_cast<int64_t>(request.hash_ids.size());
  if (run->floor) NumberFloorKeys(request, tokens.size(), run->floor.get());
  const auto start = std::chrono::steady_clock::now();
  if (run->floor) {
    const int64_t matched = ServeFloor(tokens, run->floor.get());
    result.seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CountHits(request, n, matched, &result);
    return absl::OkStatus();
  }
  if (run->host) Promote(tokens, run);
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> r =
      run->cache->Allocate(kSession, {.ns = kNs, .num_tokens = n, .prompt = tokens}, &plan);
  if (r.ok()) KVPOOL_CHECK_OK(run->cache->Free(kSession, r->sequence, OnFree::kCommit));
  if (run->host) WriteThrough(run);
  result.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!r.ok()) {
    if (!absl::IsResourceExhausted(r.status())) return r.status();
    ++result.skipped;  // larger than the whole pool
    return absl::OkStatus();
  }
  CountHits(request, n, r->matched_tokens, &result);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<ReplayResult>> ReplayAll(const std::vector<TraceRequest>& trace,
                                                    std::span<const ReplayOptions> configs,
                                                    const ReplayProgress& progress) {
  int64_t longest = 0;
  int64_t all_blocks = 0;
  for (const TraceRequest& r : trace) {
    longest = std::max(longest, r.input_length);
    all_blocks += static_cast<int64_t>(r.hash_ids.size());
  }
  ManualClock clock;
  std::vector<Run> runs;
  for (const ReplayOptions& options : configs) {
    KVPOOL_ASSIGN_OR_RETURN(Run run, MakeRun(options, all_blocks, longest, &clock));
    runs.push_back(std::move(run));
  }
  uint64_t served = 0;
  for (const TraceRequest& request : trace) {
    clock.Set(request.timestamp_ms * 1'000'000);  // trace time; never ahead of the request
    const std::vector<int32_t> tokens = ExpandTokens(request);
    // Rotate which configuration goes first (right after the expansion, with the tokens hot in
    // cache), so that requests/s compares policies, not positions.
    const size_t first = static_cast<size_t>(runs.empty() ? 0 : served++ % runs.size());
    for (size_t k = 0; k < runs.size(); ++k) {
      KVPOOL_RETURN_IF_ERROR(Serve(request, tokens, &runs[(first + k) % runs.size()]));
    }
    if (progress && !runs.empty() && runs[0].result.requests % 500 == 0) {
      progress(runs[0].result, static_cast<int64_t>(trace.size()));
    }
  }
  std::vector<ReplayResult> results;
  for (Run& run : runs) {
    if (run.floor) {
      results.push_back(std::move(run.result));
      continue;
    }
    KVPOOL_RETURN_IF_ERROR(run.cache->CheckInvariants());
    run.result.evictions = run.cache->stats().evictions;
    run.result.policy_state = run.cache->cache()->policy().DebugString();
    results.push_back(std::move(run.result));
  }
  return results;
}

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceRequest>& trace,
                                    const ReplayOptions& options, const ReplayProgress& progress) {
  KVPOOL_ASSIGN_OR_RETURN(std::vector<ReplayResult> results,
                          ReplayAll(trace, std::span(&options, 1), progress));
  return std::move(results[0]);
}

absl::StatusOr<std::vector<SweepRow>> Sweep(const std::vector<TraceRequest>& trace,
                                            std::string_view name,
                                            std::span<const int64_t> capacities,
                                            std::span<const std::string_view> policies,
                                            int threads) {
  // One pass per capacity; passes share nothing but the (read-only) trace.
  std::vector<std::vector<ReplayOptions>> passes;
  for (int64_t capacity : capacities) {
    std::vector<ReplayOptions>& configs = passes.emplace_back();
    configs.push_back({.capacity_blocks = capacity, .policy = "lru"});
    for (std::string_view policy : policies) {
      if (policy != "lru") {
        configs.push_back({.capacity_blocks = capacity, .policy = std::string(policy)});
      }
    }
  }
  std::vector<absl::StatusOr<std::vector<ReplayResult>>> results(passes.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < passes.size(); i = next++) results[i] = ReplayAll(trace, passes[i]);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && static_cast<size_t>(t) < passes.size(); ++t) {
    pool.emplace_back(work);
  }
  work();
  for (std::thread& t : pool) t.join();
  std::vector<SweepRow> rows;
  for (size_t i = 0; i < passes.size(); ++i) {
    if (!results[i].ok()) return results[i].status();
    const double lru = (*results[i])[0].hit_rate();
    for (size_t k = 0; k < passes[i].size(); ++k) {
      rows.push_back(SweepRow{.trace = std::string(name),
                              .capacity_blocks = passes[i][k].capacity_blocks,
                              .policy = passes[i][k].policy,
                              .result = std::move((*results[i])[k]),
                              .lru_hit_rate = lru});
    }
  }
  return rows;
}

}  // namespace kvpool::tools
