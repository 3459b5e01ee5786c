// EventLog: a replay ring bounded in events and in bytes; readers that fell behind are told.

#include "kvpool/kv_events.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

KvEvent Stored(size_t blocks, int32_t block_size = 16) {
  KvEvent e{.type = KvEventType::kBlockStored, .ns = NamespaceId(1), .block_size = block_size};
  e.block_hashes.assign(blocks, BlockHash{1, 2});
  e.token_ids.assign(blocks * static_cast<size_t>(block_size), 7);
  return e;
}

TEST(EventLogTest, EventBytesCountThePayload) {
  EXPECT_EQ(EventBytes(KvEvent{}), sizeof(KvEvent));
  EXPECT_EQ(EventBytes(Stored(4)), sizeof(KvEvent) + 4 * sizeof(BlockHash) + 64 * sizeof(int32_t));
}

// One event can carry a whole chain: 4096 blocks of 16 tokens is 320 KiB. A flood of them stays
// within the byte budget however many the event bound would allow.
TEST(EventLogTest, AFloodOfHugeEventsStaysWithinTheByteBudget) {
  const size_t one = EventBytes(Stored(4096));
  const size_t budget = 10 * one + one / 2;
  EventLog log(/*epoch=*/7, /*capacity=*/65536, budget);
  std::vector<KvEvent> out;
  uint64_t reader = 1;  // a consumer keeping up: reads after each append
  for (int i = 0; i < 200; ++i) {
    log.Append(Stored(4096));
    ASSERT_LE(log.bytes(), budget);
    ASSERT_TRUE(log.ReadFrom(reader, 1000, &out));
    reader = log.next_seq();
  }
  EXPECT_EQ(log.size(), 10u);
  EXPECT_EQ(log.bytes(), 10 * one);
  EXPECT_EQ(log.dropped(), 190u);
  EXPECT_EQ(log.oldest_seq(), 191u);
  EXPECT_EQ(out.size(), 200u);  // the reader that kept up missed nothing
  EXPECT_EQ(out.back().seq, 200u);
  EXPECT_EQ(out.back().epoch, 7u);
  // One that fell behind is told, exactly as past the event bound: no events, take a snapshot.
  out.clear();
  EXPECT_FALSE(log.ReadFrom(190, 1000, &out));
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(log.ReadFrom(191, 1000, &out));
  EXPECT_EQ(out.size(), 10u);
  // Small events fill the ring again up to the event bound.
  for (int i = 0; i < 100; ++i) log.Append(KvEvent{.type = KvEventType::kAllBlocksCleared});
  EXPECT_LE(log.bytes(), budget);
  EXPECT_EQ(log.next_seq(), 301u);
}

TEST(EventLogTest, AnEventOverTheWholeBudgetIsDroppedAndReadersAreTold) {
  EventLog log(1, 16, /*max_bytes=*/EventBytes(Stored(1)));
  log.Append(Stored(1));
  log.Append(Stored(2));  // alone over the budget: the ring empties
  EXPECT_EQ(log.size(), 0u);
  EXPECT_EQ(log.bytes(), 0u);
  EXPECT_EQ(log.next_seq(), 3u);
  std::vector<KvEvent> out;
  EXPECT_FALSE(log.ReadFrom(2, 10, &out));
  EXPECT_TRUE(log.ReadFrom(3, 10, &out));  // caught up: nothing to read yet
  EXPECT_TRUE(out.empty());
}

TEST(EventLogTest, TheEventBoundStillHolds) {
  EventLog log(1, 3);
  for (int i = 0; i < 5; ++i) log.Append(Stored(1));
  EXPECT_EQ(log.size(), 3u);
  EXPECT_EQ(log.oldest_seq(), 3u);
  EXPECT_EQ(log.dropped(), 2u);
  EXPECT_EQ(log.max_bytes(), kDefaultEventLogBytes);
}

TEST(EventLogTest, LoweringTheBudgetDropsTheOldestAtOnce) {
  EventLog log(1, 16);
  for (int i = 0; i < 4; ++i) log.Append(Stored(8));
  log.set_max_bytes(2 * EventBytes(Stored(8)));
  EXPECT_EQ(log.size(), 2u);
  EXPECT_EQ(log.oldest_seq(), 3u);
}

}  // namespace
}  // namespace kvpool
