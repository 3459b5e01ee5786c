// Block tables on the wire (daemon/edge/convert.cc): with a window group, SequenceInfo and
// GrowResponse carry each window table beside its block table, and the clients' checks
// (client/block_ref.h) accept exactly what the daemon sends; without one, nothing of the window.
// And SessionInfo carries its tenant's quota.

#include "client/block_ref.h"
#include "daemon/edge/convert.h"
#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

// Sequence 7: 5 entries (a sink, 2 released, 2 live), the whole table. Sequence 8: a Grow tail
// of 1 entry at 3 whose run [1, 3) was released before it.
Tables TwoSlices() {
  Tables t;
  t.slices.push_back({.sequence = SequenceId(7),
                      .num_tokens = 80,
                      .length = 5,
                      .window_released_begin = 1,
                      .window_released_end = 3});
  t.slices.push_back({.sequence = SequenceId(8),
                      .num_tokens = 64,
                      .table_offset = 3,
                      .length = 1,
                      .window_released_begin = 1,
                      .window_released_end = 3});
  for (int b : {10, 11, 12, 13, 14, 20}) {
    t.blocks.push_back(BlockId(b));
    t.generations.push_back(2);
  }
  for (int w : {4, -1, -1, 2, 6, 9}) {
    t.window_blocks.push_back(BlockId(w));
    t.window_generations.push_back(w < 0 ? 0 : 5);
  }
  return t;
}

TEST(TableConvertTest, SequenceInfoCarriesTheWindowTableAndItsRun) {
  google::protobuf::RepeatedPtrField<v1::SequenceInfo> infos;
  ToProto(TwoSlices(), &infos);
  ASSERT_EQ(infos.size(), 2);
  const v1::SequenceInfo& seven = infos[0];
  EXPECT_EQ(std::vector<int32_t>(seven.window_block_ids().begin(), seven.window_block_ids().end()),
            (std::vector<int32_t>{4, -1, -1, 2, 6}));
  EXPECT_EQ(seven.window_generations(1), 0u);
  EXPECT_EQ(seven.window_generations(3), 5u);
  EXPECT_EQ(seven.window_released_begin(), 1);
  EXPECT_EQ(seven.window_released_end(), 3);
  EXPECT_EQ(infos[1].window_block_ids_size(), 1);
  for (const v1::SequenceInfo& info : infos) {
    EXPECT_TRUE(client::ValidateSequenceInfo(info).ok()) << client::ValidateSequenceInfo(info);
  }
}

TEST(TableConvertTest, GrowResponseSplitsBackIntoTheSameTails) {
  v1::GrowResponse r;
  ToProto(TwoSlices(), &r);
  EXPECT_EQ(r.window_block_ids_size(), r.block_ids_size());
  EXPECT_EQ(r.window_released_begin_size(), 2);
  const std::vector<uint64_t> ids = {7, 8};
  absl::StatusOr<std::vector<v1::SequenceInfo>> tails = client::SplitGrowResponse(r, ids);
  ASSERT_TRUE(tails.ok()) << tails.status();
  EXPECT_EQ(client::ToWindowRefs((*tails)[0]).size(), 5u);
  EXPECT_EQ(client::ToWindowRefs((*tails)[1]), (std::vector<client::BlockRef>{{9, 5}}));
  EXPECT_EQ((*tails)[1].window_released_end(), 3);
}

TEST(TableConvertTest, WithoutAWindowGroupNothingOfTheWindowIsSent) {
  Tables t = TwoSlices();
  t.window_blocks.clear();
  t.window_generations.clear();
  google::protobuf::RepeatedPtrField<v1::SequenceInfo> infos;
  ToProto(t, &infos);
  v1::GrowResponse r;
  ToProto(t, &r);
  for (const v1::SequenceInfo& info : infos) {
    EXPECT_EQ(info.window_block_ids_size(), 0);
    EXPECT_EQ(info.window_released_begin() + info.window_released_end(), 0);
  }
  EXPECT_EQ(r.window_block_ids_size() + r.window_released_begin_size(), 0);
}

// kvpoolctl sessions' QUOTA column: the tenant's quota in its unit, nothing without one.
TEST(SessionConvertTest, SessionInfoCarriesItsTenantsQuota) {
  auto session = std::make_shared<Session>();
  session->id = SessionId(3);
  session->spec.tenant = "acme";
  SessionListing listing{
      .session = session,
      .sequences = 2,
      .block_refs = 5,
      .quota = KvCacheManager::QuotaUse{.used = 300, .bound = 800, .bytes = true}};
  v1::SessionInfo info;
  ToProto(listing, 0, &info);
  EXPECT_EQ(info.quota_used(), 300);
  EXPECT_EQ(info.quota_bound(), 800);
  EXPECT_EQ(info.quota_unit(), "bytes");
  listing.quota->bytes = false;
  ToProto(listing, 0, &info);
  EXPECT_EQ(info.quota_unit(), "blocks");
  listing.quota.reset();
  v1::SessionInfo none;
  ToProto(listing, 0, &none);
  EXPECT_EQ(none.quota_unit(), "");
  EXPECT_EQ(none.quota_bound(), 0);
}

// kvpoolctl sessions' CACHED column: the tenant's eviction share, nothing with fairness off.
TEST(SessionConvertTest, SessionInfoCarriesItsTenantsEvictionShare) {
  auto session = std::make_shared<Session>();
  session->id = SessionId(4);
  SessionListing listing{
      .session = session,
      .share = ShareUse{.key = 9, .weight = 3, .evictable = 7, .bytes = 7000, .evicted = 11}};
  v1::SessionInfo info;
  ToProto(listing, 0, &info);
  EXPECT_EQ(info.cache_share_blocks(), 7);
  EXPECT_EQ(info.cache_share_bytes(), 7000);
  EXPECT_EQ(info.cache_share_weight(), 3u);
  EXPECT_EQ(info.cache_share_evicted(), 11u);
  listing.share.reset();
  v1::SessionInfo none;
  ToProto(listing, 0, &none);
  EXPECT_EQ(none.cache_share_weight(), 0u);
}

}  // namespace
}  // namespace kvpool::daemon
