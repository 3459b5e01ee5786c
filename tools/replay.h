#pragma once

// Replays a request trace through the core library (KvCacheManager with its prefix cache), as a
// serving engine would use it: allocate each prompt with prefix match, commit it, free it. Reports
// the prefix hit rate in the trace's own 512-token blocks, so it compares directly with the
// reference rates in ../shared/traces/README.md.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "workload/mooncake_trace.h"

namespace kvpool::tools {

using workload::TraceRequest;

struct ReplayOptions {
  int32_t block_size = 512;     // pool block size in tokens; divides 512
  int64_t capacity_blocks = 0;  // cache capacity in 512-token blocks; 0 = unlimited
  std::string policy = "lru";   // eviction policy
  int32_t trace_depth = 0;      // per-block trace ring depth (0: off, for speed)
};

struct ReplayResult {
  int64_t requests = 0;
  int64_t skipped = 0;        // prompts larger than the whole pool (counted as misses)
  int64_t prompt_blocks = 0;  // 512-token blocks over all prompts
  int64_t hit_blocks = 0;     // of which found cached (wholly matched)
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;
  uint64_t evictions = 0;  // pool blocks evicted
  double seconds = 0;      // wall time of the replay loop (token expansion included)

  double hit_rate() const {
    return prompt_blocks == 0 ? 0 : static_cast<double>(hit_blocks) / prompt_blocks;
  }
};

// Called every so often with the progress so far.
using ReplayProgress = std::function<void(const ReplayResult& so_far, int64_t total)>;

// Errors: INVALID_ARGUMENT for a block size that does not divide 512, a negative capacity or an
// unknown policy.
absl::StatusOr<ReplayResult> Replay(const std::vector<TraceRequest>& trace,
                                    const ReplayOptions& options,
                                    const ReplayProgress& progress = nullptr);

}  // namespace kvpool::tools
