#pragma once

// Replays a request trace through the core library (KvCacheManager with its prefix cache), as a
// serving engine would use it: allocate each prompt with prefix match, commit it, free it. Reports
// the prefix hit rate in the trace's own 512-token blocks, so it compares directly with the
// reference rates in ../shared/traces/README.md. The managers' Clock is a ManualClock driven by
// the trace's timestamps, so time-aware eviction policies see the trace's time (never the future:
// each request is served before the clock moves on).

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "workload/mooncake_trace.h"

namespace kvpool::tools {

using workload::TraceRequest;

struct ReplayOptions {
  int32_t block_size = 512;     // pool block size in tokens; divides 512
  int64_t capacity_blocks = 0;  // cache capacity in 512-token blocks; 0 = unlimited
  std::string policy = "lru";   // eviction spec (kvpool::ParseEvictionSpec)
  int32_t trace_depth = 0;      // per-block trace ring depth (0: off, for speed)
  // Record KV events and the evicted-hash memory behind ExplainMatch, as the daemon does. Off by
  // default: a replay has no event consumer, and the event ring (65,536 events, each with its
  // blocks' tokens) would hold the whole trace's tokens, not the cache's.
  bool cache_events = false;
  // A host tier below the pool (tier::HostBlockStore), in 512-token blocks; 0: none. It works as
  // the daemon's (daemon/engine/tiers.h): every published full block is written through to it,
  // and a prompt's blocks after the pool's match that the host tier holds are promoted (through a
  // loader sequence, then published) before the prompt is matched. No bytes move in a replay.
  int64_t host_blocks = 0;
  // Not kvpool: the memory floor of an exact-token prefix cache at this block size and capacity,
  // served beside the others request by request. Per request it does the copies and compares any
  // such cache does and nothing else: the prompt copied into the sequence, each cached block's
  // tokens compared with the prompt's, each new full block's tokens written to a slot of a token
  // array of the pool's size (non-temporal stores once that array is past TokenStreamThreshold).
  // No tree, reference counts, locks or eviction policy: blocks are found by the trace's own
  // prefix hash ids (an oracle no cache has), numbered densely outside the clock so that each
  // lookup is an array read, and evicted first in, first out; a partial last block is not kept.
  // policy and host_blocks are ignored.
  bool memory_floor = false;
};

struct ReplayResult {
  int64_t requests = 0;
  int64_t skipped = 0;        // prompts larger than the whole pool (counted as misses)
  int64_t prompt_blocks = 0;  // 512-token blocks over all prompts
  int64_t hit_blocks = 0;     // of which found cached (wholly matched)
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;
  uint64_t evictions = 0;       // pool blocks evicted
  int64_t host_hit_blocks = 0;  // pool blocks promoted from the host tier (in hit_tokens too)
  // Seconds spent in this configuration's allocate + commit + free calls (token expansion,
  // shared by every configuration of a run, excluded).
  double seconds = 0;
  std::string policy_state;  // the eviction policy's DebugString() at the end

  double hit_rate() const {
    return prompt_blocks == 0 ? 0 : static_cast<double>(hit_blocks) / prompt_blocks;
  }
  double requests_per_second() const { return seconds > 0 ? requests / seconds : 0; }
};

// Called every so often with the progress of the first configuration.
using ReplayProgress = std::function<void(const ReplayResult& so_far, int64_t total)>;

// Replays `trace` once for every configuration, all in one pass (each request's tokens are
// expanded once and served to every configuration in turn). Results in configuration order.
// Errors: INVALID_ARGUMENT for a block size that does not divide 512, a negative capacity or a
// bad policy spec (naming the configuration).
absl::StatusOr<std::vector<ReplayResult>> ReplayAll(const std::vector<TraceRequest>& trace,
                                                    std::span<const ReplayOptions> configs,
                                                    const ReplayProgress& progress = nullptr);

// One configuration. Errors: as ReplayAll.
absl::StatusOr<ReplayResult> Replay(const std::vector<TraceRequest>& trace,
                                    const ReplayOptions& options,
                                    const ReplayProgress& progress = nullptr);

// The sweep (kvpool-replay --sweep, replay_test): every policy at every capacity, per trace.
inline constexpr std::array<std::string_view, 2> kSweepTraces = {"conversation_trace.jsonl",
                                                                 "synthetic_trace.jsonl"};
inline constexpr std::array<int64_t, 4> kSweepCapacities = {1000, 2000, 5000, 10000};
inline constexpr std::array<std::string_view, 8> kSweepPolicies = {
    "lru",   "lru+notail",   "lru+admit",   "lru+admit+notail",
    "reuse", "reuse+notail", "reuse+admit", "reuse+admit+notail"};

struct SweepRow {
  std::string trace;  // file name
  int64_t capacity_blocks = 0;
  std::string policy;
  ReplayResult result;
  double lru_hit_rate = 0;  // plain "lru" at the same capacity, same run
};

// Runs the sweep over `trace` (named `name`) at `capacities` for `policies`, one ReplayAll pass
// per capacity (bounding memory to one capacity's caches), up to `threads` passes at a time.
// "lru" is always run for the ratio. Rows by capacity, then policy ("lru" first).
// Errors: as ReplayAll.
absl::StatusOr<std::vector<SweepRow>> Sweep(const std::vector<TraceRequest>& trace,
                                            std::string_view name,
                                            std::span<const int64_t> capacities,
                                            std::span<const std::string_view> policies,
                                            int threads = 1);

}  // namespace kvpool::tools
