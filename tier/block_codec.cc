#include "tier/block_codec.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_format.h"
#include "xxhash.h"

namespace kvpool::tier {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the block value format is little-endian; add byte swaps for this target");

template <typename T>
void Put(char* base, int offset, T value) {
  std::memcpy(base + offset, &value, sizeof(T));
}

template <typename T>
T Get(const char* base, int offset) {
  T value;
  std::memcpy(&value, base + offset, sizeof(T));
  return value;
}

}  // namespace

std::string BlockKey(const BlockSpace& space, const BlockHash& hash, KeySlotting slotting) {
  switch (slotting) {
    case KeySlotting::kNamespace:
      return absl::StrFormat("kvp1:{%016x}:%016x:%016x%016x", space.ns.value(),
                             space.layout_fingerprint, hash.hi, hash.lo);
    case KeySlotting::kBlock:
      return absl::StrFormat("kvp1:%016x:%016x:{%016x%016x}", space.ns.value(),
                             space.layout_fingerprint, hash.hi, hash.lo);
  }
  return {};
}

void EncodeBlockValue(BlockHeader header, std::span<const std::byte> payload, std::string* out) {
  header.payload_bytes = static_cast<int64_t>(payload.size());
  header.checksum = XXH3_64bits(payload.data(), payload.size());
  const size_t start = out->size();
  out->resize(start + kBlockHeaderBytes + payload.size());
  char* h = out->data() + start;
  Put<uint32_t>(h, 0, kBlockMagic);
  Put<uint16_t>(h, 4, kBlockVersion);
  Put<uint16_t>(h, 6, static_cast<uint16_t>(kBlockHeaderBytes));
  Put<uint64_t>(h, 8, header.layout_fingerprint);
  Put<uint64_t>(h, 16, header.hash.lo);
  Put<uint64_t>(h, 24, header.hash.hi);
  Put<uint64_t>(h, 32, header.parent.lo);
  Put<uint64_t>(h, 40, header.parent.hi);
  Put<uint32_t>(h, 48, header.coverage);
  Put<uint32_t>(h, 52, 0);
  Put<uint64_t>(h, 56, static_cast<uint64_t>(header.payload_bytes));
  Put<uint64_t>(h, 64, header.checksum);
  if (!payload.empty()) std::memcpy(h + kBlockHeaderBytes, payload.data(), payload.size());
}

const char* BlockCheckName(BlockCheck check) {
  switch (check) {
    case BlockCheck::kOk:
      return "ok";
    case BlockCheck::kShort:
      return "short value";
    case BlockCheck::kMagic:
      return "bad magic/version";
    case BlockCheck::kLayout:
      return "layout fingerprint mismatch";
    case BlockCheck::kHash:
      return "block/parent hash mismatch";
    case BlockCheck::kLength:
      return "length mismatch";
    case BlockCheck::kChecksum:
      return "checksum mismatch";
  }
  return "?";
}

BlockCheck CheckBlockValue(std::string_view value, const BlockExpectation& expect,
                           BlockHeader* header, std::span<const std::byte>* payload) {
  if (static_cast<int64_t>(value.size()) < kBlockHeaderBytes) return BlockCheck::kShort;
  const char* h = value.data();
  if (Get<uint32_t>(h, 0) != kBlockMagic || Get<uint16_t>(h, 4) != kBlockVersion ||
      Get<uint16_t>(h, 6) != kBlockHeaderBytes) {
    return BlockCheck::kMagic;
  }
  header->layout_fingerprint = Get<uint64_t>(h, 8);
  header->hash = {.lo = Get<uint64_t>(h, 16), .hi = Get<uint64_t>(h, 24)};
  header->parent = {.lo = Get<uint64_t>(h, 32), .hi = Get<uint64_t>(h, 40)};
  header->coverage = Get<uint32_t>(h, 48);
  header->payload_bytes = static_cast<int64_t>(Get<uint64_t>(h, 56));
  header->checksum = Get<uint64_t>(h, 64);
  if (header->layout_fingerprint != expect.layout_fingerprint) return BlockCheck::kLayout;
  if (header->hash != expect.hash) return BlockCheck::kHash;
  if (expect.parent != nullptr && header->parent != *expect.parent) return BlockCheck::kHash;
  const int64_t actual = static_cast<int64_t>(value.size()) - kBlockHeaderBytes;
  if (header->payload_bytes != actual || actual != expect.payload_bytes) {
    return BlockCheck::kLength;
  }
  const auto* bytes = reinterpret_cast<const std::byte*>(h + kBlockHeaderBytes);
  if (XXH3_64bits(bytes, static_cast<size_t>(actual)) != header->checksum) {
    return BlockCheck::kChecksum;
  }
  *payload = std::span<const std::byte>(bytes, static_cast<size_t>(actual));
  return BlockCheck::kOk;
}

}  // namespace kvpool::tier
