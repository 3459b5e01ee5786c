// RedisBlockStore against a three-node Redis Cluster the test starts (loopback ports chosen at
// run time, `redis-cli --cluster create`): round trips between two stores, the client's slot
// function against the server's, and slots moved while the stores run, by hand (MIGRATING /
// IMPORTING / MIGRATE / SETSLOT NODE: the ASK and then the MOVED path) and with
// `redis-cli --cluster reshard` under concurrent lookups.

#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/tier/redis_harness.h"
#include "tests/tier/test_chain.h"
#include "tier/key_slot.h"
#include "tier/redis_block_store.h"

namespace kvpool::tier {
namespace {

using testing::LookupBuffers;
using testing::MakeChain;
using testing::RedisServer;
using testing::TestChain;

constexpr int64_t kBlockBytes = 4096;

std::string Str(const RedisReply& reply) { return std::string(reply->str, reply->len); }

class RedisClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::RedisServerBinary().empty() || testing::RedisCliBinary().empty()) {
      GTEST_SKIP() << "redis-server / redis-cli are not installed";
    }
    auto dir = testing::TempDir::Create("kvpool-redis-cluster");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    auto cluster = testing::StartRedisCluster(dir_->path());
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  std::unique_ptr<RedisBlockStore> NewStore(KeySlotting slotting) {
    RedisTierOptions options;
    options.enabled = true;
    options.cluster_seeds = cluster_.Seeds();
    options.key_slotting = slotting;
    options.command_timeout = absl::Seconds(5);
    auto store = RedisBlockStore::Create(options, secret_);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  int64_t LookupAll(RedisBlockStore& store, const TestChain& chain, LookupBuffers* out) {
    auto result = store.Lookup(chain.space, BlockHash{}, chain.hashes, out->spans);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->hits : -1;
  }

  std::string NodeId(int node) {
    auto id = cluster_.nodes[node]->Command({"CLUSTER", "MYID"});
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? Str(*id) : "";
  }

  // The index of the node that owns `slot` now, per node 0's CLUSTER SLOTS.
  int OwnerOf(int slot) {
    auto slots = cluster_.nodes[0]->Command({"CLUSTER", "SLOTS"});
    EXPECT_TRUE(slots.ok()) << slots.status();
    if (!slots.ok()) return -1;
    for (size_t e = 0; e < (*slots)->elements; ++e) {
      const redisReply* range = (*slots)->element[e];
      if (slot < range->element[0]->integer || slot > range->element[1]->integer) continue;
      const long long port = range->element[2]->element[1]->integer;
      for (size_t n = 0; n < cluster_.nodes.size(); ++n) {
        if (cluster_.nodes[n]->port() == port) return static_cast<int>(n);
      }
    }
    return -1;
  }

  // MIGRATE `keys` from node `from` to node `to` (the slot must be MIGRATING / IMPORTING).
  void Migrate(int from, int to, const std::vector<std::string>& keys) {
    std::vector<std::string> args = {
        "MIGRATE", "127.0.0.1", absl::StrCat(cluster_.nodes[to]->port()), "", "0", "5000", "KEYS"};
    args.insert(args.end(), keys.begin(), keys.end());
    auto reply = cluster_.nodes[from]->Command(args);
    ASSERT_TRUE(reply.ok()) << reply.status();
  }

  const DeploymentSecret secret_ =
      DeploymentSecret::FromBytes("redis cluster test: the stores' shared secret");
  std::unique_ptr<testing::TempDir> dir_;
  testing::RedisCluster cluster_;
};

TEST_F(RedisClusterTest, KeySlotMatchesTheServers) {
  std::mt19937 rng(7);
  const std::string alphabet = "ab{}:xyz0123456789";
  for (int i = 0; i < 200; ++i) {
    std::string key;
    const int length = 1 + static_cast<int>(rng() % 20);
    for (int c = 0; c < length; ++c) key += alphabet[rng() % alphabet.size()];
    auto slot = cluster_.nodes[0]->Command({"CLUSTER", "KEYSLOT", key});
    ASSERT_TRUE(slot.ok()) << slot.status();
    EXPECT_EQ(KeySlot(key), (*slot)->integer) << key;
  }
  for (const char* key : {"foo", "bar", "hello", "123456789"}) {
    auto slot = cluster_.nodes[1]->Command({"CLUSTER", "KEYSLOT", key});
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(KeySlot(key), (*slot)->integer) << key;
  }
}

class RedisClusterRoundTripTest : public RedisClusterTest,
                                  public ::testing::WithParamInterface<KeySlotting> {};

TEST_P(RedisClusterRoundTripTest, WhatOneStoreWritesTheOtherReads) {
  auto a = NewStore(GetParam());
  auto b = NewStore(GetParam());
  const TestChain chain =
      MakeChain({.ns = NamespaceId(3), .layout_fingerprint = 9}, 32, kBlockBytes, 21);
  ASSERT_EQ(chain.Put(*a), 32);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(a->stats().written, 32u);
  LookupBuffers out(32, kBlockBytes);
  EXPECT_EQ(LookupAll(*b, chain, &out), 32);
  EXPECT_EQ(out.storage, chain.blocks);
  // Where the blocks went: one node for namespace slotting, several for block slotting.
  int nodes_with_keys = 0;
  for (const auto& node : cluster_.nodes) {
    auto size = node->Command({"DBSIZE"});
    ASSERT_TRUE(size.ok());
    nodes_with_keys += (*size)->integer > 0 ? 1 : 0;
  }
  EXPECT_EQ(nodes_with_keys, GetParam() == KeySlotting::kNamespace ? 1 : 3);
}

INSTANTIATE_TEST_SUITE_P(Slotting, RedisClusterRoundTripTest,
                         ::testing::Values(KeySlotting::kNamespace, KeySlotting::kBlock));

// Moves the namespace's slot from its node to another by hand, checking reads at each stage:
// half the keys moved (source answers ASK for those: ASKING + GET on the target), writes while
// the slot is migrating (SET NX on the source answers ASK for absent keys), then the slot
// handed over (MOVED, slot map refreshed).
TEST_F(RedisClusterTest, SlotMigrationFollowsAskThenMoved) {
  auto a = NewStore(KeySlotting::kNamespace);
  auto b = NewStore(KeySlotting::kNamespace);
  const BlockSpace space{.ns = NamespaceId(5), .layout_fingerprint = 9};
  const TestChain chain = MakeChain(space, 16, kBlockBytes, 31);
  ASSERT_EQ(chain.Put(*a), 16);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(16, kBlockBytes);
  ASSERT_EQ(LookupAll(*b, chain, &out), 16);

  std::vector<std::string> keys;
  for (const BlockHash& h : chain.hashes)
    keys.push_back(BlockKey(secret_, space, h, KeySlotting::kNamespace));
  const int slot = KeySlot(keys[0]);
  const int from = OwnerOf(slot);
  ASSERT_GE(from, 0);
  const int to = (from + 1) % 3;
  const std::string from_id = NodeId(from), to_id = NodeId(to);
  const std::string slot_arg = absl::StrCat(slot);
  ASSERT_TRUE(
      cluster_.nodes[to]->Command({"CLUSTER", "SETSLOT", slot_arg, "IMPORTING", from_id}).ok());
  ASSERT_TRUE(
      cluster_.nodes[from]->Command({"CLUSTER", "SETSLOT", slot_arg, "MIGRATING", to_id}).ok());
  Migrate(from, to, std::vector<std::string>(keys.begin(), keys.begin() + 8));

  // Half moved: the first 8 answer ASK, the rest are still served by the source.
  EXPECT_EQ(LookupAll(*b, chain, &out), 16);
  EXPECT_EQ(out.storage, chain.blocks);
  EXPECT_GE(b->client_stats().ask_redirects, 8u);
  // Written while migrating: absent on the source, so they land on the target through ASK.
  const TestChain during = MakeChain(space, 8, kBlockBytes, 32);
  ASSERT_EQ(during.Put(*a), 8);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(a->stats().written, 24u);
  EXPECT_GE(a->client_stats().ask_redirects, 8u);
  LookupBuffers out_during(8, kBlockBytes);
  EXPECT_EQ(LookupAll(*b, during, &out_during), 8);
  EXPECT_EQ(out_during.storage, during.blocks);

  // Move the rest and hand the slot over; every node learns the new owner.
  auto rest = cluster_.nodes[from]->Command({"CLUSTER", "GETKEYSINSLOT", slot_arg, "1000"});
  ASSERT_TRUE(rest.ok()) << rest.status();
  std::vector<std::string> rest_keys;
  for (size_t i = 0; i < (*rest)->elements; ++i) {
    rest_keys.emplace_back((*rest)->element[i]->str, (*rest)->element[i]->len);
  }
  ASSERT_EQ(rest_keys.size(), 8u);
  Migrate(from, to, rest_keys);
  for (int n : {to, from, 3 - to - from}) {
    ASSERT_TRUE(cluster_.nodes[n]->Command({"CLUSTER", "SETSLOT", slot_arg, "NODE", to_id}).ok());
  }
  const uint64_t moved_before = b->client_stats().moved_redirects;
  EXPECT_EQ(LookupAll(*b, chain, &out), 16);
  EXPECT_EQ(out.storage, chain.blocks);
  EXPECT_GT(b->client_stats().moved_redirects, moved_before);
  // The map was refreshed: the next lookup goes straight to the new owner.
  const RedisClientStats before = b->client_stats();
  EXPECT_EQ(LookupAll(*b, during, &out_during), 8);
  EXPECT_EQ(out_during.storage, during.blocks);
  const RedisClientStats after = b->client_stats();
  EXPECT_EQ(after.moved_redirects, before.moved_redirects);
  EXPECT_EQ(after.ask_redirects, before.ask_redirects);
  EXPECT_EQ(OwnerOf(slot), to);
  EXPECT_EQ(b->stats().corrupt, 0u);
}

// `redis-cli --cluster reshard` moves 2000 slots between nodes while a second thread keeps
// looking up (and a third keeps writing) blocks spread over every node: no lookup may return
// fewer blocks or different bytes, and every block written during the move is readable after.
TEST_F(RedisClusterTest, ReshardUnderConcurrentLookupsKeepsEveryReadCorrect) {
  auto a = NewStore(KeySlotting::kBlock);
  auto b = NewStore(KeySlotting::kBlock);
  const BlockSpace space{.ns = NamespaceId(6), .layout_fingerprint = 9};
  const TestChain chain = MakeChain(space, 64, kBlockBytes, 41);
  ASSERT_EQ(chain.Put(*a), 64);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());

  std::atomic<bool> done{false};
  std::atomic<int> lookups{0}, bad_lookups{0};
  std::thread reader([&] {
    LookupBuffers out(64, kBlockBytes);
    while (!done.load()) {
      auto result = b->Lookup(space, BlockHash{}, chain.hashes, out.spans);
      if (!result.ok() || result->hits != 64 || out.storage != chain.blocks) ++bad_lookups;
      ++lookups;
    }
  });
  const TestChain during = MakeChain(space, 64, kBlockBytes, 42);
  std::thread writer([&] {
    for (size_t i = 0; i < during.hashes.size() && !done.load(); ++i) {
      a->Put(space, {.hash = during.hashes[i],
                     .parent = i == 0 ? BlockHash{} : during.hashes[i - 1],
                     .coverage = 16,
                     .bytes = during.blocks[i]});
      std::this_thread::yield();
    }
  });
  auto reshard =
      testing::RunProgram({testing::RedisCliBinary(), "--cluster", "reshard",
                           cluster_.nodes[0]->address(), "--cluster-from", NodeId(0),
                           "--cluster-to", NodeId(1), "--cluster-slots", "2000", "--cluster-yes"});
  done = true;
  reader.join();
  writer.join();
  ASSERT_TRUE(reshard.ok()) << reshard.status();
  ASSERT_TRUE(testing::WaitClusterOk(cluster_).ok());
  EXPECT_GT(lookups.load(), 0);
  EXPECT_EQ(bad_lookups.load(), 0) << "of " << lookups.load();

  LookupBuffers out(64, kBlockBytes);
  EXPECT_EQ(LookupAll(*b, chain, &out), 64);
  EXPECT_EQ(out.storage, chain.blocks);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  const RemoteTierStats writes = a->stats();
  EXPECT_EQ(writes.dropped_write_errors, 0u);
  EXPECT_EQ(writes.dropped_queue_full, 0u);
  const auto put = static_cast<int64_t>(writes.written) - 64;  // blocks of `during` stored
  auto result = b->Lookup(space, BlockHash{}, during.hashes, out.spans);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->hits, put);
  const RemoteTierStats reads = b->stats();
  EXPECT_EQ(reads.corrupt, 0u);
  const RedisClientStats redirects = b->client_stats();
  EXPECT_GT(redirects.moved_redirects + redirects.ask_redirects, 0u);
}

// The node holding the namespace's slot is killed: lookups miss within the timeouts and the
// breaker opens; the node restarts with its nodes.conf (same id and slots, data gone): after the
// backoff the probe closes the breaker and new writes are read back.
TEST_F(RedisClusterTest, KilledNodeOpensTheBreakerAndItsRestartClosesIt) {
  ManualClock clock;
  RedisTierOptions options;
  options.enabled = true;
  options.cluster_seeds = cluster_.Seeds();
  options.connect_timeout = absl::Milliseconds(300);
  options.command_timeout = absl::Milliseconds(300);
  options.breaker_failure_threshold = 2;
  auto created = RedisBlockStore::Create(options, secret_, &clock);
  ASSERT_TRUE(created.ok()) << created.status();
  RedisBlockStore& store = **created;
  const BlockSpace space{.ns = NamespaceId(11), .layout_fingerprint = 9};
  const TestChain chain = MakeChain(space, 8, kBlockBytes, 51);
  ASSERT_EQ(chain.Put(store), 8);
  ASSERT_TRUE(store.Flush(absl::Seconds(30)).ok());
  LookupBuffers out(8, kBlockBytes);
  ASSERT_EQ(LookupAll(store, chain, &out), 8);

  const int owner =
      OwnerOf(KeySlot(BlockKey(secret_, space, chain.hashes[0], KeySlotting::kNamespace)));
  ASSERT_GE(owner, 0);
  cluster_.nodes[owner]->Kill();
  for (int i = 0; i < 4; ++i) {
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(LookupAll(store, chain, &out), 0) << i;
    // One round trip to the dead node plus a slot map refresh over the live ones, each bounded.
    EXPECT_LT(absl::FromChrono(std::chrono::steady_clock::now() - start), absl::Seconds(3)) << i;
  }
  EXPECT_EQ(store.stats().breaker, BreakerState::kOpen);
  EXPECT_EQ(store.stats().rejected_lookups, 2u);
  EXPECT_FALSE(chain.Put(store) > 0);

  ASSERT_TRUE(cluster_.nodes[owner]->Restart().ok());
  ASSERT_TRUE(testing::WaitClusterOk(cluster_).ok());
  clock.Advance(absl::ToInt64Nanoseconds(options.breaker_backoff));
  EXPECT_EQ(LookupAll(store, chain, &out), 0);  // the probe: answered (empty), breaker closes
  EXPECT_EQ(store.stats().breaker, BreakerState::kClosed);
  ASSERT_EQ(chain.Put(store), 8);
  ASSERT_TRUE(store.Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(LookupAll(store, chain, &out), 8);
  EXPECT_EQ(out.storage, chain.blocks);
}

}  // namespace
}  // namespace kvpool::tier
