// The Redis tier's write budget against a real redis-server with a memory limit (label
// `integration`): Redis evicts by its own LRU and cannot tell tenants apart, so without a budget
// a tenant that floods the tier pushes out a quiet tenant's prefix; with one, the flood is cut at
// its share and the quiet prefix stays.

#include <hiredis/hiredis.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/tier/redis_store_fixture.h"
#include "tier/internal/redis_memory.h"

namespace kvpool::tier {
namespace {

using testing::kBlockBytes;
using testing::LookupBuffers;
using testing::MakeChain;
using testing::RedisServer;
using testing::RedisStoreTest;
using testing::TestChain;

constexpr NamespaceTags kQuiet{.tenant = 0x9e1e7, .model = 1};
constexpr NamespaceTags kFlood{.tenant = 0xf100d, .model = 1};
constexpr BlockSpace kQuietSpace{.ns = NamespaceId(1), .layout_fingerprint = 0x5eed};
constexpr BlockSpace kFloodSpace{.ns = NamespaceId(2), .layout_fingerprint = 0x5eed};
constexpr int64_t kTtlSeconds = 3600;
constexpr int kQuietBlocks = 8;
// 16 MiB of values through a server that keeps 4 MiB: Redis must evict about 3 of every 4.
constexpr int kFloodBlocks = 4096;

class RedisBudgetTest : public RedisStoreTest {
 protected:
  RedisServer::Options ServerOptions() const override {
    // A tight LRU (10 samples): without a budget, what is evicted is the oldest.
    return {.unix_socket = true,
            .extra_args = {"--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru",
                           "--maxmemory-samples", "10"}};
  }

  RedisTierOptions Options(int64_t budget) const {
    RedisTierOptions options = server_->TierOptions();
    options.ttl_seconds = kTtlSeconds;
    options.tenant_write_budget_bytes = budget;
    return options;
  }

  // The quiet tenant's prefix, then the flood in queue-sized rounds (each drained before the
  // next, so no write is dropped for a full queue); returns the quiet prefix's hits afterwards.
  int64_t QuietHitsAfterAFlood(RedisBlockStore& store, const TestChain& quiet) {
    EXPECT_TRUE(store.SetTenantWeight(kQuiet.tenant, 1).ok());
    EXPECT_TRUE(store.SetTenantWeight(kFlood.tenant, 1).ok());
    EXPECT_EQ(quiet.Put(store, kQuiet), kQuietBlocks);
    EXPECT_TRUE(store.Flush(absl::Seconds(30)).ok());
    for (int round = 0; round < kFloodBlocks / 256; ++round) {
      const TestChain flood = MakeChain(kFloodSpace, 256, kBlockBytes, 1000 + round);
      flood.Put(store, kFlood);
      EXPECT_TRUE(store.Flush(absl::Seconds(30)).ok());
    }
    EXPECT_EQ(store.stats().dropped_queue_full, 0u);
    EXPECT_TRUE(store.CheckInvariants().ok()) << store.CheckInvariants();
    LookupBuffers out(kQuietBlocks, kBlockBytes);
    return LookupAll(store, quiet, &out, kQuietSpace);
  }

  // A field of INFO `section` (e.g. evicted_keys of "stats"), or -1.
  int64_t Info(const std::string& section, const std::string& field) const {
    auto info = server_->Command({"INFO", section});
    if (!info.ok() || (*info)->type != REDIS_REPLY_STRING) return -1;
    const std::string text((*info)->str, (*info)->len);
    const size_t at = text.find("\n" + field + ":");
    return at == std::string::npos ? -1 : std::stoll(text.substr(at + field.size() + 2));
  }
  // Keys Redis evicted for memory, or -1.
  int64_t EvictedKeys() const { return Info("stats", "evicted_keys"); }
};

TEST_F(RedisBudgetTest, WithoutABudgetAFloodingTenantEvictsAnothersPrefix) {
  auto store = NewStore(Options(0));
  const TestChain quiet = MakeChain(kQuietSpace, kQuietBlocks, kBlockBytes, 7);
  EXPECT_LT(QuietHitsAfterAFlood(*store, quiet), kQuietBlocks);
  EXPECT_EQ(store->stats().dropped_over_budget, 0u);
  EXPECT_GT(EvictedKeys(), kFloodBlocks / 2);
}

TEST_F(RedisBudgetTest, ABudgetKeepsTheFloodToItsShareAndTheQuietPrefixInRedis) {
  // 2 MiB for both tenants, below what the server holds: each may have 1 MiB live.
  constexpr int64_t kBudget = 2 << 20;
  auto store = NewStore(Options(kBudget));
  const TestChain quiet = MakeChain(kQuietSpace, kQuietBlocks, kBlockBytes, 7);
  EXPECT_EQ(QuietHitsAfterAFlood(*store, quiet), kQuietBlocks);

  const RemoteTierStats stats = store->stats();
  EXPECT_GT(stats.dropped_over_budget, 0u);
  const TenantWrites flood = store->WritesOf(kFlood.tenant);
  EXPECT_EQ(flood.budget_bytes, kBudget / 2);
  EXPECT_LE(flood.live_bytes, flood.budget_bytes);
  EXPECT_GT(flood.live_bytes, flood.budget_bytes - 2 * kBlockBytes);  // it used its share
  EXPECT_EQ(flood.over_budget, stats.dropped_over_budget);
  // The quiet tenant's bytes: what Redis spends on its 8 keys (this server's MEMORY USAGE agrees
  // with the model: ABudgetCountsWhatRedisSpendsOnEachKey).
  const TenantWrites mine = store->WritesOf(kQuiet.tenant);
  int64_t quiet_bytes = 0;
  for (int i = 0; i < kQuietBlocks; ++i) {
    quiet_bytes +=
        internal::ModeledEntryBytes(static_cast<int64_t>(KeyOf(quiet, i).size()),
                                    static_cast<int64_t>(ValueAt(KeyOf(quiet, i)).size()));
  }
  EXPECT_EQ(mine.live_bytes, quiet_bytes);
  EXPECT_EQ(mine.over_budget, 0u);
  // Writing the prefix again finds it there: nothing more counts.
  EXPECT_EQ(quiet.Put(*store, kQuiet), kQuietBlocks);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(store->WritesOf(kQuiet.tenant).live_bytes, quiet_bytes);
  EXPECT_EQ(EvictedKeys(), 0);  // Redis never had to

  // A TTL later (on the store's clock) the flood's bytes have aged out of the window: it writes
  // again.
  clock_.Advance((kTtlSeconds + kTtlSeconds / 16) * 1'000'000'000);
  EXPECT_EQ(store->WritesOf(kFlood.tenant).live_bytes, 0);
  const TestChain later = MakeChain(kFloodSpace, 4, kBlockBytes, 99);
  EXPECT_EQ(later.Put(*store, kFlood), 4);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

// The budget counts what Redis spends on a key, not the bytes sent: jemalloc rounds a value up to
// its size class (a 4,192-byte value takes 5,120), and each key adds its name, object, and the
// entries of the keyspace and expires tables. A budget of 90 % of the room the server has left,
// all of it to one tenant, never makes Redis evict; counting the bytes sent instead writes about
// 1.25 times the budget, past maxmemory.
TEST_F(RedisBudgetTest, ABudgetCountsWhatRedisSpendsOnEachKey) {
  const int64_t maxmemory = Info("memory", "maxmemory");
  const int64_t used = Info("memory", "used_memory");
  ASSERT_GT(maxmemory, used);
  const int64_t budget = (maxmemory - used) * 9 / 10;
  RedisTierOptions options = Options(budget);
  options.write_batch_blocks = 4;  // small query buffers: the room is for the values
  auto store = NewStore(options);
  for (int round = 0; round < 32; ++round) {
    MakeChain(kFloodSpace, 64, kBlockBytes, 2000 + round).Put(*store, kFlood);
    ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  }
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.dropped_queue_full, 0u);
  EXPECT_GT(stats.dropped_over_budget, 0u);  // the budget, not the server, stopped it
  EXPECT_EQ(EvictedKeys(), 0) << stats.written << " values written, used_memory "
                              << Info("memory", "used_memory") << " of " << maxmemory;
  // It was held to the budget, counted as Redis counts: MEMORY USAGE of a key, with what that
  // leaves out (the expires entry, the tables' slots), is what the model says. (used_memory also
  // moves with the clients' query buffers, up to a write batch per connection, so it is not
  // compared key by key.)
  const TenantWrites flood = store->WritesOf(kFlood.tenant);
  EXPECT_LE(flood.live_bytes, budget);
  EXPECT_GT(flood.live_bytes, budget - 2 * kBlockBytes);
  const TestChain probe = MakeChain(kFloodSpace, 1, kBlockBytes, 2000);
  const std::string key = KeyOf(probe, 0);
  auto usage = server_->Command({"MEMORY", "USAGE", key});
  ASSERT_TRUE(usage.ok() && (*usage)->type == REDIS_REPLY_INTEGER);
  EXPECT_EQ((*usage)->integer + internal::kRedisUnreportedPerKeyBytes,
            internal::ModeledEntryBytes(static_cast<int64_t>(key.size()),
                                        static_cast<int64_t>(ValueAt(key).size())));
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

// Puts race each other and the writer between the budget's reservation and the queue (Put's lock
// gap): a reservation whose block then finds the queue full is given back. Held open here: the
// gap of one Put puts another block, which takes the queue's only room (the server paused, so
// the writer cannot finish it). Then four threads at once. Every time, once the queue is drained,
// the tenant's live bytes are exactly what Redis stored for it.
TEST_F(RedisBudgetTest, PutsRacingInTheLockGapSettleEveryReservation) {
  const TestChain chain = MakeChain(kFloodSpace, 2, 512, 500);
  const int64_t value_bytes = kBlockHeaderBytes + 512;
  const int64_t item =
      internal::ModeledEntryBytes(static_cast<int64_t>(KeyOf(chain, 0).size()), value_bytes);
  RedisBlockStore* store_in_gap = nullptr;
  bool armed = true;
  RedisTierOptions options = Options(int64_t{1} << 30);
  options.write_queue_blocks = 1;
  options.write_queue_bytes = value_bytes;
  options.put_gap_hook = [&] {
    if (!armed) return;
    armed = false;
    EXPECT_TRUE(store_in_gap->Put(chain.space, {.hash = chain.hashes[1],
                                                .parent = chain.hashes[0],
                                                .coverage = 16,
                                                .bytes = chain.blocks[1],
                                                .tags = kFlood}));
  };
  auto store = NewStore(options);
  store_in_gap = store.get();
  server_->Pause();
  EXPECT_FALSE(store->Put(
      chain.space,
      {.hash = chain.hashes[0], .coverage = 16, .bytes = chain.blocks[0], .tags = kFlood}));
  server_->Resume();
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(store->stats().dropped_queue_full, 1u);
  EXPECT_EQ(store->WritesOf(kFlood.tenant).live_bytes,
            static_cast<int64_t>(store->stats().written) * item);
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();

  options.put_gap_hook = nullptr;
  options.write_queue_blocks = 8;
  options.write_queue_bytes = 8 * value_bytes;
  store = NewStore(options);
  std::vector<TestChain> chains;
  for (int t = 0; t < 4; ++t) chains.push_back(MakeChain(kFloodSpace, 200, 512, 600 + t));
  std::vector<std::thread> threads;
  for (const TestChain& c : chains) {
    threads.emplace_back([&store, &c] { c.Put(*store, kFlood); });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.written + stats.dropped_queue_full, 4u * 200);
  EXPECT_EQ(stats.dropped_over_budget, 0u);
  EXPECT_EQ(store->WritesOf(kFlood.tenant).live_bytes, static_cast<int64_t>(stats.written) * item);
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

TEST_F(RedisBudgetTest, ABudgetNeedsATtl) {
  RedisTierOptions options = Options(1 << 20);
  options.ttl_seconds = 0;
  auto store = RedisBlockStore::Create(options, secret_, &clock_);
  ASSERT_TRUE(absl::IsInvalidArgument(store.status())) << store.status();
  EXPECT_NE(store.status().message().find("ttl_seconds"), std::string::npos);
  options = Options(-1);
  EXPECT_TRUE(absl::IsInvalidArgument(RedisBlockStore::Create(options, secret_, &clock_).status()));
}

}  // namespace
}  // namespace kvpool::tier
