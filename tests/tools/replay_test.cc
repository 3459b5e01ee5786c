#include "tools/replay.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "workload/mooncake_trace.h"

namespace kvpool::tools {

using workload::ReadMooncakeTrace;
using workload::TraceRequest;
namespace {

using ::testing::HasSubstr;

// ../shared beside the checkout (tests run from the repository root), or $KVPOOL_SHARED.
std::string SharedDir() {
  if (const char* dir = std::getenv("KVPOOL_SHARED")) return dir;
  return "../shared";
}

TEST(ReplayTest, RejectsABlockSizeThatDoesNotDivide512) {
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
}  // namespace kvpool::tools
