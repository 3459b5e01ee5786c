// kvpool-replay: replays a Mooncake-format request trace through kvpool's prefix cache and
// reports the prefix hit rate in the trace's 512-token blocks (comparable with the reference
// rates in ../shared/traces/README.md).
//
//   kvpool-replay --trace=../shared/traces/mooncake/conversation_trace.jsonl
//                 --block_size=512 --capacity_blocks=1000 --policy=lru

#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "tools/replay.h"

ABSL_FLAG(std::string, trace, "", "Mooncake-format JSONL trace to replay (required)");
ABSL_FLAG(int32_t, block_size, 512, "pool block size in tokens (must divide 512)");
ABSL_FLAG(int64_t, capacity_blocks, 0, "cache capacity in 512-token blocks; 0 = unlimited");
ABSL_FLAG(std::string, policy, "lru", "eviction policy (lru)");
ABSL_FLAG(int32_t, trace_depth, 0, "per-block operation trace depth (0 or a power of 2)");

int main(int argc, char** argv) {
  // --help lists this file's flags (absl's default looks for a file named after the binary).
  absl::SetFlagsUsageConfig({.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "tools/replay_main.cc");
  }});
  absl::SetProgramUsageMessage("Replays a Mooncake trace through kvpool's prefix cache.");
  absl::ParseCommandLine(argc, argv);
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) {
    std::fprintf(stderr, "kvpool-replay: --trace is required (see --help)\n");
    return 2;
  }
  const absl::StatusOr<std::vector<kvpool::workload::TraceRequest>> trace =
      kvpool::workload::ReadMooncakeTrace(path);
  if (!trace.ok()) {
    std::fprintf(stderr, "kvpool-replay: %s\n", std::string(trace.status().message()).c_str());
    return 1;
  }
  const kvpool::tools::ReplayOptions options{
      .block_size = absl::GetFlag(FLAGS_block_size),
      .capacity_blocks = absl::GetFlag(FLAGS_capacity_blocks),
      .policy = absl::GetFlag(FLAGS_policy),
      .trace_depth = absl::GetFlag(FLAGS_trace_depth)};
  const bool tty = isatty(STDERR_FILENO) != 0;
  kvpool::tools::ReplayProgress progress = [](const kvpool::tools::ReplayResult& r, int64_t total) {
    std::fprintf(stderr, "\r[kvpool-replay] %lld/%lld requests  hit_rate %.4f  evictions %llu",
                 static_cast<long long>(r.requests), static_cast<long long>(total), r.hit_rate(),
                 static_cast<unsigned long long>(r.evictions));
  };
  const absl::StatusOr<kvpool::tools::ReplayResult> result =
      kvpool::tools::Replay(*trace, options, tty ? progress : kvpool::tools::ReplayProgress());
  if (tty) std::fprintf(stderr, "\n");
  if (!result.ok()) {
    std::fprintf(stderr, "kvpool-replay: %s\n", result.status().ToString().c_str());
    return 1;
  }
  const kvpool::tools::ReplayResult& r = *result;
  std::printf("trace %s\n", path.c_str());
  std::printf("block_size %d capacity_blocks %lld policy %s\n", options.block_size,
              static_cast<long long>(options.capacity_blocks), options.policy.c_str());
  std::printf("requests %lld (skipped %lld)\n", static_cast<long long>(r.requests),
              static_cast<long long>(r.skipped));
  std::printf("prompt_blocks %lld hit_blocks %lld\n", static_cast<long long>(r.prompt_blocks),
              static_cast<long long>(r.hit_blocks));
  std::printf("token_hit_rate %.4f\n",
              r.prompt_tokens == 0 ? 0.0 : static_cast<double>(r.hit_tokens) / r.prompt_tokens);
  std::printf("evictions %llu\n", static_cast<unsigned long long>(r.evictions));
  std::printf("ops_per_s %.0f (allocate+commit+free per second)\n",
              r.seconds > 0 ? r.requests / r.seconds : 0.0);
  std::printf("hit_rate %.4f\n", r.hit_rate());
  return 0;
}
