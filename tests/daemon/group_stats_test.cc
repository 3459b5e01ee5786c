// The hybrid groups' rows of the stats table (daemon/metrics/group_stat_rows.h): each reads its
// figure of KvCacheStats and reaches GetStats and the exposition, only in a pool with that group;
// and docs/metrics.md names every pool row's family.

#include <fstream>
#include <sstream>
#include <string>

#include "daemon/metrics/exposition.h"
#include "daemon/metrics/stats_proto.h"
#include "daemon/metrics/stats_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace kvpool::daemon {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The value GetStats sent for row `name` with label value `label` (any, when empty); -1 when
// the row is absent.
double Sent(const v1::GetStatsResponse& r, std::string_view name, std::string_view label = "") {
  for (const v1::Stat& s : r.stats()) {
    if (s.name() != name) continue;
    if (label.empty()) return s.value();
    for (const std::string& v : s.label_values()) {
      if (v == label) return s.value();
    }
  }
  return -1;
}

// A pool's figures with a window group of 10 blocks (3 free, 4 active, 2 cached, 1 retiring).
EngineStats WithWindowGroup() {
  EngineStats e;
  e.pool = "swa";
  e.cache.pool.num_blocks = 64;
  e.cache.pool.free = 64;
  e.cache.window = {.num_blocks = 10, .free = 3, .active = 4, .cached = 2, .retiring = 1};
  e.cache.windows = {.cached = 5, .kept = 7, .evicted = 2, .released = 11};
  e.cache.missed_window_evicted = 96;
  return e;
}

TEST(GroupStatsTest, WindowGroupRowsReadTheirFiguresInEveryOutput) {
  const EngineStats e = WithWindowGroup();
  v1::GetStatsResponse r;
  FillStats({.engine = &e}, &r);
  EXPECT_EQ(Sent(r, "window_blocks", "free"), 3);
  EXPECT_EQ(Sent(r, "window_blocks", "active"), 4);
  EXPECT_EQ(Sent(r, "window_blocks", "cached"), 2);
  EXPECT_EQ(Sent(r, "window_blocks", "retiring"), 1);
  EXPECT_EQ(Sent(r, "window_cache_blocks"), 5);
  EXPECT_EQ(Sent(r, "window_block_events", "kept"), 7);
  EXPECT_EQ(Sent(r, "window_block_events", "evicted"), 2);
  EXPECT_EQ(Sent(r, "window_block_events", "released"), 11);
  EXPECT_EQ(Sent(r, "missed_tokens", "window_evicted"), 96);
  EXPECT_EQ(Sent(r, "state_slots"), -1);  // no state group
  EXPECT_EQ(Sent(r, "missed_tokens", "no_checkpoint"), -1);

  const std::string text =
      prometheus::TextSerializer().Serialize(CollectFamilies(StatsSource{.engine = &e}));
  EXPECT_THAT(text, HasSubstr("kvpool_window_blocks{pool=\"swa\",state=\"active\"} 4"));
  EXPECT_THAT(text, HasSubstr("kvpool_window_cache_blocks{pool=\"swa\"} 5"));
  EXPECT_THAT(text,
              HasSubstr("kvpool_window_block_events_total{pool=\"swa\",event=\"released\"} 11"));
  EXPECT_THAT(text,
              HasSubstr("kvpool_missed_tokens_total{pool=\"swa\",reason=\"window_evicted\"} 96"));
}

TEST(GroupStatsTest, APoolWithoutAWindowGroupExportsNoWindowRow) {
  EngineStats e = WithWindowGroup();
  e.cache.window = {};  // num_blocks 0: no window group
  v1::GetStatsResponse r;
  FillStats({.engine = &e}, &r);
  for (const v1::Stat& s : r.stats()) {
    EXPECT_FALSE(s.name().starts_with("window_")) << s.name();
    EXPECT_THAT(s.label_values(), Not(::testing::Contains("window_evicted"))) << s.name();
  }
  const std::string text =
      prometheus::TextSerializer().Serialize(CollectFamilies(StatsSource{.engine = &e}));
  EXPECT_THAT(text, Not(HasSubstr("kvpool_window_")));
  EXPECT_THAT(text, Not(HasSubstr("window_evicted")));
}

TEST(GroupStatsTest, StateGroupRowsReadTheirFigures) {
  EngineStats e;
  e.pool = "hybrid";
  e.cache.states = {.num_blocks = 8, .free = 5, .active = 2, .cached = 1, .retiring = 0};
  e.cache.checkpoints.kept = 9;
  e.cache.checkpoints.redundant = 4;
  e.cache.missed_no_checkpoint = 32;
  e.cache.checkpoints.resume_rate[static_cast<size_t>(CheckpointKind::kBranch)] = 0.5;
  v1::GetStatsResponse r;
  FillStats({.engine = &e}, &r);
  EXPECT_EQ(Sent(r, "state_slots", "free"), 5);
  EXPECT_EQ(Sent(r, "state_slots", "cached"), 1);
  EXPECT_EQ(Sent(r, "state_checkpoints", "kept"), 9);
  EXPECT_EQ(Sent(r, "state_checkpoints", "redundant"), 4);
  EXPECT_EQ(Sent(r, "missed_tokens", "no_checkpoint"), 32);
  EXPECT_EQ(Sent(r, "state_checkpoint_resume_rate", "branch"), 0.5);
  EXPECT_EQ(Sent(r, "window_blocks", "free"), -1);  // no window group
}

// docs/metrics.md documents each family in a table cell as `kvpool_<name>` (with `{a,b}`
// alternatives and a `{label}` set after it): every pool row's family must be found there.
TEST(GroupStatsTest, EveryHybridGroupFamilyIsDocumented) {
  std::ifstream in(std::string(KVPOOL_SOURCE_DIR) + "/docs/metrics.md");
  ASSERT_TRUE(in) << "docs/metrics.md";
  std::stringstream doc;
  doc << in.rdbuf();
  for (const PoolRow& row : PoolStatRows()) {
    if (!row.name.starts_with("state_") && !row.name.starts_with("window_")) continue;
    const std::string family = ExportedName(row.name, row.kind);
    EXPECT_THAT(doc.str(), HasSubstr("`" + family)) << family << " is not in docs/metrics.md";
    if (!row.label.name.empty()) {
      EXPECT_THAT(doc.str(), HasSubstr("`" + std::string(row.label.value) + "`"))
          << family << "{" << row.label.name << "=" << row.label.value << "} is not explained";
    }
  }
  EXPECT_THAT(doc.str(), HasSubstr("`window_evicted`"));
}

}  // namespace
}  // namespace kvpool::daemon
