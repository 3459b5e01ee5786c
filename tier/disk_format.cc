#include "tier/disk_format.h"

#include <openssl/crypto.h>
#include <xxhash.h>

#include <bit>
#include <cstring>
#include <string>
#include <string_view>

#include "tier/disk_tier_options.h"

namespace kvpool::tier {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the disk tier's format is little-endian; add byte swaps for this target");

constexpr uint64_t kSuperMagic = 0x524549544450564b;  // "KVPDTIER" read little-endian
constexpr uint32_t kEntryMagic = 0x4950564b;          // "KVPI"
constexpr uint16_t kEntryVersion = 1;
constexpr size_t kEntryNonceOffset = 88;
constexpr size_t kEntryTagOffset = 104;
constexpr size_t kEntryChecksumOffset = 120;
constexpr size_t kSuperChecksumOffset = 64;

template <typename T>
void Put(std::span<std::byte> base, size_t offset, T value) {
  std::memcpy(base.data() + offset, &value, sizeof(T));
}

template <typename T>
T Get(std::span<const std::byte> base, size_t offset) {
  T value;
  std::memcpy(&value, base.data() + offset, sizeof(T));
  return value;
}

uint64_t Checksum(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string_view View(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// The entry's bytes 0..88 (everything the tag covers besides the layout and the payload).
void EncodeFields(const IndexEntry& e, std::span<std::byte> out) {
  Put<uint32_t>(out, 0, kEntryMagic);
  Put<uint16_t>(out, 4, kEntryVersion);
  Put<uint16_t>(out, 6, static_cast<uint16_t>(kIndexEntryBytes));
  Put<uint64_t>(out, 8, e.ns.value());
  Put<uint64_t>(out, 16, e.hash.lo);
  Put<uint64_t>(out, 24, e.hash.hi);
  Put<uint64_t>(out, 32, e.parent.lo);
  Put<uint64_t>(out, 40, e.parent.hi);
  Put<uint32_t>(out, 48, e.coverage);
  Put<uint32_t>(out, 52, 0);
  Put<uint64_t>(out, 56, static_cast<uint64_t>(e.payload_bytes));
  Put<uint64_t>(out, 64, e.tags.tenant);
  Put<uint64_t>(out, 72, e.tags.model);
  Put<uint64_t>(out, 80, e.sequence);
}

ValueTag EntryTag(const DeploymentSecret& secret, uint64_t layout_fingerprint,
                  std::span<const std::byte> payload, const IndexEntry& entry) {
  std::array<std::byte, kEntryNonceOffset> fields{};
  EncodeFields(entry, fields);
  return OneTimeTag(secret, "kvpool disk record poly1305 v1", entry.nonce, {},
                    {LittleEndian64(layout_fingerprint), View(fields), View(payload)});
}

}  // namespace

uint64_t ContentFingerprint(std::string_view identity) {
  return XXH3_64bits(identity.data(), identity.size());
}

void EncodeSuperblock(const Superblock& sb, std::span<std::byte> out) {
  std::memset(out.data(), 0, static_cast<size_t>(kSuperblockBytes));
  Put<uint64_t>(out, 0, kSuperMagic);
  Put<uint32_t>(out, 8, sb.version);
  Put<uint32_t>(out, 12, static_cast<uint32_t>(kSuperblockBytes));
  Put<uint64_t>(out, 16, sb.secret_fingerprint);
  Put<uint64_t>(out, 24, sb.layout_fingerprint);
  Put<uint64_t>(out, 32, sb.content_fingerprint);
  Put<int64_t>(out, 40, sb.block_bytes);
  Put<int64_t>(out, 48, sb.slot_bytes);
  Put<int64_t>(out, 56, sb.slots);
  Put<uint64_t>(out, kSuperChecksumOffset, Checksum(out.first(kSuperChecksumOffset)));
}

SuperblockCheck DecodeSuperblock(std::span<const std::byte> in, Superblock* sb) {
  if (static_cast<int64_t>(in.size()) < kSuperblockBytes || Get<uint64_t>(in, 0) != kSuperMagic ||
      Get<uint64_t>(in, kSuperChecksumOffset) != Checksum(in.first(kSuperChecksumOffset))) {
    return SuperblockCheck::kMissing;
  }
  sb->version = Get<uint32_t>(in, 8);
  if (sb->version != kDiskFormatVersion || Get<uint32_t>(in, 12) != kSuperblockBytes) {
    return SuperblockCheck::kVersion;
  }
  sb->secret_fingerprint = Get<uint64_t>(in, 16);
  sb->layout_fingerprint = Get<uint64_t>(in, 24);
  sb->content_fingerprint = Get<uint64_t>(in, 32);
  sb->block_bytes = Get<int64_t>(in, 40);
  sb->slot_bytes = Get<int64_t>(in, 48);
  sb->slots = Get<int64_t>(in, 56);
  return SuperblockCheck::kOk;
}

void SealEntry(const DeploymentSecret& secret, uint64_t layout_fingerprint,
               std::span<const std::byte> payload, IndexEntry* entry) {
  entry->payload_bytes = static_cast<int64_t>(payload.size());
  entry->tag = EntryTag(secret, layout_fingerprint, payload, *entry);
}

bool VerifyEntry(const DeploymentSecret& secret, uint64_t layout_fingerprint,
                 std::span<const std::byte> payload, const IndexEntry& entry) {
  if (static_cast<int64_t>(payload.size()) != entry.payload_bytes) return false;
  const ValueTag tag = EntryTag(secret, layout_fingerprint, payload, entry);
  return CRYPTO_memcmp(tag.data(), entry.tag.data(), tag.size()) == 0;
}

void EncodeIndexEntry(const IndexEntry& entry, std::span<std::byte> out) {
  EncodeFields(entry, out);
  std::memcpy(out.data() + kEntryNonceOffset, entry.nonce.data(), entry.nonce.size());
  std::memcpy(out.data() + kEntryTagOffset, entry.tag.data(), entry.tag.size());
  Put<uint64_t>(out, kEntryChecksumOffset, Checksum(out.first(kEntryChecksumOffset)));
}

EntryCheck DecodeIndexEntry(std::span<const std::byte> in, IndexEntry* entry) {
  const uint32_t magic = Get<uint32_t>(in, 0);
  if (magic == 0) return EntryCheck::kFree;
  if (magic != kEntryMagic || Get<uint16_t>(in, 4) != kEntryVersion ||
      Get<uint16_t>(in, 6) != kIndexEntryBytes ||
      Get<uint64_t>(in, kEntryChecksumOffset) != Checksum(in.first(kEntryChecksumOffset))) {
    return EntryCheck::kDamaged;
  }
  entry->ns = NamespaceId(Get<uint64_t>(in, 8));
  entry->hash = {.lo = Get<uint64_t>(in, 16), .hi = Get<uint64_t>(in, 24)};
  entry->parent = {.lo = Get<uint64_t>(in, 32), .hi = Get<uint64_t>(in, 40)};
  entry->coverage = Get<uint32_t>(in, 48);
  entry->payload_bytes = static_cast<int64_t>(Get<uint64_t>(in, 56));
  entry->tags = {.tenant = Get<uint64_t>(in, 64), .model = Get<uint64_t>(in, 72)};
  entry->sequence = Get<uint64_t>(in, 80);
  std::memcpy(entry->nonce.data(), in.data() + kEntryNonceOffset, entry->nonce.size());
  std::memcpy(entry->tag.data(), in.data() + kEntryTagOffset, entry->tag.size());
  return EntryCheck::kOk;
}

}  // namespace kvpool::tier
