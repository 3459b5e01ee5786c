#pragma once

// The safetensors file format (https://github.com/huggingface/safetensors), read through a
// read-only mapping and written with plain POSIX I/O, plus the IEEE half and bfloat16 conversions
// checkpoints need. A file is: an 8-byte little-endian u64 N, N bytes of JSON header
// ({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional "__metadata__"}), then the
// data buffer the offsets are relative to.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool::model::internal {

// Round-to-nearest-even narrowing and exact widening. NaN stays NaN (quiet), ±inf stays ±inf,
// values past the largest finite half round to ±inf, subnormals are kept.
uint16_t F32ToF16(float value);
float F16ToF32(uint16_t bits);
uint16_t F32ToBf16(float value);
float Bf16ToF32(uint16_t bits);

// One tensor's header entry. Offsets are relative to the data buffer; the header parser has
// checked begin <= end <= buffer size and end - begin == numel(shape) * element_size.
struct TensorEntry {
  std::string dtype;           // as spelled in the file: "F32", "BF16", "I64", ...
  int64_t element_size = 0;    // bytes per element of `dtype`
  std::vector<int64_t> shape;  // row-major, outermost first
  int64_t begin = 0;           // byte offset into the data buffer
  int64_t end = 0;             // one past the last byte
};

// A mapped, header-validated safetensors file. Not thread-safe to create; const methods may be
// called concurrently. The mapping lives as long as the object.
class SafetensorsFile final {
 public:
  // Maps `path` and validates its header: header length sane (at most 100 MB and within the
  // file), JSON well formed, every dtype known, every tensor's bytes inside the data buffer and
  // matching its shape, no two tensors overlapping. Errors: INVALID_ARGUMENT naming the file (and
  // tensor) for a malformed file; INTERNAL when the file cannot be opened or mapped.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }

  // Converts the tensor `name` (an entry of tensors()) from F32, F16 or BF16 to f32 into `out`,
  // replacing its contents. Errors: INVALID_ARGUMENT naming the tensor, file and dtype for any
  // other dtype (`out` untouched).
  absl::Status ReadAsF32(const std::string& name, const TensorEntry& entry,
                         std::vector<float>* out) const;

 private:
  SafetensorsFile(std::string path, const std::byte* base, int64_t size)
      : path_(std::move(path)), base_(base), size_(size) {}

  // Fills tensors_ and data_offset_ from the mapped bytes.
  absl::Status ParseHeader();

  std::string path_;
  const std::byte* base_ = nullptr;  // the whole file, mapped read-only; null when size_ == 0
  int64_t size_ = 0;                 // file size in bytes
  int64_t data_offset_ = 0;          // where the data buffer starts: 8 + header length
  std::map<std::string, TensorEntry> tensors_;
};

// A tensor to write, in f32; `data` holds numel(shape) values and outlives the call.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// Writes `tensors` to `path` (created or truncated) as one safetensors file, each stored as
// `dtype` ("F32", "F16" or "BF16"), with `metadata` as "__metadata__". The data buffer follows
// the header's order (names sorted), and the header is padded with spaces to a multiple of 8
// bytes as the reference implementation does. REQUIRES: distinct names; dtype one of the three.
// Errors: INTERNAL naming the path and the system error; the file may be left partly written.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              std::string_view dtype,
                              const std::map<std::string, std::string>& metadata);

// Writes `contents` to `path`, created or truncated. Errors: INTERNAL naming the path.
absl::Status WriteWholeFile(const std::string& path, std::string_view contents);

// Reads all of `path`. Errors: NOT_FOUND when it does not exist, INTERNAL for other failures.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace kvpool::model::internal
