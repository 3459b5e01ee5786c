// kvpoold serving a model with sliding-window layers (tiny-swa: every other layer attends its
// last 256 tokens) over real sockets, seen from outside (docs/hybrid-groups.md §2-§3): replies
// carry each sequence's window table, a client that follows Grow tails holds the table the
// daemon holds, the mapping addresses window blocks, and GetStats, ExplainMatch and kvpoolctl
// show the window group (label `integration`).

#include <fstream>
#include <set>
#include <string>
#include <string_view>

#include "client/block_ref.h"
#include "client/client.h"
#include "client/pool_mapping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace kvpool::testing {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kWindow = 256;  // tiny-swa's sliding_window
constexpr int32_t kBlock = 16;

constexpr std::string_view kSwaDaemon = R"pb(
  pool_bytes: 33554432
  max_blocks_per_seq: 256
  shape { dtype: "f32" window_blocks: 40 }
  model { name: "tiny-swa" }
)pb";

// A file of `tokens` for `kvpoolctl explain` (whitespace-separated ids), in the test's temporary
// directory.
std::string TokensFile(const std::vector<int32_t>& tokens) {
  const std::string path = ::testing::TempDir() + "/window_integration_prompt.txt";
  std::ofstream out(path);
  for (int32_t t : tokens) out << t << ' ';
  return path;
}

class WindowIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d =
        DaemonProcess::Start(std::string(kSwaDaemon));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(
        {.runtime_dir = daemon_->dir(), .client_name = "swa", .kv_access = true});
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // The daemon's view of `sequence` (ListSequences: the whole table).
  v1::SequenceInfo Listed(uint64_t sequence) {
    absl::StatusOr<v1::ListSequencesResponse> all = client_->ListSequences();
    EXPECT_TRUE(all.ok()) << all.status();
    if (all.ok()) {
      for (const v1::SequenceInfo& info : all->sequences()) {
        if (info.sequence_id() == sequence) return info;
      }
    }
    ADD_FAILURE() << "sequence " << sequence << " not listed";
    return {};
  }

  // The GetStats row `name` whose last label value is `label`; -1 when absent.
  double Stat(const std::string& name, const std::string& label) {
    absl::StatusOr<v1::GetStatsResponse> s = client_->GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return -1;
    for (const v1::Stat& st : s->stats()) {
      if (st.name() == name &&
          (label.empty() || (!st.label_values().empty() && *st.label_values().rbegin() == label))) {
        return st.value();
      }
    }
    return -1;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

// Entries wholly before the first key a query at `computed` reads are released (no sinks).
int32_t ReleasedEnd(int64_t computed) {
  return static_cast<int32_t>(std::max<int64_t>(0, computed - kWindow + 1) / kBlock);
}

TEST_F(WindowIntegrationTest, RepliesCarryTheWindowTableAndAClientFollowsIt) {
  const v1::PoolLayout& layout = client_->layout();
  ASSERT_EQ(layout.num_window_layers(), 2);  // layers 0 and 2 slide: pool layers 2 and 3
  ASSERT_EQ(layout.num_window_blocks(), 40);

  // A compute session's 400-token prefill: the daemon's step slides the window past [0, 9).
  const std::vector<int32_t> prompt = Prompt(400, 5);
  absl::StatusOr<v1::PrefillResponse> first = client_->Prefill(0, prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  const v1::SequenceInfo prefilled = Listed(first->sequence_id());
  ASSERT_EQ(prefilled.window_block_ids_size(), prefilled.block_ids_size());
  EXPECT_EQ(prefilled.window_released_begin(), 0);
  EXPECT_EQ(prefilled.window_released_end(), ReleasedEnd(400));
  EXPECT_EQ(prefilled.window_block_ids(ReleasedEnd(400) - 1), -1);
  EXPECT_GE(prefilled.window_block_ids(ReleasedEnd(400)), 0);
  const size_t live = static_cast<size_t>(ReleasedEnd(400));
  const std::vector<client::BlockRef> pwindow = client::ToWindowRefs(prefilled);
  const std::vector<client::BlockRef> pblocks = client::ToBlockRefs(prefilled);
  // The mapping: a window layer's K of a live entry holds what the model wrote (not zeros); a
  // released entry and a window layer through the block table are refused.
  const client::PoolMapping& m = *client_->mapping();
  absl::StatusOr<char*> k = m.WindowK(2, pwindow[live]);
  ASSERT_TRUE(k.ok()) << k.status();
  const float* rows = reinterpret_cast<const float*>(*k);
  bool written = false;
  for (int i = 0; i < kBlock * layout.num_kv_heads() * layout.head_dim(); ++i) {
    written |= rows[i] != 0.0F;
  }
  EXPECT_TRUE(written);
  EXPECT_EQ(m.WindowK(2, pwindow[0]).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.K(2, pblocks[live]).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.K(0, pblocks[0]).ok());

  ASSERT_TRUE(client_->Free({first->sequence_id()}, /*commit=*/false).ok());

  // A KV client's sequence: Allocate sends the whole window table (nothing computed, nothing
  // released); its Commit of 400 computed tokens slides the window; the next Grow tail brings
  // the new entries and the released run, and the table the client follows from the two replies
  // equals the daemon's.
  const std::vector<int32_t> own = Prompt(400, 6);
  absl::StatusOr<v1::SequenceInfo> made = client_->Allocate(own);
  ASSERT_TRUE(made.ok()) << made.status();
  const uint64_t id = made->sequence_id();
  ASSERT_EQ(made->window_block_ids_size(), 25);
  EXPECT_EQ(made->window_released_end(), 0);
  std::vector<client::BlockRef> window = client::ToWindowRefs(*made);
  std::vector<client::BlockRef> blocks = client::ToBlockRefs(*made);
  ASSERT_TRUE(client_->Commit(id, 400).ok());
  absl::StatusOr<v1::SequenceInfo> tail = client_->Grow(id, 480);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_EQ(tail->table_offset(), 25);
  EXPECT_EQ(tail->window_block_ids_size(), 5);
  EXPECT_EQ(tail->window_released_end(), ReleasedEnd(400));
  ASSERT_TRUE(client::ApplyGrow(*tail, &blocks).ok());
  ASSERT_TRUE(client::ApplyWindowGrow(*tail, &window).ok());
  const v1::SequenceInfo after = Listed(id);
  EXPECT_EQ(window, client::ToWindowRefs(after));
  EXPECT_EQ(blocks, client::ToBlockRefs(after));
  // A Fork's reply carries the parent's window table (its live entries shared).
  absl::StatusOr<v1::SequenceInfo> child = client_->Fork(id);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->window_released_end(), ReleasedEnd(400));
  EXPECT_EQ(child->window_block_ids(ReleasedEnd(400)), window[ReleasedEnd(400)].id);
  ASSERT_TRUE(client_->Free({child->sequence_id()}, /*commit=*/false).ok());

  // The window group in GetStats: its blocks sum to the region, the live entries are active.
  double sum = 0;
  for (const char* state : {"free", "active", "cached", "retiring"}) {
    const double v = Stat("window_blocks", state);
    EXPECT_GE(v, 0) << state;
    sum += v;
  }
  EXPECT_EQ(sum, 40);
  EXPECT_GE(Stat("window_blocks", "active"), static_cast<double>(window.size() - live));
  EXPECT_GE(Stat("window_block_events", "released"), static_cast<double>(live));
  EXPECT_TRUE(client_->CheckInvariants()->ok());
}

// Client::Grow's held form on a window pool: two sequences (one forked from the other, so that
// its first grow copies the shared last block) grown together step after step, the window sliding
// with each Commit; the tables the client holds equal the daemon's after every step.
TEST_F(WindowIntegrationTest, HeldGrowFollowsBothTablesAsTheWindowSlides) {
  const std::vector<int32_t> prompt = Prompt(410, 11);
  absl::StatusOr<v1::SequenceInfo> made = client_->Allocate(prompt);
  ASSERT_TRUE(made.ok()) << made.status();
  absl::StatusOr<v1::SequenceInfo> forked = client_->Fork(made->sequence_id());
  ASSERT_TRUE(forked.ok()) << forked.status();
  std::vector<client::HeldSequence> held = {client::ToHeld(*made), client::ToHeld(*forked)};
  std::vector<int64_t> known = {410, 410};  // tokens the daemon has been told
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < held.size(); ++i) {
      const std::vector<int32_t> more(static_cast<size_t>(held[i].num_tokens - known[i]), 5);
      absl::Status committed = client_->Commit(held[i].sequence_id, held[i].num_tokens, more);
      ASSERT_TRUE(committed.ok()) << committed;
      known[i] = held[i].num_tokens;
    }
    const std::vector<int64_t> lengths = {held[0].num_tokens + 37, held[1].num_tokens + 1};
    ASSERT_TRUE(client_->Grow(std::span(held), lengths).ok()) << "step " << step;
    for (const client::HeldSequence& h : held) {
      const v1::SequenceInfo listed = Listed(h.sequence_id);
      EXPECT_EQ(h.num_tokens, listed.num_tokens());
      EXPECT_EQ(h.table, client::ToBlockRefs(listed)) << "step " << step;
      EXPECT_EQ(h.window_table, client::ToWindowRefs(listed)) << "step " << step;
    }
  }
  EXPECT_NE(held[0].table[25], held[1].table[25]);  // the fork's copy of the shared block
  EXPECT_GT(Listed(held[0].sequence_id).window_released_end(), 0);
  ASSERT_TRUE(client_->Free({held[0].sequence_id, held[1].sequence_id}, false).ok());
  EXPECT_TRUE(client_->CheckInvariants()->ok());
}

// WatchEvents names each group (docs/events.md): a committed prefill's full blocks as group 0
// (full_attention), and the window blocks the tree keeps beside them as group 1 (sliding_window,
// W 256), by the same hashes.
TEST_F(WindowIntegrationTest, EventsNameTheWindowGroupsBlocks) {
  const std::vector<int32_t> prompt = Prompt(400, 7);
  absl::StatusOr<v1::PrefillResponse> done = client_->Prefill(0, prompt);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(client_->Free({done->sequence_id()}, /*commit=*/true).ok());
  v1::WatchEventsRequest request;
  request.set_from_seq(1);
  std::vector<v1::KvEvent> events;
  ASSERT_TRUE(client_
                  ->WatchEvents(request,
                                [&](const v1::WatchEventsResponse& r) {
                                  events.insert(events.end(), r.events().begin(), r.events().end());
                                  return true;
                                })
                  .ok());
  std::set<std::pair<uint64_t, uint64_t>> main;
  int window = 0;
  for (const v1::KvEvent& e : events) {
    ASSERT_EQ(e.type(), v1::KvEvent::TYPE_BLOCK_STORED);
    ASSERT_TRUE(e.has_group());
    for (const v1::BlockHash& h : e.block_hashes()) {
      if (e.group().index() == 0) {
        EXPECT_EQ(e.group().kind(), "full_attention");
        main.insert({h.hi(), h.lo()});
      } else {
        EXPECT_EQ(e.group().index(), 1);
        EXPECT_EQ(e.group().kind(), "sliding_window");
        EXPECT_EQ(e.group().sliding_window(), kWindow);
        EXPECT_TRUE(main.contains({h.hi(), h.lo()}));  // after its block, by its hash
        ++window;
      }
    }
  }
  EXPECT_EQ(main.size(), 25u);  // 400 tokens: 25 full blocks
  // At least the window the prefill left live (the last 256 tokens' blocks) is kept beside its
  // blocks; chunks committed as they go keep more.
  EXPECT_GE(window, 25 - ReleasedEnd(400));
  EXPECT_LE(window, 25);
}

TEST_F(WindowIntegrationTest, ExplainAndStatsSayTheWindowGroupCutAMatch) {
  // Two 400-token prompts, each committed whole (window blocks included) as it ends. The
  // second needs 25 of the 40 window blocks, 15 are free: it takes 10 of the first's, least
  // recently kept first, which are its last entries (a commit keeps the live entries from the
  // end back). The first prompt is still cached whole for full attention, but it resumes only
  // where its window is whole: at 240 tokens (blocks 0-14), the window group cutting 160.
  const std::vector<int32_t> prompt = Prompt(400, 9);
  for (uint32_t seed : {9, 10}) {
    absl::StatusOr<v1::PrefillResponse> done = client_->Prefill(0, Prompt(400, seed));
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_TRUE(client_->Free({done->sequence_id()}, /*commit=*/true).ok());
  }
  EXPECT_EQ(Stat("window_block_events", "evicted"), 10);
  absl::StatusOr<v1::ExplainMatchResponse> e = client_->ExplainMatch(prompt);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->matched_tokens(), 400);
  EXPECT_EQ(e->resumable_tokens(), 240);
  ASSERT_TRUE(e->has_window_evicted_tokens());
  EXPECT_EQ(e->window_evicted_tokens(), 160);
  EXPECT_THAT(e->explanation(), HasSubstr("the window group cuts 160"));
  const auto [ctl_rc, explained] = RunToEnd(
      {KvpoolctlBinary(), "--socket_dir=" + daemon_->dir(), "explain", TokensFile(prompt)});
  EXPECT_EQ(ctl_rc, 0);
  EXPECT_THAT(explained, HasSubstr("resumable 240 token(s); window group cut 160 token(s)"));
  const auto [rc, text] = RunToEnd({KvpoolctlBinary(), "--socket_dir=" + daemon_->dir(), "stats"});
  EXPECT_EQ(rc, 0);
  EXPECT_THAT(text, HasSubstr("WINDOW BLOCKS"));
  // Allocating it resumes 240 tokens and counts the cut as window_evicted misses.
  const double missed = Stat("missed_tokens", "window_evicted");
  absl::StatusOr<v1::SequenceInfo> again = client_->Allocate(prompt);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->matched_tokens(), 240);
  EXPECT_EQ(Stat("missed_tokens", "window_evicted"), missed + 160);
}

}  // namespace
}  // namespace kvpool::testing
