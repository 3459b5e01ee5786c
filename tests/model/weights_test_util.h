#pragma once

// Helpers shared by weights_test.cc and checkpoint_test.cc: a small test config, the tensors of
// a ModelWeights by their transformers names, hand-made safetensors files, and a fixture that
// gives each test its own temporary checkpoint directory. Everything here is spelled out
// independently of weights.cc so the tests do not check the code against itself.

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/weights.h"

namespace kvpool::model::test_util {

inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Small enough that every test runs in milliseconds, with GQA (4 query / 2 KV heads).
ModelConfig TestConfig(bool tied = true);

// Every tensor with its transformers name, spelled out here independently of weights.cc.
// The pointers point into `w`.
std::vector<std::pair<std::string, const std::vector<float>*>> NamedTensors(const ModelWeights& w);

// The shape `name` has under config `c`.
std::vector<int64_t> ShapeOf(const ModelConfig& c, const std::string& name);

// One tensor of a hand-made safetensors file.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Little-endian bytes of `values`.
std::string F32Bytes(const std::vector<float>& values);
std::string U16Bytes(const std::vector<uint16_t>& values);

// Every tensor of `w` as F32, in NamedTensors order.
std::vector<RawTensor> RawTensorsOf(const ModelWeights& w);

// The tensor called `name`; adds a test failure and returns the first one if there is none.
// REQUIRES: `tensors` is not empty.
RawTensor& Find(std::vector<RawTensor>& tensors, const std::string& name);

// 8-byte little-endian header length, header, data.
std::string FileBytes(const std::string& header, const std::string& data);

// Lays the tensors out back to back in the order given, header JSON written by hand.
std::string SafetensorsBytes(const std::vector<RawTensor>& tensors);

// A Mamba-2 mixer's tensors as Bamba and Falcon-H1 name them, under `prefix` (e.g.
// "model.layers.3.mamba."), as F32: in_proj, conv1d (and its bias with ssm.conv_bias), the
// projection biases with ssm.proj_bias, dt_bias, A_log, D, norm (with ssm.gated_norm), out_proj.
void AppendMambaTensors(const std::string& prefix, const LayerWeights& layer, const ModelConfig& c,
                        std::vector<RawTensor>* out);

// A transformers config.json for `c`.
std::string ConfigText(const ModelConfig& c);

// Expects equal configs and bit-identical tensors under the same names.
void ExpectSameWeights(const ModelWeights& a, const ModelWeights& b);

// Summary statistics of a tensor's values.
struct Stats {
  double mean = 0, stddev = 0, within_one_sigma = 0, max_abs = 0;
};

// REQUIRES: `v` is not empty.
Stats StatsOf(const std::vector<float>& v);

// Gives each test a fresh temporary directory `dir_`, removed after the test.
class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  void WriteFile(const std::string& name, const std::string& bytes) const;

  // config.json for `config` plus one model.safetensors holding `tensors`.
  void WriteCheckpoint(const ModelConfig& config, const std::vector<RawTensor>& tensors) const;

  // Loads dir_ and expects INVALID_ARGUMENT whose message holds every one of `parts`.
  void ExpectInvalid(const std::vector<std::string>& parts) const;

  std::string dir_;
};

}  // namespace kvpool::model::test_util
