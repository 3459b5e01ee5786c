// RedisBlockStore against planted, damaged, replayed and foreign values and under the deployed
// ACL, on real redis-server processes (label `integration`, issue 27): whoever can write to
// Redis without the deployment secret, or with another one, never gets a daemon to load its
// bytes, and the tier works under exactly the ACL rules deploy/ sets up.

#include <hiredis/hiredis.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kvpool/util/logging.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "tests/tier/redis_store_fixture.h"

namespace kvpool::tier {
namespace {

using testing::kBlockBytes;
using testing::kSpace;
using testing::LookupBuffers;
using testing::MakeChain;
using testing::TestChain;

class RedisSecurityTest : public testing::RedisStoreTest {};

// A writer that reaches Redis but lacks the deployment secret plants blocks under the victim's
// keys (handed to it here: it cannot compute them, block_codec_test shows, but could see them
// in a SCAN), every header field right, the MAC made under a secret of its own. With format 1
// (an xxh3 checksum anyone can compute, keys from public values) the same value was the victim's
// KV; now it is a miss, counted as forged.
TEST_F(RedisSecurityTest, PlantedValueWithoutTheSecretIsAMissAndCounted) {
  auto victim = NewStore();
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 14);
  const DeploymentSecret guess = DeploymentSecret::FromBytes("the attacker's guess at the secret");
  const std::vector<std::byte> poison(kBlockBytes, std::byte{0x66});
  for (int i = 0; i < 2; ++i) {
    std::string value;
    EncodeBlockValue(guess, KeyOf(chain, i), RandomValueNonce(),
                     {.layout_fingerprint = kSpace.layout_fingerprint,
                      .hash = chain.hashes[i],
                      .parent = i == 0 ? BlockHash{} : chain.hashes[0],
                      .coverage = 16},
                     poison, &value);
    ASSERT_TRUE(server_->Command({"SET", KeyOf(chain, i), value}).ok());
  }
  LookupBuffers out(2, kBlockBytes);
  // Block 0's payload was read into its staging buffer and refused there: not a hit (the daemon
  // uses only out[0, hits); tiers_cluster_test checks that such bytes never reach the pool).
  EXPECT_EQ(LookupAll(*victim, chain, &out, kSpace), 0);
  const RemoteTierStats stats = victim->stats();
  EXPECT_EQ(stats.forged, 1u);  // block 1 is past the first miss: not even checked
  EXPECT_EQ(stats.corrupt, 1u);
  EXPECT_EQ(stats.misses, 2u);
}

// One flipped bit anywhere in a stored value, header (coverage and the reserved word included,
// which format 1 did not check: a flipped coverage byte used to be a hit) or payload, is a miss.
TEST_F(RedisSecurityTest, FlippedByteInHeaderOrPayloadIsAMiss) {
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 1, kBlockBytes, 15);
  ASSERT_EQ(chain.Put(*store), 1);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  const std::string key = KeyOf(chain, 0);
  const std::string good = ValueAt(key);
  ASSERT_EQ(static_cast<int64_t>(good.size()), kBlockHeaderBytes + kBlockBytes);
  std::vector<int64_t> positions;
  for (int64_t i = 0; i < kBlockHeaderBytes; ++i) positions.push_back(i);
  positions.insert(positions.end(), {kBlockHeaderBytes, kBlockHeaderBytes + kBlockBytes / 2,
                                     kBlockHeaderBytes + kBlockBytes - 1});
  LookupBuffers out(1, kBlockBytes);
  for (int64_t at : positions) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0x04);
    ASSERT_TRUE(server_->Command({"SET", key, bad}).ok());
    EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 0) << "byte " << at;
  }
  EXPECT_EQ(store->stats().corrupt, positions.size());
  ASSERT_TRUE(server_->Command({"SET", key, good}).ok());
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 1);  // the untouched value still reads
  EXPECT_EQ(out.storage[0], chain.blocks[0]);
}

// A valid value replayed under another key is refused: under another namespace's key with the
// very same chain hashes (format 1 checked layout, hashes, length and checksum, all equal here,
// and handed tenant B's bytes to tenant A), and under another block's key of the same chain.
TEST_F(RedisSecurityTest, ValueCopiedUnderAnotherKeyIsAMiss) {
  auto store = NewStore();
  const BlockSpace other{.ns = NamespaceId(8), .layout_fingerprint = kSpace.layout_fingerprint};
  const TestChain mine = MakeChain(kSpace, 2, kBlockBytes, 16);
  TestChain theirs = MakeChain(other, 2, kBlockBytes, 17);
  theirs.hashes = mine.hashes;
  ASSERT_EQ(theirs.Put(*store), 2);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  ASSERT_TRUE(server_->Command({"SET", KeyOf(mine, 0), ValueAt(KeyOf(theirs, 0))}).ok());
  LookupBuffers out(2, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, mine, &out, kSpace), 0);
  EXPECT_EQ(store->stats().forged, 1u);

  ASSERT_EQ(mine.Put(*store), 2);  // SET NX: block 0's key is taken, block 1 is stored
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  ASSERT_TRUE(server_->Command({"SET", KeyOf(mine, 0), ValueAt(KeyOf(mine, 1))}).ok());
  EXPECT_EQ(LookupAll(*store, mine, &out, kSpace), 0);
  EXPECT_EQ(store->stats().forged, 2u);
  // Block 1 alone, under its own key, is fine.
  auto tail = store->Lookup(kSpace, mine.hashes[0], std::span(mine.hashes).subspan(1, 1),
                            std::span(out.spans).subspan(0, 1));
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(tail->hits, 1);
  EXPECT_EQ(out.storage[0], mine.blocks[1]);
}

// A daemon configured with another secret shares nothing: it writes under keys this one never
// asks for, and its value moved under this one's key fails the MAC. (Before the secret existed,
// any two stores on one server shared every block.)
TEST_F(RedisSecurityTest, ValueWrittenUnderAnotherSecretIsAMiss) {
  auto mine = NewStore();
  auto stranger = NewStore(server_->TierOptions(),
                           DeploymentSecret::FromBytes("another deployment's secret, not ours"));
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 18);
  ASSERT_EQ(chain.Put(*stranger), 2);
  ASSERT_TRUE(stranger->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(2, kBlockBytes);
  EXPECT_EQ(LookupAll(*mine, chain, &out, kSpace), 0);
  EXPECT_EQ(mine->stats().corrupt, 0u);  // nothing under our keys at all
  const std::string theirs = ValueAt(
      KeyOf(chain, 0, DeploymentSecret::FromBytes("another deployment's secret, not ours")));
  ASSERT_FALSE(theirs.empty());
  ASSERT_TRUE(server_->Command({"SET", KeyOf(chain, 0), theirs}).ok());
  EXPECT_EQ(LookupAll(*mine, chain, &out, kSpace), 0);
  EXPECT_EQ(mine->stats().forged, 1u);
}

// The rules deploy/redis-kvpool-acl.rules gives the `kvpool` user, as ACL SETUSER arguments.
std::vector<std::string> DeployedAclRules() {
  std::ifstream file(std::string(KVPOOL_SOURCE_DIR) + "/deploy/redis-kvpool-acl.rules");
  std::vector<std::string> rules;
  for (std::string line; std::getline(file, line);) {
    if (line.empty() || line[0] == '#') continue;
    for (absl::string_view rule : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      rules.emplace_back(rule);
    }
  }
  return rules;
}

// The ACL deploy/setup-redis-acl.sh sets up (tests/deploy/redis_acl_setup_test.sh checks the
// script itself), on this test's private server: the default user closed, the `kvpool` user with
// a password and exactly the deployed rules. A store without the password is refused (each
// command answers NOAUTH: misses and dropped writes, never data); with it, the store writes and
// reads under those rules, so the rules allow every command the tier sends.
TEST_F(RedisSecurityTest, AclUserWithPasswordWorksAndAConnectionWithoutItIsRefused) {
  const std::vector<std::string> rules = DeployedAclRules();
  ASSERT_FALSE(rules.empty()) << "deploy/redis-kvpool-acl.rules";
  std::vector<std::string> setuser = {"ACL", "SETUSER", "kvpool", "reset", "on", ">kvpool pass"};
  setuser.insert(setuser.end(), rules.begin(), rules.end());
  ASSERT_TRUE(server_->Command(setuser).ok());
  ASSERT_TRUE(server_->Command({"ACL", "SETUSER", "default", "off"}).ok());
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 19);
  LookupBuffers out(2, kBlockBytes);

  auto anonymous = NewStore();
  ASSERT_EQ(chain.Put(*anonymous), 2);
  ASSERT_TRUE(anonymous->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(LookupAll(*anonymous, chain, &out, kSpace), 0);
  RemoteTierStats stats = anonymous->stats();
  EXPECT_EQ(stats.written, 0u);
  EXPECT_EQ(stats.dropped_write_errors, 2u);
  EXPECT_EQ(stats.lookup_errors, 1u);

  RedisTierOptions options = server_->TierOptions();
  options.username = "kvpool";
  options.password = "kvpool pass";
  auto store = NewStore(options);
  ASSERT_EQ(chain.Put(*store), 2);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(store->stats().written, 2u);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 2);
  EXPECT_EQ(out.storage, chain.blocks);
  // The checkpoint probe (EXISTS) is allowed too.
  EXPECT_EQ(store->MayHave(kSpace, chain.hashes), std::vector<bool>({true, true}));
  EXPECT_EQ(store->stats().lookup_errors, 0u);
}

// Every command the tier sends, under the deployed rules: reads, writes, the checkpoint probe and
// the write budget's MEMORY USAGE, with ACL LOG (every command or key the ACL refused) empty
// after. (The default user stays open here, to read the log.)
TEST_F(RedisSecurityTest, TheDeployedRulesAllowEveryCommandTheTierSends) {
  std::vector<std::string> setuser = {"ACL", "SETUSER", "kvpool", "reset", "on", ">kvpool pass"};
  const std::vector<std::string> rules = DeployedAclRules();
  setuser.insert(setuser.end(), rules.begin(), rules.end());
  ASSERT_TRUE(server_->Command(setuser).ok());
  ASSERT_TRUE(server_->Command({"ACL", "LOG", "RESET"}).ok());
  RedisTierOptions options = server_->TierOptions();
  options.username = "kvpool";
  options.password = "kvpool pass";
  options.ttl_seconds = 3600;
  options.tenant_write_budget_bytes = 1 << 20;
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 23);
  ASSERT_EQ(chain.Put(*store, {.tenant = 3, .model = 1}), 2);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(2, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 2);
  EXPECT_EQ(store->MayHave(kSpace, chain.hashes), std::vector<bool>({true, true}));
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.written, 2u);
  EXPECT_EQ(stats.lookup_errors, 0u);
  auto denied = server_->Command({"ACL", "LOG"});
  ASSERT_TRUE(denied.ok()) << denied.status();
  EXPECT_EQ((*denied)->elements, 0u);
}

// A command the server refuses (here EXISTS, under rules without it: e148cd2's bug) only misses
// and counts an error; the store says so once, at warn, naming the command and the reply, so an
// operator sees it without reading counters. Later refusals are at debug.
TEST_F(RedisSecurityTest, ACommandTheServerRefusesIsWarnedOnce) {
  std::vector<std::string> setuser = {"ACL", "SETUSER", "kvpool", "reset", "on", ">kvpool pass"};
  for (const std::string& rule : DeployedAclRules()) {
    if (rule != "+exists") setuser.push_back(rule);
  }
  ASSERT_TRUE(server_->Command(setuser).ok());
  auto ring = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  ring->set_level(spdlog::level::warn);
  spdlog::logger& log = Logger("tier");
  log.sinks().push_back(ring);
  RedisTierOptions options = server_->TierOptions();
  options.username = "kvpool";
  options.password = "kvpool pass";
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 29);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(store->MayHave(kSpace, chain.hashes), std::vector<bool>({false, false}));
  }
  log.sinks().pop_back();
  EXPECT_EQ(store->stats().lookup_errors, 3u);
  int warned = 0;
  for (const std::string& line : ring->last_formatted()) {
    if (line.find("refused EXISTS") == std::string::npos) continue;
    ++warned;
    EXPECT_NE(line.find("NOPERM"), std::string::npos) << line;
    EXPECT_NE(line.find("redis-kvpool-acl.rules"), std::string::npos) << line;
  }
  EXPECT_EQ(warned, 1);
}

}  // namespace
}  // namespace kvpool::tier
