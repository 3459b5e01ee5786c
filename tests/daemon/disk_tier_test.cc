// The disk tier in the engine (daemon/engine/tiers.h, tier/disk_block_store.h): a prefix
// published before a restart is promoted from disk after it, byte for byte, into an arena that
// was not there before; and an invalidation makes every tier forget a tenant's blocks, and only
// its, across a restart too; the records found at start are told as events. Real processes:
// tests/client/python/test_disk_tier.py.

#include <filesystem>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::MappedArena;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

constexpr int32_t kBlocks = 16;

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvpool-disk-tier-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    Start();
  }
  void TearDown() override {
    Stop();
    std::filesystem::remove_all(dir_);
  }
  EngineOptions Options() const {
    EngineOptions options = SmallPool(kBlocks);
    options.secret = tier::DeploymentSecret::FromBytes(std::string(32, 'k'));
    options.tiers.host_blocks = host_blocks_;
    options.tiers.disk.directory = dir_;
    options.tiers.disk.capacity_bytes = 64 * options.pools[0].layout.block_bytes();
    options.invalidations_file = dir_ + "/invalidations";
    return options;
  }
  // A fresh engine (and arena) on the same directory: a restart.
  void Start() {
    engine_ = std::move(*Engine::Create(Options(), &device_, nullptr));
    alice_ = *engine_->OpenSession(Spec("tenant-a", "alice"));
    eve_ = *engine_->OpenSession(Spec("tenant-b", "eve"));
    arena_ = std::make_unique<MappedArena>(*engine_->Grant(alice_));
  }
  void Stop() {
    arena_.reset();
    alice_.reset();
    eve_.reset();
    engine_.reset();
  }
  Tables Allocate(const Session& s, std::span<const int32_t> prompt) {
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    absl::StatusOr<Tables> t =
        engine_->Allocate(s, std::span(&request, 1), CallContext::Uncancellable());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Tables{};
  }
  // `s` computes and publishes `prompt` with its KV patterned by `seed`; it reaches the tiers.
  void Publish(const Session& s, std::span<const int32_t> prompt, uint8_t seed) {
    const Tables t = Allocate(s, prompt);
    arena_->Fill(t.blocks, seed);
    const SequenceId id = t.slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(s, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()).ok());
    ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  }
  // Tokens of `prompt` a new sequence of `s` finds cached (promoted from a tier or not); frees it.
  int64_t Matched(const Session& s, std::span<const int32_t> prompt) {
    const Tables t = Allocate(s, prompt);
    const SequenceId id = t.slices[0].sequence;
    EXPECT_TRUE(
        engine_->Free(s, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable()).ok());
    return t.slices[0].matched_tokens;
  }

  std::string dir_;
  int64_t host_blocks_ = 0;
  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
  std::shared_ptr<const Session> eve_;
  std::unique_ptr<MappedArena> arena_;
};

TEST_F(DiskTierTest, APrefixPublishedBeforeARestartComesBackFromDiskByteForByte) {
  const std::vector<int32_t> prompt = Prompt(48, 1);  // three full blocks
  Publish(*alice_, prompt, 10);
  EXPECT_EQ(engine_->Stats().tiers.disk_store.written, 3u);
  Stop();
  Start();  // a new arena: nothing of the old one is left in it
  EXPECT_EQ(engine_->Stats().tiers.disk_tier.recovered_blocks, 3);
  auto bob = *engine_->OpenSession(Spec("tenant-a", "bob"));
  std::vector<int32_t> longer = prompt;
  longer.resize(64, 5);
  const Tables t = Allocate(*bob, longer);
  EXPECT_EQ(t.slices[0].matched_tokens, 48);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(arena_->Holds(t.blocks[i], 10 + i)) << i;
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_disk, 3u);
  EXPECT_EQ(tiers.disk_store.hits, 3u);
  // Another tenant's same prompt finds nothing of it.
  EXPECT_EQ(Matched(*eve_, prompt), 0);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(DiskTierTest, DiskEventsNameTheMedium) {
  Publish(*alice_, Prompt(32, 2), 20);
  std::vector<KvEvent> events;
  ASSERT_TRUE(engine_->ReadEvents(0, 1, 100, &events));
  int64_t disk_stored = 0;
  for (const KvEvent& e : events) {
    if (e.medium == KvMedium::kDisk && e.type == KvEventType::kBlockStored) ++disk_stored;
  }
  EXPECT_EQ(disk_stored, 2);
}

// The records a restarted daemon finds on disk are the disk tier's as much as those it writes
// later: the new pool's event log tells them as Stored (with their parents), and its snapshot
// holds them. Before, nothing named them until they were dropped (a Removed of a block no
// consumer had been told of).
TEST_F(DiskTierTest, ARestartTellsTheRecordsFoundOnDisk) {
  Publish(*alice_, Prompt(48, 7), 70);  // three full blocks, a chain
  const auto disk_stored = [&] {
    std::vector<KvEvent> events;
    EXPECT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());  // the tiers' events drained
    EXPECT_TRUE(engine_->ReadEvents(0, 1, 100, &events));
    absl::flat_hash_map<BlockHash, std::optional<BlockHash>> stored;  // -> parent
    for (const KvEvent& e : events) {
      if (e.medium != KvMedium::kDisk || e.type != KvEventType::kBlockStored) continue;
      std::optional<BlockHash> parent = e.parent_hash;
      for (const BlockHash& h : e.block_hashes) {
        stored[h] = parent;
        parent = h;
      }
    }
    return stored;
  };
  const absl::flat_hash_map<BlockHash, std::optional<BlockHash>> before = disk_stored();
  ASSERT_EQ(before.size(), 3u);
  Stop();
  Start();
  EXPECT_EQ(engine_->Stats().tiers.disk_tier.recovered_blocks, 3);
  EXPECT_EQ(disk_stored(), before);
  uint64_t resume = 0;
  size_t in_snapshot = 0;
  for (const KvEvent& e : engine_->SnapshotEvents(0, &resume)) {
    if (e.medium != KvMedium::kDisk) continue;
    for (const BlockHash& h : e.block_hashes) in_snapshot += before.contains(h) ? 1 : 0;
  }
  EXPECT_EQ(in_snapshot, 3u);
}

TEST_F(DiskTierTest, InvalidationForgetsATenantInEveryTierAndOnlyIt) {
  host_blocks_ = 32;
  Stop();
  Start();
  const std::vector<int32_t> a = Prompt(48, 3);
  const std::vector<int32_t> b = Prompt(48, 4);
  Publish(*alice_, a, 30);
  Publish(*eve_, b, 40);
  // Still cached in the device pool, in the host tier and on disk.
  ASSERT_EQ(Matched(*alice_, a), 48);
  const absl::StatusOr<Engine::Invalidation> done = engine_->Invalidate("tenant-a", "");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->sessions, 1);
  EXPECT_EQ(done->tier_blocks, 6);  // three in the host tier, three on disk
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.host_invalidated, 3u);
  EXPECT_EQ(tiers.disk_tier.invalidated, 3u);
  EXPECT_EQ(engine_->Stats().invalidations, 1u);
  // The device pool's blocks are still cached, but no session of the tenant matches them.
  EXPECT_EQ(Matched(*alice_, a), 0);
  auto bob = *engine_->OpenSession(Spec("tenant-a", "bob"));
  EXPECT_EQ(Matched(*bob, a), 0);
  EXPECT_EQ(Matched(*eve_, b), 48);
  // What the tenant publishes from now on is shared again.
  Publish(*alice_, a, 31);
  EXPECT_EQ(Matched(*bob, a), 48);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(DiskTierTest, AnInvalidationHoldsAcrossARestart) {
  const std::vector<int32_t> a = Prompt(32, 5);
  const std::vector<int32_t> b = Prompt(32, 6);
  Publish(*alice_, a, 50);
  Publish(*eve_, b, 60);
  ASSERT_TRUE(engine_->Invalidate("tenant-a", "").ok());
  Stop();
  Start();
  EXPECT_EQ(Matched(*alice_, a), 0);
  EXPECT_EQ(Matched(*eve_, b), 32);  // from disk
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_disk, 2u);
}

TEST_F(DiskTierTest, InvalidatingOneModelKeepsTheTenantsOtherModels) {
  auto carol = *engine_->OpenSession(Spec("tenant-a", "carol"));  // model "m", as alice
  const std::vector<int32_t> a = Prompt(32, 7);
  Publish(*alice_, a, 70);
  ASSERT_TRUE(engine_->Invalidate("tenant-a", "another-model").ok());
  EXPECT_EQ(Matched(*carol, a), 32);
  EXPECT_FALSE(engine_->Invalidate("", "").ok());  // a tenant is required
}

}  // namespace
}  // namespace kvpool::daemon
