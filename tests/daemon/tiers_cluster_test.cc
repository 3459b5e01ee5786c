// Two engines (two daemons but for their sockets) sharing a three-node Redis Cluster started by
// the test: a prefix one publishes is promoted by the other byte for byte, with blocks spread
// over every node (key_slotting: block), across a `redis-cli --cluster reshard` between the two
// (MOVED / ASK redirects); another tenant finds nothing. Skipped without redis-server.

#include <hiredis/hiredis.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"
#include "tests/tier/redis_harness.h"
#include "tier/block_codec.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::MappedArena;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;
namespace rt = tier::testing;

// One engine with a mapping of its arena.
struct Node {
  FailingDevice device;
  std::unique_ptr<Engine> engine;
  std::shared_ptr<const Session> session;
  std::unique_ptr<MappedArena> arena;
};

class TiersClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (rt::RedisServerBinary().empty() || rt::RedisCliBinary().empty()) {
      GTEST_SKIP() << "redis-server / redis-cli are not installed";
    }
    auto dir = rt::TempDir::Create("kvpool-tiers-cluster");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    auto cluster = rt::StartRedisCluster(dir_->path());
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  std::unique_ptr<Node> Start(const std::string& tenant) {
    auto node = std::make_unique<Node>();
    EngineOptions options = SmallPool(64);
    options.tiers.redis.enabled = true;
    options.tiers.redis.cluster_seeds = cluster_.Seeds();
    options.tiers.redis.key_slotting = tier::KeySlotting::kBlock;
    options.tiers.redis.command_timeout = absl::Seconds(5);
    // Daemons that share a tier share the deployment secret (without it each would draw its
    // own, and neither could find, or would accept, the other's blocks).
    options.secret = tier::DeploymentSecret::FromBytes("tiers cluster test: a shared secret");
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(options, &node->device, /*model=*/nullptr);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    node->engine = std::move(*engine);
    node->session = *node->engine->OpenSession(Spec(tenant));
    absl::StatusOr<PoolGrant> grant = node->engine->Grant(node->session);
    if (!grant.ok()) {
      ADD_FAILURE() << grant.status();
      return nullptr;
    }
    node->arena = std::make_unique<MappedArena>(*grant);
    return node;
  }

  static Tables Allocate(Node& n, std::span<const int32_t> prompt) {
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    absl::StatusOr<Tables> t =
        n.engine->Allocate(*n.session, std::span(&request, 1), CallContext::Uncancellable());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Tables{};
  }
  // `n` computes `prompt` (block i of it filled with seed + i) and publishes it.
  static void Publish(Node& n, std::span<const int32_t> prompt, uint8_t seed) {
    const Tables t = Allocate(n, prompt);
    n.arena->Fill(t.blocks, seed);
    const SequenceId id = t.slices[0].sequence;
    ASSERT_TRUE(
        n.engine->Free(*n.session, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
            .ok());
    ASSERT_TRUE(n.engine->FlushTiers(absl::Seconds(30)).ok());
  }
  // Whether `n` now holds `prompt` whole, with the bytes Publish(seed) wrote.
  static bool Reads(Node& n, std::span<const int32_t> prompt, uint8_t seed) {
    const Tables t = Allocate(n, prompt);
    bool same = t.slices[0].matched_tokens == static_cast<int64_t>(prompt.size());
    for (size_t i = 0; same && i < t.blocks.size(); ++i) {
      same = n.arena->Holds(t.blocks[i], static_cast<uint8_t>(seed + i));
    }
    const SequenceId id = t.slices[0].sequence;
    EXPECT_TRUE(
        n.engine
            ->Free(*n.session, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable())
            .ok());
    return same;
  }

  std::unique_ptr<rt::TempDir> dir_;
  rt::RedisCluster cluster_;
};

TEST_F(TiersClusterTest, APrefixPublishedOnOneIsPromotedOnTheOtherAcrossAReshard) {
  auto a = Start("tenant-a");
  auto b = Start("tenant-a");
  auto eve = Start("tenant-b");
  ASSERT_TRUE(a && b && eve);
  const std::vector<int32_t> before = Prompt(16 * 12, 1);  // 12 blocks over every node
  Publish(*a, before, 10);
  EXPECT_TRUE(Reads(*b, before, 10));

  // Move 2000 slots from node 0 to node 1, then publish and read across the new map.
  auto id = [&](int node) -> std::string {
    auto reply = cluster_.nodes[static_cast<size_t>(node)]->Command({"CLUSTER", "MYID"});
    return reply.ok() ? std::string((*reply)->str, (*reply)->len) : std::string();
  };
  auto reshard = rt::RunProgram(
      {rt::RedisCliBinary(), "--cluster", "reshard", cluster_.nodes[0]->address(), "--cluster-from",
       id(0), "--cluster-to", id(1), "--cluster-slots", "2000", "--cluster-yes"});
  ASSERT_TRUE(reshard.ok()) << reshard.status();
  ASSERT_TRUE(rt::WaitClusterOk(cluster_).ok());
  const std::vector<int32_t> after = Prompt(16 * 12, 2);
  Publish(*a, after, 100);
  ASSERT_TRUE(b->engine->Evict(0, 0, /*all=*/true).ok());
  EXPECT_TRUE(Reads(*b, before, 10));  // a map that moved since the first read
  EXPECT_TRUE(Reads(*b, after, 100));
  const TierStats stats = b->engine->Stats().tiers;
  EXPECT_EQ(stats.promoted_from_remote, 36u);
  EXPECT_EQ(stats.remote_store.corrupt, 0u);

  // Another tenant, same prompt, same cluster: nothing.
  EXPECT_EQ(Allocate(*eve, before).slices[0].matched_tokens, 0);
  EXPECT_EQ(eve->engine->Stats().tiers.promoted_from_remote, 0u);
  EXPECT_TRUE(b->engine->CheckInvariants().ok());
}

// The Redis tier reads a value's payload from the socket straight into a staging buffer and
// checks it there: a value that fails the check must still never reach the pool. Every value of
// a published prefix is replaced with one whose payload is another (header and tag kept, so the
// tag fails); the other engine promotes nothing, and no block of its pool holds those bytes.
TEST_F(TiersClusterTest, ARefusedValueReadIntoStagingNeverReachesThePool) {
  auto a = Start("tenant-a");
  auto b = Start("tenant-a");
  ASSERT_TRUE(a && b);
  const std::vector<int32_t> prompt = Prompt(16 * 6, 3);
  Publish(*a, prompt, 10);
  constexpr uint8_t kForged = 0x66;
  int forged = 0;
  for (const auto& node : cluster_.nodes) {
    auto keys = node->Command({"KEYS", "*"});
    ASSERT_TRUE(keys.ok()) << keys.status();
    for (size_t k = 0; k < (*keys)->elements; ++k) {
      const std::string key((*keys)->element[k]->str, (*keys)->element[k]->len);
      auto value = node->Command({"GET", key});
      ASSERT_TRUE(value.ok()) << value.status();
      std::string bad((*value)->str, (*value)->len);
      std::memset(bad.data() + tier::kBlockHeaderBytes, kForged,
                  bad.size() - static_cast<size_t>(tier::kBlockHeaderBytes));
      ASSERT_TRUE(node->Command({"SET", key, bad}).ok());
      ++forged;
    }
  }
  ASSERT_EQ(forged, 6);
  const Tables t = Allocate(*b, prompt);
  EXPECT_EQ(t.slices[0].matched_tokens, 0);
  const TierStats stats = b->engine->Stats().tiers;
  EXPECT_EQ(stats.promoted_from_remote, 0u);
  EXPECT_GE(stats.remote_store.forged, 1u);
  for (int32_t block = 0; block < 64; ++block) {
    EXPECT_FALSE(b->arena->Holds(BlockId(block), kForged)) << "block " << block;
  }
  EXPECT_TRUE(b->engine->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvpool::daemon
