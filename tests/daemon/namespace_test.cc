// Namespaces (DESIGN.md §1, §7; daemon/engine/namespace_table.h): ids from a table under a keyed
// MAC, never an unkeyed hash of client strings; cache salts that split a session's namespace.

#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "daemon/engine/engine.h"
#include "daemon/engine/namespace_table.h"
#include "fmt/format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"
#include "tests/tier/redis_harness.h"

#define XXH_INLINE_ALL
#include "xxhash.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using ::testing::HasSubstr;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

const tier::DeploymentSecret& TestSecret() {
  static const tier::DeploymentSecret secret =
      tier::DeploymentSecret::FromBytes("0123456789abcdef0123456789abcdef");
  return secret;
}

TEST(NamespaceTableTest, AKeyKeepsItsIdAndOtherKeysGetOthers) {
  NamespaceTable table(&TestSecret());
  const NamespaceId a = table.Acquire({.layout_hash = 1, .tenant = "a", .model = "m"});
  EXPECT_EQ(table.Acquire({.layout_hash = 1, .tenant = "a", .model = "m"}), a);
  EXPECT_NE(table.Acquire({.layout_hash = 1, .tenant = "a", .model = "m", .salt = "s"}), a);
  EXPECT_NE(table.Acquire({.layout_hash = 2, .tenant = "a", .model = "m"}), a);
  EXPECT_NE(table.Acquire({.layout_hash = 1, .tenant = "am", .model = ""}), a);
  EXPECT_EQ(table.size(), 4u);
  EXPECT_EQ(table.Peek({.layout_hash = 1, .tenant = "a", .model = "m"}), a);
}

// Invalidation (docs/tiers.md): a raised generation gives every key of the tenant (or of its one
// model) a new id, salts included; other tenants and models keep theirs; the old id stays its
// users' until they release it; tags never depend on the generation.
TEST(NamespaceTableTest, AnInvalidationGivesTheTenantsKeysNewIdsAndNoOneElse) {
  NamespaceTable table(&TestSecret());
  const NamespaceKey am{.layout_hash = 1, .tenant = "a", .model = "m"};
  const NamespaceKey an{.layout_hash = 1, .tenant = "a", .model = "n"};
  const NamespaceKey as{.layout_hash = 1, .tenant = "a", .model = "m", .salt = "s"};
  const NamespaceKey bm{.layout_hash = 1, .tenant = "b", .model = "m"};
  const NamespaceId old_am = table.Acquire(am);
  const NamespaceId old_an = table.Peek(an);
  const NamespaceId old_as = table.Peek(as);
  const NamespaceId old_bm = table.Peek(bm);
  const tier::NamespaceTags tags = table.TagsOf(old_am);
  EXPECT_EQ(tags, table.Tags("a", "m"));
  EXPECT_NE(tags.model, table.Tags("a", "n").model);
  EXPECT_EQ(tags.tenant, table.Tags("a", "n").tenant);

  EXPECT_EQ(table.Invalidate(tags.model), 1u);  // model m of tenant a
  const NamespaceId new_am = table.Acquire(am);
  EXPECT_NE(new_am, old_am);
  EXPECT_NE(table.Peek(as), old_as);
  EXPECT_EQ(table.Peek(an), old_an);
  EXPECT_EQ(table.Peek(bm), old_bm);
  EXPECT_EQ(table.TagsOf(new_am), tags);
  EXPECT_EQ(table.TagsOf(old_am), tags);  // still its user's
  EXPECT_TRUE(table.Release(old_am));
  EXPECT_EQ(table.Acquire(am), new_am);

  EXPECT_EQ(table.Invalidate(tags.tenant), 1u);  // every model of tenant a
  EXPECT_NE(table.Peek(an), old_an);
  EXPECT_NE(table.Peek(am), new_am);
  EXPECT_EQ(table.Peek(bm), old_bm);
  // The same generations give the same ids (a restart restores them).
  NamespaceTable restarted(&TestSecret());
  restarted.SetGenerations(table.generations());
  EXPECT_EQ(restarted.Peek(an), table.Peek(an));
  EXPECT_EQ(restarted.Peek(bm), old_bm);
}

TEST(NamespaceTableTest, AReleasedKeyComesBackWithTheSameId) {
  NamespaceTable table(&TestSecret());
  const NamespaceKey key{.layout_hash = 1, .tenant = "a", .model = "m"};
  const NamespaceId id = table.Acquire(key);
  table.Acquire(key);
  EXPECT_FALSE(table.Release(id));
  EXPECT_TRUE(table.Release(id));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Peek(key), id);
  EXPECT_EQ(table.Acquire(key), id);  // what the cache holds under it stays reachable
}

TEST(NamespaceTableTest, OtherSecretsGiveOtherIds) {
  const tier::DeploymentSecret other = tier::DeploymentSecret::Random();
  NamespaceTable mine(&TestSecret()), theirs(&other);
  const NamespaceKey key{.layout_hash = 1, .tenant = "a", .model = "m"};
  EXPECT_NE(mine.Acquire(key), theirs.Acquire(key));
}

// A derivation that gives every key the same first id: the table still keeps keys apart.
TEST(NamespaceTableTest, ACollisionOfTheMacNeverMergesTwoKeys) {
  NamespaceTable table(&TestSecret(), [](std::string_view encoded, uint64_t round) {
    return round == 0 ? uint64_t{7} : XXH3_64bits(encoded.data(), encoded.size()) + round;
  });
  const NamespaceId a = table.Acquire({.layout_hash = 1, .tenant = "a", .model = "m"});
  const NamespaceId b = table.Acquire({.layout_hash = 1, .tenant = "b", .model = "m"});
  EXPECT_EQ(a, NamespaceId(7));
  EXPECT_NE(b, a);
  EXPECT_EQ(table.collisions(), 1u);
  EXPECT_EQ(table.Peek({.layout_hash = 1, .tenant = "b", .model = "m"}), b);
}

// The scheme kvpool used before: XXH3-64 of "<len>:<tenant><len>:<model><layout:016x>".
uint64_t OldNamespace(std::string_view tenant, std::string_view model, uint64_t layout) {
  std::string key = std::to_string(tenant.size()) + ":" + std::string(tenant) +
                    std::to_string(model.size()) + ":" + std::string(model);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(layout));
  key += hex;
  return XXH3_64bits(key.data(), key.size());
}

uint64_t Read64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// XXH3-64 of 33-64 bytes (xxhash.h, XXH3_len_17to128_64b) adds up four independent 16-byte chunk
// mixes, mix(c) = fold64(c.lo ^ s.lo, c.hi ^ s.hi) with its default secret's words s, then
// avalanches the sum. fold64(1, t) = t, so a chunk the attacker fully controls can contribute any
// value: set it to cancel what its different tenant name changed in chunk 0. Returns attacker's
// model string (42 bytes: a 64-byte key whose chunks 16..31 lie inside it).
std::string ForgeModel(std::string_view victim_tenant, std::string_view victim_model,
                       std::string_view attacker_tenant, uint64_t layout) {
  auto key_of = [&](std::string_view tenant, std::string_view model) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(layout));
    return std::to_string(tenant.size()) + ":" + std::string(tenant) +
           std::to_string(model.size()) + ":" + std::string(model) + hex;
  };
  auto mix = [](const std::string& key, size_t at, size_t secret_at) {
    return XXH3_mul128_fold64(Read64(key.data() + at) ^ Read64(XXH3_kSecret + secret_at),
                              Read64(key.data() + at + 8) ^ Read64(XXH3_kSecret + secret_at + 8));
  };
  const std::string victim = key_of(victim_tenant, victim_model);
  std::string model(victim_model);
  std::string attacker = key_of(attacker_tenant, model);
  EXPECT_EQ(victim.size(), 64u);
  EXPECT_EQ(attacker.size(), 64u);
  // Chunk 16 (secret words at 32) is inside the model string, which starts at byte 6.
  const uint64_t target = mix(victim, 0, 0) + mix(victim, 16, 32) - mix(attacker, 0, 0);
  const uint64_t lo = 1 ^ Read64(XXH3_kSecret + 32);
  const uint64_t hi = target ^ Read64(XXH3_kSecret + 40);
  std::memcpy(model.data() + 10, &lo, 8);
  std::memcpy(model.data() + 18, &hi, 8);
  return model;
}

class NamespaceTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(SmallPool(64)); }
  void Make(EngineOptions options) {
    options.secret = TestSecret();
    engine_ = std::move(*Engine::Create(options, &device_, /*model=*/nullptr));
  }
  std::shared_ptr<const Session> Open(std::string tenant, std::string model = "m") {
    SessionSpec spec = Spec(std::move(tenant));
    spec.model = std::move(model);
    absl::StatusOr<std::shared_ptr<const Session>> s = engine_->OpenSession(spec);
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  }
  absl::StatusOr<Tables> Allocate(const Session& s, std::span<const int32_t> prompt,
                                  std::string salt = "") {
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    const std::string salts[] = {std::move(salt)};
    return engine_->Allocate(s, std::span(&request, 1), CallContext::Uncancellable(), salts);
  }
  // `s` computes and publishes `prompt` (under `salt`).
  void Publish(const Session& s, std::span<const int32_t> prompt, std::string salt = "") {
    absl::StatusOr<Tables> t = Allocate(s, prompt, std::move(salt));
    ASSERT_TRUE(t.ok()) << t.status();
    const SequenceId id = t->slices[0].sequence;
    ASSERT_TRUE(
        engine_->Free(s, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()).ok());
  }
  int64_t Matched(const Session& s, std::span<const int32_t> prompt, std::string salt = "") {
    absl::StatusOr<int64_t> m = engine_->MatchPrefix(s, prompt, salt);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.value_or(-1);
  }

  FailingDevice device_;
  std::unique_ptr<Engine> engine_;
};

// The attack from issue 27: a model string crafted from XXH3's structure put a session of
// tenant b into tenant a's namespace, where it matched a's cached prompt.
TEST_F(NamespaceTest, AModelStringForgedAgainstXxh3LandsInItsOwnNamespace) {
  const std::string victim_model(42, 'x');
  const uint64_t layout = engine_->layout().Hash();
  const std::string forged = ForgeModel("a", victim_model, "b", layout);
  ASSERT_EQ(OldNamespace("a", victim_model, layout), OldNamespace("b", forged, layout))
      << "the forgery must collide under the old scheme, or this test proves nothing";

  std::shared_ptr<const Session> victim = Open("a", victim_model);
  std::shared_ptr<const Session> attacker = Open("b", forged);
  EXPECT_NE(victim->ns, attacker->ns);
  const std::vector<int32_t> prompt = Prompt(64, 1);
  Publish(*victim, prompt);
  EXPECT_EQ(Matched(*victim, prompt), 64);
  EXPECT_EQ(Matched(*attacker, prompt), 0);
}

TEST_F(NamespaceTest, CallsWithOtherSaltsShareNothing) {
  std::shared_ptr<const Session> s = Open("frontend");
  const std::vector<int32_t> prompt = Prompt(64, 2);
  Publish(*s, prompt, "user-1");
  EXPECT_EQ(Matched(*s, prompt, "user-1"), 64);
  EXPECT_EQ(Matched(*s, prompt, "user-2"), 0);
  EXPECT_EQ(Matched(*s, prompt), 0);
  absl::StatusOr<Tables> other = Allocate(*s, prompt, "user-2");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->slices[0].matched_tokens, 0);
  absl::StatusOr<Tables> same = Allocate(*s, prompt, "user-1");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->slices[0].matched_tokens, 64);
  // Another session of the same tenant and model shares the salt's namespace.
  EXPECT_EQ(Matched(*Open("frontend"), prompt, "user-1"), 64);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(NamespaceTest, AnOversizedSaltIsAnArgumentErrorThatChangesNothing) {
  std::shared_ptr<const Session> s = Open("frontend");
  const std::vector<int32_t> prompt = Prompt(32, 3);
  const std::string salt(kMaxCacheSaltBytes + 1, 's');
  EXPECT_TRUE(absl::IsInvalidArgument(Allocate(*s, prompt, salt).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine_->MatchPrefix(*s, prompt, salt).status()));
  EXPECT_EQ(engine_->Stats().cache.pool.active, 0);
  EXPECT_TRUE(Allocate(*s, prompt, std::string(kMaxCacheSaltBytes, 's')).ok());
}

TEST_F(NamespaceTest, SaltsDoNotEscapeTheTenantsQuota) {
  EngineOptions options = SmallPool(64);
  options.open_quota_blocks["tight"] = 4;
  Make(options);
  std::shared_ptr<const Session> s = Open("tight");
  const std::vector<int32_t> three = Prompt(48, 4);
  ASSERT_TRUE(Allocate(*s, three, "one").ok());
  EXPECT_TRUE(absl::IsResourceExhausted(Allocate(*s, three, "two").status()));
  EXPECT_TRUE(Allocate(*s, Prompt(16, 5), "three").ok());
  EXPECT_TRUE(absl::IsResourceExhausted(Allocate(*s, Prompt(16, 6), "four").status()));
}

// Fair eviction by tenant (EngineOptions::eviction_shares): a tenant that floods the pool with
// prompts, each under a cache salt of its own (so each its own namespace), evicts its own cached
// blocks, not the prefix another tenant comes back to. With fairness off it is the other way
// round. kvpoolctl sessions shows each tenant's share.
TEST_F(NamespaceTest, ATenantFloodingThePoolEvictsItsOwnBlocksUnderEverySalt) {
  for (const bool fair : {true, false}) {
    SCOPED_TRACE(fair ? "fair" : "one pool-wide order");
    EngineOptions options = SmallPool(64);
    options.eviction_shares = fair ? 16 : 0;
    Make(options);
    std::shared_ptr<const Session> quiet = Open("quiet");
    std::shared_ptr<const Session> loud = Open("loud");
    const std::vector<int32_t> prefix = Prompt(8 * 16, 7);
    Publish(*quiet, prefix);
    Publish(*quiet, prefix);  // used twice: admitted by the default policy's filter
    for (int i = 0; i < 24; ++i) {
      const std::vector<int32_t> prompt = Prompt(8 * 16, 100 + i);
      const std::string salt = fmt::format("user-{}", i);
      ASSERT_NO_FATAL_FAILURE(Publish(*loud, prompt, salt));
      ASSERT_NO_FATAL_FAILURE(Publish(*loud, prompt, salt));
    }
    EXPECT_EQ(Matched(*quiet, prefix), fair ? 8 * 16 : 0);
    const std::vector<SessionListing> sessions = engine_->ListSessions();
    ASSERT_EQ(sessions.size(), 2u);
    if (fair) {
      ASSERT_TRUE(sessions[0].share.has_value() && sessions[1].share.has_value());
      EXPECT_EQ(sessions[0].share->evicted, 0u);  // quiet's
      EXPECT_EQ(sessions[0].share->evictable, 8);
      EXPECT_EQ(sessions[0].share->bytes, 8 * engine_->layout().block_bytes());
      EXPECT_GT(sessions[1].share->evicted, 0u);  // loud's, whichever salt its blocks were under
      EXPECT_NE(sessions[0].share->key, sessions[1].share->key);
    } else {
      EXPECT_FALSE(sessions[0].share.has_value());
    }
    EXPECT_TRUE(engine_->CheckInvariants().ok());
  }
}

// The same in the host and disk tiers (their stores' tenant shares, tier/internal/
// fair_slot_lru.h): the quiet tenant's prefix, evicted from the pool into the tier, is still
// promoted after another tenant pushed six times the tier's capacity through it. With fairness
// off (one order for the pool and the tier) the flood evicts it there too.
TEST_F(NamespaceTest, ATenantFloodingALowerTierEvictsItsOwnBlocks) {
  char tmpl[] = "/tmp/kvpool-namespace-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  for (const bool disk : {false, true}) {
    for (const bool fair : {true, false}) {
      SCOPED_TRACE(fmt::format("{}, {}", disk ? "disk" : "host", fair ? "fair" : "one order"));
      EngineOptions options = SmallPool(64);
      options.eviction_shares = fair ? 16 : 0;
      if (disk) {
        std::filesystem::remove_all(dir + "/tier");
        options.tiers.disk.directory = dir + "/tier";
        options.tiers.disk.capacity_bytes = 32 * options.pools[0].layout.block_bytes();
      } else {
        options.tiers.host_blocks = 32;
      }
      Make(options);
      std::shared_ptr<const Session> quiet = Open("quiet");
      std::shared_ptr<const Session> loud = Open("loud");
      const std::vector<int32_t> prefix = Prompt(8 * 16, 7);
      ASSERT_NO_FATAL_FAILURE(Publish(*quiet, prefix));
      for (int i = 0; i < 24; ++i) {
        ASSERT_NO_FATAL_FAILURE(Publish(*loud, Prompt(8 * 16, 100 + i)));
        ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
      }
      ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
      ASSERT_EQ(Matched(*quiet, prefix), 0);  // only the tier can have it now
      absl::StatusOr<Tables> again = Allocate(*quiet, prefix);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(again->slices[0].matched_tokens, fair ? 8 * 16 : 0);
      EXPECT_EQ(disk ? engine_->Stats().tiers.disk_tier.blocks : engine_->Stats().tiers.host_blocks,
                32);
      EXPECT_TRUE(engine_->CheckInvariants().ok());
      engine_.reset();
    }
  }
  std::filesystem::remove_all(dir);
}

// The same through Redis, which evicts by its own LRU: a quiet tenant's prefix, evicted from the
// pool, is still promoted from Redis after another tenant pushed 16 MiB through a Redis that keeps
// 6 MiB, when the pool's store has a write budget (tiers.redis.tenant_write_budget_bytes: the
// flood stops at its share, three quarters at cache_weight 3 against 1, and Redis never evicts).
// Without one, Redis evicts the prefix.
TEST_F(NamespaceTest, ARedisWriteBudgetKeepsAFloodingTenantToItsShare) {
  if (tier::testing::RedisServerBinary().empty()) GTEST_SKIP() << "redis-server is not installed";
  constexpr int64_t kBudget = 4 << 20;
  for (const bool budget : {true, false}) {
    SCOPED_TRACE(budget ? "a budget" : "no budget");
    auto dir = tier::testing::TempDir::Create("kvpool-namespace-redis");
    ASSERT_TRUE(dir.ok()) << dir.status();
    auto server = tier::testing::RedisServer::Start(
        (*dir)->path(), {.unix_socket = true,
                         .extra_args = {"--maxmemory", "6mb", "--maxmemory-policy", "allkeys-lru",
                                        "--maxmemory-samples", "10"}});
    ASSERT_TRUE(server.ok()) << server.status();
    EngineOptions options = SmallPool(64);
    options.tiers.redis = (*server)->TierOptions();
    options.tiers.redis.ttl_seconds = 3600;
    options.tiers.redis.tenant_write_budget_bytes = budget ? kBudget : 0;
    options.tenants["loud"] = TenantLimits{.cache_weight = 3};
    options.tenants["quiet"] = TenantLimits{};
    Make(options);
    std::shared_ptr<const Session> quiet = Open("quiet");
    std::shared_ptr<const Session> loud = Open("loud");
    const std::vector<int32_t> prefix = Prompt(8 * 16, 7);
    ASSERT_NO_FATAL_FAILURE(Publish(*quiet, prefix));
    ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
    const int64_t block_bytes = options.pools[0].layout.block_bytes();
    const int flood = static_cast<int>((16 << 20) / (8 * block_bytes));
    for (int i = 0; i < flood; ++i) {
      ASSERT_NO_FATAL_FAILURE(Publish(*loud, Prompt(8 * 16, 100 + i)));
      ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
    }
    std::map<std::string, TenantCounters> by_tenant;
    for (const auto& [label, counters] : engine_->Stats(0).tenants) by_tenant[label] = counters;
    ASSERT_TRUE(engine_->Evict(0, 0, /*all=*/true).ok());
    ASSERT_EQ(Matched(*quiet, prefix), 0);  // only Redis can have it now
    absl::StatusOr<Tables> again = Allocate(*quiet, prefix);
    ASSERT_TRUE(again.ok()) << again.status();
    if (budget) {
      EXPECT_EQ(again->slices[0].matched_tokens, 8 * 16);
      // The flood used its three quarters, and no more.
      EXPECT_LE(by_tenant["loud"].redis_bytes, kBudget / 4 * 3);
      EXPECT_GT(by_tenant["loud"].redis_bytes, kBudget / 4 * 3 - 2 * block_bytes);
      EXPECT_GT(by_tenant["loud"].redis_over_budget_blocks, 0u);
      EXPECT_GT(by_tenant["quiet"].redis_bytes, 8 * block_bytes);  // its values and keys
      EXPECT_EQ(by_tenant["quiet"].redis_over_budget_blocks, 0u);
    } else {
      EXPECT_LT(again->slices[0].matched_tokens, 8 * 16);
      EXPECT_EQ(by_tenant["loud"].redis_bytes, 0);  // nothing counted without a budget
    }
    EXPECT_TRUE(engine_->CheckInvariants().ok());
    engine_.reset();
  }
}

// Tenants' cache_weight reaches the lower tiers: two tenants both pushing far more than a 32-block
// host tier holds through it, at weights 3 and 1, keep about 24 and 8 blocks there, as the
// per-tenant stats (kvpool_tenant_tier_blocks) show; at equal weights, 16 each.
TEST_F(NamespaceTest, CacheWeightsSplitTheHostTier) {
  for (const uint32_t heavy : {3u, 1u}) {
    SCOPED_TRACE(heavy);
    EngineOptions options = SmallPool(64);
    options.tiers.host_blocks = 32;
    options.tenants["heavy"] = TenantLimits{.cache_weight = heavy};
    options.tenants["light"] = TenantLimits{};
    Make(options);
    std::shared_ptr<const Session> a = Open("heavy");
    std::shared_ptr<const Session> b = Open("light");
    for (int i = 0; i < 20; ++i) {
      ASSERT_NO_FATAL_FAILURE(Publish(*a, Prompt(4 * 16, 100 + i)));
      ASSERT_NO_FATAL_FAILURE(Publish(*b, Prompt(4 * 16, 300 + i)));
      ASSERT_TRUE(engine_->FlushTiers(absl::Seconds(10)).ok());
    }
    std::map<std::string, TenantCounters> by_tenant;
    for (const auto& [label, counters] : engine_->Stats(0).tenants) by_tenant[label] = counters;
    const int64_t expect = heavy == 3 ? 24 : 16;
    EXPECT_NEAR(static_cast<double>(by_tenant["heavy"].tier_blocks), expect, 1.0);
    EXPECT_EQ(by_tenant["heavy"].tier_blocks + by_tenant["light"].tier_blocks, 32);
    EXPECT_EQ(by_tenant["heavy"].tier_evicted_blocks + by_tenant["light"].tier_evicted_blocks,
              2u * 20 * 4 - 32);
    EXPECT_TRUE(engine_->CheckInvariants().ok());
  }
}

// Tenant names are a client's choice in the zero-configuration mode: a client claiming more of
// them than limits.eviction_shares gets the rest into the pool's default share. Nothing is
// refused, and the invariants hold once the sessions end.
TEST_F(NamespaceTest, TenantsPastTheSharesShareTheDefaultOrder) {
  EngineOptions options = SmallPool(64);
  options.eviction_shares = 3;
  Make(options);
  std::vector<std::shared_ptr<const Session>> sessions;
  for (int i = 0; i < 6; ++i) {
    sessions.push_back(Open(fmt::format("tenant-{}", i)));
    ASSERT_NO_FATAL_FAILURE(Publish(*sessions.back(), Prompt(32, 40 + i)));
  }
  std::set<uint64_t> keys;
  int64_t in_default = 0;
  for (const SessionListing& l : engine_->ListSessions()) {
    ASSERT_TRUE(l.share.has_value());
    keys.insert(l.share->key);
    in_default += l.share->key == 0 ? 1 : 0;
  }
  EXPECT_EQ(keys.size(), 4u);  // three of their own, and the default one
  EXPECT_EQ(in_default, 3);
  EXPECT_EQ(engine_->Stats(0).cache.cache.shares, 4);
  for (const auto& s : sessions) engine_->EndSession(s->id, SessionEnd::kDetached);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(NamespaceTest, ASessionLetsGoOfSaltsItHoldsNothingUnder) {
  EngineOptions options = SmallPool(64);
  options.limits.cache_salts_per_session = 2;
  Make(options);
  std::shared_ptr<const Session> s = Open("frontend");
  const std::vector<int32_t> prompt = Prompt(16, 7);
  absl::StatusOr<Tables> held = Allocate(*s, prompt, "held-1");
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(Allocate(*s, prompt, "held-2").ok());
  // Both salts hold a sequence: a third is over the limit.
  EXPECT_TRUE(absl::IsResourceExhausted(Allocate(*s, prompt, "third").status()));
  const SequenceId first = held->slices[0].sequence;
  ASSERT_TRUE(
      engine_->Free(*s, std::span(&first, 1), OnFree::kCommit, CallContext::Uncancellable()).ok());
  // held-1 holds nothing now: it goes, and the third salt takes its place.
  EXPECT_TRUE(Allocate(*s, prompt, "third").ok());
  // Its namespace is out of the table; the blocks it published stay matchable by its salt.
  EXPECT_EQ(Matched(*s, prompt, "held-1"), 16);
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

// One uid, over many sessions each holding a zero-token sequence (no block, so no quota stops
// it) under each of its salts, must not take every slot of the pool's namespace table (65,534):
// then every other tenant's call that needs a namespace the table does not hold is refused.
// limits.cache_salts_per_uid stops it first, with the limit named.
TEST_F(NamespaceTest, OneUidCannotTakeTheWholeNamespaceTable) {
  EngineOptions options = SmallPool(64);
  Make(options);
  const ClientLimits& limits = options.limits;
  std::vector<std::shared_ptr<const Session>> mine;
  absl::Status refused;
  int salts = 0;
  const AllocateRequest empty{.num_tokens = 0};
  while (refused.ok() && salts < kMaxNamespaceSlots + 1) {
    if (salts % limits.cache_salts_per_session == 0) {
      SessionSpec spec = Spec("hog", fmt::format("hog-{}", mine.size()));
      spec.uid = 1000;
      absl::StatusOr<std::shared_ptr<const Session>> s = engine_->OpenSession(spec);
      ASSERT_TRUE(s.ok()) << s.status();
      mine.push_back(*s);
    }
    const std::string salt[] = {fmt::format("user-{}", salts)};
    refused =
        engine_->Allocate(*mine.back(), std::span(&empty, 1), CallContext::Uncancellable(), salt)
            .status();
    salts += refused.ok() ? 1 : 0;
  }
  // Another tenant's session still gets its namespace.
  SessionSpec other = Spec("other", "bystander");
  other.uid = 2000;
  absl::StatusOr<std::shared_ptr<const Session>> bystander = engine_->OpenSession(other);
  ASSERT_TRUE(bystander.ok()) << bystander.status();
  EXPECT_TRUE(Allocate(**bystander, Prompt(16, 9)).ok());
  EXPECT_TRUE(Allocate(**bystander, Prompt(16, 9), "its-own-salt").ok());
  EXPECT_EQ(salts, limits.cache_salts_per_uid);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("limits.cache_salts_per_uid"));
  // The uid's other session letting go of a salt makes room for one more, in any of its sessions.
  engine_->EndSession(mine.front()->id, SessionEnd::kDetached);
  const std::string fresh[] = {"fresh"};
  EXPECT_TRUE(
      engine_->Allocate(*mine.back(), std::span(&empty, 1), CallContext::Uncancellable(), fresh)
          .ok());
  EXPECT_TRUE(engine_->CheckInvariants().ok());
}

TEST_F(NamespaceTest, EndingTheSessionForgetsItsNamespaces) {
  const size_t before = engine_->Stats().namespaces;
  std::shared_ptr<const Session> s = Open("frontend");
  ASSERT_TRUE(Allocate(*s, Prompt(16, 8), "a").ok());
  ASSERT_TRUE(Allocate(*s, Prompt(16, 8), "b").ok());
  EXPECT_EQ(engine_->Stats().namespaces, before + 3);
  engine_->EndSession(s->id, SessionEnd::kDetached);
  EXPECT_EQ(engine_->Stats().namespaces, before);
}

}  // namespace
}  // namespace kvpool::daemon
