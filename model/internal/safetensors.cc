#include "model/internal/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/util/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvpool::model::internal {
namespace {

// safetensors stores little-endian data; F32 tensors are copied as raw bytes, which is only
// right on a little-endian host (every platform kvpool targets).
static_assert(std::endian::native == std::endian::little);

// The reference implementation refuses headers past 100 MB; so do we, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

absl::Status IoError(const char* what, const std::string& path, int err) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", ErrnoText(err)));
}

// Bytes per element for the dtypes the safetensors reference defines with whole-byte sizes;
// 0 for anything else. Knowing the size of dtypes we do not convert still lets the header check
// bound every tensor.
int64_t ElementSize(std::string_view dtype) {
  static constexpr std::pair<std::string_view, int64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8},
  };
  for (const auto& [name, size] : kSizes) {
    if (name == dtype) return size;
  }
  return 0;
}

// A little-endian u16 at `p`, whatever its alignment.
uint16_t LoadU16(const std::byte* p) {
  return static_cast<uint16_t>(std::to_integer<uint16_t>(p[0]) |
                               (std::to_integer<uint16_t>(p[1]) << 8));
}

// Reads a non-negative JSON integer into *out; false when `value` is anything else.
bool GetNonNegative(const nlohmann::json& value, int64_t* out) {
  if (!value.is_number_unsigned()) return false;
  const uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(INT64_MAX)) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

// Owns a writable fd; Close() reports the error a deferred write may surface only at close.
class FileWriter final {
 public:
  static absl::StatusOr<FileWriter> Create(const std::string& path) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return IoError("cannot create", path, errno);
    return FileWriter(path, fd);
  }
  FileWriter(FileWriter&& other) noexcept
      : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}
  FileWriter& operator=(FileWriter&&) = delete;
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return IoError("cannot write", path_, errno);
      p += n;
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Close() {
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return IoError("cannot close", path_, errno);
    return absl::OkStatus();
  }

 private:
  FileWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}

  std::string path_;
  int fd_ = -1;
};

}  // namespace

uint16_t F32ToF16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {  // NaN: keep it quiet and keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  }
  // 65520 is halfway between 65504 (the largest half) and 65536; ties go to the even 65536 = inf.
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs >= 0x38800000u) {  // normal half: rebias the exponent 127 -> 15, round off 13 bits
    uint32_t h = (abs - 0x38000000u) >> 13;
    const uint32_t rest = abs & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal half, in units of 2^-24. Below 2^-25 everything rounds to zero (2^-25 itself ties
  // to the even 0); f32 subnormals are far below that.
  const uint32_t exponent = abs >> 23;
  if (exponent < 102) return sign;
  const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t h = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;  // may round up to the smallest normal
  return static_cast<uint16_t>(sign | h);
}

float F16ToF32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in f32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t F32ToBf16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((x >> 16) & 1u);  // ties to even; overflow becomes inf
  return static_cast<uint16_t>((x + rounding) >> 16);
}

float Bf16ToF32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError("cannot open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("cannot stat", path, err);
  }
  const auto size = static_cast<int64_t>(st.st_size);
  const std::byte* base = nullptr;
  if (size > 0) {
    void* mapped = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return IoError("cannot map", path, err);
    }
    base = static_cast<const std::byte*>(mapped);
  }
  ::close(fd);  // the mapping keeps the file alive
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile(path, base, size));
  KVPOOL_RETURN_IF_ERROR(file->ParseHeader());
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) {
    ::munmap(const_cast<std::byte*>(base_), static_cast<size_t>(size_));
  }
}

absl::Status SafetensorsFile::ParseHeader() {
  if (size_ < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": ", size_, " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | std::to_integer<uint64_t>(base_[i]);
  if (header_len > kMaxHeaderBytes || header_len > static_cast<uint64_t>(size_ - 8)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header length ", header_len,
                                                   " exceeds the file (", size_,
                                                   " bytes) or the 100 MB limit"));
  }
  data_offset_ = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = size_ - data_offset_;
  const char* text = reinterpret_cast<const char*>(base_ + 8);
  const nlohmann::json header =
      nlohmann::json::parse(text, text + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": header is not a well-formed JSON object"));
  }

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;  // free-form strings; nothing we need
    const auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", name, ": ", why));
    };
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets")) {
      return bad("entry needs dtype, shape and data_offsets");
    }
    const nlohmann::json& dtype = value["dtype"];
    const nlohmann::json& shape = value["shape"];
    const nlohmann::json& offsets = value["data_offsets"];
    if (!dtype.is_string()) return bad("dtype is not a string");
    TensorEntry entry;
    entry.dtype = dtype.get<std::string>();
    entry.element_size = ElementSize(entry.dtype);
    if (entry.element_size == 0) return bad(absl::StrCat("unknown dtype ", entry.dtype));
    if (!shape.is_array()) return bad("shape is not an array");
    int64_t bytes = entry.element_size;
    for (const nlohmann::json& dim : shape) {
      int64_t d = 0;
      if (!GetNonNegative(dim, &d)) return bad("shape holds a non-integer or negative dimension");
      if (__builtin_mul_overflow(bytes, d, &bytes)) return bad("shape overflows 64 bits");
      entry.shape.push_back(d);
    }
    if (!offsets.is_array() || offsets.size() != 2 || !GetNonNegative(offsets[0], &entry.begin) ||
        !GetNonNegative(offsets[1], &entry.end)) {
      return bad("data_offsets is not a pair of non-negative integers");
    }
    if (entry.begin > entry.end || entry.end > data_size) {
      return bad(absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                              "] fall outside the data buffer of ", data_size,
                              " bytes (file truncated?)"));
    }
    if (entry.end - entry.begin != bytes) {
      return bad(absl::StrCat("data_offsets span ", entry.end - entry.begin, " bytes but ",
                              entry.dtype, " [", absl::StrJoin(entry.shape, ", "), "] needs ",
                              bytes));
    }
    tensors_.emplace(name, std::move(entry));
  }

  // Overlapping tensors would alias each other's bytes: a corrupt or hostile file.
  std::vector<std::pair<int64_t, const std::string*>> by_begin;
  for (const auto& [name, entry] : tensors_) {
    if (entry.end > entry.begin) by_begin.emplace_back(entry.begin, &name);
  }
  std::sort(by_begin.begin(), by_begin.end());
  for (size_t i = 1; i < by_begin.size(); ++i) {
    const TensorEntry& previous = tensors_.at(*by_begin[i - 1].second);
    if (by_begin[i].first < previous.end) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": tensors ", *by_begin[i - 1].second,
                                                     " and ", *by_begin[i].second, " overlap"));
    }
  }
  return absl::OkStatus();
}

absl::Status SafetensorsFile::ReadAsF32(const std::string& name, const TensorEntry& entry,
                                        std::vector<float>* out) const {
  const std::byte* p = base_ + data_offset_ + entry.begin;
  const auto n = static_cast<size_t>((entry.end - entry.begin) / entry.element_size);
  if (entry.dtype == "F32") {
    out->resize(n);
    if (n > 0) std::memcpy(out->data(), p, n * sizeof(float));
  } else if (entry.dtype == "F16") {
    out->resize(n);
    for (size_t i = 0; i < n; ++i) (*out)[i] = F16ToF32(LoadU16(p + 2 * i));
  } else if (entry.dtype == "BF16") {
    out->resize(n);
    for (size_t i = 0; i < n; ++i) (*out)[i] = Bf16ToF32(LoadU16(p + 2 * i));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", name, " has dtype ",
                                                   entry.dtype, "; only F32, F16 and BF16 load"));
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              std::string_view dtype,
                              const std::map<std::string, std::string>& metadata) {
  const std::string dtype_name(dtype);
  const int64_t element_size = ElementSize(dtype_name);

  // nlohmann::json keeps object keys sorted, so laying the data out in name order makes the
  // buffer follow the header, as the reference writer does for same-dtype tensors.
  std::vector<const TensorToWrite*> sorted;
  for (const TensorToWrite& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) { return a->name < b->name; });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const TensorToWrite* t : sorted) {
    int64_t numel = 1;
    for (int64_t d : t->shape) numel *= d;
    const int64_t end = offset + numel * element_size;
    header[t->name] = {{"dtype", dtype_name}, {"shape", t->shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text.resize((text.size() + 7) / 8 * 8, ' ');

  KVPOOL_ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Create(path));
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  KVPOOL_RETURN_IF_ERROR(writer.Append(length, sizeof(length)));
  KVPOOL_RETURN_IF_ERROR(writer.Append(text.data(), text.size()));

  // Converts in chunks so a large tensor never needs a second full-size copy.
  constexpr size_t kChunk = 1 << 16;
  std::vector<unsigned char> buffer(kChunk * sizeof(float));
  for (const TensorToWrite* t : sorted) {
    int64_t numel = 1;
    for (int64_t d : t->shape) numel *= d;
    for (size_t start = 0; start < static_cast<size_t>(numel); start += kChunk) {
      const size_t count = std::min(kChunk, static_cast<size_t>(numel) - start);
      const float* src = t->data + start;
      if (dtype_name == "F32") {
        std::memcpy(buffer.data(), src, count * sizeof(float));
      } else {
        const bool half = dtype_name == "F16";
        for (size_t i = 0; i < count; ++i) {
          const uint16_t bits = half ? F32ToF16(src[i]) : F32ToBf16(src[i]);
          buffer[2 * i] = static_cast<unsigned char>(bits & 0xFF);
          buffer[2 * i + 1] = static_cast<unsigned char>(bits >> 8);
        }
      }
      KVPOOL_RETURN_IF_ERROR(
          writer.Append(buffer.data(), count * static_cast<size_t>(element_size)));
    }
  }
  return writer.Close();
}

absl::Status WriteWholeFile(const std::string& path, std::string_view contents) {
  KVPOOL_ASSIGN_OR_RETURN(FileWriter writer, FileWriter::Create(path));
  KVPOOL_RETURN_IF_ERROR(writer.Append(contents.data(), contents.size()));
  return writer.Close();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return IoError("cannot open", path, err);
  }
  std::string contents;
  char buffer[1 << 14];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return IoError("cannot read", path, err);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

}  // namespace kvpool::model::internal
