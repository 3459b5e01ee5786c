#include "kvpool/internal/greedy_dual.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::internal {
namespace {

using Order = GreedyDualOrder<int>;

std::vector<int> Ids(const Order& order) {
  std::vector<int> out;
  for (const Order::Key& k : order) out.push_back(k.id);
  return out;
}

TEST(GreedyDualOrderTest, WithEveryCostZeroItIsLeastRecentlyUsed) {
  Order order;
  std::map<int, Order::Key> keys;
  for (int id = 0; id < 4; ++id) keys[id] = order.Insert(id, 0);
  keys[1] = order.Touch(keys[1], 0);
  EXPECT_EQ(Ids(order), (std::vector<int>{0, 2, 3, 1}));
  EXPECT_FALSE(order.Evict(keys[0]));
  EXPECT_EQ(order.floor(), 0u);
  EXPECT_EQ(Ids(order), (std::vector<int>{2, 3, 1}));
}

TEST(GreedyDualOrderTest, TheCheapestGoesFirstAndEachVictimAgesTheRest) {
  Order order;
  const Order::Key deep = order.Insert(1, 100);
  Order::Key shallow = order.Insert(2, 10);
  shallow = order.Touch(shallow, 10);  // used last, still worth less
  EXPECT_EQ(Ids(order), (std::vector<int>{2, 1}));
  EXPECT_FALSE(order.Evict(shallow));
  EXPECT_EQ(order.floor(), 10u);
  // Kept now, a new one worth 10 starts from the floor: 20, still below the deep one's 100.
  Order::Key next = order.Insert(3, 10);
  EXPECT_EQ(next.priority, 20u);
  // Nine more victims worth 10 each bring the floor to 100: then the deep one, older, goes first.
  for (int i = 0; i < 8; ++i) {
    EXPECT_FALSE(order.Evict(next));
    next = order.Insert(4 + i, 10);
  }
  EXPECT_EQ(order.floor(), 90u);
  EXPECT_EQ(next.priority, 100u);
  EXPECT_EQ(order.begin()->id, 1);
  EXPECT_EQ(deep.priority, 100u);
}

TEST(GreedyDualOrderTest, PrioritiesAreRebasedBeforeTheFloorCanWrap) {
  Order order(/*rebase_at=*/1000);
  Order::Key a = order.Insert(1, 600);
  const Order::Key b = order.Insert(2, 900);
  Order::Key c = order.Insert(3, 700);
  EXPECT_FALSE(order.Evict(a));  // floor 600
  c = order.Touch(c, 700);       // 1300
  a = order.Insert(1, 100);      // 700
  EXPECT_EQ(Ids(order), (std::vector<int>{1, 2, 3}));
  EXPECT_FALSE(order.Evict(a));               // floor 700
  EXPECT_FALSE(order.Evict(b));               // floor 900
  const Order::Key d = order.Insert(4, 200);  // 1100
  EXPECT_TRUE(order.Evict(d));                // floor 1100: rebased
  EXPECT_EQ(order.floor(), 0u);
  EXPECT_EQ(order.rebases(), 1u);
  ASSERT_EQ(order.size(), 1u);
  EXPECT_EQ(order.begin()->id, 3);
  EXPECT_EQ(order.begin()->priority, 200u);  // 1300 - 1100: what it was worth over the floor
  EXPECT_EQ(order.Insert(5, 100).priority, 100u);
  EXPECT_EQ(Ids(order), (std::vector<int>{5, 3}));
}

// Random inserts, touches, erases and evictions (of the first, or of one further on, as a caller
// that skips ids it may not evict does) against a model that recomputes every priority.
TEST(GreedyDualOrderTest, RandomOperationsAgreeWithTheModel) {
  for (const uint64_t rebase_at : {uint64_t{1} << 62, uint64_t{5000}}) {
    Order order(rebase_at);
    std::mt19937 rng(5);
    struct Held {
      uint64_t priority;
      uint64_t stamp;
      Order::Key key;
    };
    std::map<int, Held> model;
    uint64_t floor = 0, clock = 0, rebases = 0;
    for (int step = 0; step < 20000; ++step) {
      const int id = static_cast<int>(rng() % 64);
      const uint64_t cost = rng() % 4 == 0 ? 0 : rng() % 1000;
      const auto it = model.find(id);
      const int dice = static_cast<int>(rng() % 10);
      if (it == model.end()) {
        const Order::Key key = order.Insert(id, cost);
        model[id] = {floor + cost, ++clock, key};
      } else if (dice < 4) {
        it->second = {floor + cost, ++clock, order.Touch(it->second.key, cost)};
      } else if (dice < 5) {
        order.Erase(it->second.key);
        model.erase(it);
      } else {
        // The victim: the k-th in order (a caller skips the ones it may not take).
        std::vector<std::pair<std::pair<uint64_t, uint64_t>, int>> sorted;
        for (const auto& [i, h] : model) sorted.push_back({{h.priority, h.stamp}, i});
        std::sort(sorted.begin(), sorted.end());
        const int victim = sorted[std::min<size_t>(rng() % 3, sorted.size() - 1)].second;
        const Held h = model.at(victim);
        model.erase(victim);
        floor = std::max(floor, h.priority);
        const bool rebased = order.Evict(h.key);
        ASSERT_EQ(rebased, floor >= rebase_at) << step;
        if (rebased) {
          for (auto& [i, m] : model) m.priority -= std::min(m.priority, floor);
          floor = 0;
          ++rebases;
          for (const Order::Key& k : order) model.at(k.id).key = k;
        }
      }
      ASSERT_EQ(order.floor(), floor) << step;
      ASSERT_EQ(order.size(), model.size()) << step;
      uint64_t last_priority = 0, last_stamp = 0;
      for (const Order::Key& k : order) {
        const Held& h = model.at(k.id);
        ASSERT_EQ(k.priority, h.priority) << step;
        ASSERT_TRUE(std::pair(k.priority, k.stamp) > std::pair(last_priority, last_stamp));
        last_priority = k.priority;
        last_stamp = k.stamp;
      }
    }
    EXPECT_EQ(order.rebases(), rebases);
    if (rebase_at == 5000) {
      EXPECT_GT(rebases, 10u);
    }
  }
}

}  // namespace
}  // namespace kvpool::internal
