// The engine's lower tiers (daemon/engine/tiers.h): published blocks go down to the host tier,
// a local miss is promoted back into fresh blocks, byte for byte, and a sequence never sees a
// promoted block before its copy has run. The Redis tier's wiring is exercised by the two-daemon
// integration test (tests/integration/tier_integration_test.py).

#include "daemon/engine/tiers.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/notification.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/promotion_hold.h"
#include "gtest/gtest.h"
#include "kvpool/util/check.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::MappedArena;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

constexpr int32_t kBlocks = 8;

// A prefill of `prompt` by `s` (a new sequence, or the next turn of `sequence`), once it has
// completed.
ComputeResult RunPrefill(Engine& engine, std::shared_ptr<const Session> s,
                         const std::vector<int32_t>& prompt, SequenceId sequence = SequenceId(0),
                         std::shared_ptr<const CallContext> context = nullptr) {
  absl::Notification done;
  ComputeResult result;
  engine.Submit(std::make_unique<ComputeCall>(
      std::move(s),
      ComputeRequest{
          .kind = ComputeRequest::Kind::kPrefill, .sequence = sequence, .tokens = prompt},
      std::move(context), [&](ComputeCall& call) {
        result = call.result();
        done.Notify();
      }));
  done.WaitForNotification();
  return result;
}

// `got` answers as `want` did, bit for bit: the same next token with the same log-probability.
void ExpectSameAnswer(const ComputeResult& got, const ComputeResult& want) {
  ASSERT_EQ(got.results.size(), 1u);
  ASSERT_EQ(want.results.size(), 1u);
  EXPECT_EQ(got.results[0].next_token, want.results[0].next_token);
  EXPECT_EQ(got.results[0].logprob, want.results[0].logprob);
}

class TiersTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(Options()); }
  static EngineOptions Options() {
    EngineOptions options = SmallPool(kBlocks);
    options.tiers.host_blocks = 32;
    return options;
  }
  void Make(EngineOptions options, model::StepModel* model = nullptr) {
    arena_.reset();
    alice_.reset();
    engine_.reset();
    engine_ = std::move(*Engine::Create(options, &device_, model));
    alice_ = *engine_->OpenSession(Spec("tenant-a", "alice"));
    absl::StatusOr<PoolGrant> grant = engine_->Grant(alice_);
    ASSERT_TRUE(grant.ok()) << grant.status();
    arena_ = std::make_unique<MappedArena>(*grant);
  }
  // Options whose lock gap `gap` runs `action` the first time it opens after Arm().
  EngineOptions InGap(LockGap gap, std::function<void()> action) {
    EngineOptions options = Options();
    options.lock_gap_hook = [this, gap, action = std::move(action)](LockGap g) {
      if (g == gap && armed_.exchange(false)) action();
    };
    return options;
  }
  void Arm() { armed_ = true; }

  Tables Allocate(const Session& s, std::span<const int32_t> prompt, int64_t tokens) {
    const AllocateRequest request{.num_tokens = tokens, .prompt = prompt};
    absl::StatusOr<Tables> t =
        engine_->Allocate(s, std::span(&request, 1), CallContext::Uncancellable());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Tables{};
  }
  bool Holds(BlockId b, uint8_t value) const { return arena_->Holds(b, value); }
  // Alice computes and publishes `prompt` (its KV patterned by `seed`), then it is evicted from
  // the device pool: only the host tier still has it.
  void PublishThenEvict(std::span<const int32_t> prompt, uint8_t seed) {
    Publish(prompt, seed);
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    ASSERT_EQ(engine_->Stats().cache.pool.cached, 0);
  }
  // Alice computes and publishes `prompt`; it reaches the host tier.
  void Publish(std::span<const int32_t> prompt, uint8_t seed) {
    const Tables t = Allocate(*alice_, prompt, static_cast<int64_t>(prompt.size()));
    arena_->Fill(t.blocks, seed);
    const SequenceId id = t.slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
            .ok());
    ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  }
  void EvictAll() { ASSERT_TRUE(engine_->Evict(0, kBlocks, /*all=*/false).ok()); }
  void ExpectNoLoaderLeft() {
    const absl::Status s = engine_->CheckInvariants();  // loader sequences == promotions alive
    EXPECT_TRUE(s.ok()) << s;
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    engine_->ListSequences(std::nullopt, kNoSession, &owners, &pools);
    for (SessionId owner : owners) EXPECT_NE(owner, kTierLoader);
  }

  std::atomic<bool> armed_{false};
  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
  std::unique_ptr<MappedArena> arena_;
};

TEST_F(TiersTest, AnEvictedPrefixComesBackFromTheHostTierByteForByte) {
  const std::vector<int32_t> prompt = Prompt(48, 1);  // three full blocks
  PublishThenEvict(prompt, 10);
  EXPECT_EQ(engine_->Stats().tiers.demoted, 3u);
  EXPECT_EQ(engine_->Stats().tiers.host_blocks, 3);
  // The pool's event log says where the blocks went: stored on the device, then in the host tier
  // (hashes only), then the cache cleared (every medium), then the host tier's blocks told again.
  std::vector<KvEvent> events;
  ASSERT_TRUE(engine_->ReadEvents(0, 1, 100, &events));
  const auto cleared = std::find_if(events.begin(), events.end(), [](const KvEvent& e) {
    return e.type == KvEventType::kAllBlocksCleared;
  });
  ASSERT_NE(cleared, events.end());
  std::vector<BlockHash> device_stored, host_stored, told_again;
  for (auto it = events.begin(); it != events.end(); ++it) {
    if (it->type != KvEventType::kBlockStored) continue;
    std::vector<BlockHash>& into = it > cleared                    ? told_again
                                   : it->medium == KvMedium::kHost ? host_stored
                                                                   : device_stored;
    into.insert(into.end(), it->block_hashes.begin(), it->block_hashes.end());
    if (it > cleared) {
      EXPECT_EQ(it->medium, KvMedium::kHost);
    }
  }
  EXPECT_EQ(device_stored.size(), 3u);
  EXPECT_EQ(host_stored, device_stored);
  EXPECT_EQ(told_again, host_stored);

  // Another session's prompt shares the three blocks and adds one: the three are promoted.
  auto bob = *engine_->OpenSession(Spec("tenant-a", "bob"));
  std::vector<int32_t> longer = prompt;
  longer.resize(64, 5);
  const Tables t = Allocate(*bob, longer, 64);
  EXPECT_EQ(t.slices[0].matched_tokens, 48);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Holds(t.blocks[static_cast<size_t>(i)], 10 + i)) << i;
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 3u);
  EXPECT_EQ(tiers.promoted_bytes, static_cast<uint64_t>(3 * arena_->block_bytes()));
  EXPECT_EQ(tiers.host_store.hits, 3u);
  // The promoted blocks are in the host tier already: not copied down again.
  ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  EXPECT_EQ(engine_->Stats().tiers.demoted, 3u);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(TiersTest, OtherTenantsAndOtherPrefixesMiss) {
  const std::vector<int32_t> prompt = Prompt(32, 2);
  PublishThenEvict(prompt, 20);
  auto eve = *engine_->OpenSession(Spec("tenant-b", "eve"));
  EXPECT_EQ(Allocate(*eve, prompt, 32).slices[0].matched_tokens, 0);
  // Same second block, another first one: the chain differs, nothing matches.
  std::vector<int32_t> other = prompt;
  other[0] += 1;
  EXPECT_EQ(Allocate(*alice_, other, 32).slices[0].matched_tokens, 0);
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_host, 0u);
}

TEST_F(TiersTest, APromotedBlockIsNotHandedOutBeforeItsCopyRan) {
  const std::vector<int32_t> prompt = Prompt(32, 3);
  PublishThenEvict(prompt, 30);
  // Hold the transfer stream: the promotion's copies queue behind this task.
  absl::Notification release;
  ASSERT_TRUE(
      device_.EnqueueHostTask(kernels::StreamId::kTransfer, [&] { release.WaitForNotification(); })
          .ok());
  absl::Notification done;
  Tables t;
  std::thread caller([&] {
    t = Allocate(*alice_, prompt, 32);
    done.Notify();
  });
  // While the copy cannot run, the caller has no table (a fence-less promotion would return
  // blocks whose bytes are not there yet, and fail the check below).
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  release.Notify();
  caller.join();
  ASSERT_EQ(t.slices[0].matched_tokens, 32);
  EXPECT_TRUE(Holds(t.blocks[0], 30));
  EXPECT_TRUE(Holds(t.blocks[1], 31));
}

TEST_F(TiersTest, AFailedCopyIsAMissAndLeavesThePoolAsItWas) {
  const std::vector<int32_t> prompt = Prompt(32, 4);
  PublishThenEvict(prompt, 40);
  device_.fail_copy_to_device = true;
  const Tables t = Allocate(*alice_, prompt, 32);
  EXPECT_EQ(t.slices[0].matched_tokens, 0);
  const EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.tiers.promote_failed, 2u);
  EXPECT_EQ(stats.cache.pool.cached, 0);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(TiersTest, PublishedBlocksStayPutUntilTheirCopyRan) {
  // A block freed with commit is cached and evictable at once; its copy to the host tier must
  // have run before anyone can be handed the block again.
  absl::Notification release;
  const std::vector<int32_t> prompt = Prompt(16, 5);
  const Tables t = Allocate(*alice_, prompt, 16);
  arena_->Fill(t.blocks, 50);
  ASSERT_TRUE(
      device_.EnqueueHostTask(kernels::StreamId::kTransfer, [&] { release.WaitForNotification(); })
          .ok());
  const SequenceId id = t.slices[0].sequence;
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
  // Evicted now, but still in flight: the pool cannot hand it out before the copy.
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  const KvCacheStats held = engine_->Stats().cache;
  EXPECT_EQ(held.pool.retiring, 1);
  release.Notify();
  ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  auto bob = *engine_->OpenSession(Spec("tenant-a", "bob"));
  const Tables again = Allocate(*bob, prompt, 16);
  EXPECT_EQ(again.slices[0].matched_tokens, 16);
  EXPECT_TRUE(Holds(again.blocks[0], 50));
}

// Issue 27's crash, forced: the local match (two of three blocks) shrinks to nothing while the
// tiers are asked for the third. The hits then no longer join the cached prefix; the promotion
// looks up again from where the match now ends instead of indexing the hits from the old one.
TEST_F(TiersTest, AnEvictionDuringTheLookupSendsThePromotionRoundAgain) {
  Make(InGap(LockGap::kTierLookup, [this] { EvictAll(); }));
  const std::vector<int32_t> prompt = Prompt(48, 6);
  Publish(prompt, 60);
  ASSERT_TRUE(engine_->Evict(0, 1, /*all=*/false).ok());  // the leaf: two blocks stay local
  ASSERT_EQ(engine_->MatchPrefix(*alice_, prompt).value(), 32);
  Arm();
  const Tables t = Allocate(*alice_, prompt, 48);
  ASSERT_EQ(t.slices[0].matched_tokens, 48);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Holds(t.blocks[static_cast<size_t>(i)], 60 + i)) << i;
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promote_raced, 1u);
  EXPECT_EQ(tiers.promoted_from_host, 3u);
  EXPECT_EQ(tiers.promote_adopted, 1u);
  ExpectNoLoaderLeft();
}

// The same race with the re-validation switched off: the hits are indexed from the stale match,
// which is what crashed kvpoold (a wrapped size_t index and a call through garbage). Now a check
// stops it before any read out of bounds.
TEST_F(TiersTest, WithoutTheReValidationTheRaceReadsOutOfBounds) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        EngineOptions options = InGap(LockGap::kTierLookup, [this] { EvictAll(); });
        options.revalidate_lock_gaps = false;
        Make(options);
        const std::vector<int32_t> prompt = Prompt(48, 6);
        Publish(prompt, 60);
        KVPOOL_CHECK_OK(engine_->Evict(0, 1, /*all=*/false).status());
        Arm();
        Allocate(*alice_, prompt, 48);
      },
      "hit index out of range");
}

// Issue 27: a promoted block was published as an ordinary cached block, and churn between the
// promotion and the requester's allocation evicted it first. The hold keeps it for the requester.
TEST_F(TiersTest, APromotionIsHeldForItsCallerThroughAnEviction) {
  Make(InGap(LockGap::kAdoption, [this] { EvictAll(); }));
  const std::vector<int32_t> prompt = Prompt(48, 7);
  PublishThenEvict(prompt, 70);
  Arm();
  const Tables t = Allocate(*alice_, prompt, 48);
  EXPECT_EQ(t.slices[0].matched_tokens, 48);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Holds(t.blocks[static_cast<size_t>(i)], 70 + i)) << i;
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 3u);
  EXPECT_EQ(tiers.promote_adopted, 1u);
  EXPECT_EQ(tiers.promote_unused, 0u);
  ExpectNoLoaderLeft();
}

TEST_F(TiersTest, APrefillReusesWhatWasPromotedForItThroughAnEviction) {
  std::unique_ptr<model::Model> model = testing::TinyModel(Options().pools[0].layout);
  EngineOptions options = InGap(LockGap::kAdoption, [this] { EvictAll(); });
  Make(options, model.get());
  const std::vector<int32_t> prompt = Prompt(49, 8);  // three full blocks and one token
  auto prefill = [&] { return RunPrefill(*engine_, alice_, prompt); };
  ComputeResult first = prefill();
  ASSERT_TRUE(first.status.ok()) << first.status;
  const SequenceId id = first.sequences[0];
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
  ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  EvictAll();
  Arm();
  const ComputeResult again = prefill();
  ASSERT_TRUE(again.status.ok()) << again.status;
  EXPECT_EQ(again.reused, 48);
  EXPECT_EQ(again.results[0].next_token, first.results[0].next_token);
  EXPECT_EQ(engine_->Stats().tiers.promote_adopted, 1u);
  ExpectNoLoaderLeft();
}

// Lookup buffers are bounded over all lookups in flight: a promotion holding them all leaves a
// second lookup none, however long its prompt.
TEST_F(TiersTest, LookupBuffersAreBoundedOverAllLookups) {
  const std::vector<int32_t> first = Prompt(48, 9), second = Prompt(48, 10);
  EngineOptions options = Options();
  options.tiers.lookup_blocks = 2;
  Tables inner;
  options.lock_gap_hook = [&](LockGap g) {
    // The first promotion's buffers are still taken: the second lookup gets none.
    if (g != LockGap::kPromotionCopy || !armed_.exchange(false)) return;
    auto bob = *engine_->OpenSession(Spec("tenant-a", "bob"));
    inner = Allocate(*bob, second, 48);
  };
  Make(options);
  Publish(first, 90);
  Publish(second, 100);
  EvictAll();
  const uint64_t truncated = engine_->Stats().tiers.lookup_truncated;
  Arm();
  const Tables outer = Allocate(*alice_, first, 48);
  EXPECT_EQ(outer.slices[0].matched_tokens, 32);  // two blocks of buffers
  EXPECT_EQ(inner.slices[0].matched_tokens, 0);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 2u);
  EXPECT_EQ(tiers.lookup_truncated, truncated + 2);
  ExpectNoLoaderLeft();
}

// Admission first: a call its limits refuse costs no tier lookup and copies nothing.
TEST_F(TiersTest, ARefusedCallDoesNoTierWork) {
  EngineOptions options = Options();
  options.limits.sequences_per_session = 1;
  Make(options);
  const std::vector<int32_t> prompt = Prompt(32, 11);
  PublishThenEvict(prompt, 110);
  Allocate(*alice_, {}, 16);  // the one sequence it may hold
  const uint64_t lookups = engine_->Stats().tiers.lookups;
  const AllocateRequest request{.num_tokens = 32, .prompt = prompt};
  const absl::Status refused =
      engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_EQ(engine_->Stats().tiers.lookups, lookups);
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_host, 0u);
}

// A session that ends while its promotion copies leaves nothing held.
TEST_F(TiersTest, ASessionEndingDuringThePromotionLeavesNoHold) {
  Make(InGap(LockGap::kPromotionCopy,
             [this] { engine_->EndSession(alice_->id, SessionEnd::kConnectionLost); }));
  const std::vector<int32_t> prompt = Prompt(32, 12);
  PublishThenEvict(prompt, 120);
  Arm();
  const AllocateRequest request{.num_tokens = 32, .prompt = prompt};
  EXPECT_TRUE(absl::IsNotFound(
      engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable()).status()));
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 2u);  // copied and published, for whoever comes next
  EXPECT_EQ(tiers.promote_unused, 1u);
  EXPECT_EQ(engine_->Stats().cache.pool.cached, 2);
  ExpectNoLoaderLeft();
}

// Issue 31: a host-tier hit is copied once, straight from its slot into the pool block. Before,
// the lookup copied it into a staging buffer first and the device copied from there: every
// source below was a one-block staging buffer, not the host tier's arena.
TEST_F(TiersTest, AHostTierHitIsCopiedStraightFromItsSlot) {
  const std::vector<int32_t> prompt = Prompt(48, 15);
  PublishThenEvict(prompt, 150);
  const int64_t block_bytes = arena_->block_bytes();
  // The host tier's slots: the one host allocation of host_blocks blocks (TierSet::Create).
  std::optional<testing::FailingDevice::Range> slots;
  for (const auto& buffer : device_.host_buffers()) {
    if (buffer.bytes == Options().tiers.host_blocks * block_bytes) slots = buffer;
  }
  ASSERT_TRUE(slots.has_value());
  const size_t before = device_.copies_to_device().size();
  const Tables t = Allocate(*alice_, prompt, 48);
  ASSERT_EQ(t.slices[0].matched_tokens, 48);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(Holds(t.blocks[static_cast<size_t>(i)], 150 + i)) << i;
  const std::vector<testing::FailingDevice::Range> copies = device_.copies_to_device();
  int64_t copied = 0;
  for (size_t i = before; i < copies.size(); ++i) {
    EXPECT_TRUE(slots->Contains(copies[i])) << "copy " << i << " is not from the host tier's slots";
    copied += copies[i].bytes;
  }
  EXPECT_EQ(copied, 3 * block_bytes);  // each block once (consecutive ones in one copy)
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_host, 3u);
}

// Issue 31: a promotion copies straight from the host tier's slots, so a slot must keep its bytes
// until that copy has run. Forced here: the tier writer stores new blocks (which, with nothing
// pinned, evict and overwrite the promoted ones' slots) after the promotion looked its blocks up
// and before its copy runs. With the slots pinned the promoted blocks hold what was published;
// without the pins (LookupPinned not unlinking: tried by hand) they hold the newcomers' bytes.
TEST_F(TiersTest, AHostSlotIsNotReusedWhileItsPromotionCopyIsQueued) {
  EngineOptions options = Options();
  options.tiers.host_blocks = 2;
  absl::Notification release_stream;
  options.lock_gap_hook = [&](LockGap g) {
    if (g == LockGap::kPromotionCopy && armed_.exchange(false)) release_stream.Notify();
  };
  Make(options);
  const std::vector<int32_t> promoted = Prompt(32, 13), newcomer = Prompt(32, 14);
  PublishThenEvict(promoted, 130);  // both host slots hold it
  // The transfer stream waits for the promotion's lock gap; the newcomer's copies out of the pool
  // queue behind that, and then a task that lets the promotion's copies run only once the tier
  // writer has offered the newcomer's blocks to the host tier.
  ASSERT_TRUE(device_
                  .EnqueueHostTask(kernels::StreamId::kTransfer,
                                   [&] { release_stream.WaitForNotification(); })
                  .ok());
  const uint64_t puts = engine_->Stats().tiers.host_store.puts;
  const Tables t = Allocate(*alice_, newcomer, 32);
  arena_->Fill(t.blocks, 140);
  const SequenceId id = t.slices[0].sequence;
  ASSERT_TRUE(
      engine_->Free(*alice_, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable())
          .ok());
  ASSERT_TRUE(device_
                  .EnqueueHostTask(kernels::StreamId::kTransfer,
                                   [&] {
                                     const absl::Time give_up = absl::Now() + absl::Seconds(10);
                                     while (engine_->Stats().tiers.host_store.puts < puts + 2 &&
                                            absl::Now() < give_up) {
                                       absl::SleepFor(absl::Milliseconds(1));
                                     }
                                   })
                  .ok());
  Arm();
  const Tables again = Allocate(*alice_, promoted, 32);
  ASSERT_EQ(again.slices[0].matched_tokens, 32);
  ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.host_store.puts, puts + 2);
  EXPECT_EQ(tiers.promoted_from_host, 2u);
  EXPECT_TRUE(Holds(again.blocks[0], 130));
  EXPECT_TRUE(Holds(again.blocks[1], 131));
  // Both slots were pinned when the newcomer came: it found no room.
  EXPECT_EQ(tiers.host_store.dropped_queue_full, 2u);
  EXPECT_EQ(tiers.host_store.written, 2u);
  ExpectNoLoaderLeft();
}

// With disk_.dir set, a disk tier there (a restart is a Make on the same directory).
struct TestDisk {
  std::string dir;
  ~TestDisk() {
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
  void Make() {
    char tmpl[] = "/tmp/kvpool-tiers-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
  }
  void Use(EngineOptions* options) const {
    if (dir.empty()) return;
    options->secret = tier::DeploymentSecret::FromBytes(std::string(32, 'k'));
    options->tiers.disk.directory = dir;
    options->tiers.disk.capacity_bytes = 64 * options->pools[0].layout.block_bytes();
  }
};

// An engine running a real model (f32: bit for bit) whose layers fall into groups, for the tier
// tests of its components (checkpoints, window blocks).
class ModelTiersTest : public ::testing::Test {
 protected:
  // `options` laid out for `config`'s attention layers, in f32.
  static void UseModel(const model::ModelConfig& config, EngineOptions* options) {
    kernels::PoolLayout& layout = options->pools[0].layout;
    layout.num_layers = config.pool_layers();
    layout.num_kv_heads = config.num_kv_heads;
    layout.head_dim = config.head_dim;
    layout.dtype = kernels::DType::kF32;  // bit for bit
  }
  // A fresh engine (a restart when one ran) over `options` with `config`'s synthetic weights.
  // `gap`, when given, evicts every cached block (and component) nobody holds from the device
  // the first time it opens after armed_ is set.
  void Start(EngineOptions options, const model::ModelConfig& config, std::optional<LockGap> gap) {
    arena_.reset();
    alice_.reset();
    disk_.Use(&options);
    options.lock_gap_hook = [this, gap](LockGap g) {
      // What nobody holds (a promotion's hold keeps its blocks).
      if (gap && g == *gap && armed_.exchange(false)) {
        ASSERT_TRUE(engine_->Evict(0, 64, /*all=*/false).ok());
      }
      if (in_gap_) in_gap_(g);
    };
    engine_.reset();
    model_ = std::move(*model::Model::Create(model::SyntheticWeights(config, 1),
                                             options.pools[0].layout, {.threads = 1}));
    absl::StatusOr<std::unique_ptr<Engine>> made = Engine::Create(options, &device_, model_.get());
    ASSERT_TRUE(made.ok()) << made.status();
    engine_ = *std::move(made);
    alice_ = *engine_->OpenSession(Spec("tenant-a", "alice"));
    absl::StatusOr<PoolGrant> grant = engine_->Grant(alice_);
    ASSERT_TRUE(grant.ok()) << grant.status();
    arena_ = std::make_unique<MappedArena>(*grant);
    layout_ = grant->layout;
  }
  // Every state slot, or every window block, scribbled over, as their reuse by other sequences
  // would: what a promotion puts there must come from a tier, not be left over.
  void PoisonStates() {
    std::memset(arena_->base() + layout_.state_offset(), 0x7f,
                static_cast<size_t>(layout_.num_state_slots * layout_.state_slot_bytes));
  }
  void PoisonWindows() {
    std::memset(arena_->base() + layout_.window_offset(), 0x7f,
                static_cast<size_t>(layout_.num_window_blocks * layout_.window_block_bytes()));
  }
  ComputeResult Prefill(const std::vector<int32_t>& prompt) {
    ComputeResult result = RunPrefill(*engine_, alice_, prompt);
    EXPECT_TRUE(result.status.ok()) << result.status;
    return result;
  }
  void Free(const ComputeResult& r, OnFree how) {
    ASSERT_TRUE(engine_->Free(*alice_, r.sequences, how, CallContext::Uncancellable()).ok());
    ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  }
  // Prefills `prompt` with the fixture's lock gap armed: the gap must open, the prompt resume
  // `reused` tokens and answer as `want` did, and nothing be left once it is freed.
  void ExpectResumedThroughTheGap(const std::vector<int32_t>& prompt, int64_t reused,
                                  const ComputeResult& want) {
    armed_ = true;
    const ComputeResult got = Prefill(prompt);
    EXPECT_FALSE(armed_);  // the gap opened
    EXPECT_EQ(got.reused, reused);
    ExpectSameAnswer(got, want);
    Free(got, OnFree::kDiscard);
    ExpectNothingLeft();
  }
  // What the pool's event log says `medium` holds now (Stored less Removed): its blocks (no
  // `group`: the main group's events) or the components of `group`.
  absl::flat_hash_set<BlockHash> HeldBy(KvMedium medium, std::optional<KvEventGroup> group) {
    std::vector<KvEvent> events;
    EXPECT_TRUE(engine_->ReadEvents(0, 1, 100000, &events));
    absl::flat_hash_set<BlockHash> held;
    for (const KvEvent& e : events) {
      if (e.type == KvEventType::kAllBlocksCleared) held.clear();  // every medium
      if (e.medium != medium) continue;
      const bool main = !e.group || e.group->index == 0;
      if (group ? e.group != group : !main) continue;
      for (const BlockHash& h : e.block_hashes) {
        if (e.type == KvEventType::kBlockStored) held.insert(h);
        if (e.type == KvEventType::kBlockRemoved) held.erase(h);
      }
    }
    return held;
  }
  // What the pool's snapshot (a consumer's view rebuilt after a gap) says `medium` holds, as
  // HeldBy.
  absl::flat_hash_set<BlockHash> SnapshotHeldBy(KvMedium medium,
                                                std::optional<KvEventGroup> group) {
    uint64_t resume = 0;
    absl::flat_hash_set<BlockHash> held;
    for (const KvEvent& e : engine_->SnapshotEvents(0, &resume)) {
      EXPECT_EQ(e.type, KvEventType::kBlockStored);
      if (e.medium != medium) continue;
      const bool main = !e.group || e.group->index == 0;
      if (group ? e.group != group : !main) continue;
      held.insert(e.block_hashes.begin(), e.block_hashes.end());
    }
    return held;
  }
  void ExpectNothingLeft() {
    EXPECT_TRUE(engine_->CheckInvariants().ok());
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    engine_->ListSequences(std::nullopt, kNoSession, &owners, &pools);
    EXPECT_TRUE(owners.empty());  // no loader left
  }

  TestDisk disk_;  // declared first: removed after the engine is gone
  FailingDevice device_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
  std::unique_ptr<MappedArena> arena_;
  kernels::PoolLayout layout_;
  std::atomic<bool> armed_{false};
  std::function<void(LockGap)> in_gap_;  // called in every lock gap, when set
};

// Issue 28, tiers: in a pool with a state group a prompt resumes only from a state checkpoint,
// so the host tier keeps the checkpoints taken at a full block's end beside their blocks, and a
// promotion brings the deepest one back with the blocks. Before, a promoted prefix of a hybrid
// model was never resumed from (its blocks came back, no checkpoint did).
class HybridTiersTest : public ModelTiersTest {
 protected:
  void Make(int64_t host_checkpoints, std::optional<LockGap> gap = std::nullopt) {
    const model::ModelConfig config = *model::NamedConfig("tiny-hybrid");
    EngineOptions options = SmallPool(16);
    UseModel(config, &options);
    kernels::PoolLayout& layout = options.pools[0].layout;
    layout.num_state_slots = 8;
    layout.state_slot_bytes = (config.state_bytes() + 63) / 64 * 64;
    options.model_name = "tiny-hybrid";
    options.pools[0].checkpoint_slots = 4;
    options.checkpoint_interval = 2;
    options.tiers.host_blocks = 32;
    options.tiers.host_checkpoints = host_checkpoints;
    Start(std::move(options), config, gap);
  }
};

TEST_F(HybridTiersTest, APromotedPrefixResumesFromTheHostTiersCheckpoint) {
  Make(/*host_checkpoints=*/0);  // one per checkpoint interval of host blocks: 16
  const std::vector<int32_t> prompt = Prompt(57, 31);  // 3 full blocks and 9 tokens
  // The prefill's checkpoints: every 2 blocks (32) and its last block boundary (48).
  Free(Prefill(prompt), OnFree::kCommit);
  TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.host_checkpoint_capacity, 16);
  EXPECT_EQ(tiers.demoted_checkpoints, 2u);
  EXPECT_EQ(tiers.host_checkpoints, 2);
  // Resumed from the device's checkpoint at 48: what a promoted one must reproduce.
  const ComputeResult on_device = Prefill(prompt);
  EXPECT_EQ(on_device.reused, 48);
  Free(on_device, OnFree::kDiscard);

  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  ASSERT_EQ(engine_->Stats().cache.pool.cached, 0);
  ASSERT_EQ(engine_->Stats().cache.states.active, 0);  // no slot holds anything now
  PoisonStates();
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 48);
  ASSERT_EQ(promoted.results.size(), 1u);
  ExpectSameAnswer(promoted, on_device);
  tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_checkpoints, 1u);
  EXPECT_EQ(tiers.promoted_from_host, 3u);
  EXPECT_EQ(tiers.demoted_checkpoints, 2u);  // the promoted one is not copied down again
  Free(promoted, OnFree::kDiscard);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// Checkpoints give way to others (checkpoint_slots) while their blocks stay on the device: the
// device's match is then cut at none, and the host tier gives the checkpoint back. The loader
// adopts the device's blocks past the cut (AllocateRequest::adopt_uncut): none is copied again.
TEST_F(HybridTiersTest, ACheckpointEvictedWhileItsBlocksStayComesBackFromTheHostTier) {
  Make(/*host_checkpoints=*/0);
  const std::vector<int32_t> prompt = Prompt(57, 34);
  Free(Prefill(prompt), OnFree::kCommit);
  const ComputeResult on_device = Prefill(prompt);
  ASSERT_EQ(on_device.reused, 48);
  Free(on_device, OnFree::kDiscard);
  // Two more prompts' checkpoints (two each) take the pool's 4 checkpoint slots; all three
  // prompts' blocks (4 each) fit its 16.
  for (uint32_t seed : {35u, 36u}) Free(Prefill(Prompt(57, seed)), OnFree::kCommit);
  const int64_t cached = engine_->Stats().cache.pool.cached;
  EXPECT_GE(cached, 12);
  PoisonStates();  // every slot not holding a checkpoint now, and those that do
  const ComputeResult again = Prefill(prompt);
  EXPECT_EQ(again.reused, 48);
  ExpectSameAnswer(again, on_device);
  EXPECT_EQ(engine_->Stats().tiers.promoted_checkpoints, 1u);
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_host, 0u);  // the device had every block
  Free(again, OnFree::kDiscard);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// The promotion's lock gaps forced open: the device's cache is emptied while the tiers are asked
// (the lookup is done again), while the copies run, and while the promotion waits for its call.
// Each time the prompt still resumes from the host tier's checkpoint, bit for bit, and no loader
// or slot is left behind.
TEST_F(HybridTiersTest, AnEvictionInEachPromotionGapStillResumesBitForBit) {
  for (const LockGap gap : {LockGap::kTierLookup, LockGap::kPromotionCopy, LockGap::kAdoption}) {
    SCOPED_TRACE(static_cast<int>(gap));
    Make(/*host_checkpoints=*/0, gap);
    const std::vector<int32_t> prompt = Prompt(57, 37);
    Free(Prefill(prompt), OnFree::kCommit);
    const ComputeResult on_device = Prefill(prompt);
    ASSERT_EQ(on_device.reused, 48);
    Free(on_device, OnFree::kDiscard);
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    PoisonStates();
    ExpectResumedThroughTheGap(prompt, 48, on_device);
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    EXPECT_EQ(engine_->Stats().cache.states.active, 0);
  }
}

// Without checkpoints in the host tier nothing promoted could be resumed from: no promotion.
TEST_F(HybridTiersTest, WithoutAHostCheckpointNothingIsPromoted) {
  Make(/*host_checkpoints=*/-1);
  const std::vector<int32_t> prompt = Prompt(57, 32);
  Free(Prefill(prompt), OnFree::kCommit);
  EXPECT_EQ(engine_->Stats().tiers.host_checkpoint_capacity, 0);
  EXPECT_EQ(engine_->Stats().tiers.host_blocks, 3);
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  const ComputeResult again = Prefill(prompt);
  EXPECT_EQ(again.reused, 0);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 0u);
  EXPECT_EQ(tiers.promoted_checkpoints, 0u);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// The disk tier keeps checkpoints too: a prefix published before a restart resumes after it from
// the disk's checkpoint, bit for bit, into slots that never held it.
TEST_F(HybridTiersTest, APrefixPublishedBeforeARestartResumesFromTheDisksCheckpoint) {
  disk_.Make();
  Make(/*host_checkpoints=*/0);
  const std::vector<int32_t> prompt = Prompt(57, 38);
  Free(Prefill(prompt), OnFree::kCommit);
  const ComputeResult on_device = Prefill(prompt);
  ASSERT_EQ(on_device.reused, 48);
  Free(on_device, OnFree::kDiscard);
  EXPECT_EQ(engine_->Stats().tiers.disk_checkpoints, 2);  // at 32 and 48
  Make(/*host_checkpoints=*/0);  // a restart: an empty pool and host tier, the same directory
  PoisonStates();
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 48);
  ExpectSameAnswer(promoted, on_device);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_disk, 3u);
  EXPECT_EQ(tiers.promoted_checkpoints, 1u);
  EXPECT_EQ(tiers.host_checkpoints, 1);  // kept in the host tier too
  Free(promoted, OnFree::kDiscard);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A promotion whose blocks all come from the host tier but whose checkpoint comes from the disk
// keeps that checkpoint in the host tier, and the host tier's events for it (Stored, and Removed
// for the checkpoint it evicted) are in the pool's event log as soon as the promotion published,
// before its call goes on. Before, they were drained only when a block came from below the host
// tier, and otherwise waited for an unrelated later drain (in an idle pool, none).
TEST_F(HybridTiersTest, ACheckpointTheDiskGaveIsAHostEventAtOnce) {
  disk_.Make();
  Make(/*host_checkpoints=*/2);
  const KvEventGroup state{.index = 1, .kind = KvGroupKind::kStateSpace};
  const std::vector<int32_t> prompt = Prompt(57, 40);
  Free(Prefill(prompt), OnFree::kCommit);
  // Another prompt's two checkpoints take the host tier's two slots; every block stays there.
  Free(Prefill(Prompt(57, 41)), OnFree::kCommit);
  ASSERT_EQ(engine_->Stats().tiers.host_blocks, 6);
  ASSERT_EQ(engine_->Stats().tiers.disk_checkpoints, 4);
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  const absl::flat_hash_set<BlockHash> before = HeldBy(KvMedium::kHost, state);
  ASSERT_EQ(before.size(), 2u);

  std::optional<absl::flat_hash_set<BlockHash>> published;
  in_gap_ = [&](LockGap g) {
    if (g == LockGap::kAdoption) published = HeldBy(KvMedium::kHost, state);
  };
  const ComputeResult promoted = Prefill(prompt);
  in_gap_ = nullptr;
  EXPECT_EQ(promoted.reused, 48);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 3u);
  EXPECT_EQ(tiers.promoted_from_disk, 0u);
  EXPECT_EQ(tiers.promoted_checkpoints, 1u);
  const absl::flat_hash_set<BlockHash> after = HeldBy(KvMedium::kHost, state);
  EXPECT_NE(after, before);            // the disk's checkpoint is in the host tier now
  ASSERT_TRUE(published.has_value());  // the promotion's hold waited for its call
  EXPECT_EQ(*published, after);
  Free(promoted, OnFree::kDiscard);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A tenant's invalidation takes its checkpoints with its blocks: none is promoted afterwards.
TEST_F(HybridTiersTest, AnInvalidationDropsTheHostTiersCheckpoints) {
  Make(/*host_checkpoints=*/0);
  const std::vector<int32_t> prompt = Prompt(57, 33);
  Free(Prefill(prompt), OnFree::kCommit);
  ASSERT_EQ(engine_->Stats().tiers.host_checkpoints, 2);
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  absl::StatusOr<Engine::Invalidation> dropped = engine_->Invalidate("tenant-a", "");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  // Gone, not only unreachable under the tenant's new namespace ids.
  EXPECT_EQ(engine_->Stats().tiers.host_checkpoints, 0);
  EXPECT_EQ(Prefill(prompt).reused, 0);
  EXPECT_EQ(engine_->Stats().tiers.promoted_checkpoints, 0u);
}

// Issue 28, events: the host and disk tiers' checkpoints are events of the state group, named by
// the hashes of the blocks they end, as the device's are; an invalidation removes them. Before,
// the tiers told of their main blocks only: a consumer saw a prefix there it could not resume.
TEST_F(HybridTiersTest, TheTiersCheckpointsAreEventsOfTheStateGroup) {
  disk_.Make();
  Make(/*host_checkpoints=*/0);
  const std::vector<int32_t> prompt = Prompt(57, 39);
  Free(Prefill(prompt), OnFree::kCommit);  // checkpoints at 32 and 48
  const KvEventGroup state{.index = 1, .kind = KvGroupKind::kStateSpace};
  const absl::flat_hash_set<BlockHash> on_device = HeldBy(KvMedium::kDevice, state);
  EXPECT_EQ(on_device.size(), 2u);
  EXPECT_EQ(HeldBy(KvMedium::kHost, state), on_device);
  EXPECT_EQ(HeldBy(KvMedium::kDisk, state), on_device);
  EXPECT_EQ(HeldBy(KvMedium::kHost, std::nullopt).size(), 3u);  // the blocks, as before
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  ASSERT_TRUE(engine_->Invalidate("tenant-a", "").ok());
  EXPECT_TRUE(HeldBy(KvMedium::kHost, state).empty());
  EXPECT_TRUE(HeldBy(KvMedium::kDisk, state).empty());
}

// A consumer that fell behind rebuilds from the pool's snapshot after clearing its view
// (WatchEvents, the ZeroMQ publisher's resync): the snapshot holds the tiers' blocks and
// checkpoints as their events told them. And a cleared device cache (AllBlocksCleared, which
// clears every medium) tells the tiers' again. Before, both held the device's alone: a consumer
// lost every tier block it knew.
TEST_F(HybridTiersTest, TheSnapshotAndAClearRestateTheTiersBlocksAndCheckpoints) {
  disk_.Make();
  Make(/*host_checkpoints=*/0);
  Free(Prefill(Prompt(57, 39)), OnFree::kCommit);  // 3 full blocks, checkpoints at 32 and 48
  const KvEventGroup state{.index = 1, .kind = KvGroupKind::kStateSpace};
  for (KvMedium medium : {KvMedium::kDevice, KvMedium::kHost, KvMedium::kDisk}) {
    for (std::optional<KvEventGroup> group : {std::optional<KvEventGroup>(), {state}}) {
      const absl::flat_hash_set<BlockHash> held = HeldBy(medium, group);
      EXPECT_EQ(held.size(), group ? 2u : 3u) << static_cast<int>(medium);
      EXPECT_EQ(SnapshotHeldBy(medium, group), held) << static_cast<int>(medium);
    }
  }
  const absl::flat_hash_set<BlockHash> host = HeldBy(KvMedium::kHost, std::nullopt);
  const absl::flat_hash_set<BlockHash> checkpoints = HeldBy(KvMedium::kHost, state);

  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  EXPECT_TRUE(HeldBy(KvMedium::kDevice, std::nullopt).empty());
  EXPECT_TRUE(HeldBy(KvMedium::kDevice, state).empty());
  EXPECT_EQ(HeldBy(KvMedium::kHost, std::nullopt), host);
  EXPECT_EQ(HeldBy(KvMedium::kHost, state), checkpoints);
  EXPECT_EQ(HeldBy(KvMedium::kDisk, state), checkpoints);
  EXPECT_EQ(SnapshotHeldBy(KvMedium::kDisk, std::nullopt), host);
  EXPECT_TRUE(SnapshotHeldBy(KvMedium::kDevice, std::nullopt).empty());
}

// Issue 28, tiers: a sliding-window model's promoted prefix. A prompt resumes only where the
// window group still holds the last W tokens (and the sinks), so a promotion must bring the
// window blocks its resume point needs, not only the full-attention blocks, and must never hand
// the caller window blocks nobody filled. Before, the tier loader's fresh window blocks were kept
// by the tree beside the promoted blocks, unfilled: the next prompt resumed and read them.
class WindowTiersTest : public ModelTiersTest {
 protected:
  static constexpr int32_t kWindow = 32;  // W: two blocks; the window group holds at most 3
  // `hybrid`: a model with a state-space layer too (its checkpoints every 2 blocks).
  void Make(int32_t sinks = 0, int64_t host_window_blocks = 0,
            std::optional<LockGap> gap = std::nullopt, int32_t blocks = 16, bool hybrid = false) {
    model::ModelConfig config = *model::NamedConfig(hybrid ? "tiny-hybrid" : "tiny-swa");
    if (hybrid) {
      config.layer_kinds = {model::LayerKind::kStateSpace, model::LayerKind::kSlidingAttention,
                            model::LayerKind::kFullAttention, model::LayerKind::kStateSpace};
    }
    config.sliding_window = kWindow;
    config.sink_tokens = sinks;
    EngineOptions options = SmallPool(blocks);
    UseModel(config, &options);
    kernels::PoolLayout& layout = options.pools[0].layout;
    layout.num_window_layers = config.num_sliding_layers();
    layout.num_window_blocks = 16;
    if (hybrid) {
      // Room for a 120-token prompt's five checkpoints (32, 64, 96, 112 and its end), so that
      // none gives way to another.
      layout.num_state_slots = 9;
      layout.state_slot_bytes = (config.state_bytes() + 63) / 64 * 64;
      options.pools[0].checkpoint_slots = 5;
      options.checkpoint_interval = 2;
    }
    options.model_name = hybrid ? "tiny-hybrid" : "tiny-swa";
    options.window_tokens = kWindow;
    options.sink_tokens = sinks;
    options.tiers.host_blocks = 2 * blocks;
    options.tiers.host_window_blocks = host_window_blocks;
    Start(std::move(options), config, gap);
  }
  // `prompt` computed from scratch, published, resumed once from the device (what a promotion
  // must reproduce), then evicted from the device with every window block poisoned.
  ComputeResult PublishResumeEvict(const std::vector<int32_t>& prompt, int64_t resumed) {
    const ComputeResult fresh = Prefill(prompt);
    EXPECT_EQ(fresh.reused, 0);
    Free(fresh, OnFree::kCommit);
    const ComputeResult on_device = Prefill(prompt);
    EXPECT_EQ(on_device.reused, resumed);
    ExpectSameAnswer(on_device, fresh);
    Free(on_device, OnFree::kDiscard);
    EXPECT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    EXPECT_EQ(engine_->Stats().cache.pool.cached, 0);
    EXPECT_EQ(engine_->Stats().cache.windows.cached, 0);
    PoisonWindows();
    return on_device;
  }
};

TEST_F(WindowTiersTest, APromotedPrefixResumesWithTheHostTiersWindowBlocks) {
  Make();
  const std::vector<int32_t> prompt = Prompt(120, 41);  // 7 full blocks and 8 tokens
  const ComputeResult on_device = PublishResumeEvict(prompt, 119);
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 112);  // the full blocks: the partial one is in no tier
  ASSERT_EQ(promoted.results.size(), 1u);
  ExpectSameAnswer(promoted, on_device);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 7u);
  // The window at 112 reads tokens [81, 112): blocks 5 and 6.
  EXPECT_EQ(tiers.promoted_window_blocks, 2u);
  Free(promoted, OnFree::kDiscard);
  ExpectNothingLeft();
}

// The sinks are read by every query: a promotion that starts at the prompt's beginning brings
// their block too.
TEST_F(WindowTiersTest, APromotionBringsTheSinksWindowBlocksToo) {
  Make(/*sinks=*/16);
  const std::vector<int32_t> prompt = Prompt(120, 42);
  const ComputeResult on_device = PublishResumeEvict(prompt, 119);
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 112);
  ExpectSameAnswer(promoted, on_device);
  EXPECT_EQ(engine_->Stats().tiers.promoted_window_blocks, 3u);  // the sink's, 5 and 6
  Free(promoted, OnFree::kDiscard);
  ExpectNothingLeft();
}

// Without window blocks in the host tier nothing promoted could be resumed from: no promotion,
// and above all no window block nobody filled is kept for the next prompt to read.
TEST_F(WindowTiersTest, WithoutHostWindowBlocksNothingIsPromoted) {
  Make(/*sinks=*/0, /*host_window_blocks=*/-1);
  const std::vector<int32_t> prompt = Prompt(120, 43);
  const ComputeResult on_device = PublishResumeEvict(prompt, 119);
  EXPECT_EQ(engine_->Stats().tiers.host_window_capacity, 0);
  const ComputeResult again = Prefill(prompt);
  EXPECT_EQ(again.reused, 0);
  EXPECT_EQ(again.results[0].next_token, on_device.results[0].next_token);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_host, 0u);
  EXPECT_EQ(tiers.promoted_window_blocks, 0u);
  Free(again, OnFree::kDiscard);
  ExpectNothingLeft();
}

// The window group is the scarce one: its kept blocks give way to other prompts' while the
// full-attention blocks stay on the device, which cuts the device's match to nothing. The host
// tier gives the window blocks back, and the tree keeps them beside its own blocks, which the
// loader adopts rather than copying them again (AllocateRequest::adopt_uncut).
TEST_F(WindowTiersTest, WindowBlocksEvictedWhileTheirBlocksStayComeBackFromTheHostTier) {
  Make(/*sinks=*/0, /*host_window_blocks=*/0, std::nullopt, /*blocks=*/64);
  const std::vector<int32_t> prompt = Prompt(120, 44);
  const ComputeResult fresh = Prefill(prompt);
  Free(fresh, OnFree::kCommit);
  // Each prompt, computed in one step, keeps its 7 full blocks' window blocks: the window group's
  // 16 keep two prompts', so two more prompts take the first one's (least recently used), while
  // the 64 blocks keep every prompt's.
  for (uint32_t seed : {45u, 46u}) Free(Prefill(Prompt(120, seed)), OnFree::kCommit);
  const KvCacheStats cache = engine_->Stats().cache;
  ASSERT_GE(cache.windows.evicted, 5u);
  ASSERT_EQ(cache.pool.cached, 24);
  PoisonWindows();  // every window block, kept or not
  const ComputeResult again = Prefill(prompt);
  EXPECT_EQ(again.reused, 112);
  ExpectSameAnswer(again, fresh);
  EXPECT_EQ(engine_->Stats().tiers.promoted_window_blocks, 2u);
  EXPECT_EQ(engine_->Stats().tiers.promoted_from_host, 0u);  // the device had every block
  Free(again, OnFree::kDiscard);
  ExpectNothingLeft();
}

// The same with the device's blocks adopted past the cut, and everything cached emptied in each
// of the promotion's lock gaps: the loader's adoption is re-validated (the lookup is done again,
// and the blocks then come from the host tier), and the answer stays bit for bit.
TEST_F(WindowTiersTest, AnEvictionInEachGapWhileTheDeviceHeldTheBlocksStillResumesBitForBit) {
  for (const LockGap gap : {LockGap::kTierLookup, LockGap::kPromotionCopy, LockGap::kAdoption}) {
    SCOPED_TRACE(static_cast<int>(gap));
    Make(/*sinks=*/0, /*host_window_blocks=*/0, gap, /*blocks=*/64);
    const std::vector<int32_t> prompt = Prompt(120, 54);
    const ComputeResult fresh = Prefill(prompt);
    Free(fresh, OnFree::kCommit);
    for (uint32_t seed : {55u, 56u}) Free(Prefill(Prompt(120, seed)), OnFree::kCommit);
    ASSERT_GE(engine_->Stats().cache.windows.evicted, 5u);
    PoisonWindows();
    ExpectResumedThroughTheGap(prompt, 112, fresh);
  }
}

// The promotion's lock gaps forced open: the device's cache is emptied while the tiers are asked,
// while the copies run, and while the promotion waits for its call. Each time the prompt resumes
// with the host tier's window blocks, bit for bit, and no loader or window block is left behind.
TEST_F(WindowTiersTest, AnEvictionInEachPromotionGapStillResumesBitForBit) {
  for (const LockGap gap : {LockGap::kTierLookup, LockGap::kPromotionCopy, LockGap::kAdoption}) {
    SCOPED_TRACE(static_cast<int>(gap));
    Make(/*sinks=*/0, /*host_window_blocks=*/0, gap);
    const std::vector<int32_t> prompt = Prompt(120, 50);
    const ComputeResult on_device = PublishResumeEvict(prompt, 119);
    ExpectResumedThroughTheGap(prompt, 112, on_device);
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    EXPECT_EQ(engine_->Stats().cache.window.active, 0);
  }
}

// A model with both: a promoted prefix resumes at the deepest checkpoint the host tier has, and
// only with the window blocks the window reads there, bit for bit.
TEST_F(WindowTiersTest, AHybridWithBothGroupsResumesAtTheCheckpointWithItsWindow) {
  Make(/*sinks=*/0, /*host_window_blocks=*/0, std::nullopt, /*blocks=*/16, /*hybrid=*/true);
  const std::vector<int32_t> prompt = Prompt(120, 52);
  // Checkpoints at 32, 64, 96 and the prefill's last block boundary, 112.
  const ComputeResult on_device = PublishResumeEvict(prompt, 112);
  EXPECT_GE(engine_->Stats().tiers.host_checkpoints, 1);
  PoisonStates();
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 112);
  ExpectSameAnswer(promoted, on_device);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_checkpoints, 1u);
  EXPECT_EQ(tiers.promoted_window_blocks, 2u);
  Free(promoted, OnFree::kDiscard);
  ExpectNothingLeft();
}

// The disk tier keeps window blocks too: a prefix published before a restart resumes after it
// with the disk's window blocks, bit for bit, and an invalidation drops them there as well.
TEST_F(WindowTiersTest, APrefixPublishedBeforeARestartResumesFromTheDisksWindowBlocks) {
  disk_.Make();
  Make();
  const std::vector<int32_t> prompt = Prompt(120, 53);
  const ComputeResult on_device = PublishResumeEvict(prompt, 119);
  ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
  EXPECT_EQ(engine_->Stats().tiers.disk_window_blocks, 7);
  Make();  // a restart: an empty pool and host tier, the same directory
  PoisonWindows();
  const ComputeResult promoted = Prefill(prompt);
  EXPECT_EQ(promoted.reused, 112);
  ExpectSameAnswer(promoted, on_device);
  TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.promoted_from_disk, 7u);
  EXPECT_EQ(tiers.promoted_window_blocks, 2u);
  EXPECT_EQ(tiers.host_window_blocks, 2);  // kept in the host tier too
  Free(promoted, OnFree::kDiscard);
  ExpectNothingLeft();
  ASSERT_TRUE(engine_->Invalidate("tenant-a", "").ok());
  EXPECT_EQ(engine_->Stats().tiers.disk_window_blocks, 0);
}

// A tenant's invalidation takes its window blocks with its blocks.
TEST_F(WindowTiersTest, AnInvalidationDropsTheHostTiersWindowBlocks) {
  Make();
  const std::vector<int32_t> prompt = Prompt(120, 51);
  Free(Prefill(prompt), OnFree::kCommit);
  const TierStats tiers = engine_->Stats().tiers;
  EXPECT_EQ(tiers.host_window_capacity, 32);  // 16 window blocks per 16 blocks, of 32 host blocks
  // Computed in one step, every full block's window block was live at the commit, and kept.
  EXPECT_EQ(tiers.demoted_window_blocks, 7u);
  ASSERT_EQ(tiers.host_window_blocks, 7);
  ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
  absl::StatusOr<Engine::Invalidation> dropped = engine_->Invalidate("tenant-a", "");
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(engine_->Stats().tiers.host_window_blocks, 0);
  EXPECT_EQ(Prefill(prompt).reused, 0);
  EXPECT_EQ(engine_->Stats().tiers.promoted_window_blocks, 0u);
}

// Issue 28, events: in a pool with both groups the tiers' window blocks are events of the window
// group (index 1) and their checkpoints of the state group (index 2), as the device's are.
TEST_F(WindowTiersTest, TheTiersWindowBlocksAndCheckpointsAreEventsOfTheirGroups) {
  disk_.Make();
  Make(/*sinks=*/0, /*host_window_blocks=*/0, std::nullopt, /*blocks=*/16, /*hybrid=*/true);
  Free(Prefill(Prompt(120, 52)), OnFree::kCommit);
  const KvEventGroup window{
      .index = 1, .kind = KvGroupKind::kSlidingWindow, .sliding_window = kWindow};
  const KvEventGroup state{.index = 2, .kind = KvGroupKind::kStateSpace};
  for (const KvEventGroup& group : {window, state}) {
    SCOPED_TRACE(group.index);
    const absl::flat_hash_set<BlockHash> on_device = HeldBy(KvMedium::kDevice, group);
    EXPECT_FALSE(on_device.empty());
    EXPECT_EQ(HeldBy(KvMedium::kHost, group), on_device);
    EXPECT_EQ(HeldBy(KvMedium::kDisk, group), on_device);
  }
  EXPECT_EQ(HeldBy(KvMedium::kDevice, window).size(),
            static_cast<size_t>(engine_->Stats().tiers.host_window_blocks));
  EXPECT_EQ(HeldBy(KvMedium::kDevice, state).size(),
            static_cast<size_t>(engine_->Stats().tiers.host_checkpoints));
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

// The step's lock gap: a KV client rewinds its sequence and grows it again while a prefill of it
// runs, so the blocks the step writes are no longer the sequence's. Finish must not publish the
// fresh blocks (never written) as holding the step's tokens.
// A remote tier that has every block (a Redis with every checkpoint): each lookup hits whole,
// writing a mark at the start of each buffer only (the buffers are the test's subject, not the
// bytes).
class EverythingRemote final : public tier::RemoteTier {
 public:
  bool Put(const tier::BlockSpace&, const tier::BlockToStore&) override { return true; }
  absl::Status Flush(absl::Duration) override { return absl::OkStatus(); }
  tier::RemoteTierStats stats() const override { return {}; }
  std::atomic<int> lookups{0};

 protected:
  tier::LookupResult LookupChecked(const tier::BlockSpace&, const BlockHash&,
                                   std::span<const BlockHash> hashes,
                                   std::span<const std::span<std::byte>> out) override {
    ++lookups;
    for (std::span<std::byte> o : out) o[0] = std::byte{7};
    return {.hits = static_cast<int64_t>(hashes.size()),
            .coverage = std::vector<uint32_t>(hashes.size(), 16)};
  }
};

// A TierSet over `layout` whose only store is an EverythingRemote (*remote: it).
std::unique_ptr<TierSet> OverEverything(kernels::Device* device, const kernels::PoolLayout& layout,
                                        EverythingRemote** remote) {
  auto made = std::make_unique<EverythingRemote>();
  *remote = made.get();
  return std::make_unique<TierSet>(device, layout, Clock::Real(),
                                   TierSet::Stores{.remote = std::move(made)},
                                   /*staged_blocks=*/4);
}

// `n` full blocks of 16 tokens in `ns`, chained.
std::vector<BlockHash> Blocks(NamespaceId ns, int n) {
  std::vector<BlockHash> chain;
  BlockHash parent;
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> tokens(16, i);
    chain.push_back(parent = PrefixChainHash(parent, ns, tokens));
  }
  return chain;
}

// Three of them.
std::vector<BlockHash> ThreeBlocks(NamespaceId ns) { return Blocks(ns, 3); }

// Checkpoint buffers of all lookups together stay within kMaxStagedBytes: with a state of more
// than half of it, one lookup holding its buffer leaves the next none (truncated, counted, Redis
// not asked), until the first is recycled. At least one is always allowed.
TEST(TierBoundsTest, CheckpointBuffersOfAllLookupsStayWithinTheStagingBound) {
  kernels::CpuDevice device(1);
  const kernels::PoolLayout layout{.block_size = 16,
                                   .num_layers = 1,
                                   .num_kv_heads = 1,
                                   .head_dim = 64,
                                   .dtype = kernels::DType::kF32,
                                   .num_blocks = 8,
                                   .num_state_slots = 2,
                                   .state_slot_bytes = kMaxStagedBytes / 2 + 4096};
  EverythingRemote* remote = nullptr;
  const std::unique_ptr<TierSet> set = OverEverything(&device, layout, &remote);
  TierSet& tiers = *set;
  EverythingRemote& redis = *remote;
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = ThreeBlocks(ns);
  TierSet::Found first;
  tiers.LookupCheckpoint(ns, chain, 0, 3, &first);
  ASSERT_EQ(first.checkpoint, 2);  // the deepest
  ASSERT_NE(first.checkpoint_buffer, nullptr);
  EXPECT_EQ(first.checkpoint_bytes(layout.state_slot_bytes)[0], std::byte{7});
  const int asked = redis.lookups.load();

  TierSet::Found second;
  tiers.LookupCheckpoint(ns, chain, 0, 3, &second);
  EXPECT_EQ(second.checkpoint, -1);
  EXPECT_EQ(second.checkpoint_buffer, nullptr);
  EXPECT_EQ(redis.lookups.load(), asked);  // not asked: no buffer to read into
  EXPECT_EQ(tiers.stats().lookup_truncated, 1u);

  tiers.Recycle(&first);  // its buffer goes back
  TierSet::Found third;
  tiers.LookupCheckpoint(ns, chain, 0, 3, &third);
  EXPECT_EQ(third.checkpoint, 2);
  EXPECT_EQ(tiers.stats().lookup_truncated, 1u);
  tiers.Recycle(&third);
  tiers.Recycle(&second);
}

// The same bound for the window blocks LookupWindow reads from the disk or Redis: with a window
// block of more than half of it, one lookup holding its buffer leaves the next none (the point it
// finds falls back to where it started), until the first is recycled.
TEST(TierBoundsTest, WindowBuffersOfAllLookupsStayWithinTheStagingBound) {
  kernels::CpuDevice device(1);
  kernels::PoolLayout layout{.block_size = 16,
                             .num_layers = 2,
                             .num_kv_heads = 1,
                             .head_dim = 1,
                             .dtype = kernels::DType::kF32,
                             .num_blocks = 8,
                             .num_window_layers = 1,
                             .num_window_blocks = 4};
  // 16 tokens x K,V x 4 bytes per dim: just over half the bound.
  layout.head_dim = static_cast<int32_t>((kMaxStagedBytes / 2) / (16 * 2 * 4) + 64);
  ASSERT_GT(layout.window_block_bytes(), kMaxStagedBytes / 2);
  ASSERT_LE(layout.window_block_bytes(), kMaxStagedBytes);
  EverythingRemote* remote = nullptr;
  const std::unique_ptr<TierSet> set = OverEverything(&device, layout, &remote);
  TierSet& tiers = *set;
  EverythingRemote& redis = *remote;
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = ThreeBlocks(ns);
  // A window of one block, no sinks: resuming after 3 blocks reads block 2's window block only.
  const TierSet::WindowReach reach{.block_size = 16, .window_tokens = 16, .sink_blocks = 0};
  TierSet::Found first;
  ASSERT_EQ(tiers.LookupWindow(ns, chain, 0, 3, reach, &first), 3u);
  EXPECT_EQ(first.window_block(2)[0], std::byte{7});
  const int asked = redis.lookups.load();

  TierSet::Found second;
  EXPECT_EQ(tiers.LookupWindow(ns, chain, 0, 3, reach, &second), 0u);
  EXPECT_EQ(redis.lookups.load(), asked);  // not asked: no buffer to read into
  EXPECT_EQ(tiers.stats().lookup_truncated, 1u);

  tiers.Recycle(&first);
  TierSet::Found third;
  EXPECT_EQ(tiers.LookupWindow(ns, chain, 0, 3, reach, &third), 3u);
  EXPECT_EQ(tiers.stats().lookup_truncated, 1u);
  tiers.Recycle(&third);
  tiers.Recycle(&second);
}

// The same bound on the way down (StageComponents): checkpoints staged for the writer take at
// most kMaxStagedBytes, at least one. With a state of more than half of it and the writer held
// (the transfer stream blocked, so the first copy has not run), a second published checkpoint is
// dropped, counted; once the first is written, a third is staged again.
TEST(TierBoundsTest, StagedCheckpointsStayWithinTheStagingBound) {
  kernels::CpuDevice device(1);
  kernels::PoolLayout layout{.block_size = 16,
                             .num_layers = 1,
                             .num_kv_heads = 1,
                             .head_dim = 64,
                             .dtype = kernels::DType::kF32,
                             .num_blocks = 8,
                             .num_state_slots = 3,
                             .state_slot_bytes = kMaxStagedBytes / 2 + 4096};
  EverythingRemote* remote = nullptr;
  const std::unique_ptr<TierSet> set = OverEverything(&device, layout, &remote);
  TierSet& tiers = *set;
  ASSERT_TRUE(tiers.keeps_checkpoints());
  // Three sequences, each holding a state slot (MarkStatesInFlight takes live slots only).
  std::unique_ptr<KvCacheManager> cache = *KvCacheManager::Create({.block_size = 16,
                                                                   .num_blocks = 8,
                                                                   .max_blocks_per_seq = 2,
                                                                   .fences = &device,
                                                                   .state_slots = 3});
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = ThreeBlocks(ns);
  std::vector<PublishedCheckpoint> published;
  for (int i = 0; i < 3; ++i) {
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> made =
        cache->Allocate(SessionId(1), {.ns = ns, .num_tokens = 16}, &plan);
    ASSERT_TRUE(made.ok()) << made.status();
    const BlockId slot = cache->Find(made->sequence)->state_slot;
    ASSERT_NE(slot, kInvalidBlock);
    published.push_back(
        {.block = {.ns = ns,
                   .block = BlockId(i),
                   .hash = chain[static_cast<size_t>(i)],
                   .parent = i == 0 ? BlockHash{} : chain[static_cast<size_t>(i - 1)]},
         .slot = slot});
  }
  // The pool's memory: only the state slots are read (untouched pages read as zeros).
  const auto arena_bytes =
      static_cast<size_t>(layout.state_offset() + layout.num_state_slots * layout.state_slot_bytes);
  const std::unique_ptr<std::byte[]> arena(new std::byte[arena_bytes]);
  const kernels::KvPoolView view{.base = arena.get(), .layout = layout};

  absl::Notification gate;
  ASSERT_TRUE(
      device.EnqueueHostTask(kernels::StreamId::kTransfer, [&] { gate.WaitForNotification(); })
          .ok());
  tiers.StageCheckpoints(*cache, view, std::span(published).subspan(0, 1));
  tiers.StageCheckpoints(*cache, view, std::span(published).subspan(1, 1));
  EXPECT_EQ(tiers.stats().demote_dropped_full, 1u);  // the second: no room while the first waits
  gate.Notify();
  ASSERT_TRUE(tiers.Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(tiers.stats().demoted_checkpoints, 1u);
  tiers.StageCheckpoints(*cache, view, std::span(published).subspan(2, 1));
  ASSERT_TRUE(tiers.Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(tiers.stats().demoted_checkpoints, 2u);
  EXPECT_EQ(tiers.stats().demote_dropped_full, 1u);
  tiers.Stop();
}

// A remote tier holding the values of chosen blocks only, each under the space it was stored in
// (a Redis whose other values were evicted): a lookup hits the leading run it has.
class SelectiveRemote final : public tier::RemoteTier {
 public:
  void Add(uint64_t layout_fingerprint, const BlockHash& hash) {
    has_.emplace_back(layout_fingerprint, hash);
  }
  bool Put(const tier::BlockSpace&, const tier::BlockToStore&) override { return true; }
  absl::Status Flush(absl::Duration) override { return absl::OkStatus(); }
  tier::RemoteTierStats stats() const override { return {}; }
  std::atomic<int> lookups{0};

 protected:
  tier::LookupResult LookupChecked(const tier::BlockSpace& space, const BlockHash&,
                                   std::span<const BlockHash> hashes,
                                   std::span<const std::span<std::byte>> out) override {
    ++lookups;
    tier::LookupResult r;
    for (size_t i = 0; i < hashes.size(); ++i) {
      const std::pair<uint64_t, BlockHash> key(space.layout_fingerprint, hashes[i]);
      if (std::find(has_.begin(), has_.end(), key) == has_.end()) break;
      out[i][0] = std::byte{7};
      ++r.hits;
      r.coverage.push_back(16);
    }
    return r;
  }

 private:
  std::vector<std::pair<uint64_t, BlockHash>> has_;
};

// A layout of one attention and one window layer (window blocks of 16 tokens), with state slots
// when `state`.
kernels::PoolLayout SmallHybrid(bool state) {
  return {.block_size = 16,
          .num_layers = 2,
          .num_kv_heads = 1,
          .head_dim = 4,
          .dtype = kernels::DType::kF32,
          .num_blocks = 16,
          .num_state_slots = state ? 4 : 0,
          .state_slot_bytes = state ? 256 : 0,
          .num_window_layers = 1,
          .num_window_blocks = 8};
}

// A checkpoint or window block StageComponents cannot stage is counted as Stage counts a block:
// after Stop() (Stop's contract: later Stage calls only drop, counted) in demote_dropped_full,
// and when the transfer stream cannot be ordered after the compute stream (a device error) in
// demote_failed. Neither is marked in flight.
TEST(TierBoundsTest, ComponentsStagedAfterStopOrAFailedStreamWaitAreCounted) {
  FailingDevice device;
  const kernels::PoolLayout layout = SmallHybrid(/*state=*/true);
  EverythingRemote* remote = nullptr;
  const std::unique_ptr<TierSet> set = OverEverything(&device, layout, &remote);
  TierSet& tiers = *set;
  ASSERT_TRUE(tiers.keeps_checkpoints());
  ASSERT_TRUE(tiers.keeps_window_blocks());
  std::unique_ptr<KvCacheManager> cache = *KvCacheManager::Create(
      {.block_size = 16, .num_blocks = 8, .max_blocks_per_seq = 2, .fences = &device});
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = ThreeBlocks(ns);
  const PublishedBlock block{.ns = ns, .block = BlockId(0), .hash = chain[0]};
  const std::vector<PublishedCheckpoint> checkpoint{{.block = block, .slot = BlockId(0)}};
  const std::vector<PublishedWindowBlock> window{{.block = block, .window = BlockId(0)}};
  const auto arena_bytes = static_cast<size_t>(layout.arena_bytes());
  const std::unique_ptr<std::byte[]> arena(new std::byte[arena_bytes]);
  const kernels::KvPoolView view{.base = arena.get(), .layout = layout};

  // Some compute work, so that staging orders the transfer stream after it.
  ASSERT_TRUE(device.EnqueueHostTask(kernels::StreamId::kCompute, [] {}).ok());
  device.fail_stream_wait = true;
  tiers.StageCheckpoints(*cache, view, checkpoint);
  EXPECT_EQ(tiers.stats().demote_failed, 1u);
  tiers.StageWindowBlocks(*cache, view, window);
  EXPECT_EQ(tiers.stats().demote_failed, 2u);
  device.fail_stream_wait = false;

  tiers.Stop();
  tiers.StageCheckpoints(*cache, view, checkpoint);
  EXPECT_EQ(tiers.stats().demote_dropped_full, 1u);
  tiers.StageWindowBlocks(*cache, view, window);
  EXPECT_EQ(tiers.stats().demote_dropped_full, 2u);
  EXPECT_EQ(tiers.stats().demoted_checkpoints, 0u);
  EXPECT_EQ(tiers.stats().demote_failed, 2u);
}

// A TierSet over `layout` whose only store is a SelectiveRemote (*remote: it) holding the
// checkpoints and window blocks of `chain`'s blocks at indexes `checkpoints` and `windows`.
std::unique_ptr<TierSet> OverSelective(kernels::Device* device, const kernels::PoolLayout& layout,
                                       std::span<const BlockHash> chain,
                                       std::initializer_list<size_t> checkpoints,
                                       std::initializer_list<size_t> windows,
                                       SelectiveRemote** remote) {
  auto made = std::make_unique<SelectiveRemote>();
  for (const size_t i : checkpoints) made->Add(layout.Hash() ^ kCheckpointKeySalt, chain[i]);
  for (const size_t i : windows) made->Add(layout.Hash() ^ kWindowKeySalt, chain[i]);
  *remote = made.get();
  return std::make_unique<TierSet>(device, layout, Clock::Real(),
                                   TierSet::Stores{.remote = std::move(made)},
                                   /*staged_blocks=*/4);
}

// The disk and Redis are asked for what shallower resume points' windows reach too, not only the
// deepest one's: with a window of one block and only block 2's window block in Redis, a prefix of
// six blocks resumes after three. (Before, Redis was asked for block 5's alone, and the lookup
// found no point.) The rounds are bounded: with only block 0's, four candidates are asked (blocks
// 5, 4, 3, 2), one round trip each, and no point is found.
TEST(TierResumeTest, RedisIsAskedForTheWindowsOfShallowerPointsToo) {
  kernels::CpuDevice device(1);
  const kernels::PoolLayout layout = SmallHybrid(/*state=*/false);
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = Blocks(ns, 6);
  const TierSet::WindowReach reach{.block_size = 16, .window_tokens = 16, .sink_blocks = 0};
  for (const size_t in_redis : {size_t{2}, size_t{0}}) {
    SCOPED_TRACE(in_redis);
    SelectiveRemote* remote = nullptr;
    const std::unique_ptr<TierSet> set =
        OverSelective(&device, layout, chain, {}, {in_redis}, &remote);
    TierSet& tiers = *set;
    SelectiveRemote& redis = *remote;
    TierSet::Found found;
    const size_t point = tiers.LookupWindow(ns, chain, 0, 6, reach, &found);
    if (in_redis == 2) {
      EXPECT_EQ(point, 3u);
      EXPECT_EQ(found.window_block(2)[0], std::byte{7});
      EXPECT_EQ(redis.lookups.load(), 4);  // blocks 5, 4, 3, then 2
    } else {
      EXPECT_EQ(point, 0u);
      EXPECT_EQ(redis.lookups.load(), TierSet::kMaxWindowRounds);
    }
    tiers.Recycle(&found);
  }
}

// With a state group and a window group a prompt resumes at a checkpoint whose window the tiers
// have whole. When the deepest checkpoint's is not, the next shallower checkpoint is tried (before,
// nothing was promoted): checkpoints after blocks 5 and 2, window blocks of block 2 only, resume
// after 3 blocks. With no checkpoint whose window is whole, nothing, and nothing is held.
TEST(TierResumeTest, AShallowerCheckpointIsTriedWhenTheDeepestOnesWindowIsNotWhole) {
  kernels::CpuDevice device(1);
  const kernels::PoolLayout layout = SmallHybrid(/*state=*/true);
  const NamespaceId ns(3);
  const std::vector<BlockHash> chain = Blocks(ns, 6);
  const TierSet::WindowReach reach{.block_size = 16, .window_tokens = 16, .sink_blocks = 0};
  for (const bool shallower : {true, false}) {
    SCOPED_TRACE(shallower);
    SelectiveRemote* remote = nullptr;
    const std::unique_ptr<TierSet> set =
        shallower ? OverSelective(&device, layout, chain, {5, 2}, {2}, &remote)
                  : OverSelective(&device, layout, chain, {5}, {2}, &remote);
    TierSet& tiers = *set;
    TierSet::Found found;
    const size_t point = tiers.LookupResume(ns, chain, 0, 6, /*checkpoint=*/true, &reach, &found);
    if (shallower) {
      EXPECT_EQ(point, 3u);
      EXPECT_EQ(found.checkpoint, 2);
      ASSERT_NE(found.checkpoint_buffer, nullptr);
      EXPECT_EQ(found.checkpoint_bytes(layout.state_slot_bytes)[0], std::byte{7});
      EXPECT_EQ(found.window_block(2)[0], std::byte{7});
    } else {
      EXPECT_EQ(point, 0u);
      EXPECT_EQ(found.checkpoint, -1);
      EXPECT_EQ(found.checkpoint_buffer, nullptr);
      for (const auto& b : found.window_buffers) EXPECT_EQ(b, nullptr);
    }
    tiers.Recycle(&found);
  }
}

// tiny-swa with a window of 32 tokens (two blocks), and a pool of 16 blocks for it in f32.
model::ModelConfig SlidingWindowConfig() {
  model::ModelConfig config = *model::NamedConfig("tiny-swa");
  config.sliding_window = 32;
  return config;
}
EngineOptions SlidingWindowPool(const model::ModelConfig& config) {
  EngineOptions options = testing::SmallPool(16);
  kernels::PoolLayout& layout = options.pools[0].layout;
  layout.num_layers = config.pool_layers();
  layout.num_kv_heads = config.num_kv_heads;
  layout.head_dim = config.head_dim;
  layout.dtype = kernels::DType::kF32;
  layout.num_window_layers = config.num_sliding_layers();
  layout.num_window_blocks = 16;
  options.model_name = "tiny-swa";
  options.window_tokens = config.sliding_window;
  return options;
}

// A KV client whose own calls race its model steps: armed, it rewinds its sequence and grows it
// again in the next step's gap (the lock free, the step planned).
class StepGapTest : public ::testing::Test {
 protected:
  // The tiny model over SmallPool(16), or `config` over `options` laid out for it.
  void Make() { Make(testing::SmallPool(16), *model::NamedConfig("tiny")); }
  void Make(EngineOptions options, const model::ModelConfig& config) {
    options.lock_gap_hook = [this](LockGap gap) {
      if (gap != LockGap::kStepLaunch || !armed_.exchange(false)) return;
      ASSERT_TRUE(
          engine_->Truncate(*alice_, sequence_, rewind_to_, CallContext::Uncancellable()).ok());
      const GrowRequest grow{.sequence = sequence_, .num_tokens = regrow_to_};
      ASSERT_TRUE(engine_->Grow(*alice_, std::span(&grow, 1), CallContext::Uncancellable()).ok());
    };
    model_ = std::move(*model::Model::Create(model::SyntheticWeights(config, 1),
                                             options.pools[0].layout, {.threads = 1}));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(testing::Spec("t"));
  }
  // In the next step's gap: `sequence` rewound to `rewind_to` tokens and grown to `regrow_to`.
  void RewindAndRegrowInTheNextStep(SequenceId sequence, int64_t rewind_to, int64_t regrow_to) {
    sequence_ = sequence;
    rewind_to_ = rewind_to;
    regrow_to_ = regrow_to;
    armed_ = true;
  }

  testing::FailingDevice device_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_;
  std::atomic<bool> armed_{false};
  SequenceId sequence_{0};
  int64_t rewind_to_ = 0;
  int64_t regrow_to_ = 0;
};

TEST_F(StepGapTest, ASequenceRewoundAndRegrownDuringItsStepPublishesNothingItDidNotWrite) {
  Make();
  const std::vector<int32_t> first = testing::Prompt(32, 1);
  const ComputeResult made = RunPrefill(*engine_, alice_, first);
  ASSERT_TRUE(made.status.ok()) << made.status;
  std::vector<int32_t> turn = testing::Prompt(16, 2);
  turn[0] = made.results[0].next_token;  // the next turn starts with the pending token
  RewindAndRegrowInTheNextStep(made.sequences[0], 32, 48);
  const ComputeResult next = RunPrefill(*engine_, alice_, turn, made.sequences[0]);
  ASSERT_TRUE(next.status.ok()) << next.status;
  ASSERT_FALSE(armed_);  // the gap opened
  std::vector<int32_t> all = first;
  all.insert(all.end(), turn.begin(), turn.end());
  // The first turn's two blocks are published; the third block is not the one the step wrote.
  EXPECT_EQ(engine_->MatchPrefix(*alice_, all).value(), 32);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// The same race in a pool with a window group: the client rewinds its sequence into the step's
// first block's window and grows it again while a prefill of its next turn runs. The step's
// tokens are not the sequence's, so the step must not slide its window either: the client still
// has to compute tokens 63-95, whose queries read the window entries the slide released (entry 3
// was the client's own copy-on-write block, handed out by its Grow, then freed).
TEST_F(StepGapTest, ARegrownSequenceKeepsTheWindowItsClientComputesNext) {
  const model::ModelConfig config = SlidingWindowConfig();
  Make(SlidingWindowPool(config), config);
  const ComputeResult made = RunPrefill(*engine_, alice_, testing::Prompt(64, 1));
  ASSERT_TRUE(made.status.ok()) << made.status;
  const SequenceId sequence = made.sequences[0];  // window entries 0-1 released, 2-3 live
  std::vector<int32_t> turn = testing::Prompt(32, 2);
  turn[0] = made.results[0].next_token;
  RewindAndRegrowInTheNextStep(sequence, 63, 96);
  const ComputeResult next = RunPrefill(*engine_, alice_, turn, sequence);
  ASSERT_TRUE(next.status.ok()) << next.status;
  ASSERT_FALSE(armed_);  // the gap opened
  std::vector<SessionId> owners;
  std::vector<int32_t> pools;
  const Tables t = engine_->ListSequences(0, alice_->id, &owners, &pools);
  ASSERT_EQ(t.slices.size(), 1u);
  ASSERT_EQ(t.window_blocks.size(), 6u);
  EXPECT_NE(t.window_blocks[2], kInvalidBlock);  // what the query at 63 reads
  EXPECT_NE(t.window_blocks[3], kInvalidBlock);
  EXPECT_TRUE(engine_->Truncate(*alice_, sequence, 63, CallContext::Uncancellable()).ok());
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A prefill of a KV client's sequence whose window table stops short of its end (allocated with
// window_ahead) fills the entries below its start; when its caller gives up after the step ran,
// those go back too, as the grow's own RevertGrow would. Before, eight stayed held.
TEST_F(StepGapTest, AGivenUpPrefillTakesBackTheWindowEntriesItsGrowFilled) {
  const model::ModelConfig config = SlidingWindowConfig();
  Make(SlidingWindowPool(config), config);
  const std::vector<int32_t> prompt = testing::Prompt(160, 3);
  const AllocateRequest request{.num_tokens = 160, .prompt = prompt, .window_ahead = 32};
  absl::StatusOr<Tables> made =
      engine_->Allocate(*alice_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  const int64_t window_blocks = engine_->Stats().cache.window.active;  // 2 of its 10 entries
  // (Checked as it queues, as it joins its step, then as it answers: it gives up there.)
  const ComputeResult result =
      RunPrefill(*engine_, alice_, testing::Prompt(8, 4), made->slices[0].sequence,
                 std::make_shared<testing::GivesUpAfter>(2));
  EXPECT_EQ(result.status.code(), absl::StatusCode::kCancelled) << result.status;
  EXPECT_EQ(engine_->Stats().cache.window.active, window_blocks);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

}  // namespace
}  // namespace kvpool::daemon
