// StampedLru (kvpool/internal/stamped_lru.h): the O(1) least-recently-used list of the window
// group's kept blocks and the cached state checkpoints, held to the ordered set of (stamp, id)
// it replaced, through random inserts, touches and erases.

#include "kvpool/internal/stamped_lru.h"

#include <iterator>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::internal {
namespace {

using Entry = std::pair<uint64_t, BlockId>;

std::vector<Entry> Listed(const StampedLru<BlockId>& lru) {
  std::vector<Entry> out;
  for (const auto& [stamp, id] : lru) out.emplace_back(stamp, id);
  return out;
}

TEST(StampedLruTest, KeepsLeastRecentlyUsedFirst) {
  StampedLru<BlockId> lru;
  lru.Reset(4);
  EXPECT_TRUE(lru.empty());
  lru.insert({1, BlockId(2)});
  lru.insert({2, BlockId(0)});
  lru.insert({3, BlockId(3)});
  lru.erase({1, BlockId(2)});  // the front
  lru.erase({3, BlockId(3)});  // the back
  lru.insert({4, BlockId(2)});
  EXPECT_EQ(Listed(lru), (std::vector<Entry>{{2, BlockId(0)}, {4, BlockId(2)}}));
  EXPECT_EQ(lru.size(), 2u);
  EXPECT_TRUE(lru.CheckOrder());
  lru.Reset(4);
  EXPECT_TRUE(lru.empty());
  EXPECT_TRUE(Listed(lru).empty());
}

TEST(StampedLruTest, MatchesTheOrderedSetItReplaced) {
  constexpr int32_t kIds = 64;
  std::mt19937 rng(7);
  StampedLru<BlockId> lru;
  lru.Reset(kIds);
  std::set<Entry> reference;
  std::vector<uint64_t> stamp_of(kIds, 0);  // 0: not held
  uint64_t clock = 0;
  for (int op = 0; op < 20000; ++op) {
    const int32_t id = static_cast<int32_t>(rng() % kIds);
    const bool held = stamp_of[static_cast<size_t>(id)] != 0;
    const int what = static_cast<int>(rng() % 3);
    if (held) {  // erase, or touch (erase, then insert anew)
      lru.erase({stamp_of[static_cast<size_t>(id)], BlockId(id)});
      reference.erase({stamp_of[static_cast<size_t>(id)], BlockId(id)});
      stamp_of[static_cast<size_t>(id)] = 0;
    }
    if (!held || what != 0) {
      lru.insert({++clock, BlockId(id)});
      reference.insert({clock, BlockId(id)});
      stamp_of[static_cast<size_t>(id)] = clock;
    }
    ASSERT_EQ(lru.size(), reference.size());
    if (op % 97 == 0) {
      ASSERT_TRUE(lru.CheckOrder());
      ASSERT_EQ(Listed(lru), std::vector<Entry>(reference.begin(), reference.end()));
    }
  }
}

}  // namespace
}  // namespace kvpool::internal
