
#include "workload/mooncake_trace.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::workload {
namespace {

using ::testing::HasSubstr;

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
}

}  // namespace
}  // namespace kvpool::workload
