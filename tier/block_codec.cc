#include "tier/block_codec.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvpool/util/check.h"

namespace kvpool::tier {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the block value format is little-endian; add byte swaps for this target");

constexpr size_t kTagBytes = 16;
static_assert(kBlockTagOffset + kTagBytes == kBlockHeaderBytes);
static_assert(kBlockNonceOffset + sizeof(ValueNonce) == kBlockTagOffset);

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

std::string_view Bytes(const void* data, size_t size) {
  return std::string_view(static_cast<const char*>(data), size);
}

// Feeds `bytes` to a MAC context. OpenSSL fails an update only on a misused context.
void Update(EVP_MAC_CTX* ctx, std::string_view bytes) {
  KVPOOL_CHECK(
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) == 1);
}

// The tag of the value whose first kBlockTagOffset header bytes are `header` and whose payload
// is `payload`, stored under `key` (block_codec.h has the construction).
std::array<uint8_t, kTagBytes> Tag(const DeploymentSecret& secret, std::string_view key,
                                   std::string_view header, std::string_view payload) {
  ValueNonce nonce;
  std::memcpy(nonce.data(), header.data() + kBlockNonceOffset, nonce.size());
  return OneTimeTag(secret, "kvpool redis value poly1305 v2", nonce, key,
                    {LittleEndian64(key.size()), key, header.substr(0, kBlockTagOffset), payload});
}

std::string Hex(const uint8_t* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kDigits[bytes[i] >> 4]);
    out.push_back(kDigits[bytes[i] & 15]);
  }
  return out;
}

}  // namespace

ValueTag OneTimeTag(const DeploymentSecret& secret, std::string_view domain,
                    const ValueNonce& nonce, std::string_view key,
                    std::initializer_list<std::string_view> parts) {
  const DeploymentSecret::Digest one_time_key =
      secret.Mac(domain, {Bytes(nonce.data(), nonce.size()), key});
  // Fetched once: a fetch costs about as much as a 4 KiB Poly1305. EVP_MAC objects are
  // immutable and may create contexts from any thread.
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "POLY1305", nullptr);
  KVPOOL_CHECK_MSG(mac != nullptr, "OpenSSL has no POLY1305");
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  KVPOOL_CHECK(ctx != nullptr);
  KVPOOL_CHECK(EVP_MAC_init(ctx, one_time_key.data(), one_time_key.size(), nullptr) == 1);
  for (std::string_view part : parts) Update(ctx, part);
  ValueTag tag{};
  size_t written = 0;
  KVPOOL_CHECK(EVP_MAC_final(ctx, tag.data(), &written, tag.size()) == 1 && written == tag.size());
  EVP_MAC_CTX_free(ctx);
  return tag;
}

SpaceKeys::SpaceKeys(const DeploymentSecret& secret, const BlockSpace& space, KeySlotting slotting)
    : secret_(secret),
      space_(space),
      slotting_(slotting),
      space_tag_(absl::StrFormat(
          "%016x",
          secret.Mac64("kvpool redis space v2", {LittleEndian64(space.ns.value()),
                                                 LittleEndian64(space.layout_fingerprint)}))) {}

std::string SpaceKeys::Key(const BlockHash& hash) const {
  const DeploymentSecret::Digest block =
      secret_.Mac("kvpool redis block v2",
                  {LittleEndian64(space_.ns.value()), LittleEndian64(space_.layout_fingerprint),
                   LittleEndian64(hash.lo), LittleEndian64(hash.hi)});
  const std::string block_hex = Hex(block.data(), 16);
  switch (slotting_) {
    case KeySlotting::kNamespace:
      return absl::StrCat("kvp2:{", space_tag_, "}:", block_hex);
    case KeySlotting::kBlock:
      return absl::StrCat("kvp2:", space_tag_, ":{", block_hex, "}");
  }
  return {};
}

std::string BlockKey(const DeploymentSecret& secret, const BlockSpace& space, const BlockHash& hash,
                     KeySlotting slotting) {
  return SpaceKeys(secret, space, slotting).Key(hash);
}

ValueNonce RandomValueNonce() {
  ValueNonce nonce{};
  // RAND_bytes fails only when OpenSSL's generator cannot be seeded at all (no getrandom, no
  // /dev/urandom): nothing on which a daemon can run.
  KVPOOL_CHECK_MSG(RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) == 1,
                   "OpenSSL RAND_bytes failed");
  return nonce;
}

void EncodeBlockValue(const DeploymentSecret& secret, std::string_view key, const ValueNonce& nonce,
                      BlockHeader header, std::span<const std::byte> payload, std::string* out) {
  header.payload_bytes = static_cast<int64_t>(payload.size());
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
  std::memcpy(h + kBlockNonceOffset, nonce.data(), nonce.size());
  if (!payload.empty()) std::memcpy(h + kBlockHeaderBytes, payload.data(), payload.size());
  const std::array<uint8_t, kTagBytes> tag =
      Tag(secret, key, Bytes(h, kBlockHeaderBytes), Bytes(payload.data(), payload.size()));
  std::memcpy(h + kBlockTagOffset, tag.data(), tag.size());
}

const char* BlockCheckName(BlockCheck check) {
  switch (check) {
    case BlockCheck::kOk:
      return "ok";
    case BlockCheck::kShort:
      return "short value";
    case BlockCheck::kMagic:
      return "bad magic/version";
    case BlockCheck::kLength:
      return "length mismatch";
    case BlockCheck::kMac:
      return "MAC mismatch (forged, damaged, another key's or another secret's)";
    case BlockCheck::kLayout:
      return "layout fingerprint mismatch";
    case BlockCheck::kHash:
      return "block/parent hash mismatch";
  }
  return "?";
}

BlockCheck CheckBlockValue(const DeploymentSecret& secret, std::string_view key,
                           std::string_view value, const BlockExpectation& expect,
                           BlockHeader* header, std::span<const std::byte>* payload) {
  if (static_cast<int64_t>(value.size()) < kBlockHeaderBytes) return BlockCheck::kShort;
  const std::string_view rest = value.substr(kBlockHeaderBytes);
  *payload =
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(rest.data()), rest.size());
  return CheckBlockParts(secret, key, value.substr(0, kBlockHeaderBytes), *payload, expect, header);
}

BlockCheck CheckBlockParts(const DeploymentSecret& secret, std::string_view key,
                           std::string_view head, std::span<const std::byte> payload,
                           const BlockExpectation& expect, BlockHeader* header) {
  if (static_cast<int64_t>(head.size()) != kBlockHeaderBytes) return BlockCheck::kShort;
  const char* h = head.data();
  if (Get<uint32_t>(h, 0) != kBlockMagic || Get<uint16_t>(h, 4) != kBlockVersion ||
      Get<uint16_t>(h, 6) != kBlockHeaderBytes) {
    return BlockCheck::kMagic;
  }
  const int64_t actual = static_cast<int64_t>(payload.size());
  if (static_cast<int64_t>(Get<uint64_t>(h, 56)) != actual || actual != expect.payload_bytes) {
    return BlockCheck::kLength;
  }
  const std::array<uint8_t, kTagBytes> tag =
      Tag(secret, key, head, Bytes(payload.data(), payload.size()));
  if (CRYPTO_memcmp(tag.data(), h + kBlockTagOffset, tag.size()) != 0) return BlockCheck::kMac;
  header->layout_fingerprint = Get<uint64_t>(h, 8);
  header->hash = {.lo = Get<uint64_t>(h, 16), .hi = Get<uint64_t>(h, 24)};
  header->parent = {.lo = Get<uint64_t>(h, 32), .hi = Get<uint64_t>(h, 40)};
  header->coverage = Get<uint32_t>(h, 48);
  header->payload_bytes = actual;
  if (header->layout_fingerprint != expect.layout_fingerprint) return BlockCheck::kLayout;
  if (header->hash != expect.hash) return BlockCheck::kHash;
  if (expect.parent != nullptr && header->parent != *expect.parent) return BlockCheck::kHash;
  return BlockCheck::kOk;
}

}  // namespace kvpool::tier
