#include "tools/replay.h"

#include <algorithm>
#include <chrono>

#include "fmt/format.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::tools {

using workload::ExpandTokens;
using workload::kTraceBlockTokens;

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceRequest>& trace,
                                    const ReplayOptions& options, const ReplayProgress& progress) {
  if (options.block_size <= 0 || kTraceBlockTokens % options.block_size != 0) {
    return absl::InvalidArgumentError(
        fmt::format("block_size {} does not divide {}", options.block_size, kTraceBlockTokens));
  }
  if (options.capacity_blocks < 0) {
    return absl::InvalidArgumentError("capacity_blocks must be >= 0 (0: unlimited)");
  }
  const int64_t per_trace_block = kTraceBlockTokens / options.block_size;
  int64_t longest = 0;
  int64_t all_blocks = 0;
  for (const TraceRequest& r : trace) {
    longest = std::max(longest, r.input_length);
    all_blocks += static_cast<int64_t>(r.hash_ids.size());
  }
  // Unlimited: room for every block of every prompt, so nothing is ever evicted.
  const int64_t capacity = options.capacity_blocks > 0 ? options.capacity_blocks : all_blocks;
  const int64_t num_blocks = std::max<int64_t>(1, capacity * per_trace_block);
  if (num_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("capacity too large for one pool");
  }
  KVPOOL_ASSIGN_OR_RETURN(
      std::unique_ptr<KvCacheManager> cache,
      KvCacheManager::Create({.block_size = options.block_size,
                              .num_blocks = static_cast<int32_t>(num_blocks),
                              .max_blocks_per_seq = static_cast<int32_t>(std::max<int64_t>(
                                  1, (longest + options.block_size - 1) / options.block_size)),
                              .trace_depth = options.trace_depth,
                              .eviction_policy = options.policy}));

  const SessionId session(1);
  const NamespaceId ns(1);
  ReplayResult result;
  const auto start = std::chrono::steady_clock::now();
  DevicePlan plan;
  for (const TraceRequest& request : trace) {
    const std::vector<int32_t> tokens = ExpandTokens(request);
    const int64_t n = static_cast<int64_t>(tokens.size());
    ++result.requests;
    result.prompt_tokens += n;
    result.prompt_blocks += static_cast<int64_t>(request.hash_ids.size());
    plan.copies.clear();
    plan.fills.clear();
    const absl::StatusOr<AllocateResult> r =
        cache->Allocate(session, {.ns = ns, .num_tokens = n, .prompt = tokens}, &plan);
    if (!r.ok()) {
      if (!absl::IsResourceExhausted(r.status())) return r.status();
      ++result.skipped;  // larger than the whole pool
      continue;
    }
    result.hit_tokens += r->matched_tokens;
    // A trace block counts as a hit when every token of it matched.
    for (int64_t b = 0; b < static_cast<int64_t>(request.hash_ids.size()); ++b) {
      if (r->matched_tokens >= std::min(n, (b + 1) * kTraceBlockTokens)) ++result.hit_blocks;
    }
    KVPOOL_CHECK_OK(cache->Free(session, r->sequence, OnFree::kCommit));
    if (progress && result.requests % 500 == 0)
      progress(result, static_cast<int64_t>(trace.size()));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.evictions = cache->stats().evictions;
  KVPOOL_RETURN_IF_ERROR(cache->CheckInvariants());
  return result;
}

}  // namespace kvpool::tools
