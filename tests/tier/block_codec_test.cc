#include "tier/block_codec.h"

#include <vector>

#include "gtest/gtest.h"
#include "tier/key_slot.h"

namespace kvpool::tier {
namespace {

constexpr BlockSpace kSpace{.ns = NamespaceId(0x1234), .layout_fingerprint = 0xabcdef};
constexpr BlockHash kHash{.lo = 0x1111, .hi = 0x2222};
constexpr BlockHash kParent{.lo = 0x3333, .hi = 0x4444};

std::vector<std::byte> Payload(size_t n) {
  std::vector<std::byte> bytes(n);
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<std::byte>(i * 31 + 7);
  return bytes;
}

std::string Encode(const std::vector<std::byte>& payload) {
  std::string value;
  EncodeBlockValue({.layout_fingerprint = kSpace.layout_fingerprint,
                    .hash = kHash,
                    .parent = kParent,
                    .coverage = 16},
                   payload, &value);
  return value;
}

BlockExpectation Expect(int64_t payload_bytes) {
  return {.layout_fingerprint = kSpace.layout_fingerprint,
          .hash = kHash,
          .parent = &kParent,
          .payload_bytes = payload_bytes};
}

TEST(BlockCodecTest, KeysNameSpaceLayoutAndHashWithTheChosenHashTag) {
  EXPECT_EQ(BlockKey(kSpace, kHash, KeySlotting::kNamespace),
            "kvp1:{0000000000001234}:0000000000abcdef:00000000000022220000000000001111");
  EXPECT_EQ(BlockKey(kSpace, kHash, KeySlotting::kBlock),
            "kvp1:0000000000001234:0000000000abcdef:{00000000000022220000000000001111}");
  // Namespace slotting: every block of a namespace shares a slot.
  EXPECT_EQ(KeySlot(BlockKey(kSpace, kHash, KeySlotting::kNamespace)),
            KeySlot(BlockKey(kSpace, kParent, KeySlotting::kNamespace)));
}

TEST(BlockCodecTest, RoundTripGivesHeaderAndPayloadBack) {
  const std::vector<std::byte> payload = Payload(4096);
  const std::string value = Encode(payload);
  ASSERT_EQ(value.size(), kBlockHeaderBytes + payload.size());
  BlockHeader header;
  std::span<const std::byte> out;
  ASSERT_EQ(CheckBlockValue(value, Expect(4096), &header, &out), BlockCheck::kOk);
  EXPECT_EQ(header.coverage, 16u);
  EXPECT_EQ(header.parent, kParent);
  EXPECT_EQ(header.payload_bytes, 4096);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), payload.begin(), payload.end()));
}

TEST(BlockCodecTest, EveryFlippedByteIsRefused) {
  const std::vector<std::byte> payload = Payload(512);
  const std::string good = Encode(payload);
  for (size_t i = 0; i < good.size(); ++i) {
    if (i >= 48 && i < 56) continue;  // coverage and reserved are data, not checked
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x40);
    BlockHeader header;
    std::span<const std::byte> out;
    EXPECT_NE(CheckBlockValue(bad, Expect(512), &header, &out), BlockCheck::kOk) << "byte " << i;
  }
}

TEST(BlockCodecTest, NamesTheReasonForARefusal) {
  const std::string good = Encode(Payload(256));
  BlockHeader header;
  std::span<const std::byte> out;
  EXPECT_EQ(CheckBlockValue(good.substr(0, 10), Expect(256), &header, &out), BlockCheck::kShort);
  EXPECT_EQ(CheckBlockValue(good.substr(0, 200), Expect(256), &header, &out), BlockCheck::kLength);
  EXPECT_EQ(CheckBlockValue(good, Expect(128), &header, &out), BlockCheck::kLength);
  BlockExpectation other_layout = Expect(256);
  other_layout.layout_fingerprint = 1;
  EXPECT_EQ(CheckBlockValue(good, other_layout, &header, &out), BlockCheck::kLayout);
  BlockExpectation other_parent = Expect(256);
  other_parent.parent = &kHash;
  EXPECT_EQ(CheckBlockValue(good, other_parent, &header, &out), BlockCheck::kHash);
  std::string bad_payload = good;
  bad_payload.back() = static_cast<char>(bad_payload.back() ^ 1);
  EXPECT_EQ(CheckBlockValue(bad_payload, Expect(256), &header, &out), BlockCheck::kChecksum);
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  EXPECT_EQ(CheckBlockValue(bad_magic, Expect(256), &header, &out), BlockCheck::kMagic);
}

}  // namespace
}  // namespace kvpool::tier
