// Checkpoint files (model/internal/safetensors.h, model/weights.h): arbitrary bytes as a
// safetensors file through SafetensorsFile::Open and ReadAsF32, or as a checkpoint directory
// (config.json + model.safetensors) through LoadCheckpoint, as kvpoold loads `model.checkpoint`.
//
// Checked on every input: every entry of a header Open accepted lies inside the data buffer,
// spans exactly numel(shape) * element size bytes and overlaps no other; ReadAsF32 converts
// exactly numel values of an F32/F16/BF16 tensor and refuses any other dtype with
// INVALID_ARGUMENT; LoadCheckpoint refuses with the codes weights.h names, and weights it accepts
// have the sizes their config says.
//
// Input: byte 0 bit 0 selects the mode. Mode 0: the rest is the safetensors file. Mode 1:
// bytes 1-2 (little-endian) = n, the next n bytes = config.json, the rest = model.safetensors.

#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "model/internal/safetensors.h"
#include "model/weights.h"

namespace kvpool::fuzz {
namespace {

using model::internal::SafetensorsFile;
using model::internal::TensorEntry;

void CheckFile(std::string_view bytes) {
  MemFile file(bytes);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened = SafetensorsFile::Open(file.path());
  if (!opened.ok()) {
    Require(opened.status().code() == absl::StatusCode::kInvalidArgument,
            "Open refused readable bytes with a code other than INVALID_ARGUMENT");
    return;
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  const auto data_size = static_cast<int64_t>(bytes.size() - 8 - header_len);

  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& [name, entry] : (*opened)->tensors()) {
    Require(entry.element_size > 0, "an entry without an element size");
    Require(0 <= entry.begin && entry.begin <= entry.end && entry.end <= data_size,
            "an entry outside the data buffer");
    int64_t numel = 1;
    for (int64_t d : entry.shape) {
      Require(d >= 0, "a negative dimension");
      numel *= d;  // cannot overflow: the parser bounded numel * element_size
    }
    Require(entry.end - entry.begin == numel * entry.element_size, "an entry's size != its shape");
    if (entry.end > entry.begin) spans.emplace_back(entry.begin, entry.end);

    std::vector<float> out;
    const absl::Status read = (*opened)->ReadAsF32(name, entry, &out);
    if (entry.dtype == "F32" || entry.dtype == "F16" || entry.dtype == "BF16") {
      RequireOk(read, "ReadAsF32 of a float tensor");
      Require(static_cast<int64_t>(out.size()) == numel, "ReadAsF32 returned != numel values");
    } else {
      Require(read.code() == absl::StatusCode::kInvalidArgument, "ReadAsF32 of a non-float dtype");
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    Require(spans[i].first >= spans[i - 1].second, "two tensors overlap");
  }
}

// A scratch checkpoint directory for this process, its files rewritten for every input.
const std::string& ScratchDir() {
  static const std::string* const kDir = [] {
    std::string pattern = "/tmp/kvpool-safetensors-fuzz-XXXXXX";
    Require(mkdtemp(pattern.data()) != nullptr, "mkdtemp");
    return new std::string(pattern);
  }();
  return *kDir;
}

void CheckCheckpoint(std::string_view config_json, std::string_view safetensors) {
  const std::string& dir = ScratchDir();
  RequireOk(model::internal::WriteWholeFile(dir + "/config.json", config_json), "config.json");
  RequireOk(model::internal::WriteWholeFile(dir + "/model.safetensors", safetensors),
            "model.safetensors");
  absl::StatusOr<model::ModelWeights> weights = model::LoadCheckpoint(dir);
  if (!weights.ok()) {
    Require(weights.status().code() == absl::StatusCode::kInvalidArgument,
            "LoadCheckpoint refused with a code other than INVALID_ARGUMENT");
    return;
  }
  const model::ModelConfig& c = weights->config;
  RequireOk(model::ValidateConfig(c), "loaded weights with an invalid config");
  const auto size = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size()); };
  const int64_t hidden = c.hidden_size;
  Require(size(weights->embed) == int64_t{c.vocab_size} * hidden, "embed size");
  Require(size(weights->lm_head) == (c.tie_word_embeddings ? 0 : int64_t{c.vocab_size} * hidden),
          "lm_head size");
  Require(size(weights->final_norm) == hidden, "final_norm size");
  Require(static_cast<int64_t>(weights->layers.size()) == c.num_layers, "layer count");
  for (int32_t i = 0; i < c.num_layers; ++i) {
    // An attention layer has its projections, a layer with an MLP its MLP; others none.
    const model::LayerWeights& l = weights->layers[static_cast<size_t>(i)];
    const int64_t attention = c.is_attention(i) ? 1 : 0, mlp = c.has_mlp(i) ? 1 : 0;
    Require(size(l.wq) == attention * c.num_heads * c.head_dim * hidden, "wq size");
    Require(size(l.wk) == attention * c.num_kv_heads * c.head_dim * hidden, "wk size");
    Require(size(l.w_down) == mlp * hidden * c.intermediate_size, "w_down size");
    Require(size(l.w_gate) == (c.gated_mlp() ? mlp * hidden * c.intermediate_size : 0),
            "w_gate size");
  }
}

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvpool::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::fuzz;
  if (size < 1) return -1;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    CheckFile(rest);
    return 0;
  }
  if (rest.size() < 2) return -1;
  const size_t n = std::min<size_t>(
      static_cast<uint8_t>(rest[0]) | (static_cast<uint8_t>(rest[1]) << 8), rest.size() - 2);
  CheckCheckpoint(rest.substr(2, n), rest.substr(2 + n));
  return 0;
}
