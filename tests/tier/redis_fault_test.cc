// RedisBlockStore against scripted fake Redis nodes (tests/tier/fake_redis.h) doing what a real
// server will not do on request: a server that dribbles its replies a byte at a time must cost
// a Lookup or a write batch no more than the call's deadline, and such calls open the breaker.

#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "tests/tier/fake_redis.h"
#include "tests/tier/test_chain.h"
#include "tier/internal/redis_connection.h"
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

}  // namespace
}  // namespace kvpool::tier
