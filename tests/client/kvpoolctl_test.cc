#include "client/kvpoolctl.h"

#include <fstream>
#include <sstream>

#include "client/kvpoolctl_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_daemon.h"

namespace kvpool::client::ctl {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(ParseTokensTest, AcceptsWhitespaceAndCommas) {
  auto tokens = ParseTokens(" 1 2,3,\n4\t5,,6\r\n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_THAT(*tokens, ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_TRUE(ParseTokens("").value().empty());
  EXPECT_THAT(ParseTokens("2147483647").value(), ElementsAre(2147483647));
}

TEST(ParseTokensTest, RejectsWhatIsNotATokenId) {
  auto bad = ParseTokens("1 x 3");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("token 2 ('x')"));
  EXPECT_FALSE(ParseTokens("-1").ok());
  EXPECT_FALSE(ParseTokens("2147483648").ok());
  EXPECT_FALSE(ParseTokens("1.5").ok());
  EXPECT_FALSE(ParseTokens("[1,2]").ok());
}

TEST(ParseTokensTest, ReadsAFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/prompt.txt";
  std::ofstream(path) << "10, 20, 30\n40\n";
  EXPECT_THAT(ReadTokensFile(path).value(), ElementsAre(10, 20, 30, 40));
  EXPECT_EQ(ReadTokensFile(dir.path() + "/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(ValidateInvocationTest, KnowsEachCommandsArguments) {
  const auto valid = [](Invocation inv) { return ValidateInvocation(inv).ok(); };
  EXPECT_TRUE(valid({.command = "stats"}));
  EXPECT_FALSE(valid({.command = "stats", .args = {"x"}}));
  EXPECT_FALSE(valid({.command = "nope"}));
  EXPECT_FALSE(valid({}));
  EXPECT_TRUE(valid({.command = "trace", .args = {"7"}}));
  EXPECT_TRUE(valid({.command = "trace", .all = true, .format = "chrome"}));
  EXPECT_FALSE(valid({.command = "trace"}));
  EXPECT_FALSE(valid({.command = "trace", .args = {"7"}, .all = true}));
  EXPECT_FALSE(valid({.command = "trace", .args = {"-3"}}));
  EXPECT_FALSE(valid({.command = "trace", .args = {"7"}, .format = "xml"}));
  EXPECT_TRUE(valid({.command = "explain", .args = {"prompt.txt"}}));
  EXPECT_FALSE(valid({.command = "explain"}));
  EXPECT_TRUE(valid({.command = "evict", .blocks = 4}));
  EXPECT_TRUE(valid({.command = "evict", .all = true}));
  EXPECT_FALSE(valid({.command = "evict"}));
  EXPECT_FALSE(valid({.command = "evict", .all = true, .blocks = 4}));
  EXPECT_FALSE(valid({.command = "evict", .blocks = -4}));
  EXPECT_TRUE(valid({.command = "log-level", .args = {"debug"}}));
  EXPECT_FALSE(valid({.command = "log-level"}));
  EXPECT_TRUE(valid({.command = "invalidate", .tenant = "t"}));
  EXPECT_TRUE(valid({.command = "invalidate", .tenant = "t", .model = "m"}));
  EXPECT_FALSE(valid({.command = "invalidate"}));  // a tenant is required
  EXPECT_FALSE(valid({.command = "invalidate", .args = {"t"}, .tenant = "t"}));
}

TEST(FormatTest, SessionsAreAnAlignedTable) {
  v1::ListSessionsResponse sessions;
  v1::SessionInfo* a = sessions.add_sessions();
  a->set_session_id(7);
  a->set_client_name("kvpoolctl");
  a->set_pid(12);
  v1::SessionInfo* b = sessions.add_sessions();
  b->set_session_id(12345);
  b->set_client_name("w");
  b->set_pid(999999);
  b->set_tenant("acme");
  b->set_quota_used(3 << 20);
  b->set_quota_bound(8 << 20);
  b->set_quota_unit("bytes");
  b->set_cache_share_blocks(48);
  b->set_cache_share_bytes(6 << 20);
  b->set_cache_share_weight(2);
  const std::vector<std::string> lines = Lines(FormatSessions(sessions, false));
  ASSERT_EQ(lines.size(), 4u);
  // Its tenant's quota: in bytes where every layer group is charged, "-" without one.
  EXPECT_THAT(lines[0], HasSubstr("QUOTA"));
  EXPECT_THAT(lines[2], HasSubstr("3.0 MiB/8.0 MiB"));
  EXPECT_EQ(lines[1].substr(lines[0].find("QUOTA"), 1), "-");
  // Its tenant's cached bytes in its eviction share, "-" with fair eviction off.
  EXPECT_THAT(lines[0], HasSubstr("CACHED"));
  EXPECT_THAT(lines[2], HasSubstr("6.0 MiB (48 blocks) w2"));
  EXPECT_EQ(lines[1].substr(lines[0].find("CACHED"), 1), "-");
  EXPECT_THAT(lines[0], HasSubstr("SESSION  CLIENT"));
  // Numbers are right-aligned: the ids end in the same column, names start in the same column.
  EXPECT_EQ(lines[0].find("CLIENT"), lines[1].find("kvpoolctl"));
  EXPECT_EQ(lines[1].find("kvpoolctl"), lines[2].find("w "));
  EXPECT_EQ(lines[1].find("7 ") + 1, lines[2].find("12345 ") + 5);
  EXPECT_EQ(lines[3], "2 session(s)");
}

TEST(FormatTest, StatsShowBlockShares) {
  v1::GetStatsResponse stats;
  stats.set_num_blocks(16);
  stats.set_free_blocks(4);
  stats.set_prompt_tokens(200);
  stats.set_hit_tokens(50);
  stats.set_device("cpu");
  const std::string text = FormatStats(stats, false);
  EXPECT_THAT(text, HasSubstr("device cpu"));
  EXPECT_THAT(text, ::testing::ContainsRegex("free +4 +25.0"));
  EXPECT_THAT(text, ::testing::ContainsRegex("hit_rate_% +25.0"));
  const json parsed = json::parse(FormatStats(stats, true));
  EXPECT_EQ(parsed["free_blocks"], 4);
  EXPECT_EQ(parsed["device"], "cpu");
  EXPECT_TRUE(parsed.contains("evictions"));  // defaults are printed too
}

// A stats-table row as the daemon sends it: name{medium=...} and its value.
void AddTierRow(v1::GetStatsResponse* stats, const std::string& name, const std::string& medium,
                double value) {
  v1::Stat* stat = stats->add_stats();
  stat->set_name(name);
  stat->set_kind(v1::Stat::KIND_COUNTER);
  stat->set_unit("blocks");
  stat->add_label_names("pool");
  stat->add_label_values("default");
  stat->add_label_names("medium");
  stat->add_label_values(medium);
  stat->set_value(value);
}

TEST(FormatTest, StatsShowTiersOnlyWhenConfigured) {
  v1::GetStatsResponse stats;
  stats.set_num_blocks(16);
  EXPECT_THAT(FormatStats(stats, false), ::testing::Not(HasSubstr("tiers:")));
  stats.mutable_tiers()->add_stores()->set_medium("host");
  v1::TierStoreStats* redis = stats.mutable_tiers()->add_stores();
  redis->set_medium("redis");
  redis->set_breaker("open");
  stats.mutable_tiers()->set_demote_gbps(1.5);
  // The figures are the table's rows, printed as every other row is.
  AddTierRow(&stats, "tier_store_hits", "host", 5);
  AddTierRow(&stats, "tier_store_forged", "redis", 1);
  AddTierRow(&stats, "tier_promoted_blocks", "redis", 3);
  const std::string text = FormatStats(stats, false);
  EXPECT_THAT(text, ::testing::ContainsRegex("\ntier_store_hits\\{medium=host\\} +5 +blocks"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\ntier_store_forged\\{medium=redis\\} +1 "));
  EXPECT_THAT(text, ::testing::ContainsRegex("\ntier_promoted_blocks\\{medium=redis\\} +3 "));
  EXPECT_THAT(text, HasSubstr("tiers: host redis (breaker open); demoted at 1.50 GB/s"));
}

TEST(FormatTest, StatsShowTheDiskTierAndHowItStarted) {
  v1::GetStatsResponse stats;
  v1::TierStoreStats* disk = stats.mutable_tiers()->add_stores();
  disk->set_medium("disk");
  disk->set_breaker("closed");
  disk->set_started_empty("it was written for another model");
  AddTierRow(&stats, "tier_store_write_errors", "disk", 2);
  const std::string text = FormatStats(stats, false);
  EXPECT_THAT(text, ::testing::ContainsRegex("\ntier_store_write_errors\\{medium=disk\\} +2 "));
  EXPECT_THAT(text, HasSubstr("disk (breaker closed) (started empty: it was written for another "
                              "model)"));
}

TEST(FormatTest, StatsShowBytesPerTokenOfEachLayer) {
  v1::GetStatsResponse stats;
  v1::PoolLayout* l = stats.mutable_layout();
  l->set_block_size(16);
  l->set_num_layers(4);
  const std::pair<v1::DType, double> layers[] = {{v1::DTYPE_BF16, 1024},
                                                 {v1::DTYPE_FP8_E4M3, 513},
                                                 {v1::DTYPE_FP8_E4M3, 513},
                                                 {v1::DTYPE_BF16, 1024}};
  for (const auto& [dtype, bytes] : layers) {
    v1::LayerLayout* layer = l->add_layers();
    layer->set_k_dtype(dtype);
    layer->set_v_dtype(dtype == v1::DTYPE_BF16 ? v1::DTYPE_BF16 : v1::DTYPE_INT8);
    layer->set_bytes_per_token(bytes);
  }
  const std::string text = FormatStats(stats, false);
  EXPECT_THAT(text, HasSubstr("mixed dtypes"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\n0 +bf16 +bf16 +1024.0\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\n1-2 +fp8 +int8 +513.0\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\n3 +bf16 +bf16 +1024.0\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\nall +3074.0\n"));
}

TEST(FormatTest, StatsShowTheWindowGroupsBlocksOnlyWithOne) {
  v1::GetStatsResponse stats;
  EXPECT_THAT(FormatStats(stats, false), Not(HasSubstr("WINDOW BLOCKS")));
  v1::PoolLayout* l = stats.mutable_layout();
  l->set_num_layers(4);
  l->set_num_window_layers(2);
  l->set_num_window_blocks(8);
  l->set_window_block_bytes(1024);
  for (auto [state, count] : {std::pair{"free", 2}, {"active", 4}, {"cached", 1}}) {
    AddTierRow(&stats, "window_blocks", "", count);  // a row of the table, relabelled below
    stats.mutable_stats()->rbegin()->set_label_names(1, "state");
    stats.mutable_stats()->rbegin()->set_label_values(1, state);
  }
  const std::string text = FormatStats(stats, false);
  EXPECT_THAT(text, HasSubstr("window group: layers 2-3"));
  EXPECT_THAT(text, ::testing::ContainsRegex("WINDOW BLOCKS +COUNT"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\nactive +4 +50.0"));
  EXPECT_THAT(text, ::testing::ContainsRegex("\nretiring +0 +0.0"));  // absent row: none
  EXPECT_THAT(text, ::testing::ContainsRegex("window_blocks\\{state=cached\\} +1 "));
}

TEST(FormatTest, SequencesShowTheWindowTableWithItsReleasedRun) {
  v1::ListSequencesResponse sequences;
  v1::SequenceInfo* info = sequences.add_sequences();
  info->set_sequence_id(5);
  for (int w : {7, -1, -1, -1, 3, 9}) {
    info->add_block_ids(20);
    info->add_generations(1);
    info->add_window_block_ids(w);
    info->add_window_generations(w < 0 ? 0 : 2);
  }
  EXPECT_THAT(FormatSequences(sequences, false), HasSubstr("7@2 -x3 3@2 9@2"));
  info->clear_window_block_ids();
  info->clear_window_generations();
  EXPECT_THAT(Lines(FormatSequences(sequences, false))[1], ::testing::EndsWith(" -"));
}

TEST(FormatTest, ExplainSaysWhatTheWindowGroupCut) {
  v1::ExplainMatchResponse explain;
  explain.set_matched_tokens(96);
  explain.set_stop("prompt_end");
  EXPECT_THAT(FormatExplain(explain, false), Not(HasSubstr("resumable")));
  explain.set_resumable_tokens(32);
  explain.set_window_evicted_tokens(64);
  EXPECT_THAT(FormatExplain(explain, false),
              HasSubstr("resumable 32 token(s); window group cut 64 token(s)\n"));
  EXPECT_EQ(json::parse(FormatExplain(explain, true))["window_evicted_tokens"], 64);
}

TEST(FormatTest, SequencesAbbreviateLongTables) {
  v1::ListSequencesResponse sequences;
  v1::SequenceInfo* info = sequences.add_sequences();
  info->set_sequence_id(5);
  for (int b = 0; b < 10; ++b) {
    info->add_block_ids(b);
    info->add_generations(2);
  }
  sequences.add_session_ids(42);
  const std::string text = FormatSequences(sequences, false);
  EXPECT_THAT(text, HasSubstr("0@2 1@2"));
  EXPECT_THAT(text, HasSubstr("7@2 ... (+2)"));
  EXPECT_THAT(text, Not(HasSubstr("8@2")));
}

TEST(FormatTest, JsonKeepsUint64sEnumsAndHashes) {
  v1::WatchEventsResponse events;
  v1::KvEvent* e = events.add_events();
  e->set_seq(18446744073709551615ull);
  e->set_type(v1::KvEvent::TYPE_BLOCK_REMOVED);
  e->add_block_hashes()->set_lo(0xff);
  const json parsed = json::parse(ToJson(events));
  EXPECT_EQ(parsed["events"][0]["seq"].get<uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(parsed["events"][0]["type"], "TYPE_BLOCK_REMOVED");
  EXPECT_EQ(parsed["events"][0]["block_hashes"][0], "000000000000000000000000000000ff");
  EXPECT_TRUE(parsed["events"][0]["parent_hash"].is_null());
  EXPECT_EQ(Lines(FormatEvents(events, true)).size(), 1u);
}

TEST(FormatTest, EventsTextHasALinePerEvent) {
  v1::WatchEventsResponse events;
  events.set_snapshot(true);
  events.set_resume_seq(9);
  v1::KvEvent* e = events.add_events();
  e->set_type(v1::KvEvent::TYPE_BLOCK_STORED);
  e->add_block_hashes()->set_lo(1);
  e->add_token_ids(5);
  e->set_block_size(4);
  const std::vector<std::string> lines = Lines(FormatEvents(events, false));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], HasSubstr("resume at seq 9"));
  EXPECT_THAT(lines[0], HasSubstr("1 device block(s);"));  // no tier holds any
  EXPECT_THAT(lines[1], HasSubstr("stored"));
  EXPECT_THAT(lines[1], HasSubstr("parent root"));
  EXPECT_THAT(lines[1], Not(HasSubstr("group")));  // a pool of one group
  // A hybrid pool's events name their group, and a window group its window.
  e->mutable_group()->set_index(1);
  e->mutable_group()->set_kind("sliding_window");
  e->mutable_group()->set_sliding_window(256);
  v1::KvEvent* removed = events.add_events();
  removed->set_type(v1::KvEvent::TYPE_BLOCK_REMOVED);
  removed->mutable_group()->set_index(2);
  removed->mutable_group()->set_kind("mamba");
  const std::vector<std::string> grouped = Lines(FormatEvents(events, false));
  ASSERT_EQ(grouped.size(), 3u);
  EXPECT_THAT(grouped[1], HasSubstr("group 1 sliding_window W 256"));
  EXPECT_THAT(grouped[2], HasSubstr("group 2 mamba"));
  EXPECT_THAT(grouped[2], Not(HasSubstr(" W ")));
  EXPECT_EQ(json::parse(ToJson(events))["events"][0]["group"]["kind"], "sliding_window");
  // A snapshot's header counts each medium's blocks, the tiers' too.
  v1::KvEvent* host = events.add_events();
  host->set_type(v1::KvEvent::TYPE_BLOCK_STORED);
  host->set_medium("host");
  host->add_block_hashes()->set_lo(2);
  host->add_block_hashes()->set_lo(3);
  EXPECT_THAT(Lines(FormatEvents(events, false))[0],
              HasSubstr("snapshot: 3 event(s), 1 device block(s), 2 host; resume at seq 9"));
}

TEST(FormatTest, ChromeTraceHasATrackPerBlockAndAnEventPerOperation) {
  const v1::DumpBlockTraceResponse trace = testing::SampleTrace();
  const json doc = json::parse(ChromeTrace(trace));
  ASSERT_TRUE(doc["traceEvents"].is_array());
  std::map<std::string, std::vector<json>> by_phase;
  for (const json& e : doc["traceEvents"]) by_phase[e["ph"].get<std::string>()].push_back(e);

  std::vector<int> named_tracks;
  for (const json& m : by_phase["M"]) {
    if (m["name"] == "thread_name") named_tracks.push_back(m["tid"].get<int>());
  }
  EXPECT_THAT(named_tracks, ElementsAre(3, 5));

  const std::vector<json>& instants = by_phase["i"];
  ASSERT_EQ(instants.size(), 5u);
  EXPECT_EQ(instants[0]["name"], "alloc");
  EXPECT_EQ(instants[0]["tid"], 3);
  EXPECT_DOUBLE_EQ(instants[0]["ts"].get<double>(), 1000.0);  // 1'000'000 ns
  EXPECT_EQ(instants[4]["name"], "retain");
  EXPECT_EQ(instants[4]["args"]["refs"], 2);
  EXPECT_EQ(instants[4]["args"]["generation"], 2);
  EXPECT_EQ(instants[4]["args"]["session"], 43);
  EXPECT_EQ(instants[4]["args"]["sequence"], 102);
  EXPECT_EQ(instants[4]["args"]["site"], "block_pool.cc:120 (Allocate)");

  // One complete event per (block, generation): block 3 gen 1 and 2, block 5 gen 1.
  const std::vector<json>& spans = by_phase["X"];
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[0]["tid"], 3);
  EXPECT_DOUBLE_EQ(spans[0]["ts"].get<double>(), 1000.0);
  EXPECT_DOUBLE_EQ(spans[0]["dur"].get<double>(), 1000.0);
  EXPECT_EQ(spans[1]["args"]["generation"], 2);
  EXPECT_DOUBLE_EQ(spans[1]["dur"].get<double>(), 1000.0);
}

TEST(FormatTest, TraceTextIsATable) {
  const std::string text = FormatTrace(testing::SampleTrace(), TraceFormat::kText);
  const std::vector<std::string> lines = Lines(text);
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_THAT(lines[0], ::testing::StartsWith("OP_SEQ"));
  EXPECT_THAT(lines[3], HasSubstr("free"));
  EXPECT_EQ(lines[6], "5 operation(s)");
}

// kvpoolctl's commands end to end against the fake daemon.
class KvpoolctlRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ConnectOptions options;
    options.runtime_dir = dir_.path();
    options.client_name = "kvpoolctl";
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  int Run(const Invocation& inv) {
    out_.str("");
    err_.str("");
    return ctl::Run(*client_, inv, out_, err_);
  }

  testing::TempDir dir_;
  testing::FakePool pool_{testing::SmallLayout()};
  testing::FakeAttachServer attach_{dir_.path(), &pool_, {}};
  testing::FakeGrpcServer grpc_{dir_.path()};
  std::unique_ptr<Client> client_;
  std::ostringstream out_;
  std::ostringstream err_;
};

TEST_F(KvpoolctlRunTest, StatsAndSessionsPrint) {
  EXPECT_EQ(Run({.command = "stats"}), kExitOk);
  EXPECT_THAT(out_.str(), HasSubstr("up 1h2m3s"));
  EXPECT_EQ(Run({.command = "sessions"}), kExitOk);
  EXPECT_THAT(out_.str(), HasSubstr("vllm-worker-0"));
  EXPECT_THAT(out_.str(), HasSubstr("0x0000000000abcdef"));
  EXPECT_EQ(Run({.command = "sequences", .json = true, .session = 43}), kExitOk);
  EXPECT_EQ(json::parse(out_.str())["session_ids"], json::array({43}));
}

TEST_F(KvpoolctlRunTest, CheckFailsOnAViolation) {
  EXPECT_EQ(Run({.command = "check"}), kExitFailure);
  EXPECT_THAT(out_.str(), HasSubstr("INVARIANT VIOLATED: free + active"));
}

TEST_F(KvpoolctlRunTest, TraceExportsChromeJson) {
  EXPECT_EQ(Run({.command = "trace", .all = true, .format = "chrome"}), kExitOk);
  const json doc = json::parse(out_.str());
  EXPECT_GT(doc["traceEvents"].size(), 5u);
  EXPECT_EQ(Run({.command = "trace", .args = {"5"}, .json = true}), kExitOk);
  EXPECT_EQ(json::parse(out_.str())["entries"].size(), 1u);
}

TEST_F(KvpoolctlRunTest, EventsPrintEveryMessage) {
  EXPECT_EQ(Run({.command = "events", .from = 4}), kExitOk);
  const std::vector<std::string> lines = Lines(out_.str());
  ASSERT_EQ(lines.size(), 4u);  // snapshot header + its event, then two events
  EXPECT_THAT(lines[2], ::testing::StartsWith("       4 stored"));
  EXPECT_THAT(lines[3], HasSubstr("removed"));
}

TEST_F(KvpoolctlRunTest, ExplainReadsTheTokensFile) {
  const std::string path = dir_.path() + "/tokens";
  std::ofstream(path) << "1,2,3,4,5,6";
  EXPECT_EQ(Run({.command = "explain", .args = {path}, .namespace_id = 9}), kExitOk);
  EXPECT_THAT(out_.str(), HasSubstr("matched 3 token(s); stopped: diverged"));
  EXPECT_THAT(out_.str(), HasSubstr("namespace 9: 6 tokens"));
  EXPECT_EQ(Run({.command = "explain", .args = {dir_.path() + "/none"}}), kExitFailure);
  EXPECT_THAT(err_.str(), HasSubstr("kvpoolctl: explain: NOT_FOUND"));
}

TEST_F(KvpoolctlRunTest, OperatorCommands) {
  EXPECT_EQ(Run({.command = "evict", .blocks = 3}), kExitOk);
  EXPECT_EQ(out_.str(), "evicted 3 block(s)\n");
  EXPECT_EQ(Run({.command = "evict", .json = true, .all = true}), kExitOk);
  EXPECT_EQ(json::parse(out_.str())["evicted"], 9);
  EXPECT_EQ(Run({.command = "log-level", .args = {"debug"}}), kExitOk);
  EXPECT_EQ(grpc_.service().log_level(), "debug");
  EXPECT_EQ(Run({.command = "drain"}), kExitOk);
  EXPECT_THAT(out_.str(), HasSubstr("2 sequence(s) still live"));
}

TEST_F(KvpoolctlRunTest, UsageErrorsAndRefusalsHaveTheirExitCodes) {
  EXPECT_EQ(Run({.command = "evict"}), kExitUsage);
  EXPECT_EQ(Lines(err_.str()).size(), 1u);
  grpc_.service().set_deny_admin(true);
  EXPECT_EQ(Run({.command = "stats"}), kExitFailure);
  EXPECT_EQ(err_.str(), "kvpoolctl: stats: PERMISSION_DENIED: session 42 is not an admin\n");
}

}  // namespace
}  // namespace kvpool::client::ctl
