#include "kvpool/workload/replay.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/workload/mooncake_trace.h"

namespace kvpool::workload {
namespace {

using ::testing::HasSubstr;

// ../shared beside the checkout (tests run from the repository root), or $KVPOOL_SHARED.
std::string SharedDir() {
  if (const char* dir = std::getenv("KVPOOL_SHARED")) return dir;
  return "../shared";
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::ofstream(path) << text;
  return path;
}

TEST(MooncakeTraceTest, ReadsRecordsAndExpandsTokens) {
  const std::string path = WriteTemp(
      "kvpool_trace_ok.jsonl",
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n"
      "{\"timestamp\": 3, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [1]}\n");
  const absl::StatusOr<std::vector<TraceRequest>> trace = ReadMooncakeTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 2u);
  const std::vector<int32_t> a = ExpandTokens((*trace)[0]);
  const std::vector<int32_t> b = ExpandTokens((*trace)[1]);
  ASSERT_EQ(a.size(), 600u);
  ASSERT_EQ(b.size(), 512u);
  EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin()));  // same id, same tokens
  EXPECT_NE(a[512], a[0]);
  for (int32_t t : a) ASSERT_TRUE(t >= 0 && t < kDefaultVocab);
}

TEST(MooncakeTraceTest, MalformedRecordsNameTheirLine) {
  const std::string path = WriteTemp(
      "kvpool_trace_bad.jsonl",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n"
      "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [1]}\n");
  const absl::StatusOr<std::vector<TraceRequest>> trace = ReadMooncakeTrace(path);
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(trace.status().message()), HasSubstr(":2:"));
  EXPECT_EQ(ReadMooncakeTrace("/nonexistent/trace.jsonl").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Replay({}, {.block_size = 100}).status().code(), absl::StatusCode::kInvalidArgument);
}

// The replay must reproduce the leaf-LRU reference of ../shared/traces/README.md within 0.001.
struct Reference {
  const char* trace;
  int64_t capacity;
  double leaf_lru;
};

class ReplayReferenceTest : public ::testing::TestWithParam<Reference> {};

TEST_P(ReplayReferenceTest, HitRateMatchesTheLeafLruReference) {
  const std::string path = SharedDir() + "/traces/mooncake/" + GetParam().trace;
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << path << " is absent: this test needs ../shared beside the checkout (or "
                 << "$KVPOOL_SHARED); the traces are not copied into the project";
  }
  const absl::StatusOr<std::vector<TraceRequest>> trace = ReadMooncakeTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const absl::StatusOr<ReplayResult> result =
      Replay(*trace, {.block_size = 512, .capacity_blocks = GetParam().capacity});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->hit_rate(), GetParam().leaf_lru, 0.001);
  EXPECT_EQ(result->skipped, 0);
  EXPECT_GT(result->evictions, 0u);
}

INSTANTIATE_TEST_SUITE_P(Mooncake, ReplayReferenceTest,
                         ::testing::Values(Reference{"conversation_trace.jsonl", 1000, 0.0445},
                                           Reference{"synthetic_trace.jsonl", 5000, 0.2793}));

}  // namespace
}  // namespace kvpool::workload
