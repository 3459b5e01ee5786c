// RedisBlockStore against scripted fake Redis nodes (tests/tier/fake_redis.h) doing what a real
// server will not do on request: a server that dribbles its replies a byte at a time must cost
// a Lookup or a write batch no more than the call's deadline, and such calls open the breaker;
// a cluster node that redirects to an address outside the cluster is not followed there, and
// the password never goes there; a server that says it spends more on a key than the write
// budget's model is believed.

#include <atomic>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/tier/fake_redis.h"
#include "tests/tier/test_chain.h"
#include "tier/internal/redis_connection.h"
#include "tier/internal/redis_memory.h"
#include "tier/key_slot.h"
#include "tier/redis_block_store.h"

namespace kvpool::tier {
namespace {

using testing::FakeConnection;
using testing::FakeRedisServer;
using testing::LookupBuffers;
using testing::MakeChain;
using testing::TestChain;

constexpr int64_t kBlockBytes = 512;
constexpr BlockSpace kSpace{.ns = NamespaceId(7), .layout_fingerprint = 0x5eed};
constexpr absl::Duration kDeadline = absl::Milliseconds(300);
// Scheduling on a loaded test machine, beyond the client's own kDeadlineSlack.
const absl::Duration kSlack = internal::kDeadlineSlack + absl::Milliseconds(250);

template <typename F>
absl::Duration Timed(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return absl::FromChrono(std::chrono::steady_clock::now() - start);
}

// Reads one command, then answers it with a valid 1000-byte bulk reply, one byte every 20 ms
// (20 s in all), until the client hangs up. Each read(2) makes progress well within any
// per-syscall timeout: with timeouts per syscall (the code before whole-call deadlines, and this
// code with Arm() reduced to arming once) each call below took 20 s.
void DribbleOneReply(FakeConnection& connection) {
  if (!connection.ReadCommand()) return;
  const std::string reply = testing::RespBulk(std::string(1000, 'x'));
  for (char c : reply) {
    if (!connection.Write(std::string_view(&c, 1)) || !connection.Pause(absl::Milliseconds(20))) {
      return;
    }
  }
}

class RedisFaultTest : public ::testing::Test {
 protected:
  std::unique_ptr<RedisBlockStore> NewStore(const FakeRedisServer& server, int threshold) {
    RedisTierOptions options;
    options.enabled = true;
    options.host = "127.0.0.1";
    options.port = server.port();
    options.command_timeout = kDeadline;
    options.breaker_failure_threshold = threshold;
    options.write_batch_blocks = 1;
    auto store = RedisBlockStore::Create(options, secret_, &clock_);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  const DeploymentSecret secret_ =
      DeploymentSecret::FromBytes("redis fault test: the deployment secret");
  ManualClock clock_;  // the breaker's: it never reopens for a probe on its own
};

TEST_F(RedisFaultTest, SlowDripLookupEndsAtTheDeadlineAndOpensTheBreaker) {
  auto server = FakeRedisServer::Start(DribbleOneReply);
  ASSERT_TRUE(server.ok()) << server.status();
  auto store = NewStore(**server, /*threshold=*/2);
  const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 1);
  LookupBuffers out(4, kBlockBytes);
  for (int i = 0; i < 2; ++i) {
    int64_t hits = -1;
    const absl::Duration took = Timed([&] {
      auto result = store->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
      hits = result.ok() ? result->hits : -1;
    });
    EXPECT_EQ(hits, 0) << i;
    EXPECT_GE(took, kDeadline - absl::Milliseconds(5)) << i;
    EXPECT_LT(took, kDeadline + kSlack) << i;
  }
  RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.breaker, BreakerState::kOpen);
  EXPECT_EQ(stats.lookup_errors, 2u);
  // Open: the next call costs nothing and reaches no server.
  const int accepted = (*server)->accepted();
  EXPECT_LT(Timed([&] { ASSERT_TRUE(store->Lookup(kSpace, {}, chain.hashes, out.spans).ok()); }),
            absl::Milliseconds(50));
  EXPECT_EQ(store->stats().rejected_lookups, 1u);
  EXPECT_EQ((*server)->accepted(), accepted);
}

// A value of the length the store expects is read from the socket straight into the caller's
// staging buffer (ReplySink::Place), not through hiredis: that read keeps the call's deadline
// too, and a server that hangs up in the middle of such a value is an I/O error (a miss, the
// connection remade for the next call), never a hit or a hang.
TEST_F(RedisFaultTest, AValueReadStraightIntoStagingKeepsTheDeadlineAndACutOneIsAMiss) {
  std::atomic<bool> cut{false};
  auto server = FakeRedisServer::Start([&cut](FakeConnection& connection) {
    while (connection.ReadCommand()) {
      const std::string reply =
          testing::RespBulk(std::string(kBlockHeaderBytes + kBlockBytes, 'x'));
      const size_t at_once = 40;  // the "$<len>" line and a little of the value
      if (!connection.Write(std::string_view(reply).substr(0, at_once))) return;
      if (cut) {
        connection.HangUp();
        return;
      }
      for (size_t i = at_once; i < reply.size(); ++i) {
        if (!connection.Write(std::string_view(reply).substr(i, 1)) ||
            !connection.Pause(absl::Milliseconds(20))) {
          return;
        }
      }
    }
  });
  ASSERT_TRUE(server.ok()) << server.status();
  auto store = NewStore(**server, /*threshold=*/3);
  const TestChain chain = MakeChain(kSpace, 1, kBlockBytes, 2);
  LookupBuffers out(1, kBlockBytes);
  int64_t hits = -1;
  const absl::Duration took = Timed([&] {
    auto result = store->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
    hits = result.ok() ? result->hits : -1;
  });
  EXPECT_EQ(hits, 0);
  EXPECT_GE(took, kDeadline - absl::Milliseconds(5));
  EXPECT_LT(took, kDeadline + kSlack);
  cut = true;
  auto result = store->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->hits, 0);
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.lookup_errors, 2u);
  EXPECT_EQ(stats.corrupt, 0u);         // never checked: the value never arrived whole
  EXPECT_EQ((*server)->accepted(), 2);  // the timed-out connection was not reused
  EXPECT_EQ(store->client_stats().io_errors, 2u);
}

TEST_F(RedisFaultTest, SlowDripWriteBatchEndsAtTheDeadlineAndOpensTheBreaker) {
  auto server = FakeRedisServer::Start(DribbleOneReply);
  ASSERT_TRUE(server.ok()) << server.status();
  auto store = NewStore(**server, /*threshold=*/1);
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 2);
  ASSERT_TRUE(
      store->Put(kSpace, {.hash = chain.hashes[0], .coverage = 16, .bytes = chain.blocks[0]}));
  // Flush waits on the manual clock, so it returns when the writer has finished the batch: in
  // real time, the batch's deadline.
  const absl::Duration took = Timed([&] { ASSERT_TRUE(store->Flush(absl::Seconds(1)).ok()); });
  EXPECT_LT(took, kDeadline + kSlack);
  RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.dropped_write_errors, 1u);
  EXPECT_EQ(stats.breaker, BreakerState::kOpen);
  EXPECT_FALSE(store->Put(kSpace, {.hash = chain.hashes[1],
                                   .parent = chain.hashes[0],
                                   .coverage = 16,
                                   .bytes = chain.blocks[1]}));
  EXPECT_EQ(store->stats().dropped_breaker_open, 1u);
}

// Answers +OK to everything (AUTH included) and nil to GET; the server records what it got.
void AnswerEverything(FakeConnection& connection) {
  while (std::optional<std::vector<std::string>> command = connection.ReadCommand()) {
    if (!connection.Write((*command)[0] == "GET" ? "$-1\r\n" : "+OK\r\n")) return;
  }
}

// One CLUSTER SLOTS range served by 127.0.0.1:`port`.
std::string SlotRange(int first, int last, int port) {
  return absl::StrCat("*3\r\n:", first, "\r\n:", last, "\r\n*2\r\n", testing::RespBulk("127.0.0.1"),
                      ":", port, "\r\n");
}

// A fake cluster node. CLUSTER SLOTS says it serves every slot but one, which an `other` node
// serves (one that is not `key_slot`, so the test's keys are all routed here); it answers every
// GET with `redirect` ("MOVED" or "ASK") to `target_port`, a node of the cluster or not.
struct RedirectingNode {
  int key_slot = 0;
  std::atomic<int> own_port{0}, other_port{0}, target_port{0};
  std::atomic<const char*> redirect{"MOVED"};

  void Serve(FakeConnection& connection) {
    const int other_slot = key_slot == 0 ? kNumClusterSlots - 1 : 0;
    const int first = other_slot == 0 ? 1 : 0;
    while (std::optional<std::vector<std::string>> command = connection.ReadCommand()) {
      const std::vector<std::string>& c = *command;
      std::string reply = "+OK\r\n";
      if (c[0] == "CLUSTER") {
        reply = absl::StrCat("*2\r\n", SlotRange(first, first + kNumClusterSlots - 2, own_port),
                             SlotRange(other_slot, other_slot, other_port));
      } else if (c[0] == "GET") {
        reply = testing::RespError(
            absl::StrCat(redirect.load(), " ", KeySlot(c[1]), " 127.0.0.1:", target_port.load()));
      }
      if (!connection.Write(reply)) return;
    }
  }
};

bool SawAuth(const FakeRedisServer& server) {
  for (const std::vector<std::string>& command : server.commands()) {
    if (command[0] == "AUTH") return true;
  }
  return false;
}

// Before redirects were checked against the cluster's nodes, the client connected to whatever
// address a MOVED or ASK named and sent it AUTH with the password first: `foreign` below got a
// connection and the password on the first lookup.
TEST_F(RedisFaultTest, RedirectOutsideTheClusterIsRefusedAndNeverConnected) {
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 3);
  auto foreign = FakeRedisServer::Start(AnswerEverything);
  auto member = FakeRedisServer::Start(AnswerEverything);  // named by CLUSTER SLOTS
  RedirectingNode script;
  script.key_slot = KeySlot(BlockKey(secret_, kSpace, chain.hashes[0], KeySlotting::kNamespace));
  auto node = FakeRedisServer::Start([&script](FakeConnection& c) { script.Serve(c); });
  ASSERT_TRUE(foreign.ok() && member.ok() && node.ok());
  script.own_port = (*node)->port();
  script.other_port = (*member)->port();
  script.target_port = (*foreign)->port();
  RedisTierOptions options;
  options.enabled = true;
  options.cluster_seeds = {(*node)->address()};
  options.username = "kvpool";
  options.password = "the redis password";
  options.command_timeout = absl::Seconds(5);
  auto store = RedisBlockStore::Create(options, secret_, &clock_);
  ASSERT_TRUE(store.ok()) << store.status();
  LookupBuffers out(2, kBlockBytes);
  for (const char* redirect : {"MOVED", "ASK"}) {
    script.redirect = redirect;
    auto result = (*store)->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
    ASSERT_TRUE(result.ok());
    EXPECT_EQ(result->hits, 0) << redirect;
  }
  EXPECT_EQ((*foreign)->accepted(), 0);
  EXPECT_TRUE((*foreign)->commands().empty());
  EXPECT_TRUE(SawAuth(**node));  // the password went to the cluster's node, and only there
  RedisClientStats client = (*store)->client_stats();
  EXPECT_EQ(client.refused_redirects, 4u);
  EXPECT_EQ(client.moved_redirects + client.ask_redirects, 0u);
  EXPECT_EQ((*store)->stats().breaker, BreakerState::kClosed);  // Redis answered; not an outage

  // A redirect to a node the cluster itself named is followed (with AUTH, as to any member).
  script.target_port = (*member)->port();
  script.redirect = "MOVED";
  auto result = (*store)->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->hits, 0);  // the member answers nil
  client = (*store)->client_stats();
  EXPECT_EQ(client.refused_redirects, 4u);
  EXPECT_EQ(client.moved_redirects, 2u);
  EXPECT_TRUE(SawAuth(**member));
  EXPECT_EQ((*foreign)->accepted(), 0);
}

// A server whose keys cost more than the model of Redis 7 with jemalloc (another allocator, other
// objects): the write budget charges what its MEMORY USAGE says, from the first answer on.
TEST_F(RedisFaultTest, TheWriteBudgetChargesWhatTheServerSaysAKeyCosts) {
  constexpr int64_t kUsage = 10'000;
  auto server = FakeRedisServer::Start([](FakeConnection& connection) {
    while (std::optional<std::vector<std::string>> command = connection.ReadCommand()) {
      const bool usage = (*command)[0] == "MEMORY";
      if (!connection.Write(usage ? absl::StrCat(":", kUsage, "\r\n") : "+OK\r\n")) return;
    }
  });
  ASSERT_TRUE(server.ok()) << server.status();
  RedisTierOptions options;
  options.enabled = true;
  options.host = "127.0.0.1";
  options.port = (*server)->port();
  options.ttl_seconds = 60;
  constexpr int64_t kBudget = 100'000;
  options.tenant_write_budget_bytes = kBudget;
  auto made = RedisBlockStore::Create(options, secret_, &clock_);
  ASSERT_TRUE(made.ok()) << made.status();
  RedisBlockStore& store = **made;
  const NamespaceTags tags{.tenant = 5, .model = 1};
  const TestChain chain = MakeChain(kSpace, 20, kBlockBytes, 3);
  // The first block is charged by the model (nothing measured yet) and measured once written.
  ASSERT_TRUE(store.Put(
      kSpace, {.hash = chain.hashes[0], .coverage = 16, .bytes = chain.blocks[0], .tags = tags}));
  ASSERT_TRUE(store.Flush(absl::Seconds(30)).ok());
  const int64_t key_bytes =
      static_cast<int64_t>(BlockKey(secret_, kSpace, chain.hashes[0], options.key_slotting).size());
  const int64_t modeled = internal::ModeledEntryBytes(key_bytes, kBlockHeaderBytes + kBlockBytes);
  ASSERT_LT(modeled, kUsage);
  EXPECT_EQ(store.WritesOf(tags.tenant).live_bytes, modeled);
  // The others at what the server said: as many as the rest of the budget holds.
  for (int i = 1; i < 20; ++i) {
    store.Put(kSpace, {.hash = chain.hashes[static_cast<size_t>(i)],
                       .parent = chain.hashes[static_cast<size_t>(i) - 1],
                       .coverage = 16,
                       .bytes = chain.blocks[static_cast<size_t>(i)],
                       .tags = tags});
  }
  ASSERT_TRUE(store.Flush(absl::Seconds(30)).ok());
  const int64_t more = (kBudget - modeled) / (kUsage + internal::kRedisUnreportedPerKeyBytes);
  EXPECT_EQ(store.stats().written, static_cast<uint64_t>(1 + more));
  EXPECT_EQ(store.stats().dropped_over_budget, static_cast<uint64_t>(19 - more));
  EXPECT_EQ(store.WritesOf(tags.tenant).live_bytes,
            modeled + more * (kUsage + internal::kRedisUnreportedPerKeyBytes));
  // Only the first value of that length was asked about.
  int64_t asked = 0;
  for (const std::vector<std::string>& command : (*server)->commands()) {
    asked += command[0] == "MEMORY" ? 1 : 0;
  }
  EXPECT_EQ(asked, 1);
}

}  // namespace
}  // namespace kvpool::tier
