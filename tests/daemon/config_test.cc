// kvpoold's configuration: defaults, validation, and the engine options made from it.

#include "daemon/edge/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_join.h"
#include "daemon/engine/pool_state.h"
#include "daemon/metrics/metrics_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/prefix_cache.h"
#include "model/weights.h"

namespace kvpool::daemon {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, EmbeddedDefaultsNeedNoFile) {
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend(), "cpu");
  EXPECT_EQ(c->pool_bytes(), 256ll << 20);
  EXPECT_EQ(c->shape().dtype(), "bf16");
  EXPECT_THAT(c->allowed_uids(), ::testing::ElementsAre(getuid()));
  EXPECT_FALSE(c->runtime_dir().empty());
  EXPECT_EQ(c->socket_mode(), 0660u);
  EXPECT_EQ(c->model().prefill_max_wait_steps(), 4);
  EXPECT_EQ(c->eviction_policy(), "default");  // the measured default (docs/eviction.md)
  EXPECT_EQ(c->event_capacity_bytes(), int64_t{64} << 20);
  EXPECT_EQ(c->limits().sequences_per_session(), 65536);
}

TEST(ConfigTest, EventCapacityBytesIsPositive) {
  const std::string path = ::testing::TempDir() + "/event_bytes.textproto";
  std::ofstream(path) << "event_capacity_bytes: -5\n";
  const absl::Status bad = LoadConfig(path).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("event_capacity_bytes: must be > 0"));
  std::ofstream(path) << "event_capacity_bytes: 1048576\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::StatusOr<EngineOptions> o = MakeEngineOptions(*c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->event_capacity_bytes, size_t{1} << 20);
}

TEST(ConfigTest, TheZmqEventPublisherIsOffByDefaultAndCheckedWhenSet) {
  v1::DaemonConfig c;
  ApplyDefaults(&c);
  EXPECT_TRUE(ValidateConfig(c).empty());
  c.mutable_zmq_events()->set_topic("kv");  // a field set, no endpoint
  EXPECT_THAT(ValidateConfig(c),
              ::testing::Contains(HasSubstr("zmq_events.endpoint: must be set for a publisher")));
  c.mutable_zmq_events()->set_endpoint("ipc:///tmp/kv-events");
  EXPECT_TRUE(ValidateConfig(c).empty());
  c.mutable_zmq_events()->set_replay_endpoint("ipc:///tmp/kv-events");
  c.mutable_zmq_events()->set_replay_batches(-1);
  c.mutable_zmq_events()->set_queued_bytes(-1);
  c.mutable_zmq_events()->set_pool("elsewhere");
  const std::vector<std::string> problems = ValidateConfig(c);
  EXPECT_THAT(problems, ::testing::Contains(HasSubstr("zmq_events.replay_endpoint: must differ")));
  EXPECT_THAT(problems,
              ::testing::Contains(HasSubstr("zmq_events.replay_batches: must be in [0, 1000000]")));
  EXPECT_THAT(problems, ::testing::Contains(HasSubstr("zmq_events.queued_bytes: must be > 0")));
  EXPECT_THAT(problems,
              ::testing::Contains(HasSubstr("zmq_events.pool: no pool named 'elsewhere'")));
  c.mutable_zmq_events()->set_pool("default");
  c.mutable_zmq_events()->set_replay_endpoint("ipc:///tmp/kv-replay");
  c.mutable_zmq_events()->set_replay_batches(0);
  c.mutable_zmq_events()->set_queued_bytes(1 << 20);
  EXPECT_TRUE(ValidateConfig(c).empty());
}

TEST(ConfigTest, EvictionPolicySpecsAreCheckedWhole) {
  const std::string path = ::testing::TempDir() + "/eviction.textproto";
  std::ofstream(path) << "eviction_policy: \"reuse+admit\"\n";
  ASSERT_TRUE(LoadConfig(path).ok());
  std::ofstream(path) << "eviction_policy: \"lru+bogus\"\n";
  const absl::Status bad = LoadConfig(path).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("eviction_policy: "));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("'bogus'"));
}

TEST(ConfigTest, EveryProblemIsOneLineNamingTheField) {
  const std::string path = ::testing::TempDir() + "/bad.textproto";
  std::ofstream(path)
      << "pool_bytes: -1\nbackend: \"tpu\"\ntrace_depth: 3\nshape { head_dim: 12 }\n"
         "model { prefill_share_tokens: 100000 }\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(c.status().message());
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 4);  // five lines
  EXPECT_THAT(message, HasSubstr("backend: unknown backend 'tpu' (auto, cpu, cuda)"));
  EXPECT_THAT(message, HasSubstr("pool_bytes: must be > 0"));
  EXPECT_THAT(message, HasSubstr("trace_depth"));
  EXPECT_THAT(message, HasSubstr("head_dim must be a multiple of 8"));
  EXPECT_THAT(message, HasSubstr("model.prefill_share_tokens"));
  std::ofstream(path) << "pool_bytes: 12 12\n";
  EXPECT_THAT(std::string(LoadConfig(path).status().message()), HasSubstr("bad.textproto:1:"));
  EXPECT_EQ(LoadConfig("/nonexistent.textproto").status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, EngineOptionsFollowTheConfig) {
  v1::DaemonConfig c = DefaultConfig();
  c.set_pool_bytes(int64_t{64} << 16);
  c.set_fill_policy("zero");
  c.set_session_quota_blocks(7);
  (*c.mutable_tenant_quota_blocks())["a"] = 9;
  c.mutable_model()->set_gather_window_us(300);
  c.mutable_model()->set_max_step_tokens(64);
  c.mutable_model()->set_prefill_max_wait_steps(2);
  c.mutable_model()->set_prefill_share_tokens(8);
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 42);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->pools.size(), 1u);
  EXPECT_EQ(o->pools[0].name, "default");
  EXPECT_EQ(o->pools[0].layout.num_blocks, 64);
  EXPECT_EQ(o->pools[0].layout.block_bytes(), 64 << 10);
  EXPECT_EQ(o->fill_policy, kernels::FillPolicy::kZero);
  EXPECT_EQ(o->session_quota_blocks, 7);
  EXPECT_EQ(o->open_quota_blocks.at("a"), 9);
  EXPECT_TRUE(o->tenants.empty());
  EXPECT_EQ(o->epoch, 42u);
  EXPECT_EQ(o->gather_window_ns, 300'000);
  EXPECT_EQ(o->scheduler.max_step_tokens, 64);
  EXPECT_EQ(o->scheduler.prefill_max_wait_steps, 2);
  EXPECT_EQ(o->scheduler.prefill_share, 8);
  EXPECT_EQ(o->model_name, "tiny");
  EXPECT_EQ(o->limits.decode_width, 64);  // follows max_step_tokens unless set
  EXPECT_EQ(o->limits.sessions_per_uid, 64);
  EXPECT_EQ(o->limits.batch_items, 4096);
  EXPECT_EQ(o->limits.sequences_per_session, 65536);
  EXPECT_EQ(o->limits.cache_salts_per_uid, 16384);
  c.mutable_limits()->set_cache_salts_per_uid(-1);
  EXPECT_THAT(std::string(MakeEngineOptions(c, 42).status().message()),
              HasSubstr("limits.cache_salts_per_uid"));
  c.mutable_limits()->set_cache_salts_per_uid(0);
  EXPECT_EQ(o->event_capacity_bytes, size_t{64} << 20);
  c.mutable_limits()->set_decode_width(65);
  EXPECT_THAT(std::string(MakeEngineOptions(c, 42).status().message()),
              HasSubstr("limits.decode_width"));
  c.mutable_limits()->set_decode_width(0);
  c.set_pool_bytes(-1);
  EXPECT_EQ(MakeEngineOptions(c, 42).status().code(), absl::StatusCode::kInvalidArgument);
}

// One way to give a tenant a quota: with `tenants`, their quota_blocks; tenant_quota_blocks is
// its alias for the zero-configuration mode, and naming both is a config error (issue 29).
// Issue 29: one pass checks each field and converts it; the engine's options and the problems
// come from the same pass, so they cannot disagree.
TEST(ConfigTest, EngineOptionsAndProblemsComeFromOnePass) {
  v1::DaemonConfig c = DefaultConfig();
  c.set_fill_policy("poison");
  c.mutable_tiers()->mutable_redis()->set_enabled(true);
  c.mutable_tiers()->mutable_redis()->set_host("h");
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->fill_policy, kernels::FillPolicy::kPoison);
  EXPECT_EQ(o->tiers.redis.key_slotting, tier::KeySlotting::kNamespace);  // the first is default
  c.set_fill_policy("scribble");
  c.mutable_tiers()->mutable_redis()->set_key_slotting("slot");
  c.mutable_model()->set_name("huge");
  const std::vector<std::string> problems = ValidateConfig(c);
  EXPECT_THAT(problems, ::testing::UnorderedElementsAre(
                            "fill_policy: unknown fill policy 'scribble' (none, zero, poison)",
                            "tiers.redis.key_slotting: 'slot' is not one of namespace, block",
                            HasSubstr("model.name: unknown model size 'huge'; known sizes: tiny")));
  o = MakeEngineOptions(c, 1);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().message(), absl::StrJoin(problems, "\n"));
}

v1::DaemonConfig HybridConfig() {
  v1::DaemonConfig c;
  c.mutable_model()->set_name("tiny-hybrid");
  ApplyDefaults(&c);
  return c;
}

// Issue 28: a model with state-space layers gets the pool's state group (docs/hybrid-groups.md
// §2): the pool keeps K/V of its attention layers only, and shape.state_slots slots of the
// model's state come out of the pool's bytes before the blocks; by name or as a checkpoint.
TEST(ConfigTest, StateSpaceModelsGetAStateGroup) {
  const model::ModelConfig hybrid = *model::NamedConfig("tiny-hybrid");
  auto check = [&](const v1::DaemonConfig& c) {
    EXPECT_THAT(ValidateConfig(c), ::testing::IsEmpty());
    EXPECT_EQ(c.shape().num_layers(), 1);  // one attention layer of four
    EXPECT_EQ(c.shape().state_slots(), 64);
    absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
    ASSERT_TRUE(o.ok()) << o.status();
    const kernels::PoolLayout& l = o->pools[0].layout;
    EXPECT_EQ(l.num_layers, 1);
    // 64 working states, and for the prefix cache's state checkpoints a quarter of what is left.
    EXPECT_EQ(l.state_slot_bytes, (hybrid.state_bytes() + 63) / 64 * 64);
    const int64_t rest = c.pool_bytes() - 64 * l.state_slot_bytes;
    EXPECT_EQ(o->pools[0].checkpoint_slots, rest / 4 / l.state_slot_bytes);
    EXPECT_GE(o->pools[0].checkpoint_slots, 2);
    EXPECT_EQ(l.num_state_slots, 64 + o->pools[0].checkpoint_slots);
    EXPECT_GT(l.num_blocks, 0);
    EXPECT_LE(l.arena_bytes(), c.pool_bytes());
    EXPECT_GT(l.arena_bytes() + l.block_bytes(), c.pool_bytes() - 4096);  // nothing left unused
  };
  check(HybridConfig());

  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("kvpool_config_hybrid_" + std::to_string(::getpid())))
                              .string();
  ASSERT_TRUE(model::SaveCheckpoint(model::SyntheticWeights(hybrid, 1), dir, "bf16").ok());
  v1::DaemonConfig from_checkpoint;
  from_checkpoint.mutable_model()->set_checkpoint(dir);
  ApplyDefaults(&from_checkpoint);
  check(from_checkpoint);
  std::filesystem::remove_all(dir);
}

// shape.checkpoint_slots unset: each pool gives its state checkpoints a quarter of its bytes left
// after the working states (the share the default interval is made for), so a pool twice the
// size gets more than twice the checkpoints; an explicit count is every pool's.
TEST(ConfigTest, CheckpointSlotsDefaultToAQuarterOfEachPool) {
  v1::DaemonConfig c = HybridConfig();
  for (const auto& [name, bytes] :
       std::vector<std::pair<std::string, int64_t>>{{"small", 256 << 20}, {"large", 512 << 20}}) {
    v1::PoolSpec* p = c.add_pools();
    p->set_name(name);
    p->set_pool_bytes(bytes);
  }
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->pools.size(), 2);
  for (const PoolOptions& pool : o->pools) {
    const kernels::PoolLayout& l = pool.layout;
    const int64_t slot = l.state_slot_bytes;
    const int64_t bytes = pool.name == "small" ? 256 << 20 : 512 << 20;
    const int64_t checkpoint_bytes = pool.checkpoint_slots * slot;
    const int64_t kv_bytes = int64_t{l.num_blocks} * l.block_bytes();
    EXPECT_EQ(l.num_state_slots, 64 + pool.checkpoint_slots) << pool.name;
    EXPECT_LE(checkpoint_bytes, (bytes - 64 * slot) / 4) << pool.name;
    EXPECT_GT(checkpoint_bytes + slot, (bytes - 64 * slot) / 4) << pool.name;
    // About a third of the bytes of the K/V beside them (a block's rounding apart).
    EXPECT_NEAR(static_cast<double>(checkpoint_bytes) / kv_bytes, 1.0 / 3.0, 0.05) << pool.name;
  }
  EXPECT_GT(o->pools[1].checkpoint_slots, 2 * o->pools[0].checkpoint_slots);
  c.mutable_shape()->set_checkpoint_slots(5);
  o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->pools[0].checkpoint_slots, 5);
  EXPECT_EQ(o->pools[1].checkpoint_slots, 5);
}

// The state and checkpoint slots of shape: too many for the pool, explicit, none, bad, stray.
TEST(ConfigTest, StateAndCheckpointSlotsAreChecked) {
  const v1::DaemonConfig c = HybridConfig();
  v1::DaemonConfig crowded = c;
  crowded.mutable_shape()->set_state_slots(1000);  // 1.5 GiB of states in 256 MiB
  EXPECT_THAT(
      ValidateConfig(crowded),
      ::testing::ElementsAre(AllOf(HasSubstr("pool_bytes"), HasSubstr("after 1001 state slots"))));
  // Checkpoint slots: explicit, none (-1), none with the prefix cache off, bad, stray.
  for (const auto& [set, disable_cache, want] : std::vector<std::tuple<int32_t, bool, int32_t>>{
           {8, false, 8}, {-1, false, 0}, {8, true, 0}}) {
    v1::DaemonConfig k = c;
    k.mutable_shape()->set_checkpoint_slots(set);
    k.set_disable_prefix_cache(disable_cache);
    absl::StatusOr<EngineOptions> o = MakeEngineOptions(k, 1);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->pools[0].checkpoint_slots, want);
    EXPECT_EQ(o->pools[0].layout.num_state_slots, 64 + want);
  }
  v1::DaemonConfig bad_checkpoints = c;
  bad_checkpoints.mutable_shape()->set_checkpoint_slots(-2);
  EXPECT_THAT(ValidateConfig(bad_checkpoints),
              ::testing::ElementsAre(HasSubstr("shape.checkpoint_slots: must be >= 0")));
  v1::DaemonConfig stray = DefaultConfig();
  stray.mutable_shape()->set_checkpoint_slots(4);
  EXPECT_THAT(ValidateConfig(stray),
              ::testing::ElementsAre(HasSubstr("shape.checkpoint_slots: the model has no")));
  // The checkpoint interval: three times the break-even one (0, resolved per pool: its state slot
  // over its block, rounded up), explicit, none (-1).
  for (const auto& [set, want] :
       std::vector<std::pair<int32_t, int32_t>>{{0, -2}, {8, 8}, {-1, 0}}) {
    v1::DaemonConfig k = c;
    k.mutable_shape()->set_checkpoint_interval(set);
    absl::StatusOr<EngineOptions> o = MakeEngineOptions(k, 1);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->checkpoint_interval, set);
    const kernels::PoolLayout& l = o->pools[0].layout;
    const int64_t break_even = (l.state_slot_bytes + l.block_bytes() - 1) / l.block_bytes();
    EXPECT_GT(break_even, 1);
    EXPECT_EQ(PoolCheckpointInterval(*o, l), want == -2 ? 3 * break_even : want) << set;
  }
  absl::StatusOr<EngineOptions> plain = MakeEngineOptions(DefaultConfig(), 1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(PoolCheckpointInterval(*plain, plain->pools[0].layout), 0);  // no state group
  v1::DaemonConfig bad_interval = c;
  bad_interval.mutable_shape()->set_checkpoint_interval(-2);
  EXPECT_THAT(ValidateConfig(bad_interval),
              ::testing::ElementsAre(HasSubstr("shape.checkpoint_interval: must be >= 0 blocks")));
  v1::DaemonConfig stray_interval = DefaultConfig();
  stray_interval.mutable_shape()->set_checkpoint_interval(4);
  EXPECT_THAT(ValidateConfig(stray_interval),
              ::testing::ElementsAre(HasSubstr("shape.checkpoint_interval: the model has no")));
  v1::DaemonConfig stateless = DefaultConfig();
  stateless.mutable_shape()->set_state_slots(4);
  EXPECT_THAT(ValidateConfig(stateless),
              ::testing::ElementsAre("shape.state_slots: the model has no state-space layers "
                                     "(0: none)"));
  stateless.mutable_shape()->set_state_slots(-1);
  EXPECT_THAT(ValidateConfig(stateless),
              ::testing::ElementsAre("shape.state_slots: must be >= 0 (got -1)"));
  v1::DaemonConfig negative = c;
  negative.mutable_limits()->set_state_slots_per_uid(-2);
  EXPECT_THAT(ValidateConfig(negative),
              ::testing::ElementsAre(HasSubstr("limits.state_slots_per_uid: must be >= 0")));
  negative.mutable_limits()->set_state_slots_per_uid(8);
  EXPECT_EQ(MakeEngineOptions(negative, 1)->limits.state_slots_per_uid, 8);
}

// The order checkpoints give way in: by tokens saved weighed by kind (unset or named), by tokens
// saved alone, least recently used, nothing else, and only for a model with state-space layers.
TEST(ConfigTest, CheckpointEvictionIsByTokensSavedOrLru) {
  const v1::DaemonConfig c = HybridConfig();
  for (const auto& [set, want] :
       std::vector<std::pair<std::string, KvCacheOptions::CheckpointEviction>>{
           {"", KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved},
           {"expected_tokens_saved", KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved},
           {"tokens_saved", KvCacheOptions::CheckpointEviction::kByTokensSaved},
           {"lru", KvCacheOptions::CheckpointEviction::kLeastRecentlyUsed}}) {
    v1::DaemonConfig k = c;
    k.mutable_shape()->set_checkpoint_eviction(set);
    absl::StatusOr<EngineOptions> o = MakeEngineOptions(k, 1);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->checkpoint_eviction, want) << set;
  }
  v1::DaemonConfig bad_eviction = c;
  bad_eviction.mutable_shape()->set_checkpoint_eviction("LRU");
  EXPECT_THAT(ValidateConfig(bad_eviction),
              ::testing::ElementsAre("shape.checkpoint_eviction: must be "
                                     "\"expected_tokens_saved\", \"tokens_saved\" or \"lru\" "
                                     "(got \"LRU\")"));
  v1::DaemonConfig stray_eviction = DefaultConfig();
  stray_eviction.mutable_shape()->set_checkpoint_eviction("lru");
  EXPECT_THAT(ValidateConfig(stray_eviction),
              ::testing::ElementsAre(HasSubstr("shape.checkpoint_eviction: the model has no")));
}

TEST(ConfigTest, AHybridModelNeedsItsOwnShape) {
  // The shape of another model is refused, naming what the model needs.
  v1::DaemonConfig mismatched = DefaultConfig();  // tiny's shape: 4 layers with K/V
  mismatched.mutable_model()->set_name("tiny-hybrid");
  EXPECT_THAT(ValidateConfig(mismatched), ::testing::Contains(HasSubstr("needs num_layers 1")));
  // tiny-swa (full and window layers only) has no state group.
  v1::DaemonConfig c = DefaultConfig();
  c.mutable_model()->set_name("tiny-swa");
  EXPECT_THAT(ValidateConfig(c), ::testing::IsEmpty());
  EXPECT_EQ(MakeEngineOptions(c, 1)->pools[0].layout.num_state_slots, 0);
}

TEST(ConfigTest, ASlidingWindowModelGetsAWindowGroup) {
  v1::DaemonConfig c = DefaultConfig();
  c.mutable_model()->set_name("tiny-swa");  // window 256 in every other one of its 4 layers
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  const kernels::PoolLayout& l = o->pools[0].layout;
  EXPECT_EQ(l.num_window_layers, 2);
  // Default: a quarter of the pool's bytes.
  EXPECT_EQ(l.num_window_blocks, c.pool_bytes() / 4 / l.window_block_bytes());
  EXPECT_EQ(o->window_tokens, 256);
  EXPECT_EQ(o->sink_tokens, 0);
  c.mutable_shape()->set_window_blocks(100);
  EXPECT_EQ(MakeEngineOptions(c, 1)->pools[0].layout.num_window_blocks, 100);
  // None: the sliding layers keep every token in the main blocks, as before window groups.
  c.mutable_shape()->set_window_blocks(-1);
  EXPECT_EQ(MakeEngineOptions(c, 1)->pools[0].layout.num_window_layers, 0);
  c.mutable_shape()->set_window_blocks(-2);
  EXPECT_THAT(ValidateConfig(c),
              ::testing::ElementsAre("shape.window_blocks: must be >= 0, or -1 for none (got -2)"));
  v1::DaemonConfig stray = DefaultConfig();
  stray.mutable_shape()->set_window_blocks(8);
  EXPECT_THAT(ValidateConfig(stray),
              ::testing::ElementsAre("shape.window_blocks: the model has no sliding-window "
                                     "layers (0: none)"));
  // More window blocks than the pool's bytes hold: refused, naming the budget.
  c.mutable_shape()->set_window_blocks(1 << 30);
  EXPECT_THAT(ValidateConfig(c), ::testing::Contains(HasSubstr("pool_bytes")));
}

TEST(ConfigTest, ATenantsQuotaIsGivenOneWay) {
  v1::DaemonConfig c = *LoadConfig("");
  (*c.mutable_tenant_quota_blocks())["a"] = 9;
  EXPECT_THAT(ValidateConfig(c), ::testing::IsEmpty());
  v1::TenantSpec* t = c.add_tenants();
  t->set_name("a");
  t->add_uids(1000);
  t->set_quota_blocks(9);
  EXPECT_THAT(ValidateConfig(c), ::testing::Contains(HasSubstr("tenant_quota_blocks")));
  c.clear_tenant_quota_blocks();
  EXPECT_THAT(ValidateConfig(c), ::testing::IsEmpty());
}

// Fair eviction by tenant: on by default (16 shares a pool), -1 turns it off, and a tenant's
// weight is checked.
TEST(ConfigTest, FairEvictionIsOnByDefaultAndItsWeightsAreChecked) {
  v1::DaemonConfig c = *LoadConfig("");
  EXPECT_EQ(c.limits().eviction_shares(), 16);
  EXPECT_EQ(MakeEngineOptions(c, 1)->eviction_shares, 16);
  c.mutable_limits()->set_eviction_shares(-1);
  EXPECT_EQ(MakeEngineOptions(c, 1)->eviction_shares, 0);
  c.mutable_limits()->set_eviction_shares(-2);
  EXPECT_THAT(ValidateConfig(c),
              ::testing::ElementsAre(HasSubstr("limits.eviction_shares: must be in [1, 1024]")));
  c.mutable_limits()->set_eviction_shares(4);
  v1::TenantSpec* t = c.add_tenants();
  t->set_name("a");
  t->add_uids(1000);
  EXPECT_EQ(MakeEngineOptions(c, 1)->tenants.at("a").cache_weight, 1u);  // 0: 1
  t->set_cache_weight(3);
  EXPECT_EQ(MakeEngineOptions(c, 1)->tenants.at("a").cache_weight, 3u);
  t->set_cache_weight(PrefixCache::kMaxShareWeight + 1);
  EXPECT_THAT(ValidateConfig(c),
              ::testing::ElementsAre(HasSubstr("tenants[0].cache_weight: must be in [1, ")));
}

TEST(ConfigTest, TiersAreOffByDefaultAndCheckedWhenOn) {
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(DefaultConfig(), 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->tiers.enabled());

  const std::string path = ::testing::TempDir() + "/tiers.textproto";
  std::ofstream(path) << "tiers { host_blocks: -1 host_checkpoints: -2 host_window_blocks: -3 "
                         "redis { enabled: true "
                         "unix_socket: \"/r.sock\" host: \"h\" key_slotting: \"row\" "
                         "command_timeout_ms: -2 tenant_write_budget_bytes: 4096 } }\n";
  const absl::Status bad = LoadConfig(path).status();
  ASSERT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  const std::string message(bad.message());
  EXPECT_THAT(message, HasSubstr("tiers.host_blocks"));
  EXPECT_THAT(message, HasSubstr("tiers.host_checkpoints: must be >= 0"));
  EXPECT_THAT(message, HasSubstr("tiers.host_window_blocks: must be >= 0"));
  EXPECT_THAT(message, HasSubstr("tiers.redis: name exactly one of"));
  EXPECT_THAT(message, HasSubstr("tiers.redis.key_slotting: 'row' is not one of namespace, block"));
  EXPECT_THAT(message, HasSubstr("tiers.redis.command_timeout_ms"));
  EXPECT_THAT(message, HasSubstr("tiers.redis.tenant_write_budget_bytes: needs "
                                 "tiers.redis.ttl_seconds > 0"));

  std::ofstream(path) << "tiers { host_blocks: 64 staged_blocks: 8 host_checkpoints: 5 "
                         "host_window_blocks: 9 redis { "
                         "enabled: true cluster_seeds: \"127.0.0.1:7000\" key_slotting: "
                         "\"block\" command_timeout_ms: 50 ttl_seconds: 600 "
                         "tenant_write_budget_bytes: 1073741824 } }\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  o = MakeEngineOptions(*c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tiers.host_blocks, 64);
  EXPECT_EQ(o->tiers.staged_blocks, 8);
  EXPECT_EQ(o->tiers.host_checkpoints, 5);
  EXPECT_EQ(o->tiers.host_window_blocks, 9);
  EXPECT_TRUE(o->tiers.redis.enabled);
  EXPECT_EQ(o->tiers.redis.cluster_seeds, std::vector<std::string>{"127.0.0.1:7000"});
  EXPECT_EQ(o->tiers.redis.key_slotting, tier::KeySlotting::kBlock);
  EXPECT_EQ(o->tiers.redis.command_timeout, absl::Milliseconds(50));
  EXPECT_EQ(o->tiers.redis.connect_timeout, absl::Milliseconds(200));  // the default
  EXPECT_EQ(o->tiers.redis.ttl_seconds, 600);
  EXPECT_EQ(o->tiers.redis.tenant_write_budget_bytes, int64_t{1} << 30);
}

// The disk tier needs the deployment secret (its records are sealed under it, and a random one
// would make them useless after a restart) and pool names that can name a directory.
TEST(ConfigTest, TheDiskTierNeedsASecretFileAndPathSafePoolNames) {
  const std::string path = ::testing::TempDir() + "/disk.textproto";
  std::ofstream(path) << "pools { name: \"a/b\" pool_bytes: 16777216 }\n"
                         "tiers { disk { directory: \"rel\" capacity_bytes: 0 fsync: \"always\" "
                         "} }\n";
  const absl::Status bad = LoadConfig(path).status();
  ASSERT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  const std::string message(bad.message());
  EXPECT_THAT(message, HasSubstr("tiers.disk: needs secret_file"));
  EXPECT_THAT(message, HasSubstr("tiers.disk.directory: must be an absolute path"));
  EXPECT_THAT(message, HasSubstr("tiers.disk.capacity_bytes: must be > 0"));
  EXPECT_THAT(message, HasSubstr("tiers.disk.fsync: 'always' is not one of none, batch, periodic"));
  EXPECT_THAT(message, HasSubstr("pools[0].name: must be letters"));

  const std::string secret = ::testing::TempDir() + "/disk-secret";
  std::ofstream(secret) << std::string(32, 'x');
  ASSERT_EQ(chmod(secret.c_str(), 0600), 0);
  std::ofstream(path) << "secret_file: \"" << secret << "\"\n"
                      << "tiers { disk { directory: \"/var/cache/kvpool\" capacity_bytes: "
                         "1073741824 fsync: \"batch\" } }\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  const absl::StatusOr<EngineOptions> o = MakeEngineOptions(*c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->tiers.enabled());
  EXPECT_EQ(o->tiers.disk.directory, "/var/cache/kvpool");
  EXPECT_EQ(o->tiers.disk.fsync, tier::DiskFsync::kBatch);
  EXPECT_EQ(o->invalidations_file, "/var/cache/kvpool/invalidations");
  EXPECT_NE(o->tiers.disk.content_fingerprint, 0u);  // the model's
}

// tiers.redis.password_file: read at load, owner-only, not a symlink; a clear one-line error
// otherwise (the field is new: before it, the config test could not name a file at all).
TEST(ConfigTest, RedisPasswordFileIsReadAndMustBeOwnerOnly) {
  const std::string file = ::testing::TempDir() + "/redis-password";
  std::remove(file.c_str());
  std::ofstream(file) << "s3cret pass\n";
  v1::DaemonConfig c = DefaultConfig();
  v1::RedisTierSpec* redis = c.mutable_tiers()->mutable_redis();
  redis->set_enabled(true);
  redis->set_unix_socket("/run/redis/redis.sock");
  redis->set_username("kvpool");
  redis->set_password_file(file);

  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  absl::Status bad = MakeEngineOptions(c, 1).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("tiers.redis.password_file: "));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("chmod 0600"));
  EXPECT_EQ(std::string(bad.message()).find('\n'), std::string::npos) << bad;

  const std::string link = file + ".link";
  std::remove(link.c_str());
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  ASSERT_EQ(chmod(file.c_str(), 0600), 0);
  redis->set_password_file(link);
  bad = MakeEngineOptions(c, 1).status();
  EXPECT_THAT(std::string(bad.message()), HasSubstr("symbolic link")) << bad;
  redis->set_password_file(file + ".missing");
  EXPECT_EQ(MakeEngineOptions(c, 1).status().code(), absl::StatusCode::kInvalidArgument);

  redis->set_password_file(file);
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->tiers.redis.password, "s3cret pass");  // the trailing newline is not part of it
  EXPECT_EQ(o->tiers.redis.username, "kvpool");

  redis->set_password("inline");
  EXPECT_THAT(ValidateConfig(c), ::testing::Contains(HasSubstr("not both")));
}

// The sample config in deploy/ spells out the defaults: it loads, and its tiers are off.
TEST(ConfigTest, TheSampleConfigLoads) {
  const absl::StatusOr<v1::DaemonConfig> c =
      LoadConfig(std::string(KVPOOL_SOURCE_DIR) + "/deploy/kvpoold.textproto");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tiers().host_blocks(), 0);
  EXPECT_FALSE(c->tiers().redis().enabled());
}

// metrics.listen: a bare port is loopback only; a bad address or tenant bound is one line each.
TEST(ConfigTest, MetricsAddressDefaultsToLoopback) {
  EXPECT_EQ(*MetricsBindAddress("9400"), "127.0.0.1:9400");
  EXPECT_EQ(*MetricsBindAddress(":9400"), "127.0.0.1:9400");
  EXPECT_EQ(*MetricsBindAddress("0.0.0.0:9400"), "0.0.0.0:9400");
  EXPECT_EQ(*MetricsBindAddress("[::1]:0"), "[::1]:0");
  for (const char* bad : {"", "x", "host:", "1.2.3.4:65536", ":-1", "9400x"}) {
    EXPECT_EQ(MetricsBindAddress(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  v1::DaemonConfig c = DefaultConfig();
  EXPECT_THAT(ValidateConfig(c), ::testing::IsEmpty());  // unset: off
  c.mutable_metrics()->set_listen("localhost:http");
  c.mutable_metrics()->set_max_tenants(-1);
  c.mutable_metrics()->set_block_residency_sample(1.5);
  EXPECT_THAT(ValidateConfig(c),
              ::testing::UnorderedElementsAre(HasSubstr("metrics.listen: 'localhost:http'"),
                                              HasSubstr("metrics.max_tenants"),
                                              HasSubstr("metrics.block_residency_sample")));
  v1::DaemonConfig sampled = DefaultConfig();
  sampled.mutable_metrics()->set_block_residency_sample(0.25);
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(sampled, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->block_residency_sample, 0.25);
}

// PoolShape's dtypes (config.proto): default, K / V, then per-layer entries, last match wins.
TEST(ConfigTest, ShapeDTypesPerLayerAndSide) {
  v1::DaemonConfig c = DefaultConfig();
  v1::PoolShape* s = c.mutable_shape();
  s->set_dtype("fp8");
  s->set_v_dtype("int8");
  v1::PoolShape::LayerDTypes* edges = s->add_layers();
  edges->add_index(0);
  edges->add_index(-1);
  edges->set_dtype("bf16");
  v1::PoolShape::LayerDTypes* k_only = s->add_layers();
  k_only->add_index(-1);
  k_only->set_k_dtype("f16");
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  const kernels::PoolLayout& l = o->pools[0].layout;
  ASSERT_EQ(l.num_layers, 4);  // the tiny model's
  EXPECT_EQ(l.k_dtype(0), kernels::DType::kBF16);
  EXPECT_EQ(l.v_dtype(0), kernels::DType::kBF16);
  EXPECT_EQ(l.k_dtype(1), kernels::DType::kFp8E4M3);
  EXPECT_EQ(l.v_dtype(2), kernels::DType::kInt8);
  EXPECT_EQ(l.k_dtype(3), kernels::DType::kF16);
  EXPECT_EQ(l.v_dtype(3), kernels::DType::kBF16);
  // The pool is sized by the blocks these chunks make, not by the widest dtype.
  EXPECT_EQ(l.num_blocks, (int64_t{256} << 20) / l.block_bytes());
  EXPECT_LT(l.block_bytes(), 8 * l.chunk_bytes(0, kernels::KvSide::kK));
}

TEST(ConfigTest, ShapeDTypeProblemsAreOneLineEach) {
  const std::string path = ::testing::TempDir() + "/bad_dtypes.textproto";
  std::ofstream(path) << "shape {\n  k_dtype: \"fp4\"\n"
                         "  layers { index: [0, 4] dtype: \"bf16\" }\n"
                         "  layers { index: [1] }\n"
                         "  layers { dtype: \"int8\" v_dtype: \"int4\" }\n}\n";
  const absl::StatusOr<v1::DaemonConfig> c = LoadConfig(path);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(c.status().message());
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 4) << message;  // five lines
  EXPECT_THAT(message, HasSubstr("shape.k_dtype: unknown dtype 'fp4'"));
  EXPECT_THAT(message, HasSubstr("shape.layers[0].index[1]: layer 4 outside [-4, 4)"));
  EXPECT_THAT(message, HasSubstr("shape.layers[1]: sets no dtype"));
  EXPECT_THAT(message, HasSubstr("shape.layers[2]: names no layer"));
  EXPECT_THAT(message, HasSubstr("shape.layers[2].v_dtype: unknown dtype 'int4'"));
}

}  // namespace
}  // namespace kvpool::daemon

namespace kvpool::daemon {
namespace {

TEST(ConfigTest, TheSecretFileIsReadAndAnOpenOneRefused) {
  const std::string path = ::testing::TempDir() + "/kvpool-config-test-secret";
  std::remove(path.c_str());
  { std::ofstream(path) << "0123456789abcdef0123456789abcdef"; }
  v1::DaemonConfig c = DefaultConfig();
  c.set_secret_file(path);
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  absl::StatusOr<EngineOptions> o = MakeEngineOptions(c, 1);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.status().message()), ::testing::HasSubstr("secret_file"));
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  o = MakeEngineOptions(c, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE(o->secret.has_value());
  EXPECT_EQ(o->secret->fingerprint(),
            tier::DeploymentSecret::FromBytes("0123456789abcdef0123456789abcdef").fingerprint());
  EXPECT_FALSE(MakeEngineOptions(DefaultConfig(), 1)->secret.has_value());  // random at start
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvpool::daemon
