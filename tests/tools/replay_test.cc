#include "tools/replay.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/eviction_policy.h"
#include "workload/mooncake_trace.h"

namespace kvpool::tools {

using workload::ReadMooncakeTrace;
using workload::TraceRequest;
namespace {

// ../shared beside the checkout (tests run from the repository root), or $KVPOOL_SHARED.
std::string SharedDir() {
  if (const char* dir = std::getenv("KVPOOL_SHARED")) return dir;
  return "../shared";
}

TEST(ReplayTest, RejectsABlockSizeThatDoesNotDivide512) {
  EXPECT_EQ(Replay({}, {.block_size = 100}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReplayTest, RejectsAnUnknownPolicyNamingIt) {
  const absl::StatusOr<ReplayResult> r = Replay({}, {.policy = "lfu"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("lfu"));
}

// Serving several configurations in one pass is the same as replaying each alone.
TEST(ReplayTest, OnePassServesEachConfigurationAsIfAlone) {
  std::vector<TraceRequest> trace;
  for (int64_t i = 0; i < 400; ++i) {
    trace.push_back({.timestamp_ms = i * 250,
                     .input_length = 512 * (1 + i % 3) + i % 5,
                     .hash_ids = {0, 10 + i % 7, 100 + i % 11, 200 + i}});
    trace.back().hash_ids.resize(static_cast<size_t>((trace.back().input_length + 511) / 512));
  }
  const std::vector<ReplayOptions> configs = {{.capacity_blocks = 12, .policy = "lru"},
                                              {.capacity_blocks = 12, .policy = "reuse+admit"},
                                              {.capacity_blocks = 20, .policy = "default"}};
  const absl::StatusOr<std::vector<ReplayResult>> together = ReplayAll(trace, configs);
  ASSERT_TRUE(together.ok()) << together.status();
  for (size_t i = 0; i < configs.size(); ++i) {
    const absl::StatusOr<ReplayResult> alone = Replay(trace, configs[i]);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ((*together)[i].hit_blocks, alone->hit_blocks) << configs[i].policy;
    EXPECT_EQ((*together)[i].evictions, alone->evictions) << configs[i].policy;
    EXPECT_GT(alone->hit_blocks, 0);
  }
}

// Prefix-chained hash ids, as Mooncake's: equal ids mean equal prefixes.
std::vector<TraceRequest> ChainedTrace(int64_t n) {
  std::map<std::vector<int64_t>, int64_t> ids;
  std::vector<TraceRequest> trace;
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t> path = {0, i % 7, i % 11, i};
    TraceRequest r{.timestamp_ms = i * 250, .input_length = 512 * (1 + i % 4)};
    std::vector<int64_t> prefix;
    for (size_t b = 0; b < static_cast<size_t>(r.input_length / 512); ++b) {
      prefix.push_back(path[b]);
      r.hash_ids.push_back(ids.try_emplace(prefix, static_cast<int64_t>(ids.size())).first->second);
    }
    trace.push_back(std::move(r));
  }
  return trace;
}

// With room for everything, the floor finds every block kvpool finds (whole blocks: the floor
// keeps no partial ones), at both block sizes.
TEST(ReplayTest, TheMemoryFloorFindsWhatAnUnboundedPoolFinds) {
  const std::vector<TraceRequest> trace = ChainedTrace(300);
  for (int32_t block_size : {16, 512}) {
    const std::vector<ReplayOptions> configs = {{.block_size = block_size, .policy = "lru"},
                                                {.block_size = block_size, .memory_floor = true}};
    const absl::StatusOr<std::vector<ReplayResult>> r = ReplayAll(trace, configs);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GT((*r)[0].hit_blocks, 0);
    EXPECT_EQ((*r)[1].hit_blocks, (*r)[0].hit_blocks) << block_size;
    EXPECT_EQ((*r)[1].hit_tokens, (*r)[0].hit_tokens) << block_size;
    EXPECT_EQ((*r)[1].requests, 300);
    EXPECT_GT((*r)[1].seconds, 0);
  }
}

// Full, the floor evicts its oldest block first, whatever was used since.
TEST(ReplayTest, TheMemoryFloorEvictsFirstInFirstOut) {
  auto one_block = [](int64_t t, int64_t id) {
    return TraceRequest{.timestamp_ms = t, .input_length = 512, .hash_ids = {id}};
  };
  // A, B, A (a hit), C (evicts A: the oldest in, though the last used), A (a miss). Least
  // recently used would evict B and find A again.
  const std::vector<TraceRequest> trace = {one_block(0, 1), one_block(1, 2), one_block(2, 1),
                                           one_block(3, 3), one_block(4, 1)};
  const std::vector<ReplayOptions> configs = {
      {.block_size = 512, .capacity_blocks = 2, .memory_floor = true},
      {.block_size = 512, .capacity_blocks = 2, .policy = "lru"}};
  const absl::StatusOr<std::vector<ReplayResult>> r = ReplayAll(trace, configs);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].hit_blocks, 1);
  EXPECT_EQ((*r)[0].hit_tokens, 512);
  EXPECT_EQ((*r)[1].hit_blocks, 2);
}

// A host tier below the pool (write-through, promoted on a miss, as in the daemon) only adds
// hits: never fewer than the pool alone, and with a host tier of the pool's size or more, at
// least as many as a pool as large as the host tier would have (it is inclusive).
TEST(ReplayTest, AHostTierOnlyAddsHits) {
  std::vector<TraceRequest> trace;
  for (int64_t i = 0; i < 600; ++i) {
    trace.push_back({.timestamp_ms = i * 250,
                     .input_length = 512 * (2 + i % 3) + i % 5,
                     .hash_ids = {i % 8, 100 + i % 16, 200 + i % 32, 300 + i}});
    trace.back().hash_ids.resize(static_cast<size_t>((trace.back().input_length + 511) / 512));
  }
  for (int32_t block_size : {16, 512}) {
    const std::vector<ReplayOptions> configs = {
        {.block_size = block_size, .capacity_blocks = 20, .policy = "lru"},
        {.block_size = block_size, .capacity_blocks = 20, .policy = "lru", .host_blocks = 80},
        {.block_size = block_size, .capacity_blocks = 80, .policy = "lru"}};
    const absl::StatusOr<std::vector<ReplayResult>> r = ReplayAll(trace, configs);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].host_hit_blocks, 0);
    EXPECT_GT((*r)[1].host_hit_blocks, 0) << block_size;
    EXPECT_GT((*r)[1].hit_blocks, (*r)[0].hit_blocks) << block_size;
    EXPECT_GE((*r)[1].hit_blocks, (*r)[2].hit_blocks * 9 / 10) << block_size;
  }
  EXPECT_EQ(Replay(trace, {.host_blocks = -1}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Recording events (and the evicted-hash memory) changes nothing the replay measures: with them
// off, as kvpool-replay runs by default to keep its memory bounded by the cache, the hit rates
// and evictions are those of a replay with them on, at both block sizes.
TEST(ReplayTest, EventsOffGivesTheSameHitsAsEventsOn) {
  std::vector<TraceRequest> trace;
  for (int64_t i = 0; i < 300; ++i) {
    trace.push_back({.timestamp_ms = i * 250,
                     .input_length = 512 * (1 + i % 4) + i % 7,
                     .hash_ids = {0, 10 + i % 5, 100 + i % 13, 200 + i}});
    trace.back().hash_ids.resize(static_cast<size_t>((trace.back().input_length + 511) / 512));
  }
  for (int32_t block_size : {16, 512}) {
    const std::vector<ReplayOptions> configs = {
        {.block_size = block_size, .capacity_blocks = 10, .policy = "lru", .cache_events = true},
        {.block_size = block_size, .capacity_blocks = 10, .policy = "lru"}};
    const absl::StatusOr<std::vector<ReplayResult>> r = ReplayAll(trace, configs);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].hit_blocks, (*r)[1].hit_blocks) << block_size;
    EXPECT_EQ((*r)[0].hit_tokens, (*r)[1].hit_tokens) << block_size;
    EXPECT_EQ((*r)[0].evictions, (*r)[1].evictions) << block_size;
    EXPECT_GT((*r)[1].hit_blocks, 0);
    EXPECT_GT((*r)[1].evictions, 0u);
  }
}

// The whole table, both traces x 1k/2k/5k/10k blocks x the policies below, as `kvpool-replay
// --sweep` prints it: plain LRU must land within 0.001 of the leaf-LRU reference of
// ../shared/traces/README.md; every other cell must not move (a change in policy results shows
// up here, in either direction: update the table on purpose); and the targets hold.
constexpr std::string_view kTablePolicies[] = {
    "lru", "lru+notail", "lru+admit", "lru+admit+notail", "reuse", "reuse+admit"};
struct Cell {
  const char* trace;
  int64_t capacity;
  double rates[std::size(kTablePolicies)];  // in kTablePolicies order
};
// "lru" holds the README's leaf-LRU reference; the others what the replay measured.
constexpr Cell kTable[] = {
    {"conversation_trace.jsonl", 1000, {0.0445, 0.0450, 0.0790, 0.0790, 0.0763, 0.0774}},
    {"conversation_trace.jsonl", 2000, {0.0543, 0.0553, 0.1083, 0.1083, 0.1071, 0.1089}},
    {"conversation_trace.jsonl", 5000, {0.1118, 0.1185, 0.1676, 0.1678, 0.1703, 0.1699}},
    {"conversation_trace.jsonl", 10000, {0.2116, 0.2149, 0.2161, 0.2164, 0.2262, 0.2157}},
    {"synthetic_trace.jsonl", 1000, {0.0841, 0.0851, 0.0913, 0.0914, 0.0788, 0.0799}},
    {"synthetic_trace.jsonl", 2000, {0.1464, 0.1498, 0.1562, 0.1562, 0.1540, 0.1347}},
    {"synthetic_trace.jsonl", 5000, {0.2793, 0.2839, 0.3029, 0.3031, 0.2803, 0.2826}},
    {"synthetic_trace.jsonl", 10000, {0.4239, 0.4345, 0.4425, 0.4435, 0.4287, 0.4331}},
};

class ReplayTableTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ReplayTableTest, EveryPolicyAtEveryCapacityMatchesTheTable) {
  const std::string path = SharedDir() + "/traces/mooncake/" + GetParam();
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << path << " is absent: this test needs ../shared beside the checkout (or "
                 << "$KVPOOL_SHARED); the traces are not copied into the project";
  }
  const absl::StatusOr<std::vector<TraceRequest>> trace = ReadMooncakeTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  std::vector<int64_t> capacities;
  for (const Cell& cell : kTable) {
    if (std::string_view(cell.trace) == GetParam()) capacities.push_back(cell.capacity);
  }
  const absl::StatusOr<std::vector<SweepRow>> rows =
      Sweep(*trace, GetParam(), capacities, kTablePolicies, /*threads=*/2);
  ASSERT_TRUE(rows.ok()) << rows.status();
  std::map<std::pair<int64_t, std::string>, const SweepRow*> measured;
  for (const SweepRow& row : *rows) measured[{row.capacity_blocks, row.policy}] = &row;
  for (const Cell& cell : kTable) {
    if (std::string_view(cell.trace) != GetParam()) continue;
    const double lru = measured.at({cell.capacity, "lru"})->result.hit_rate();
    for (size_t p = 0; p < std::size(kTablePolicies); ++p) {
      const std::string policy(kTablePolicies[p]);
      const ReplayResult& r = measured.at({cell.capacity, policy})->result;
      SCOPED_TRACE(policy + " at " + std::to_string(cell.capacity) + " blocks");
      EXPECT_NEAR(r.hit_rate(), cell.rates[p], p == 0 ? 0.001 : 0.0006);
      EXPECT_EQ(r.skipped, 0);
      EXPECT_GT(r.evictions, 0u);
      if (policy == kDefaultEvictionSpec) {
        EXPECT_GE(r.hit_rate(), lru - 0.005) << "the default may never trail LRU by more";
      }
    }
    const double best =
        measured.at({cell.capacity, std::string(kDefaultEvictionSpec)})->result.hit_rate();
    if (std::string_view(cell.trace) == "conversation_trace.jsonl" && cell.capacity <= 5000) {
      EXPECT_GE(best / lru, cell.capacity <= 2000 ? 1.5 : 1.3)
          << "the default's gain over LRU at " << cell.capacity << " blocks";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Mooncake, ReplayTableTest,
                         ::testing::Values("conversation_trace.jsonl", "synthetic_trace.jsonl"));

}  // namespace
}  // namespace kvpool::tools
