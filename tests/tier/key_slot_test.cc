#include "tier/key_slot.h"

#include "gtest/gtest.h"

namespace kvpool::tier {
namespace {

TEST(KeySlotTest, Crc16MatchesTheClusterSpecVector) {
  EXPECT_EQ(Crc16("123456789"), 0x31C3);  // the reference value in the cluster specification
  EXPECT_EQ(Crc16(""), 0);
  EXPECT_EQ(KeySlot("123456789"), 0x31C3 & 16383);
}

TEST(KeySlotTest, KnownSlotsOfPlainKeys) {
  // Values from `CLUSTER KEYSLOT` on Redis 7 (cluster_test.cc also checks random keys live).
  EXPECT_EQ(KeySlot("foo"), 12182);
  EXPECT_EQ(KeySlot("bar"), 5061);
  EXPECT_EQ(KeySlot("hello"), 866);
}

TEST(KeySlotTest, HashTagRules) {
  // The first {...} with something inside is hashed.
  EXPECT_EQ(HashTag("{user1000}.following"), "user1000");
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("{user1000}.followers"));
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  // Only the first '{' counts, and the first '}' after it.
  EXPECT_EQ(HashTag("foo{{bar}}zap"), "{bar");
  EXPECT_EQ(HashTag("foo{bar}{zap}"), "bar");
  // An empty tag or an unclosed brace hashes the whole key.
  EXPECT_EQ(HashTag("foo{}{bar}"), "foo{}{bar}");
  EXPECT_EQ(HashTag("foo{bar"), "foo{bar");
  EXPECT_EQ(HashTag("}foo{"), "}foo{");
  EXPECT_EQ(HashTag("nobraces"), "nobraces");
}

TEST(KeySlotTest, SlotsStayInRange) {
  for (int i = 0; i < 10000; ++i) {
    const int slot = KeySlot("key:" + std::to_string(i));
    ASSERT_GE(slot, 0);
    ASSERT_LT(slot, kNumClusterSlots);
  }
}

}  // namespace
}  // namespace kvpool::tier
