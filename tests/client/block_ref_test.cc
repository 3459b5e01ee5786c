// The window half of BlockRef's helpers: window tables in SequenceInfo and GrowResponse
// (kvpool.proto), checked as strictly as the block tables, split per item and applied to a held
// window table. (pool_mapping_test.cc has the block half.)
#include "client/block_ref.h"

#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvpool::client {
namespace {

// A full window table of 5 entries: a sink (entry 0), entries 1 and 2 released, 3 and 4 live.
v1::SequenceInfo FiveEntries() {
  v1::SequenceInfo info;
  info.set_sequence_id(7);
  for (int i = 0; i < 5; ++i) {
    info.add_block_ids(10 + i);
    info.add_generations(1);
  }
  for (int w : {4, -1, -1, 2, 6}) {
    info.add_window_block_ids(w);
    info.add_window_generations(w < 0 ? 0 : 3);
  }
  info.set_window_released_begin(1);
  info.set_window_released_end(3);
  return info;
}

TEST(BlockRefWindowTest, ToWindowRefsKeepsReleasedEntriesInPlace) {
  const v1::SequenceInfo info = FiveEntries();
  ASSERT_TRUE(ValidateSequenceInfo(info).ok()) << ValidateSequenceInfo(info);
  EXPECT_EQ(ToWindowRefs(info), (std::vector<BlockRef>{{4, 3}, {-1, 0}, {-1, 0}, {2, 3}, {6, 3}}));
  // Entries past the last window block: not allocated yet (a prefill in chunks).
  v1::SequenceInfo lagging = FiveEntries();
  lagging.set_window_block_ids(4, -1);
  lagging.set_window_generations(4, 0);
  ASSERT_TRUE(ValidateSequenceInfo(lagging).ok()) << ValidateSequenceInfo(lagging);
  EXPECT_EQ(ToWindowRefs(lagging).back(), (BlockRef{-1, 0}));
  v1::SequenceInfo plain;  // a pool without a window group
  plain.add_block_ids(1);
  plain.add_generations(1);
  EXPECT_TRUE(ValidateSequenceInfo(plain).ok());
  EXPECT_TRUE(ToWindowRefs(plain).empty());
}

TEST(BlockRefWindowTest, RejectsWindowTablesThatDisagreeWithTheirReleasedRun) {
  std::vector<v1::SequenceInfo> bad(8, FiveEntries());
  bad[0].add_window_block_ids(1);                     // longer than the block table
  bad[1].mutable_window_generations()->RemoveLast();  // generations not parallel
  bad[2].set_window_block_ids(1, 5);                  // a live entry inside the released run
  bad[3].set_window_block_ids(3, -1);                 // a released entry outside it
  bad[4].set_window_released_end(6);                  // past the table
  bad[5].set_window_released_begin(4);                // begin > end
  bad[6].set_window_released_begin(-1);               // negative
  bad[7].set_window_generations(1, 9);                // a released entry with a generation
  for (const v1::SequenceInfo& info : bad) {
    EXPECT_EQ(ValidateSequenceInfo(info).code(), absl::StatusCode::kInvalidArgument)
        << info.ShortDebugString();
  }
}

// Two items: sequence 7 grew by one entry (its released run moved to [1, 3)), sequence 8 did
// not grow (no tail) but its window slid past entries [2, 4).
v1::GrowResponse TwoItems() {
  v1::GrowResponse r;
  for (int64_t n : {80, 64}) r.add_num_tokens(n);
  for (int32_t offset : {4, 4}) r.add_table_offsets(offset);
  for (int32_t length : {1, 0}) r.add_tail_lengths(length);
  r.add_block_ids(14);
  r.add_generations(2);
  r.add_window_block_ids(6);
  r.add_window_generations(3);
  for (auto [begin, end] : {std::pair{1, 3}, {2, 4}}) {
    r.add_window_released_begin(begin);
    r.add_window_released_end(end);
  }
  return r;
}

TEST(BlockRefWindowTest, SplitGrowResponseCarriesEachItemsWindowTailAndRun) {
  const std::vector<uint64_t> ids = {7, 8};
  absl::StatusOr<std::vector<v1::SequenceInfo>> tails = SplitGrowResponse(TwoItems(), ids);
  ASSERT_TRUE(tails.ok()) << tails.status();
  ASSERT_EQ(tails->size(), 2u);
  EXPECT_EQ(ToWindowRefs((*tails)[0]), (std::vector<BlockRef>{{6, 3}}));
  EXPECT_EQ((*tails)[1].window_released_begin(), 2);
  EXPECT_EQ((*tails)[1].window_released_end(), 4);

  // A held window table follows: item 7's entry 2 released since, item 8's 2 and 3.
  std::vector<BlockRef> seven = {{4, 3}, {-1, 0}, {5, 3}, {2, 3}};
  ASSERT_TRUE(ApplyWindowGrow((*tails)[0], &seven).ok());
  EXPECT_EQ(seven, (std::vector<BlockRef>{{4, 3}, {-1, 0}, {-1, 0}, {2, 3}, {6, 3}}));
  std::vector<BlockRef> eight = {{1, 1}, {2, 1}, {3, 1}, {5, 1}};
  ASSERT_TRUE(ApplyWindowGrow((*tails)[1], &eight).ok());
  EXPECT_EQ(eight, (std::vector<BlockRef>{{1, 1}, {2, 1}, {-1, 0}, {-1, 0}}));
}

TEST(BlockRefWindowTest, SplitGrowResponseRejectsMisshapenWindowArrays) {
  const std::vector<uint64_t> ids = {7, 8};
  std::vector<v1::GrowResponse> bad(4, TwoItems());
  bad[0].add_window_block_ids(1);                      // more window ids than blocks
  bad[1].mutable_window_released_end()->RemoveLast();  // a run missing for an item
  bad[2].set_window_block_ids(0, -1);                  // a released entry outside its run
  bad[3].clear_window_block_ids();                     // runs without the tails
  for (const v1::GrowResponse& r : bad) {
    EXPECT_EQ(SplitGrowResponse(r, ids).status().code(), absl::StatusCode::kInvalidArgument)
        << r.ShortDebugString();
  }
  v1::GrowResponse plain = TwoItems();  // no window group at all: fine
  plain.clear_window_block_ids();
  plain.clear_window_generations();
  plain.clear_window_released_begin();
  plain.clear_window_released_end();
  absl::StatusOr<std::vector<v1::SequenceInfo>> tails = SplitGrowResponse(plain, ids);
  ASSERT_TRUE(tails.ok()) << tails.status();
  EXPECT_TRUE(ToWindowRefs((*tails)[0]).empty());
}

TEST(BlockRefWindowTest, ApplyWindowGrowLeavesTheHeldTableAloneOnError) {
  std::vector<BlockRef> held = {{4, 3}};
  v1::SequenceInfo tail;  // starts past the held table
  tail.set_table_offset(3);
  tail.add_block_ids(1);
  tail.add_generations(1);
  tail.add_window_block_ids(2);
  tail.add_window_generations(1);
  EXPECT_EQ(ApplyWindowGrow(tail, &held).code(), absl::StatusCode::kInvalidArgument);
  v1::SequenceInfo no_window;  // blocks but no window table
  no_window.add_block_ids(1);
  no_window.add_generations(1);
  EXPECT_EQ(ApplyWindowGrow(no_window, &held).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(held, (std::vector<BlockRef>{{4, 3}}));
}

// ApplyGrowResponse (Client::Grow's held form) against the per-item path it replaces:
// SplitGrowResponse, then ApplyGrow and ApplyWindowGrow on each item's tables.
absl::Status SplitThenApply(const v1::GrowResponse& r, std::vector<HeldSequence>* held) {
  std::vector<uint64_t> ids;
  for (const HeldSequence& h : *held) ids.push_back(h.sequence_id);
  absl::StatusOr<std::vector<v1::SequenceInfo>> tails = SplitGrowResponse(r, ids);
  if (!tails.ok()) return tails.status();
  std::vector<HeldSequence> out = *held;
  for (size_t i = 0; i < out.size(); ++i) {
    if (absl::Status s = ApplyGrow((*tails)[i], &out[i].table); !s.ok()) return s;
    if (r.window_released_begin_size() > 0) {  // a pool with a window group
      if (absl::Status s = ApplyWindowGrow((*tails)[i], &out[i].window_table); !s.ok()) return s;
    }
    out[i].num_tokens = (*tails)[i].num_tokens();
  }
  *held = std::move(out);
  return absl::OkStatus();
}

std::vector<HeldSequence> HeldForTwoItems() {
  return {{.sequence_id = 7,
           .num_tokens = 64,
           .table = {{10, 1}, {11, 1}, {12, 1}, {13, 1}},
           .window_table = {{4, 3}, {-1, 0}, {5, 3}, {2, 3}}},
          {.sequence_id = 8,
           .num_tokens = 64,
           .table = {{20, 1}, {21, 1}, {22, 1}, {23, 1}},
           .window_table = {{1, 1}, {2, 1}, {3, 1}, {5, 1}}}};
}

TEST(ApplyGrowResponseTest, AppliesEveryItemAsTheSplitThenApplyPathDoes) {
  std::vector<HeldSequence> held = HeldForTwoItems();
  std::vector<HeldSequence> expected = HeldForTwoItems();
  ASSERT_TRUE(SplitThenApply(TwoItems(), &expected).ok());
  ASSERT_TRUE(ApplyGrowResponse(TwoItems(), std::span(held)).ok());
  EXPECT_EQ(held[0].table.back(), (BlockRef{14, 2}));
  EXPECT_EQ(held[0].num_tokens, 80);
  EXPECT_EQ(held[1].window_table, (std::vector<BlockRef>{{1, 1}, {2, 1}, {-1, 0}, {-1, 0}}));
  EXPECT_EQ(held, expected);
}

TEST(ApplyGrowResponseTest, AnErrorInAnyItemChangesNoItem) {
  const std::vector<HeldSequence> before = HeldForTwoItems();
  // Item 8's tables are shorter than its tail's offset: stale, though item 7's would apply.
  std::vector<HeldSequence> stale = HeldForTwoItems();
  stale[1].table.resize(2);
  std::vector<HeldSequence> kept = stale;
  EXPECT_EQ(ApplyGrowResponse(TwoItems(), std::span(stale)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stale[0], before[0]);
  EXPECT_EQ(stale[1], kept[1]);
  // A malformed response, or one for another number of items.
  v1::GrowResponse malformed = TwoItems();
  malformed.set_window_block_ids(0, -1);
  std::vector<HeldSequence> held = HeldForTwoItems();
  EXPECT_EQ(ApplyGrowResponse(malformed, std::span(held)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyGrowResponse(TwoItems(), std::span(held).first(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(held, before);
}

// Random responses, well-formed or damaged in one place, applied both ways to random held
// tables: the same verdict, and the same tables after (unchanged after an error).
TEST(ApplyGrowResponseTest, RandomResponsesGetTheSplitThenApplyVerdict) {
  std::mt19937 rng(20261205);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int applied = 0;
  int refused = 0;
  for (int round = 0; round < 3000; ++round) {
    const bool window = pick(0, 1) == 1;
    const int items = pick(1, 5);
    std::vector<HeldSequence> held(static_cast<size_t>(items));
    v1::GrowResponse r;
    for (int i = 0; i < items; ++i) {
      HeldSequence& h = held[static_cast<size_t>(i)];
      h.sequence_id = static_cast<uint64_t>(100 + i);
      const int size = pick(0, 6);
      for (int e = 0; e < size; ++e) h.table.push_back({pick(0, 50), 1});
      if (window) h.window_table = h.table;
      const int offset = pick(0, size + 1);  // size + 1: a stale held table
      const int length = pick(0, 3);
      r.add_num_tokens(pick(1, 200));
      r.add_table_offsets(offset);
      r.add_tail_lengths(length);
      const int begin = pick(0, offset + length);
      const int end = pick(begin, offset + length);
      for (int k = 0; k < length; ++k) {
        r.add_block_ids(pick(0, 50));
        r.add_generations(2);
        if (window) {
          const bool released = offset + k >= begin && offset + k < end;
          r.add_window_block_ids(released ? -1 : pick(0, 50));
          r.add_window_generations(released ? 0 : 3);
        }
      }
      if (window) {
        r.add_window_released_begin(begin);
        r.add_window_released_end(end);
      }
    }
    switch (pick(0, 7)) {  // one damage, or none
      case 0:
        if (r.block_ids_size() > 0) r.set_block_ids(0, -3);
        break;
      case 1:
        r.add_generations(1);
        break;
      case 2:
        r.set_tail_lengths(0, r.tail_lengths(0) + 1);
        break;
      case 3:
        r.set_table_offsets(0, -1);
        break;
      case 4:
        if (window) r.set_window_released_end(0, r.window_released_end(0) + 7);
        break;
      default:
        break;
    }
    std::vector<HeldSequence> ours = held;
    std::vector<HeldSequence> theirs = held;
    const absl::Status a = ApplyGrowResponse(r, std::span(ours));
    const absl::Status b = SplitThenApply(r, &theirs);
    ASSERT_EQ(a.ok(), b.ok()) << a << " / " << b << "\n" << r.ShortDebugString();
    if (!a.ok()) {
      // A stale table is the caller's; everything else is the response's.
      EXPECT_EQ(a.code(), absl::IsInvalidArgument(b) && absl::StrContains(b.message(), "held")
                              ? absl::StatusCode::kFailedPrecondition
                              : absl::StatusCode::kInvalidArgument)
          << a << " / " << b;
    }
    ASSERT_EQ(ours, theirs) << r.ShortDebugString();
    (a.ok() ? applied : refused) += 1;
  }
  EXPECT_GT(applied, 500);  // both verdicts were exercised
  EXPECT_GT(refused, 500);
}

}  // namespace
}  // namespace kvpool::client
