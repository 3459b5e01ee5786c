#include "tools/hybrid_replay.h"

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::tools {
namespace {

using ::testing::HasSubstr;
using workload::TraceRequest;

TEST(ParseLayersTest, PresetsCarryTheirModelsSizes) {
  const absl::StatusOr<LayerLayout> bamba = ParseLayers("bamba-9b");
  ASSERT_TRUE(bamba.ok()) << bamba.status();
  EXPECT_EQ(bamba->attention_layers, 3);
  EXPECT_EQ(bamba->state_layers, 29);
  EXPECT_EQ(bamba->kv_bytes_per_token, 4096);
  EXPECT_EQ(bamba->state_bytes, 2'147'840);
  const absl::StatusOr<LayerLayout> nemotron = ParseLayers("nemotron-h-8b");
  ASSERT_TRUE(nemotron.ok()) << nemotron.status();
  EXPECT_EQ(nemotron->attention_layers, 4);
  EXPECT_EQ(nemotron->state_layers, 24);
  // Falcon-H1-0.5B: every layer both; a state of 3 x (1,536 + 2 x 128) conv inputs and 24 x 128 x
  // 64 scan values in bf16.
  const absl::StatusOr<LayerLayout> falcon = ParseLayers("falcon-h1-0.5b");
  ASSERT_TRUE(falcon.ok()) << falcon.status();
  EXPECT_EQ(falcon->attention_layers, 36);
  EXPECT_EQ(falcon->state_layers, 36);
  EXPECT_EQ(falcon->kv_bytes_per_token, 2 * 2 * 64 * 2);
  EXPECT_EQ(falcon->state_bytes, (3 * (1536 + 2 * 128) + 24 * 128 * 64) * 2);
  // vLLM's rule: 403,968 / (16 x 512) = 49.3 -> 50 x 16 = 800 tokens; 36 and 36 layers, one
  // group of each.
  const HashChainLayout c = HashChain(*falcon);
  EXPECT_EQ(c.block_size, 800);
  EXPECT_EQ(c.attention_groups, 1);
  EXPECT_EQ(c.state_groups, 1);
}

TEST(ParseLayersTest, APatternCountsItsLayersAndTakesTheGivenSizes) {
  const absl::StatusOr<LayerLayout> layout = ParseLayers("M,M,A,M", 1024, 5000);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->attention_layers, 1);
  EXPECT_EQ(layout->state_layers, 3);
  EXPECT_EQ(layout->kv_bytes_per_token_all(), 1024);
  EXPECT_EQ(layout->state_bytes_all(), 15000);
  const absl::StatusOr<LayerLayout> same = ParseLayers("SSFSX");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->state_layers, 3);
  EXPECT_EQ(same->kv_bytes_per_token, kDefaultKvBytesPerToken);
  const absl::StatusOr<LayerLayout> parallel = ParseLayers("PPA");
  ASSERT_TRUE(parallel.ok()) << parallel.status();
  EXPECT_EQ(parallel->attention_layers, 3);
  EXPECT_EQ(parallel->state_layers, 2);
}

TEST(ParseLayersTest, BadPatternsAreRejectedNamingTheFault) {
  const absl::StatusOr<LayerLayout> letter = ParseLayers("MMQA");
  EXPECT_EQ(letter.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(letter.status().message()), HasSubstr("'Q' at 2"));
  const absl::StatusOr<LayerLayout> no_attention = ParseLayers("MMM");
  EXPECT_EQ(no_attention.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(no_attention.status().message()), HasSubstr("attention and state"));
  EXPECT_EQ(ParseLayers("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseLayers("MA", -1).status().code(), absl::StatusCode::kInvalidArgument);
}

// vLLM's rule: 2,147,840 / (16 * 4,096) = 32.8 -> 33 * 16 = 528 tokens (the 528 in vLLM's
// Bamba logs); 3 attention and 29 Mamba layers pair in groups of 3: 1 + 10 groups.
TEST(HashChainTest, BambaGets528TokenBlocksAndElevenGroups) {
  const HashChainLayout c = HashChain(*ParseLayers("bamba-9b"));
  EXPECT_EQ(c.block_size, 528);
  EXPECT_EQ(c.page_bytes, 528 * 4096);
  EXPECT_GE(c.page_bytes, 2'147'840);
  EXPECT_EQ(c.group_size, 3);
  EXPECT_EQ(c.attention_groups, 1);
  EXPECT_EQ(c.state_groups, 10);
  EXPECT_EQ(c.block_bytes(), 11 * 3 * 528 * 4096);
  // Kinds within 25 % of each other share one group size, the larger.
  const HashChainLayout even = HashChain(*ParseLayers("AAAAAMMMMMM", 100, 100));
  EXPECT_EQ(even.block_size, 16);
  EXPECT_EQ(even.group_size, 6);
  EXPECT_EQ(even.attention_groups, 1);
  EXPECT_EQ(even.state_groups, 1);
  // 25 % apart or more: groups of the fewest (5 state layers pad to 2 groups of 4).
  const HashChainLayout apart = HashChain(*ParseLayers("AAAAMMMMM", 100, 100));
  EXPECT_EQ(apart.group_size, 4);
  EXPECT_EQ(apart.state_groups, 2);
}

// Three prompts: 600 tokens, then 1,200 sharing those 600, then the first 1,100 of the second.
// Layers M,A,M at Bamba's sizes: B = 528 (pages of 2,162,688 B, 3 per cached block).
std::vector<TraceRequest> ThreePrompts() {
  return {{.timestamp_ms = 0, .input_length = 600, .hash_ids = {1, 2}},
          {.timestamp_ms = 1, .input_length = 1200, .hash_ids = {1, 2, 3}},
          {.timestamp_ms = 2, .input_length = 1100, .hash_ids = {1, 2, 3}}};
}

HybridReplayOptions Options(int32_t interval) {
  return {.layers = *ParseLayers("M,A,M"),
          .capacity_blocks = 100,
          .state_share = 0.5,
          .checkpoint_interval = interval};
}

TEST(ReplayHybridTest, HandComputedHitsOfBothLayouts) {
  const std::vector<HybridReplayOptions> configs = {Options(0), Options(4)};
  const absl::StatusOr<std::vector<HybridReplayResult>> results =
      ReplayHybrid(ThreePrompts(), configs);
  ASSERT_TRUE(results.ok()) << results.status();
  // Hash chain: prompt 1 caches 1 block (528 tokens), prompt 2 hits it and caches 2 (1,056),
  // prompt 3 hits both. Trace blocks: 1 (prompt 2) + 2 (prompt 3).
  const LayoutResult& base = (*results)[0].baseline;
  EXPECT_EQ((*results)[0].hash_chain.block_size, 528);
  EXPECT_EQ(base.replay.hit_tokens, 528 + 1056);
  EXPECT_EQ(base.replay.hit_blocks, 3);
  EXPECT_EQ(base.replay.prompt_blocks, 8);
  // 100 * 512 * 4,096 B / (3 * 528 * 4,096 B) = 32 blocks.
  EXPECT_EQ(base.num_blocks, 32);
  // kvpool, no interval checkpoints: prompt 1's end (600) is a checkpoint, so prompt 2 resumes
  // all 600; prompt 3 matches 1,100 tokens of attention but the deepest checkpoint there is 600.
  const LayoutResult& sparse = (*results)[0].hybrid;
  EXPECT_EQ(sparse.replay.hit_tokens, 600 + 600);
  EXPECT_EQ(sparse.replay.hit_blocks, 2);
  EXPECT_EQ(sparse.cut_no_checkpoint, 1100 - 600);
  EXPECT_EQ(sparse.checkpoints_resumed, 2);
  // Prompt 1's end was resumed from (then counted as resumed), and again by prompt 3.
  EXPECT_GT(sparse.resume_rate[static_cast<size_t>(CheckpointKind::kSequenceEnd)], 0.0);
  EXPECT_EQ(sparse.resume_rate[static_cast<size_t>(CheckpointKind::kResumed)], 1.0);
  // Prompt 3's branch point (where its attention match went past the checkpoint it resumed
  // from): kept, never resumed from, (0 + 1) / (1 + 1).
  EXPECT_EQ(sparse.resume_rate[static_cast<size_t>(CheckpointKind::kBranch)], 0.5);
  EXPECT_EQ(base.resume_rate[static_cast<size_t>(CheckpointKind::kResumed)], 0.0);  // no states
  // Every 4 blocks (64 tokens): prompt 2 leaves checkpoints at 640, ..., 1,088, so prompt 3
  // resumes at 1,088.
  const LayoutResult& dense = (*results)[1].hybrid;
  EXPECT_EQ(dense.replay.hit_tokens, 600 + 1088);
  EXPECT_EQ(dense.replay.hit_blocks, 1 + 2);
  // Both fit the budget: 0.5 of 209,715,200 B buys 24 states of 2 * 2,147,840 B.
  for (const HybridReplayResult& r : *results) {
    EXPECT_EQ(r.budget_bytes, 100 * 512 * 4096);
    EXPECT_EQ(r.hybrid.state_slots, 24);
    EXPECT_LE(r.hybrid.memory_bytes, r.budget_bytes);
    EXPECT_LE(r.baseline.memory_bytes, r.budget_bytes);
    EXPECT_GT(r.hybrid.mean_state_bytes, 0);
  }
}

TEST(ReplayHybridTest, RejectsBadOptionsNamingThem) {
  HybridReplayOptions o = Options(0);
  o.state_share = 1;
  EXPECT_THAT(std::string(ReplayHybrid({}, std::span(&o, 1)).status().message()),
              HasSubstr("state_share"));
  o = Options(0);
  o.capacity_blocks = 0;
  EXPECT_EQ(ReplayHybrid({}, std::span(&o, 1)).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(0);
  o.block_size = 100;
  EXPECT_THAT(std::string(ReplayHybrid({}, std::span(&o, 1)).status().message()),
              HasSubstr("divide"));
  // Three 512-token blocks' worth (6,291,456 B) hold no hash-chain block (3 * 528 * 4,096 B) but
  // the working state (4,295,680 B) and 30 kvpool blocks; one holds not even the working state.
  o = Options(0);
  o.capacity_blocks = 3;
  o.state_share = 0;
  EXPECT_THAT(std::string(ReplayHybrid({}, std::span(&o, 1)).status().message()),
              HasSubstr("hash-chain layout"));
  o.capacity_blocks = 1;
  EXPECT_THAT(std::string(ReplayHybrid({}, std::span(&o, 1)).status().message()),
              HasSubstr("kvpool layout"));
}

// The default interval is kvpoold's, three times the break-even one: M,A,M's two states (2 x
// 2,147,840 B) over a block of its one attention layer (16 x 4,096 B) is 65.5 blocks, rounded up
// to 66: a checkpoint every 198, a quarter of the memory for state slots.
TEST(ReplayHybridTest, TheDefaultIntervalIsThriceTheBreakEven) {
  HybridReplayOptions o{.layers = *ParseLayers("M,A,M"), .capacity_blocks = 100};
  EXPECT_EQ(o.checkpoint_interval, kDefaultInterval);
  EXPECT_EQ(o.state_share, 1.0 / 4.0);
  absl::StatusOr<std::vector<HybridReplayResult>> r =
      ReplayHybrid(ThreePrompts(), std::span(&o, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].hybrid.checkpoint_interval, 198);
  o.checkpoint_interval = 4;
  r = ReplayHybrid(ThreePrompts(), std::span(&o, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].hybrid.checkpoint_interval, 4);
  o.checkpoint_interval = -2;
  EXPECT_THAT(std::string(ReplayHybrid({}, std::span(&o, 1)).status().message()),
              HasSubstr("checkpoint_interval"));
}

// The real synthetic trace (../shared beside the checkout, or $KVPOOL_SHARED), 2,000 blocks'
// worth at kvpool-replay's defaults: both layouts stay within the budget, both hit, and kvpool's
// layout holds more tokens per byte. (Its hit rate against the baseline is measured, not
// asserted: docs/hybrid-groups.md §5 has the table.)
TEST(ReplayHybridTest, SyntheticTraceStaysWithinTheBudget) {
  const char* shared = std::getenv("KVPOOL_SHARED");
  const std::string path = std::string(shared != nullptr ? shared : "../shared") +
                           "/traces/mooncake/synthetic_trace.jsonl";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no " << path;
  const absl::StatusOr<std::vector<TraceRequest>> trace = workload::ReadMooncakeTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const HybridReplayOptions o{.layers = *ParseLayers("bamba-9b"), .capacity_blocks = 2000};
  const absl::StatusOr<std::vector<HybridReplayResult>> r = ReplayHybrid(*trace, std::span(&o, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  const HybridReplayResult& result = (*r)[0];
  EXPECT_EQ(result.hybrid.replay.requests, static_cast<int64_t>(trace->size()));
  for (const LayoutResult* l : {&result.hybrid, &result.baseline}) {
    EXPECT_LE(l->memory_bytes, result.budget_bytes);
    EXPECT_GT(l->memory_bytes, result.budget_bytes * 9 / 10);
    EXPECT_GT(l->replay.hit_blocks, 0);
    EXPECT_LE(l->mean_kv_bytes + l->mean_state_bytes, static_cast<double>(l->memory_bytes));
  }
  EXPECT_LT(result.hybrid.bytes_per_cached_token(), result.baseline.bytes_per_cached_token());
  EXPECT_GT(result.hybrid.checkpoints_resumed, 0);
}

}  // namespace
}  // namespace kvpool::tools
