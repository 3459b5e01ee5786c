// Loading hand-made checkpoints: sharded and half-precision files, config defaults, and the
// rejection of every malformed config, header and tensor layout.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/weights.h"
#include "tests/model/weights_test_util.h"

namespace kvpool::model {
namespace {

using test_util::ConfigText;
using test_util::ExpectSameWeights;
using test_util::FileBytes;
using test_util::Find;
using test_util::kInf;
using test_util::NamedTensors;
using test_util::RawTensor;
using test_util::RawTensorsOf;
using test_util::SafetensorsBytes;
using test_util::TestConfig;
using test_util::U16Bytes;
using ::testing::HasSubstr;

class CheckpointTest : public test_util::WeightsTest {};

TEST_F(CheckpointTest, LoadsTensorsSplitAcrossTwoFiles) {
  const ModelWeights original = SyntheticWeights(TestConfig(false), 9);
  std::vector<RawTensor> tensors = RawTensorsOf(original);
  const std::vector<RawTensor> first(tensors.begin(), tensors.begin() + 7);
  const std::vector<RawTensor> second(tensors.begin() + 7, tensors.end());
  WriteFile("config.json", ConfigText(original.config));
  WriteFile("model-00001-of-00002.safetensors", SafetensorsBytes(first));
  WriteFile("model-00002-of-00002.safetensors", SafetensorsBytes(second));
  WriteFile("model.safetensors.index.json", "{}");  // not a *.safetensors file: ignored
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameWeights(original, *loaded);
}

TEST_F(CheckpointTest, LoadsF16AndBf16TensorsBitExactly) {
  const ModelWeights original = SyntheticWeights(TestConfig(), 2);
  std::vector<RawTensor> tensors = RawTensorsOf(original);
  std::vector<uint16_t> f16(32, 0), bf16(32, 0);
  const std::vector<uint16_t> f16_head = {0x3C00, 0xC100, 0x7BFF, 0x0001, 0x7C00, 0x7E00};
  const std::vector<uint16_t> bf16_head = {0x3F80, 0xC020, 0x0001, 0xFF80, 0x7FC0};
  std::copy(f16_head.begin(), f16_head.end(), f16.begin());
  std::copy(bf16_head.begin(), bf16_head.end(), bf16.begin());
  Find(tensors, "model.norm.weight") = {"model.norm.weight", "F16", {32}, U16Bytes(f16)};
  Find(tensors, "model.layers.0.input_layernorm.weight") = {
      "model.layers.0.input_layernorm.weight", "BF16", {32}, U16Bytes(bf16)};
  WriteCheckpoint(original.config, tensors);
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<float>& norm = loaded->final_norm;
  EXPECT_EQ(norm[0], 1.0f);
  EXPECT_EQ(norm[1], -2.5f);
  EXPECT_EQ(norm[2], 65504.0f);
  EXPECT_EQ(norm[3], 0x1p-24f);
  EXPECT_EQ(norm[4], kInf);
  EXPECT_TRUE(std::isnan(norm[5]));
  const std::vector<float>& attn = loaded->layers[0].attn_norm;
  EXPECT_EQ(attn[0], 1.0f);
  EXPECT_EQ(attn[1], -2.5f);
  EXPECT_EQ(attn[2], 0x1p-133f);
  EXPECT_EQ(attn[3], -kInf);
  EXPECT_TRUE(std::isnan(attn[4]));
  EXPECT_EQ(loaded->layers[1].wq, original.layers[1].wq);
}

TEST_F(CheckpointTest, TiedCheckpointIgnoresLmHeadTensor) {
  const ModelWeights untied = SyntheticWeights(TestConfig(false), 1);
  WriteCheckpoint(TestConfig(true), RawTensorsOf(untied));
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->lm_head.empty());
  EXPECT_EQ(loaded->embed, untied.embed);
}

TEST_F(CheckpointTest, DefaultsHeadDimAndKvHeadsFromConfig) {
  ModelConfig config = TestConfig();
  config.num_kv_heads = config.num_heads;
  std::string text = ConfigText(config);
  for (const char* key : {R"(, "head_dim": 8)", R"(, "num_key_value_heads": 4)"}) {
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    text.erase(at, std::strlen(key));
  }
  WriteFile("config.json", text);
  WriteFile("model.safetensors", SafetensorsBytes(RawTensorsOf(SyntheticWeights(config, 1))));
  const absl::StatusOr<ModelWeights> loaded = LoadCheckpoint(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config, config);
}

TEST_F(CheckpointTest, ReadCheckpointConfigReadsOnlyConfigJson) {
  EXPECT_EQ(ReadCheckpointConfig(dir_).status().code(), absl::StatusCode::kNotFound);
  WriteFile("config.json", ConfigText(TestConfig(false)));
  const absl::StatusOr<ModelConfig> config = ReadCheckpointConfig(dir_);  // no tensors needed
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, TestConfig(false));
}

TEST_F(CheckpointTest, MissingDirectoryConfigOrTensorsIsNotFound) {
  EXPECT_EQ(LoadCheckpoint(Path("absent")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadCheckpoint(dir_).status().code(), absl::StatusCode::kNotFound);  // empty
  WriteFile("model.safetensors", SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1))));
  const absl::Status no_config = LoadCheckpoint(dir_).status();
  EXPECT_EQ(no_config.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_config.message(), HasSubstr("config.json"));
  std::filesystem::remove(Path("model.safetensors"));
  WriteFile("config.json", ConfigText(TestConfig()));
  const absl::Status no_tensors = LoadCheckpoint(dir_).status();
  EXPECT_EQ(no_tensors.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_tensors.message(), HasSubstr("safetensors"));
}

TEST_F(CheckpointTest, RejectsMalformedConfigJson) {
  const std::string tensors = SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  WriteFile("model.safetensors", tensors);
  WriteFile("config.json", "{\"vocab_size\": 64,");
  ExpectInvalid({"config.json"});
  std::string text = ConfigText(TestConfig());
  text.replace(text.find("\"hidden_size\""), 13, "\"hidden_sizes\"");
  WriteFile("config.json", text);
  ExpectInvalid({"config.json", "hidden_size"});
  WriteFile("config.json", ConfigText(TestConfig()).replace(1, 0, "\"rope_scaling\": {}, "));
  ExpectInvalid({"rope_scaling"});
  ModelConfig bad = TestConfig();
  bad.num_kv_heads = 3;
  WriteFile("config.json", ConfigText(bad));
  ExpectInvalid({"config.json", "num_kv_heads"});
  WriteFile("config.json", R"({"vocab_size": "64"})");
  ExpectInvalid({"vocab_size"});
  text = ConfigText(TestConfig());
  const std::string theta = R"("rope_theta": 10000)";
  ASSERT_NE(text.find(theta), std::string::npos);
  WriteFile("config.json", text.replace(text.find(theta), theta.size(), R"("rope_theta": 1e300)"));
  ExpectInvalid({"rope_theta", "out of range"});
}

TEST_F(CheckpointTest, RejectsWrongShape) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  Find(tensors, "model.layers.1.mlp.up_proj.weight").shape = {32, 48};  // transposed
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.layers.1.mlp.up_proj.weight", "[32, 48]", "[48, 32]"});
}

TEST_F(CheckpointTest, RejectsUnsupportedDtype) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  RawTensor& norm = Find(tensors, "model.norm.weight");
  norm.dtype = "I64";
  norm.bytes = std::string(32 * 8, '\0');
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.norm.weight", "I64", "model.safetensors"});
}

TEST_F(CheckpointTest, RejectsUnknownDtype) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  Find(tensors, "model.norm.weight").dtype = "F12";
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({"model.norm.weight", "F12"});
}

TEST_F(CheckpointTest, RejectsTruncatedFile) {
  WriteCheckpoint(TestConfig(), RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  const std::string path = Path("model.safetensors");
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 5);
  ExpectInvalid({"model.safetensors", "truncated"});
  std::filesystem::resize_file(path, 5);  // not even the header length
  ExpectInvalid({"model.safetensors"});
  std::filesystem::resize_file(path, 0);
  ExpectInvalid({"model.safetensors"});
}

TEST_F(CheckpointTest, RejectsHeaderLongerThanFile) {
  WriteFile("config.json", ConfigText(TestConfig()));
  std::string bytes = FileBytes("{}", "");
  bytes[0] = 100;  // claims a 100-byte header in a 10-byte file
  WriteFile("model.safetensors", bytes);
  ExpectInvalid({"model.safetensors", "header length 100"});
  bytes[0] = 0;
  bytes[7] = static_cast<char>(0x80);  // 2^63
  WriteFile("model.safetensors", bytes);
  ExpectInvalid({"model.safetensors", "header length"});
}

TEST_F(CheckpointTest, RejectsOffsetsOutOfBounds) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors", FileBytes(R"({"model.norm.weight":{"dtype":"F32","shape":[32],)"
                                           R"("data_offsets":[64,192]}})",
                                           std::string(128, '\0')));
  ExpectInvalid({"model.norm.weight", "[64, 192]"});
}

TEST_F(CheckpointTest, RejectsOffsetsThatDisagreeWithShape) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors", FileBytes(R"({"model.norm.weight":{"dtype":"F32","shape":[32],)"
                                           R"("data_offsets":[0,64]}})",
                                           std::string(128, '\0')));
  ExpectInvalid({"model.norm.weight", "64 bytes"});
}

TEST_F(CheckpointTest, RejectsOverlappingTensors) {
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("model.safetensors",
            FileBytes(R"({"a":{"dtype":"F32","shape":[16],"data_offsets":[0,64]},)"
                      R"("b":{"dtype":"F16","shape":[16],"data_offsets":[32,64]}})",
                      std::string(64, '\0')));
  ExpectInvalid({"overlap"});
}

TEST_F(CheckpointTest, RejectsBadHeaderJson) {
  WriteFile("config.json", ConfigText(TestConfig()));
  for (const std::string header :
       {"{\"model.norm.weight\": {", "[1, 2]", "{\"x\": {\"dtype\": \"F32\"}}",
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 0]}}",
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}"}) {
    SCOPED_TRACE(header);
    WriteFile("model.safetensors", FileBytes(header, std::string(16, '\0')));
    ExpectInvalid({"model.safetensors"});
  }
}

TEST_F(CheckpointTest, RejectsMissingTensor) {
  std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  tensors.erase(tensors.begin() + 5);
  const std::string missing = NamedTensors(SyntheticWeights(TestConfig(), 1))[5].first;
  WriteCheckpoint(TestConfig(), tensors);
  ExpectInvalid({missing});
}

// Found by safetensors_fuzzer: the weights were sized by num_hidden_layers before any tensor was
// looked up, so a config.json claiming 2e9 layers made the loader allocate ~400 GB and abort.
TEST_F(CheckpointTest, RejectsMoreLayersThanTheFilesHoldBeforeAllocating) {
  ModelConfig huge = TestConfig();
  huge.num_layers = 2'000'000'000;
  WriteCheckpoint(huge, RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  ExpectInvalid({"config.json", "2000000000 layers", "tensors"});
}

TEST_F(CheckpointTest, RejectsUntiedCheckpointWithoutLmHead) {
  WriteCheckpoint(TestConfig(false), RawTensorsOf(SyntheticWeights(TestConfig(true), 1)));
  ExpectInvalid({"lm_head.weight"});
}

TEST_F(CheckpointTest, RejectsTensorInTwoFiles) {
  const std::vector<RawTensor> tensors = RawTensorsOf(SyntheticWeights(TestConfig(), 1));
  WriteFile("config.json", ConfigText(TestConfig()));
  WriteFile("a.safetensors", SafetensorsBytes(tensors));
  WriteFile("b.safetensors", SafetensorsBytes({tensors[3]}));
  ExpectInvalid({tensors[3].name, "a.safetensors", "b.safetensors"});
}

TEST_F(CheckpointTest, IgnoresDanglingSafetensorsLink) {
  WriteCheckpoint(TestConfig(), RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  std::filesystem::create_symlink(Path("absent"), Path("broken.safetensors"));
  EXPECT_TRUE(LoadCheckpoint(dir_).ok());
}

// Seeded random corruption of a valid file: every outcome is a load or INVALID_ARGUMENT, never a
// crash or an out-of-bounds read (run under ASan to see the latter).
TEST_F(CheckpointTest, CorruptedFilesNeverCrash) {
  WriteFile("config.json", ConfigText(TestConfig()));
  const std::string valid = SafetensorsBytes(RawTensorsOf(SyntheticWeights(TestConfig(), 1)));
  const size_t header_end = 8 + 1024;  // the header and a little data: where corruption bites
  std::mt19937 rng(12345);
  int loaded = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      bytes[rng() % std::min(header_end, bytes.size())] = static_cast<char>(rng() & 0xFF);
    }
    if (trial % 10 == 0) bytes.resize(rng() % bytes.size());
    WriteFile("model.safetensors", bytes);
    const absl::StatusOr<ModelWeights> result = LoadCheckpoint(dir_);
    if (result.ok()) {
      ++loaded;
    } else {
      ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    }
  }
  EXPECT_LT(loaded, 300);
}

}  // namespace
}  // namespace kvpool::model
