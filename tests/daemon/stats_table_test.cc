// The stats tables (daemon/metrics/stats_table.h): every row reaches GetStats, `kvpoolctl stats`
// and the Prometheus exposition; every figure GetStatsResponse had is still filled, with its old
// meaning; per-tenant figures fold past their bound.

#include "daemon/metrics/stats_table.h"

#include <cmath>
#include <set>
#include <string>

#include "client/kvpoolctl_format.h"
#include "daemon/edge/convert.h"
#include "daemon/engine/label_fold.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/stats_proto.h"
#include "engine_test_util.h"
#include "fmt/format.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using ::testing::HasSubstr;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

TEST(LabelFoldTest, FirstValuesKeepTheirLabelsAndLaterOnesFold) {
  LabelFold fold(2);
  EXPECT_EQ(fold.Label("a"), "a");
  EXPECT_EQ(fold.Label("b"), "b");
  EXPECT_EQ(fold.Label("c"), LabelFold::kOther);
  EXPECT_EQ(fold.Label("a"), "a");  // kept for good
  EXPECT_EQ(fold.Label("b"), "b");
  EXPECT_EQ(fold.Label("other"), LabelFold::kOther);  // takes no slot
  EXPECT_EQ(fold.size(), 2u);
  LabelFold none(0);
  EXPECT_EQ(none.Label("a"), LabelFold::kOther);
  EXPECT_EQ(none.size(), 0u);
}

class StatsTableTest : public ::testing::Test {
 protected:
  void Make(size_t max_tenants = 64) {
    EngineOptions options = SmallPool(64, &clock_);
    options.tiers.host_blocks = 16;
    options.block_residency_sample = 1;  // every block: the residency rows are present
    options.max_tenant_labels = max_tenants;
    options.epoch = 0xF00DFACE12345679;  // above 2^53: a double would round it
    model_ = testing::TinyModel(options.pools[0].layout);
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
  }

  // One Allocate of `prompt` by a session of `tenant`, then a Free that commits it.
  void AllocateAndFree(const std::string& tenant, const std::vector<int32_t>& prompt) {
    std::shared_ptr<const Session> s = *engine_->OpenSession(Spec(tenant, tenant + "-client"));
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    absl::StatusOr<Tables> t =
        engine_->Allocate(*s, std::span(&request, 1), CallContext::Uncancellable());
    ASSERT_TRUE(t.ok()) << t.status();
    const SequenceId id = t->slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(*s, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()).ok());
  }

  v1::GetStatsResponse GetStats() {
    v1::GetStatsResponse r;
    const EventStreamStats streams = streams_.Read();
    ToProto(engine_->Stats(0), &attach_, &rpcs_, &r, &streams, &zmq_);
    return r;
  }
  std::string Exposition() {
    return prometheus::TextSerializer().Serialize(
        CollectFamilies(*engine_, &attach_, &rpcs_, &streams_, &zmq_));
  }

  ManualClock clock_{1'000'000'000};  // outlives the engine
  FailingDevice device_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  AttachCounters attach_;
  RpcCounters rpcs_;
  EventStreamCounters streams_;
  ZmqEventCounters zmq_;
};

// The GetStats row `name` with label value `label` (any, when empty); null when absent.
const v1::Stat* FindStat(const v1::GetStatsResponse& r, std::string_view name,
                         std::string_view label = "") {
  for (const v1::Stat& s : r.stats()) {
    if (s.name() != name) continue;
    if (label.empty()) return &s;
    for (const std::string& v : s.label_values()) {
      if (v == label) return &s;
    }
  }
  return nullptr;
}

// Observations of a GetStats histogram in the bucket holding `value`.
uint64_t InBucket(const v1::Stat& s, double value) {
  size_t i = 0;
  while (i < static_cast<size_t>(s.bucket_bounds_size()) && s.bucket_bounds(i) < value) ++i;
  return s.bucket_counts(static_cast<int>(i));
}

// A Stat's name with every label, for comparing outputs: name{k=v,...}.
std::string Key(std::string_view name, const std::vector<std::pair<std::string, std::string>>& l) {
  std::string out(name);
  for (const auto& [k, v] : l) out += "," + k + "=" + v;
  return out;
}

TEST_F(StatsTableTest, EveryPresentRowReachesGetStatsKvpoolctlAndTheExposition) {
  Make();
  AllocateAndFree("tenant-a", Prompt(48, 1));
  AllocateAndFree("tenant-a", Prompt(48, 1));
  attach_.malformed = 3;
  const int allocate = rpcs_.MethodIndex("/kvpool.v1.KvPool/Allocate");
  ASSERT_GE(allocate, 0);
  EXPECT_EQ(rpcs_.MethodIndex("/grpc.health.v1.Health/Check"), -1);
  rpcs_.Count(allocate, 0);
  rpcs_.Count(allocate, 0);
  rpcs_.Count(allocate, 5);
  const v1::GetStatsResponse r = GetStats();
  const std::string ctl = client::ctl::FormatStats(r, false);
  const std::string text = Exposition();

  std::set<std::string> sent;
  for (const v1::Stat& s : r.stats()) {
    std::vector<std::pair<std::string, std::string>> labels;
    for (int i = 0; i < s.label_names_size(); ++i) {
      labels.emplace_back(s.label_names(i), s.label_values(i));
    }
    EXPECT_TRUE(sent.insert(Key(s.name(), labels)).second) << "sent twice: " << s.name();
    EXPECT_FALSE(s.help().empty()) << s.name();
    EXPECT_FALSE(s.unit().empty()) << s.name();
    EXPECT_THAT(ctl, HasSubstr(s.name())) << "kvpoolctl stats leaves out " << s.name();
    const StatKind kind = s.kind() == v1::Stat::KIND_COUNTER ? StatKind::kCounter
                          : s.kind() == v1::Stat::KIND_GAUGE ? StatKind::kGauge
                                                             : StatKind::kHistogram;
    EXPECT_THAT(text, HasSubstr("# TYPE " + ExportedName(s.name(), kind) + " "))
        << "/metrics leaves out " << s.name();
  }
  // Every row of every table is sent (this source has a model, a host tier and a tenant; the
  // disk and Redis rows are absent without those tiers, the state group's without a model with
  // state-space layers (compute_integration_test sees them with one), the window group's without
  // sliding-window layers (group_stats_test), and only they).
  const EngineStats stats = engine_->Stats(0);
  const StatsSource source{.engine = &stats, .attach = &attach_};
  auto sent_name = [&](std::string_view name) {
    for (const v1::Stat& s : r.stats()) {
      if (s.name() == name) return true;
    }
    return false;
  };
  for (const PoolRow& row : PoolStatRows()) {
    const bool present = row.present == nullptr || row.present(source);
    EXPECT_TRUE(present
                    ? sent_name(row.name)
                    : row.label.value == "disk" || row.label.value == "redis" ||
                          row.name == "state_slots" || row.name == "state_checkpoints" ||
                          row.name == "state_checkpoint_resume_rate" ||
                          row.label.value == "no_checkpoint" || row.name.starts_with("window_") ||
                          row.label.value == "window_evicted")
        << row.name;
  }
  for (const PoolRow& row : DaemonStatRows()) EXPECT_TRUE(sent_name(row.name)) << row.name;
  for (const TenantRow& row : TenantStatRows()) EXPECT_TRUE(sent_name(row.name)) << row.name;
  for (const RpcRow& row : RpcStatRows()) EXPECT_TRUE(sent_name(row.name)) << row.name;
  EXPECT_THAT(text, HasSubstr("kvpool_rpcs_total{method=\"Allocate\",code=\"OK\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvpool_rpcs_total{method=\"Allocate\",code=\"NOT_FOUND\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvpool_attach_refusals_total{reason=\"malformed\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvpool_tenant_hit_tokens_total{pool=\"default\",tenant=\"tenant-a\"}"
                              " 48"));
  EXPECT_THAT(text, HasSubstr("vllm:prefix_cache_hits_total{pool=\"default\",model_name=\"tiny\"}"
                              " 48"));
  // Its eviction share (fair eviction, on by default): the 3 cached blocks of its prompt.
  EXPECT_THAT(text, HasSubstr(fmt::format(
                        "kvpool_tenant_cached_bytes{{pool=\"default\",tenant=\"tenant-a\"}}"
                        " {}",
                        3 * engine_->layout().block_bytes())));
  EXPECT_THAT(text, HasSubstr("kvpool_step_seconds_bucket{pool=\"default\",le=\"+Inf\"} 0"));
}

TEST_F(StatsTableTest, EveryFigureOfGetStatsResponseIsFilledByARow) {
  std::set<std::string_view> named;
  for (const PoolRow& row : PoolStatRows()) named.insert(row.proto_field);
  for (const PoolRow& row : DaemonStatRows()) named.insert(row.proto_field);
  const google::protobuf::Descriptor& d = *v1::GetStatsResponse::descriptor();
  for (int i = 0; i < d.field_count(); ++i) {
    const google::protobuf::FieldDescriptor& f = *d.field(i);
    if (f.is_repeated() || f.cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE ||
        f.cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_STRING) {
      continue;  // the layout, tiers, names: not table figures
    }
    if (f.name() == "epoch") continue;  // 64 random bits, set exactly by convert.cc

    EXPECT_TRUE(named.contains(f.name())) << "no stats row fills GetStatsResponse." << f.name();
  }
  for (std::string_view field : named) {
    if (field.find('.') != std::string_view::npos) continue;  // paths: EveryTierRowReaches...
    EXPECT_TRUE(field.empty() || d.FindFieldByName(std::string(field)) != nullptr) << field;
  }
}

TEST_F(StatsTableTest, OldFieldsKeepTheirMeaning) {
  Make();
  AllocateAndFree("tenant-a", Prompt(64, 2));
  ASSERT_TRUE(engine_->Evict(0, 2, false).ok());
  const EngineStats stats = engine_->Stats(0);
  const v1::GetStatsResponse r = GetStats();
  EXPECT_EQ(r.num_blocks(), 64);
  EXPECT_EQ(r.free_blocks(), stats.cache.pool.free);
  EXPECT_EQ(r.cached_blocks(), stats.cache.pool.cached);
  EXPECT_EQ(r.prompt_tokens(), 64u);
  EXPECT_EQ(r.evictions(), 2u);  // the reasons add up into the one old field
  EXPECT_EQ(r.evictions(), stats.cache.evictions);
  EXPECT_EQ(r.blocks_allocated(), stats.cache.pool.allocated);
  EXPECT_EQ(r.epoch(), 0xF00DFACE12345679u);
  EXPECT_EQ(r.sessions_opened(), 1u);
  EXPECT_EQ(r.attached_sessions(), 1);
  EXPECT_EQ(r.model_busy_us(), static_cast<uint64_t>(stats.model.busy_ns / 1000));
  EXPECT_EQ(r.model(), "tiny");
  EXPECT_EQ(r.device(), "failing-cpu");
}

// Residency is timed by the engine's clock: born at the first Allocate, hit by the next two,
// evicted 7.5 s after birth; the misses of the first Allocate count as not cached.
TEST_F(StatsTableTest, ResidencyAndMissesAreCountedAndExported) {
  Make();
  constexpr int64_t kS = 1'000'000'000;
  const std::vector<int32_t> prompt = Prompt(48, 4);  // 3 full blocks
  AllocateAndFree("t", prompt);                       // born at 0 s (misses 48 tokens)
  clock_.Advance(2 * kS);
  AllocateAndFree("t", prompt);  // hit at 2 s
  clock_.Advance(3 * kS / 2);
  AllocateAndFree("t", prompt);  // hit at 3.5 s
  clock_.Advance(4 * kS);
  ASSERT_TRUE(engine_->Evict(0, 3, false).ok());  // at 7.5 s
  const v1::GetStatsResponse r = GetStats();
  const v1::Stat* lifetime = FindStat(r, "vllm:kv_block_lifetime_seconds");
  const v1::Stat* idle = FindStat(r, "vllm:kv_block_idle_before_evict_seconds");
  const v1::Stat* gap = FindStat(r, "vllm:kv_block_reuse_gap_seconds");
  ASSERT_TRUE(lifetime && idle && gap);
  EXPECT_EQ(lifetime->count(), 3u);
  EXPECT_EQ(InBucket(*lifetime, 7.5), 3u);
  EXPECT_EQ(idle->count(), 3u);
  EXPECT_EQ(InBucket(*idle, 4), 3u);
  EXPECT_EQ(gap->count(), 3u);
  EXPECT_EQ(InBucket(*gap, 1.5), 3u);
  ASSERT_NE(FindStat(r, "missed_tokens", "not_cached"), nullptr);
  EXPECT_EQ(FindStat(r, "missed_tokens", "not_cached")->value(), 48);
  EXPECT_EQ(FindStat(r, "missed_tokens", "evicted")->value(), 0);
  double missed = 0;  // every reason's row, the two folded out of not_cached included
  std::set<std::string> reasons;
  for (const v1::Stat& stat : r.stats()) {
    if (stat.name() != "missed_tokens") continue;
    missed += stat.value();
    reasons.insert(stat.label_values(stat.label_values_size() - 1));
  }
  EXPECT_EQ(missed, static_cast<double>(r.prompt_tokens() - r.hit_tokens()));
  EXPECT_EQ(reasons, (std::set<std::string>{"not_cached", "another_namespace", "evicted",
                                            "below_admission_bar", "coverage"}));
  const std::string text = Exposition();
  EXPECT_THAT(text, HasSubstr("vllm:kv_block_lifetime_seconds_count{pool=\"default\","
                              "model_name=\"tiny\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvpool_missed_tokens_total{pool=\"default\",reason=\"not_cached\"}"
                              " 48"));
  EXPECT_THAT(text, HasSubstr("kvpool_fence_wait_seconds_count{pool=\"default\"}"));
}

// Distinct values for every figure of a store, from `base` up (so a row reading the wrong
// field shows).
tier::RemoteTierStats StoreFigures(uint64_t base) {
  tier::RemoteTierStats s;
  uint64_t* fields[] = {&s.breaker_opens,
                        &s.lookups,
                        &s.rejected_lookups,
                        &s.lookup_errors,
                        &s.hits,
                        &s.misses,
                        &s.corrupt,
                        &s.forged,
                        &s.puts,
                        &s.written,
                        &s.already_present,
                        &s.dropped_queue_full,
                        &s.dropped_over_budget,
                        &s.dropped_breaker_open,
                        &s.dropped_write_errors,
                        &s.dropped_shutdown,
                        &s.bytes_read,
                        &s.bytes_written};
  for (uint64_t* f : fields) *f = base++;
  s.queued_blocks = static_cast<int64_t>(base++);
  s.queued_bytes = static_cast<int64_t>(base);
  return s;
}

// All three tiers, every figure distinct.
TierStats AllTiers() {
  TierStats t;
  t.host = t.disk = t.remote = true;
  t.host_store = StoreFigures(100);
  t.disk_store = StoreFigures(200);
  t.remote_store = StoreFigures(300);
  t.host_capacity_blocks = 401;
  t.host_blocks = 402;
  t.host_evicted = 403;
  t.host_invalidated = 404;
  tier::DiskTierStats& d = t.disk_tier;
  d = {.capacity_blocks = 501,
       .blocks = 502,
       .evicted = 503,
       .invalidated = 504,
       .read_errors = 505,
       .write_errors = 506,
       .direct_io = true,
       .recovered_blocks = 507,
       .scan_dropped = 508,
       .scan_ns = 509'000'000,
       .started_empty = "another secret"};
  uint64_t v = 600;
  for (uint64_t* f :
       {&t.demoted, &t.demoted_bytes, &t.demote_dropped_full, &t.demote_failed, &t.lookups,
        &t.promoted_from_host, &t.promoted_from_disk, &t.promoted_from_remote, &t.promoted_bytes,
        &t.promote_failed, &t.promote_raced, &t.promote_adopted, &t.promote_unused,
        &t.lookup_truncated, &t.demoted_checkpoints, &t.promoted_checkpoints,
        &t.demoted_window_blocks, &t.promoted_window_blocks}) {
    *f = v++;
  }
  t.host_checkpoints = 41;
  t.host_checkpoint_capacity = 42;
  t.host_window_blocks = 43;
  t.host_window_capacity = 44;
  t.disk_checkpoints = 45;
  t.disk_window_blocks = 46;
  t.demote_ns = 2'000'000'000;
  t.promote_ns = 4'000'000'000;
  t.demote_queued = 7;
  return t;
}

// The proto value at a row's path (as stats_proto.cc walks it), as a double; NaN when the path
// leads nowhere.
double AtPath(const google::protobuf::Message& root, std::string_view path, const StatLabel& key) {
  const google::protobuf::Message* m = &root;
  for (size_t dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.')) {
    const auto* f = m->GetDescriptor()->FindFieldByName(std::string(path.substr(0, dot)));
    if (f == nullptr) return std::nan("");
    const google::protobuf::Reflection& r = *m->GetReflection();
    if (!f->is_repeated()) {
      m = &r.GetMessage(*m, f);
    } else {
      const google::protobuf::Message* found = nullptr;
      for (int i = 0; i < r.FieldSize(*m, f); ++i) {
        const google::protobuf::Message& e = r.GetRepeatedMessage(*m, f, i);
        const auto* k = e.GetDescriptor()->FindFieldByName(std::string(key.name));
        if (k != nullptr && e.GetReflection()->GetString(e, k) == key.value) found = &e;
      }
      if (found == nullptr) return std::nan("");
      m = found;
    }
    path.remove_prefix(dot + 1);
  }
  const auto* f = m->GetDescriptor()->FindFieldByName(std::string(path));
  if (f == nullptr) return std::nan("");
  const google::protobuf::Reflection& r = *m->GetReflection();
  using FD = google::protobuf::FieldDescriptor;
  switch (f->cpp_type()) {
    case FD::CPPTYPE_INT32:
      return r.GetInt32(*m, f);
    case FD::CPPTYPE_INT64:
      return static_cast<double>(r.GetInt64(*m, f));
    case FD::CPPTYPE_UINT64:
      return static_cast<double>(r.GetUInt64(*m, f));
    case FD::CPPTYPE_DOUBLE:
      return r.GetDouble(*m, f);
    case FD::CPPTYPE_BOOL:
      return r.GetBool(*m, f) ? 1 : 0;
    default:
      return std::nan("");
  }
}

bool IsTierRow(const PoolRow& row) {
  return row.name.starts_with("tier_") || row.name.starts_with("vllm:external_");
}

// With a host, a disk and a Redis tier, every tier row reaches GetStats (as a Stat, and in the
// old TierStats field it names, with its value), `kvpoolctl stats` and the exposition.
TEST_F(StatsTableTest, EveryTierRowReachesEveryOutput) {
  Make();
  EngineStats stats = engine_->Stats(0);
  stats.tiers = AllTiers();
  const StatsSource source{.engine = &stats, .attach = &attach_};
  v1::GetStatsResponse r;
  ToProto(stats, &attach_, &rpcs_, &r);
  const std::string ctl = client::ctl::FormatStats(r, false);
  const std::string text = prometheus::TextSerializer().Serialize(CollectFamilies(source));
  int tier_rows = 0;
  for (const PoolRow& row : PoolStatRows()) {
    if (!IsTierRow(row)) continue;
    ++tier_rows;
    ASSERT_TRUE(row.present == nullptr || row.present(source)) << row.name;
    // The row as kvpoolctl prints it (labels but the pool's) and as /metrics exports it.
    std::vector<std::pair<std::string, std::string>> labels;
    if (row.name.starts_with("vllm:")) labels.emplace_back("model_name", "tiny");
    if (!row.label.name.empty()) labels.emplace_back(row.label.name, row.label.value);
    std::string shown(row.name), exported = ExportedName(row.name, row.kind) + "{pool=\"default\"";
    for (size_t i = 0; i < labels.size(); ++i) {
      shown += (i == 0 ? "{" : ",") + labels[i].first + "=" + labels[i].second;
      exported += "," + labels[i].first + "=\"" + labels[i].second + "\"";
    }
    if (!labels.empty()) shown += "}";
    const v1::Stat* stat = FindStat(r, row.name, row.label.value);
    ASSERT_NE(stat, nullptr) << "GetStats leaves out " << shown;
    EXPECT_EQ(stat->value(), row.value(source)) << shown;
    EXPECT_THAT(ctl, HasSubstr("\n" + shown + " ")) << "kvpoolctl stats leaves out " << shown;
    EXPECT_THAT(text, HasSubstr("\n" + exported + "} ")) << "/metrics leaves out " << shown;
    if (!row.proto_field.empty()) {
      EXPECT_DOUBLE_EQ(AtPath(r, row.proto_field, row.label), row.value(source) * row.proto_scale)
          << shown << " -> " << row.proto_field;
    }
  }
  EXPECT_GT(tier_rows, 40);
  // The old fields keep their meaning (kvpoolctl and the Python client read them).
  ASSERT_EQ(r.tiers().stores_size(), 3);
  EXPECT_EQ(r.tiers().stores(0).medium(), "host");
  EXPECT_EQ(r.tiers().stores(0).hits(), 104u);
  EXPECT_EQ(r.tiers().stores(0).breaker(), "");
  EXPECT_EQ(r.tiers().stores(1).medium(), "disk");
  EXPECT_EQ(r.tiers().stores(1).dropped(), 211u + 212 + 213 + 214 + 215);
  EXPECT_EQ(r.tiers().stores(1).scan_ms(), 509);
  EXPECT_TRUE(r.tiers().stores(1).direct_io());
  EXPECT_EQ(r.tiers().stores(1).started_empty(), "another secret");
  EXPECT_EQ(r.tiers().stores(2).medium(), "redis");
  EXPECT_EQ(r.tiers().stores(2).breaker(), "closed");
  EXPECT_EQ(r.tiers().stores(2).queued_blocks(), 318);
  EXPECT_EQ(r.tiers().promoted_from_redis(), 607u);
  EXPECT_DOUBLE_EQ(r.tiers().demote_gbps(), 601.0 / 2e9);
}

// Every number of the old TierStats / TierStoreStats messages is filled by a tier row (the
// rates, names and states excepted: they are not figures).
TEST_F(StatsTableTest, EveryTierFieldIsFilledByARow) {
  std::set<std::string> named;
  for (const PoolRow& row : PoolStatRows()) named.insert(std::string(row.proto_field));
  using FD = google::protobuf::FieldDescriptor;
  for (const auto& [prefix, d] :
       {std::pair{std::string("tiers."), v1::TierStats::descriptor()},
        std::pair{std::string("tiers.stores."), v1::TierStoreStats::descriptor()}}) {
    for (int i = 0; i < d->field_count(); ++i) {
      const FD& f = *d->field(i);
      if (f.cpp_type() == FD::CPPTYPE_MESSAGE || f.cpp_type() == FD::CPPTYPE_STRING) continue;
      if (f.name() == "demote_gbps" || f.name() == "promote_gbps") continue;  // ratios
      EXPECT_TRUE(named.contains(prefix + f.name())) << "no tier row fills " << prefix << f.name();
    }
  }
}

// The event streams' rows read the counters they are given; the ZeroMQ rows only when there is
// a publisher.
TEST_F(StatsTableTest, EventStreamRowsReadTheirCounters) {
  Make();
  streams_.FollowerOpened();
  streams_.SnapshotSent(/*requested=*/false);
  streams_.BatchSent(300);
  zmq_.batches = 7;
  zmq_.replays_abandoned = 2;
  zmq_.dropped = 3;
  zmq_.queued_bytes = 4096;
  zmq_.replay_queued_bytes = 512;
  const v1::GetStatsResponse r = GetStats();
  EXPECT_EQ(FindStat(r, "event_followers")->value(), 1);
  EXPECT_EQ(FindStat(r, "event_snapshots", "fell_behind")->value(), 1);
  EXPECT_EQ(FindStat(r, "event_snapshots", "requested")->value(), 0);
  EXPECT_EQ(InBucket(*FindStat(r, "event_follower_lag_events"), 300), 1u);
  EXPECT_EQ(FindStat(r, "zmq_event_batches")->value(), 7);
  EXPECT_EQ(FindStat(r, "zmq_event_replays", "abandoned")->value(), 2);
  EXPECT_EQ(FindStat(r, "zmq_event_dropped")->value(), 3);
  EXPECT_EQ(FindStat(r, "zmq_event_queued_bytes", "pub")->value(), 4096);
  EXPECT_EQ(FindStat(r, "zmq_event_queued_bytes", "replay")->value(), 512);
  EXPECT_THAT(Exposition(), HasSubstr("kvpool_zmq_event_batches_total 7"));
  v1::GetStatsResponse without;
  ToProto(engine_->Stats(0), &attach_, &rpcs_, &without);
  EXPECT_EQ(FindStat(without, "zmq_event_batches"), nullptr);
  EXPECT_EQ(FindStat(without, "event_followers"), nullptr);
}

TEST_F(StatsTableTest, TenantsPastTheBoundCountUnderOther) {
  Make(/*max_tenants=*/2);
  const std::vector<int32_t> prompt = Prompt(32, 3);
  for (const char* tenant : {"t1", "t2", "t3", "t4"}) AllocateAndFree(tenant, prompt);
  const EngineStats stats = engine_->Stats(0);
  ASSERT_EQ(stats.tenants.size(), 3u);
  EXPECT_EQ(stats.tenants[0].first, "other");
  EXPECT_EQ(stats.tenants[0].second.prompt_tokens, 64u);  // t3 and t4
  EXPECT_EQ(stats.tenants[1].first, "t1");
  EXPECT_EQ(stats.tenants[1].second.prompt_tokens, 32u);
  EXPECT_EQ(stats.tenants[2].first, "t2");
  uint64_t prompt_tokens = 0;
  for (const auto& [tenant, counters] : stats.tenants) prompt_tokens += counters.prompt_tokens;
  EXPECT_EQ(prompt_tokens, stats.cache.prompt_tokens);
  const std::string text =
      prometheus::TextSerializer().Serialize(CollectFamilies(*engine_, nullptr));
  EXPECT_THAT(text, HasSubstr("tenant=\"other\""));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("tenant=\"t3\"")));
}

}  // namespace
}  // namespace kvpool::daemon
