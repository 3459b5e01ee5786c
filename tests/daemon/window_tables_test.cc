// The engine's tables with a window group (PoolState::AppendTable): every call that returns
// tables (Allocate, Grow, Fork, ListSequences) returns each window table beside its block table,
// entry for entry, with the released run past the sinks; a pool without a window group returns
// none. (window_integration_test sees the same through kvpoold and the client.)

#include "daemon/engine/engine.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

constexpr int32_t kWindow = 64;  // W: a query at p reads [p - 63, p] and the sink
constexpr int32_t kSinks = 16;   // S: one sink block

class WindowTablesTest : public ::testing::Test {
 protected:
  void Make(bool window_group) {
    EngineOptions options = SmallPool(64);
    if (window_group) {  // tiny's 4 layers, the last 2 in 32 window blocks
      options.pools[0].layout.num_window_layers = 2;
      options.pools[0].layout.num_window_blocks = 32;
      options.window_tokens = kWindow;
      options.sink_tokens = kSinks;
    }
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(options, &device_, nullptr);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    session_ = *engine_->OpenSession(Spec("t", "kv"));
  }

  // Checks that `t`'s window arrays are parallel to its blocks, and each slice's entries are
  // kInvalidBlock exactly inside its released run (generation 0 there).
  static void ExpectWellFormed(const Tables& t) {
    ASSERT_EQ(t.window_blocks.size(), t.blocks.size());
    ASSERT_EQ(t.window_generations.size(), t.blocks.size());
    size_t first = 0;
    for (const TableSlice& s : t.slices) {
      for (int32_t i = 0; i < s.length; ++i) {
        const int32_t entry = s.table_offset + i;
        const bool released = entry >= s.window_released_begin && entry < s.window_released_end;
        const size_t at = first + static_cast<size_t>(i);
        EXPECT_EQ(t.window_blocks[at] == kInvalidBlock, released) << "entry " << entry;
        if (released) {
          EXPECT_EQ(t.window_generations[at], 0u);
        }
      }
      first += static_cast<size_t>(s.length);
    }
  }

  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> session_;
};

TEST_F(WindowTablesTest, EveryCallThatReturnsTablesCarriesTheWindowTableAndItsReleasedRun) {
  Make(true);
  const std::vector<int32_t> prompt = Prompt(160, 3);  // 10 entries
  const AllocateRequest request{.num_tokens = 160, .prompt = prompt};
  absl::StatusOr<Tables> made =
      engine_->Allocate(*session_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  ExpectWellFormed(*made);
  EXPECT_EQ(made->window_blocks.size(), 10u);
  EXPECT_EQ(made->slices[0].window_released_end, 0);  // nothing computed, nothing released
  const SequenceId id = made->slices[0].sequence;

  // 160 computed tokens: the next query (160) reads [97, 160] and the sink, so entries 1-5
  // (tokens 16-95) are released; entry 0 is the sink's.
  ASSERT_TRUE(engine_->Commit(*session_, id, 160, {}, CallContext::Uncancellable()).ok());
  const GrowRequest grow{id, 200};
  absl::StatusOr<Tables> grown =
      engine_->Grow(*session_, std::span(&grow, 1), CallContext::Uncancellable());
  ASSERT_TRUE(grown.ok()) << grown.status();
  ExpectWellFormed(*grown);
  ASSERT_EQ(grown->slices.size(), 1u);
  EXPECT_EQ(grown->slices[0].table_offset, 10);
  EXPECT_EQ(grown->slices[0].length, 3);
  EXPECT_EQ(grown->slices[0].window_released_begin, 1);
  EXPECT_EQ(grown->slices[0].window_released_end, 6);

  std::vector<SessionId> owners;
  std::vector<int32_t> pools;
  const Tables listed = engine_->ListSequences(std::nullopt, SessionId(0), &owners, &pools);
  ExpectWellFormed(listed);
  ASSERT_EQ(listed.slices.size(), 1u);
  EXPECT_EQ(listed.window_blocks.size(), 13u);
  EXPECT_NE(listed.window_blocks[0], kInvalidBlock);  // the sink
  EXPECT_EQ(listed.window_blocks[5], kInvalidBlock);
  EXPECT_NE(listed.window_blocks[6], kInvalidBlock);
  EXPECT_GT(listed.window_generations[6], 0u);  // handed out at least once

  absl::StatusOr<Tables> child = engine_->Fork(*session_, id, CallContext::Uncancellable());
  ASSERT_TRUE(child.ok()) << child.status();
  ExpectWellFormed(*child);
  EXPECT_EQ(child->slices[0].window_released_begin, 1);
  EXPECT_EQ(child->slices[0].window_released_end, 6);
  EXPECT_EQ(child->window_blocks[0], listed.window_blocks[0]);  // shared
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A sequence whose window table does not reach its end yet (a prefill in chunks takes each
// chunk's window blocks as it goes: AllocateRequest::window_ahead) lists the entries not
// allocated as a trailing run of kInvalidBlock, and a Grow that allocates them sends them again.
TEST_F(WindowTablesTest, EntriesNotAllocatedYetTrailAndAGrowResendsThem) {
  Make(true);
  const AllocateRequest request{.num_tokens = 160, .window_ahead = 32};  // 10 entries, 2 now
  absl::StatusOr<Tables> made =
      engine_->Allocate(*session_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->window_blocks.size(), 10u);
  EXPECT_NE(made->window_blocks[1], kInvalidBlock);
  for (size_t i = 2; i < 10; ++i) {
    EXPECT_EQ(made->window_blocks[i], kInvalidBlock) << "entry " << i;
    EXPECT_EQ(made->window_generations[i], 0u);
  }
  EXPECT_EQ(made->slices[0].window_released_end, 0);
  const GrowRequest grow{made->slices[0].sequence, 176};  // every entry now
  absl::StatusOr<Tables> grown =
      engine_->Grow(*session_, std::span(&grow, 1), CallContext::Uncancellable());
  ASSERT_TRUE(grown.ok()) << grown.status();
  ExpectWellFormed(*grown);
  EXPECT_EQ(grown->slices[0].table_offset, 2);  // from the first entry allocated now
  EXPECT_EQ(grown->slices[0].length, 9);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// A Grow whose caller gave up takes back the window entries it filled below the old length too,
// as RevertGrow does: the caller never learned of them (a later Grow replies from the end of the
// window table, so they were never sent) and they were held for nothing. Before, the give-up's
// Truncate released only the entries past the old length: eight here stayed held.
TEST_F(WindowTablesTest, AGivenUpGrowTakesBackTheWindowEntriesItFilledBelowTheOldLength) {
  Make(true);
  const AllocateRequest request{.num_tokens = 160, .window_ahead = 32};  // 10 entries, 2 now
  absl::StatusOr<Tables> made =
      engine_->Allocate(*session_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  const int64_t window_blocks = engine_->Stats().cache.window.active;
  const GrowRequest grow{made->slices[0].sequence, 161};
  EXPECT_EQ(engine_->Grow(*session_, std::span(&grow, 1), testing::GivesUpAfter(1)).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(engine_->Stats().cache.window.active, window_blocks);
  std::vector<SessionId> owners;
  std::vector<int32_t> pools;
  const Tables t = engine_->ListSequences(0, session_->id, &owners, &pools);
  ASSERT_EQ(t.window_blocks.size(), 10u);
  for (size_t i = 2; i < 10; ++i) EXPECT_EQ(t.window_blocks[i], kInvalidBlock) << "entry " << i;
  // The same Grow, not given up, sends them.
  absl::StatusOr<Tables> grown =
      engine_->Grow(*session_, std::span(&grow, 1), CallContext::Uncancellable());
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_EQ(grown->slices[0].table_offset, 2);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(WindowTablesTest, APoolWithoutAWindowGroupReturnsNoWindowTables) {
  Make(false);
  const std::vector<int32_t> prompt = Prompt(48, 4);
  const AllocateRequest request{.num_tokens = 48, .prompt = prompt};
  absl::StatusOr<Tables> made =
      engine_->Allocate(*session_, std::span(&request, 1), CallContext::Uncancellable());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->blocks.size(), 3u);
  EXPECT_TRUE(made->window_blocks.empty());
  EXPECT_TRUE(made->window_generations.empty());
  EXPECT_EQ(made->slices[0].window_released_end, 0);
}

}  // namespace
}  // namespace kvpool::daemon
