// Namespace quotas over every layer group (docs/hybrid-groups.md §4): with
// KvCacheOptions::block_bytes a quota of N blocks bounds N blocks' bytes, and the window group's
// ACTIVE blocks and the live sequences' state slots are charged their own bytes beside the main
// blocks. Without the charge a tenant of a hybrid pool held as many state slots and window blocks
// as it liked within a quota that counted its full-attention blocks only.

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/manual_fences.h"

namespace kvpool {
namespace {

using ::testing::HasSubstr;

constexpr SessionId kAlice(1);
constexpr NamespaceId kTenant(100);
constexpr NamespaceId kOther(200);
constexpr int32_t kBlockSize = 16;
constexpr int64_t kBlockBytes = 100;
constexpr int64_t kWindowBytes = 50;
constexpr int64_t kStateBytes = 250;

using testing::ManualFences;

std::vector<int32_t> Prompt(int32_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = 5 * i + 1;
  return out;
}

struct Groups {
  int32_t state_slots = 0;
  int32_t window_blocks = 0;
  bool bytes = true;  // charge bytes (KvCacheOptions::block_bytes) or count blocks only
};

class GroupQuotaTest : public ::testing::Test {
 protected:
  void Make(const Groups& g) {
    auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                         .num_blocks = 64,
                                         .max_blocks_per_seq = 16,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .state_slots = g.state_slots,
                                         .window_blocks = g.window_blocks,
                                         .window_tokens = g.window_blocks > 0 ? 32 : 0,
                                         .block_bytes = g.bytes ? kBlockBytes : 0,
                                         .window_block_bytes = g.bytes ? kWindowBytes : 0,
                                         .state_bytes = g.bytes ? kStateBytes : 0});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  absl::StatusOr<AllocateResult> Alloc(int64_t tokens, std::span<const int32_t> prompt = {},
                                       int64_t window_ahead = -1, NamespaceId ns = kTenant) {
    DevicePlan plan;
    return cache_->Allocate(
        kAlice, {.ns = ns, .num_tokens = tokens, .prompt = prompt, .window_ahead = window_ahead},
        &plan);
  }

  int64_t Used(NamespaceId ns = kTenant) const { return cache_->QuotaOf(ns)->used; }

  static void ExpectQuotaRefusal(const absl::Status& status) {
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    ASSERT_TRUE(GetShortfall(status).has_value()) << status;
    EXPECT_EQ(GetShortfall(status)->resource, Resource::kNamespaceQuota);
  }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    EXPECT_TRUE(status.ok()) << status;
  }

  ManualClock clock_;
  ManualFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
};

TEST_F(GroupQuotaTest, CreateRefusesBytesItCannotCharge) {
  const auto make = [](int64_t block, int64_t window, int64_t state) {
    return KvCacheManager::Create({.block_size = 16,
                                   .num_blocks = 8,
                                   .max_blocks_per_seq = 8,
                                   .block_bytes = block,
                                   .window_block_bytes = window,
                                   .state_bytes = state})
        .status();
  };
  EXPECT_TRUE(make(0, 0, 0).ok());
  EXPECT_TRUE(make(64, 32, 640).ok());
  for (const absl::Status& s :
       {make(-1, 0, 0), make(64, -1, 0), make(64, 0, -1), make(0, 32, 0), make(0, 0, 640)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("block_bytes"));
  }
}

TEST_F(GroupQuotaTest, EachSequencesStateSlotIsChargedItsBytes) {
  Make({.state_slots = 8});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 8).ok());  // 800 bytes
  EXPECT_EQ(cache_->QuotaOf(kTenant)->bound, 8 * kBlockBytes);
  absl::StatusOr<AllocateResult> a = Alloc(20);  // 2 blocks and a slot
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Used(), 2 * kBlockBytes + kStateBytes);
  absl::StatusOr<AllocateResult> empty = Alloc(0);  // no block, still a slot
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(Used(), 2 * kBlockBytes + 2 * kStateBytes);
  // Counting blocks alone, this fork (one copied block) would fit a quota of 8 blocks.
  DevicePlan plan;
  const absl::StatusOr<SequenceId> fork = cache_->Fork(kAlice, a->sequence, &plan);
  ExpectQuotaRefusal(fork.status());
  EXPECT_EQ(GetShortfall(fork.status())->blocks, 3);  // 250 bytes over: 2.5 blocks, up
  EXPECT_THAT(std::string(fork.status().message()),
              HasSubstr("700 of 800 bytes in use: a quota of 8 blocks of 100 bytes"));
  EXPECT_EQ(cache_->stats().sequences, 2);  // nothing changed
  EXPECT_EQ(Used(), 2 * kBlockBytes + 2 * kStateBytes);
  ExpectQuotaRefusal(Alloc(0).status());
  // A slot given back makes room for one.
  ASSERT_TRUE(cache_->Free(kAlice, empty->sequence, OnFree::kDiscard).ok());
  EXPECT_EQ(Used(), 2 * kBlockBytes + kStateBytes);
  ASSERT_TRUE(cache_->Fork(kAlice, a->sequence, &plan).ok());
  EXPECT_EQ(Used(), 3 * kBlockBytes + 2 * kStateBytes);
  ExpectInvariants();
}

TEST_F(GroupQuotaTest, WithoutBytesAQuotaCountsMainBlocksOnly) {
  Make({.state_slots = 8, .window_blocks = 16, .bytes = false});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 4).ok());
  ASSERT_TRUE(Alloc(48).ok());
  EXPECT_EQ(Used(), 3);  // 3 blocks: the window blocks and the slot are not counted
  ASSERT_TRUE(Alloc(0).ok());
  ASSERT_TRUE(Alloc(16).ok());
  EXPECT_EQ(Used(), 4);
  const absl::Status over = Alloc(1).status();
  ExpectQuotaRefusal(over);
  EXPECT_THAT(std::string(over.message()), HasSubstr("4 of 4 blocks in use"));
  ExpectInvariants();
}

TEST_F(GroupQuotaTest, ActiveWindowBlocksAreChargedTheirBytes) {
  Make({.window_blocks = 32});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 6).ok());
  absl::StatusOr<AllocateResult> a = Alloc(48);  // 3 blocks, 3 window blocks
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Used(), 3 * kBlockBytes + 3 * kWindowBytes);
  absl::StatusOr<AllocateResult> b = Alloc(16);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Used(), 4 * kBlockBytes + 4 * kWindowBytes);
  // One more block and window block: 750 bytes of 600 (blocks alone: 5 of 6).
  DevicePlan plan;
  ExpectQuotaRefusal(cache_->Grow(kAlice, b->sequence, 17, &plan));
  EXPECT_EQ(cache_->Find(b->sequence)->num_tokens, 16);
  // A window block that leaves the window is no longer charged (W = 32: tokens [17, 48) are
  // read from token 48 on, so block 0 goes).
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 48).ok());
  EXPECT_EQ(Used(), 4 * kBlockBytes + 3 * kWindowBytes);
  ExpectQuotaRefusal(cache_->Grow(kAlice, b->sequence, 17, &plan));
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kDiscard).ok());
  ASSERT_TRUE(cache_->Grow(kAlice, b->sequence, 17, &plan).ok());
  EXPECT_EQ(Used(), 2 * kBlockBytes + 2 * kWindowBytes);
  ExpectInvariants();
}

TEST_F(GroupQuotaTest, ExtendingTheWindowIsChargedAndARefusalChangesNothing) {
  Make({.window_blocks = 32});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 5).ok());  // 500 bytes
  // The first step's window blocks only (16 tokens): 4 blocks and 1 window block.
  absl::StatusOr<AllocateResult> a = Alloc(64, {}, /*window_ahead=*/16);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Used(), 4 * kBlockBytes + kWindowBytes);
  DevicePlan plan;
  ASSERT_TRUE(cache_->ExtendWindow(kAlice, a->sequence, 32, &plan).ok());
  EXPECT_EQ(Used(), 4 * kBlockBytes + 2 * kWindowBytes);
  const absl::Status over = cache_->ExtendWindow(kAlice, a->sequence, 48, &plan);
  ExpectQuotaRefusal(over);
  EXPECT_THAT(std::string(over.message()), HasSubstr("extend window"));
  EXPECT_EQ(cache_->Find(a->sequence)->window_table.size(), 2u);
  EXPECT_EQ(Used(), 4 * kBlockBytes + 2 * kWindowBytes);
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 6).ok());
  ASSERT_TRUE(cache_->ExtendWindow(kAlice, a->sequence, 48, &plan).ok());
  EXPECT_EQ(Used(), 4 * kBlockBytes + 3 * kWindowBytes);
  ExpectInvariants();
}

// A prompt that resumes a cached prefix turns its cached window blocks ACTIVE: they are charged
// before the call is let through, as its cached main blocks are.
TEST_F(GroupQuotaTest, AdoptedCachedWindowBlocksAreChargedBeforeTheCall) {
  Make({.window_blocks = 32});
  const std::vector<int32_t> prompt = Prompt(48);
  absl::StatusOr<AllocateResult> a = Alloc(48, prompt);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(cache_->SlideWindow(kAlice, a->sequence, 48).ok());
  ASSERT_TRUE(cache_->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  // Cached: charged to no one.
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 5).ok());
  EXPECT_EQ(Used(), 0);
  // 3 cached blocks and 2 cached window blocks adopted, 1 fresh of each: 550 bytes of 500.
  // Counting the fresh window block alone the call would have looked like 450.
  const absl::Status over = Alloc(49, prompt).status();
  ExpectQuotaRefusal(over);
  EXPECT_EQ(Used(), 0);
  EXPECT_EQ(cache_->stats().sequences, 0);
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 6).ok());
  absl::StatusOr<AllocateResult> resumed = Alloc(49, prompt);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->matched_tokens, 48);
  EXPECT_EQ(Used(), 4 * kBlockBytes + 3 * kWindowBytes);
  ExpectInvariants();
}

TEST_F(GroupQuotaTest, AQuotaGroupSumsEveryGroupOverItsNamespaces) {
  Make({.state_slots = 8, .window_blocks = 32});
  constexpr uint64_t kGroup = 7;
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 10, kGroup).ok());
  ASSERT_TRUE(cache_->SetNamespaceQuota(kOther, 10, kGroup).ok());
  ASSERT_TRUE(Alloc(32, {}, -1, kTenant).ok());  // 200 + 100 + 250
  ASSERT_TRUE(Alloc(16, {}, -1, kOther).ok());   // 100 + 50 + 250
  EXPECT_EQ(Used(kTenant), 950);
  EXPECT_EQ(Used(kOther), 950);
  // A batch over both namespaces is checked on its sum: 150 + 300 more.
  const std::vector<AllocateRequest> batch = {{.ns = kTenant, .num_tokens = 0},
                                              {.ns = kOther, .num_tokens = 16}};
  std::vector<AllocateResult> results;
  DevicePlan plan;
  ExpectQuotaRefusal(cache_->AllocateBatch(kAlice, batch, &results, &plan));
  EXPECT_EQ(Used(kTenant), 950);
  ASSERT_TRUE(cache_->SetNamespaceQuota(kOther, 16, kGroup).ok());  // the group's bound now
  ASSERT_TRUE(cache_->AllocateBatch(kAlice, batch, &results, &plan).ok());
  EXPECT_EQ(Used(kOther), 950 + 250 + 400);
  ExpectInvariants();
}

// A tier loader's window (ImportWindow) is charged like any ACTIVE window block: one the quota
// cannot hold is refused whole, with nothing changed, and fits once the quota grows.
TEST_F(GroupQuotaTest, ImportWindowIsChargedAndRefusedWholeByTheQuota) {
  Make({.window_blocks = 16});
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 12).ok());  // 1200 bytes
  const std::vector<int32_t> prompt = Prompt(161);
  absl::StatusOr<AllocateResult> loader = Alloc(161, prompt, /*window_ahead=*/0);
  ASSERT_TRUE(loader.ok()) << loader.status();
  EXPECT_EQ(Used(), 11 * kBlockBytes);  // no window blocks yet
  // The window at 161 tokens reads [130, 161): entries 8, 9 and 10, 150 bytes: 50 too many.
  const absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> refused =
      cache_->ImportWindow(kAlice, loader->sequence);
  ExpectQuotaRefusal(refused.status());
  EXPECT_EQ(GetShortfall(refused.status())->blocks, 1);  // 50 bytes over: half a block, up
  EXPECT_TRUE(cache_->Find(loader->sequence)->window_table.empty());  // nothing changed
  EXPECT_EQ(Used(), 11 * kBlockBytes);
  EXPECT_EQ(cache_->stats().window.active, 0);
  ExpectInvariants();
  ASSERT_TRUE(cache_->SetNamespaceQuota(kTenant, 13).ok());
  const auto imported = cache_->ImportWindow(kAlice, loader->sequence);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->size(), 3u);
  EXPECT_EQ(Used(), 11 * kBlockBytes + 3 * kWindowBytes);
  ExpectInvariants();
}

}  // namespace
}  // namespace kvpool
