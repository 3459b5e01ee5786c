// The Redis tier's keys and values (tier/block_codec.h): keys are keyed MACs that keep each
// KeySlotting's slot sharing; values are authenticated by a Poly1305 tag under a one-time key,
// bound to the key they are stored under, and every byte of them counts.

#include "tier/block_codec.h"

#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tier/key_slot.h"

namespace kvpool::tier {
namespace {

constexpr BlockSpace kSpace{.ns = NamespaceId(0x1234), .layout_fingerprint = 0xabcdef};
constexpr BlockHash kHash{.lo = 0x1111, .hi = 0x2222};
constexpr BlockHash kParent{.lo = 0x3333, .hi = 0x4444};
constexpr ValueNonce kNonce = {100, 101, 102, 103, 104, 105, 106, 107,
                               108, 109, 110, 111, 112, 113, 114, 115};

std::string Bytes0To31() {
  std::string key;
  for (int i = 0; i < 32; ++i) key.push_back(static_cast<char>(i));
  return key;
}

const DeploymentSecret& Secret() {
  static const DeploymentSecret* secret =
      new DeploymentSecret(DeploymentSecret::FromBytes(Bytes0To31()));
  return *secret;
}

std::string Key() { return BlockKey(Secret(), kSpace, kHash, KeySlotting::kNamespace); }

std::vector<std::byte> Payload(size_t n) {
  std::vector<std::byte> bytes(n);
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<std::byte>(i * 31 + 7);
  return bytes;
}

std::string Encode(const std::vector<std::byte>& payload, const std::string& key = Key(),
                   const DeploymentSecret& secret = Secret()) {
  std::string value;
  EncodeBlockValue(secret, key, kNonce,
                   {.layout_fingerprint = kSpace.layout_fingerprint,
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

BlockCheck Check(std::string_view value, const BlockExpectation& expect,
                 const std::string& key = Key(), const DeploymentSecret& secret = Secret()) {
  BlockHeader header;
  std::span<const std::byte> out;
  return CheckBlockValue(secret, key, value, expect, &header, &out);
}

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (char c : bytes) {
    out.push_back(kDigits[static_cast<uint8_t>(c) >> 4]);
    out.push_back(kDigits[static_cast<uint8_t>(c) & 15]);
  }
  return out;
}

// Expected keys and tag from Python (hmac, hashlib and cryptography's Poly1305) over the
// construction block_codec.h writes down, so the comment and the code cannot drift apart.
TEST(BlockCodecTest, KeysAndTagAreTheDocumentedConstruction) {
  EXPECT_EQ(BlockKey(Secret(), kSpace, kHash, KeySlotting::kNamespace),
            "kvp2:{01a26d9d49c5ae7a}:565ac22f61b5224d9e296c086c933826");
  EXPECT_EQ(BlockKey(Secret(), kSpace, kHash, KeySlotting::kBlock),
            "kvp2:01a26d9d49c5ae7a:{565ac22f61b5224d9e296c086c933826}");
  const std::string value = Encode(Payload(8));
  ASSERT_EQ(value.size(), static_cast<size_t>(kBlockHeaderBytes) + 8);
  EXPECT_EQ(Hex(std::string_view(value).substr(kBlockTagOffset, 16)),
            "f8c737dfb6f560f323eaf6ab2e9dbbb1");
}

// Format 1 keys were `kvp1:{<namespace>}:<layout>:<hash>`: anyone could name any tenant's key.
TEST(BlockCodecTest, KeysRevealNothingAndDependOnTheSecret) {
  const std::string key = BlockKey(Secret(), kSpace, kHash, KeySlotting::kNamespace);
  EXPECT_THAT(key, ::testing::MatchesRegex("kvp2:\\{[0-9a-f]{16}\\}:[0-9a-f]{32}"));
  EXPECT_THAT(BlockKey(Secret(), kSpace, kHash, KeySlotting::kBlock),
              ::testing::MatchesRegex("kvp2:[0-9a-f]{16}:\\{[0-9a-f]{32}\\}"));
  for (const char* plain : {"1234", "abcdef", "1111", "2222"}) {
    EXPECT_THAT(key, ::testing::Not(::testing::HasSubstr(plain)));
  }
  const DeploymentSecret other = DeploymentSecret::FromBytes("another secret, 32 bytes or more");
  for (KeySlotting slotting : {KeySlotting::kNamespace, KeySlotting::kBlock}) {
    const std::string mine = BlockKey(Secret(), kSpace, kHash, slotting);
    const std::string theirs = BlockKey(other, kSpace, kHash, slotting);
    EXPECT_NE(mine, theirs);
    EXPECT_NE(HashTag(mine), HashTag(theirs));
  }
  // Each input changes the key.
  const BlockSpace other_ns{.ns = NamespaceId(0x1235), .layout_fingerprint = 0xabcdef};
  const BlockSpace other_layout{.ns = kSpace.ns, .layout_fingerprint = 0xabcdee};
  const std::set<std::string> keys = {
      key, BlockKey(Secret(), other_ns, kHash, KeySlotting::kNamespace),
      BlockKey(Secret(), other_layout, kHash, KeySlotting::kNamespace),
      BlockKey(Secret(), kSpace, kParent, KeySlotting::kNamespace)};
  EXPECT_EQ(keys.size(), 4u);
}

TEST(BlockCodecTest, NamespaceSlottingSharesASlotAndBlockSlottingSpreads) {
  const SpaceKeys by_space(Secret(), kSpace, KeySlotting::kNamespace);
  const SpaceKeys by_block(Secret(), kSpace, KeySlotting::kBlock);
  std::set<int> space_slots, block_slots;
  for (uint64_t i = 0; i < 64; ++i) {
    const BlockHash hash{.lo = i, .hi = ~i};
    space_slots.insert(KeySlot(by_space.Key(hash)));
    block_slots.insert(KeySlot(by_block.Key(hash)));
    EXPECT_EQ(by_space.Key(hash), BlockKey(Secret(), kSpace, hash, KeySlotting::kNamespace));
  }
  EXPECT_EQ(space_slots.size(), 1u);
  EXPECT_GT(block_slots.size(), 32u);  // 64 keys over 16384 slots: almost surely all distinct
}

TEST(BlockCodecTest, RoundTripGivesHeaderAndPayloadBack) {
  const std::vector<std::byte> payload = Payload(4096);
  const std::string value = Encode(payload);
  ASSERT_EQ(value.size(), kBlockHeaderBytes + payload.size());
  BlockHeader header;
  std::span<const std::byte> out;
  ASSERT_EQ(CheckBlockValue(Secret(), Key(), value, Expect(4096), &header, &out), BlockCheck::kOk);
  EXPECT_EQ(header.coverage, 16u);
  EXPECT_EQ(header.parent, kParent);
  EXPECT_EQ(header.hash, kHash);
  EXPECT_EQ(header.payload_bytes, 4096);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), payload.begin(), payload.end()));
}

// Format 1 left coverage and the reserved word (bytes 48..55) unchecked; now every byte counts.
TEST(BlockCodecTest, EveryFlippedByteIsRefused) {
  const std::string good = Encode(Payload(512));
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x40);
    EXPECT_NE(Check(bad, Expect(512)), BlockCheck::kOk) << "byte " << i;
  }
}

TEST(BlockCodecTest, AValueIsBoundToItsKeyAndSecret) {
  const std::string value = Encode(Payload(256));
  ASSERT_EQ(Check(value, Expect(256)), BlockCheck::kOk);
  // Under another key (another block's, another namespace's: same header, same hashes).
  const BlockSpace other_ns{.ns = NamespaceId(0x1235), .layout_fingerprint = 0xabcdef};
  EXPECT_EQ(Check(value, Expect(256), BlockKey(Secret(), other_ns, kHash, KeySlotting::kNamespace)),
            BlockCheck::kMac);
  EXPECT_EQ(Check(value, Expect(256), BlockKey(Secret(), kSpace, kHash, KeySlotting::kBlock)),
            BlockCheck::kMac);
  // Checked by a daemon with another secret, or made by a writer with another secret.
  const DeploymentSecret other = DeploymentSecret::FromBytes("another secret, 32 bytes or more");
  EXPECT_EQ(Check(value, Expect(256), Key(), other), BlockCheck::kMac);
  EXPECT_EQ(Check(Encode(Payload(256), Key(), other), Expect(256)), BlockCheck::kMac);
  // Two encodings of the same block under fresh nonces differ, and both verify.
  std::string fresh;
  EncodeBlockValue(Secret(), Key(), RandomValueNonce(),
                   {.layout_fingerprint = kSpace.layout_fingerprint,
                    .hash = kHash,
                    .parent = kParent,
                    .coverage = 16},
                   Payload(256), &fresh);
  EXPECT_NE(fresh, value);
  EXPECT_EQ(Check(fresh, Expect(256)), BlockCheck::kOk);
}

TEST(BlockCodecTest, NamesTheReasonForARefusal) {
  const std::string good = Encode(Payload(256));
  EXPECT_EQ(Check(good.substr(0, 10), Expect(256)), BlockCheck::kShort);
  EXPECT_EQ(Check(good.substr(0, 200), Expect(256)), BlockCheck::kLength);
  EXPECT_EQ(Check(good, Expect(128)), BlockCheck::kLength);
  BlockExpectation other_layout = Expect(256);
  other_layout.layout_fingerprint = 1;
  EXPECT_EQ(Check(good, other_layout), BlockCheck::kLayout);
  BlockExpectation other_parent = Expect(256);
  other_parent.parent = &kHash;
  EXPECT_EQ(Check(good, other_parent), BlockCheck::kHash);
  std::string bad_payload = good;
  bad_payload.back() = static_cast<char>(bad_payload.back() ^ 1);
  EXPECT_EQ(Check(bad_payload, Expect(256)), BlockCheck::kMac);
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  EXPECT_EQ(Check(bad_magic, Expect(256)), BlockCheck::kMagic);
  // A format 1 value (version 1, 72-byte header) is not read.
  std::string version_one = good;
  version_one[4] = 1;
  version_one[6] = 72;
  EXPECT_EQ(Check(version_one, Expect(256)), BlockCheck::kMagic);
}

}  // namespace
}  // namespace kvpool::tier
