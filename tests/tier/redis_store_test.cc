// RedisBlockStore against real redis-server processes on private Unix sockets (label
// `integration`): round trips, two stores sharing one server as two daemons would, namespace
// isolation, corrupted and foreign values, a server killed and restarted, a full write queue.
// Planted, replayed and other-secret values and the deployed ACL: redis_security_test.cc.

#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/tier/redis_store_fixture.h"

namespace kvpool::tier {
namespace {

using testing::kBlockBytes;
using testing::kSpace;
using testing::LookupBuffers;
using testing::MakeChain;
using testing::RedisServer;
using testing::RedisStoreTest;
using testing::TestChain;

TEST_F(RedisStoreTest, RoundTripIsByteIdentical) {
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 8, kBlockBytes, 1);
  ASSERT_EQ(chain.Put(*store), 8);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(8, kBlockBytes);
  auto result = store->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->hits, 8);
  EXPECT_EQ(result->coverage, std::vector<uint32_t>(8, 16));
  EXPECT_EQ(out.storage, chain.blocks);
  // Written once: the second put of the same content finds it there.
  ASSERT_EQ(chain.Put(*store), 8);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.written, 8u);
  EXPECT_EQ(stats.already_present, 8u);
  EXPECT_EQ(stats.hits, 8u);
  EXPECT_EQ(stats.bytes_read, static_cast<uint64_t>(8 * kBlockBytes));
  EXPECT_EQ(stats.breaker, BreakerState::kClosed);
  EXPECT_TRUE(store->CheckInvariants().ok());
}

// Issue 31: a GET's value goes to its command's ReplySink straight from hiredis's read buffer (the
// store verifies it there and copies the payload once, into the caller's buffer); the reply
// handed on is then empty, so no second copy of the value exists. Only a top-level bulk string
// is offered: nil, error and array replies (and strings inside arrays) come through as before.
TEST_F(RedisStoreTest, AReplySinkTakesABulkStringWhereHiredisReadIt) {
  struct Sink final : ReplySink {
    bool Take(std::string_view value) override {
      taken.emplace_back(value);
      return keep;
    }
    bool keep = true;
    std::vector<std::string> taken;
  };
  std::string value(300 * 1024, 'v');
  for (size_t i = 0; i < value.size(); i += 4099) value[i] = static_cast<char>('a' + i % 26);
  ASSERT_TRUE(server_->Command({"SET", "k", value}).ok());
  ASSERT_TRUE(server_->Command({"RPUSH", "list", "x"}).ok());
  auto client = CreateRedisClient(server_->TierOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  Sink sink;
  const std::vector<RedisCommand> commands = {
      {.args = {"GET", "k"}, .sink = &sink},
      {.args = {"GET", "missing"}, .sink = &sink},
      {.args = {"GET", "list"}, .sink = &sink},
      {.args = {"MGET", "k", "k"}, .sink = &sink},
      {.args = {"GET", "k"}},
      {.args = {"PING"}, .key_index = -1, .sink = &sink},
  };
  std::vector<absl::StatusOr<RedisReply>> replies = (*client)->Execute(commands);
  ASSERT_EQ(sink.taken.size(), 1u);  // the first GET's value only
  EXPECT_TRUE(sink.taken[0] == value);
  ASSERT_TRUE(replies[0].ok()) << replies[0].status();
  EXPECT_EQ((*replies[0])->type, REDIS_REPLY_STRING);
  EXPECT_EQ((*replies[0])->len, 0u) << "a value the sink took is not copied into the reply too";
  EXPECT_EQ((*replies[1])->type, REDIS_REPLY_NIL);
  EXPECT_FALSE(replies[2].ok());  // WRONGTYPE: an error, never offered
  ASSERT_TRUE(replies[3].ok());
  ASSERT_EQ((*replies[3])->elements, 2u);
  EXPECT_EQ((*replies[3])->element[1]->len, value.size());
  EXPECT_EQ((*replies[4])->len, value.size());  // no sink: the reply carries the value
  EXPECT_EQ((*replies[5])->type, REDIS_REPLY_STATUS);
  // A sink that declines leaves the value in the reply.
  sink.keep = false;
  replies = (*client)->Execute(std::span(commands).first(1));
  ASSERT_EQ(sink.taken.size(), 2u);
  ASSERT_TRUE(replies[0].ok());
  EXPECT_EQ(std::string_view((*replies[0])->str, (*replies[0])->len), value);
}

// A sink that places a bulk string has its bytes read from the socket straight into its buffers
// (what hiredis had already buffered copied, the rest read(2) there), in two pieces; the reply
// handed on is empty, and the stream stays in step: values of every size (one that fits in what
// hiredis read with the header, an empty one, large ones) pipelined between replies that are not
// placed (nil, an error, a declined length, a command without a sink) all come back right.
TEST_F(RedisStoreTest, APlacingSinkReadsAValueStraightFromTheSocketIntoItsBuffers) {
  struct Sink final : ReplySink {
    bool Take(std::string_view value) override {
      taken.emplace_back(value);
      return true;
    }
    bool Place(size_t len, Placement* where) override {
      if (len == decline) return false;
      buffer.assign(len, '\0');
      const size_t head = std::min<size_t>(len, 10);
      where->head = std::span<char>(buffer.data(), head);
      where->tail = std::span<char>(buffer.data() + head, len - head);
      return true;
    }
    void Placed() override { placed.push_back(buffer); }
    size_t decline = 7;
    std::string buffer;
    std::vector<std::string> placed, taken;
  };
  auto pattern = [](size_t n, char base) {
    std::string v(n, base);
    for (size_t i = 0; i < n; i += 4099) v[i] = static_cast<char>('a' + i % 26);
    return v;
  };
  const std::vector<std::string> values = {pattern(300 * 1024, 'v'), "small", "",
                                           pattern(2 * 1024 * 1024 + 3, 'w'), "decline"};
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_TRUE(server_->Command({"SET", absl::StrCat("k", i), values[i]}).ok());
  }
  ASSERT_TRUE(server_->Command({"RPUSH", "list", "x"}).ok());
  auto client = CreateRedisClient(server_->TierOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  Sink sink;
  const std::vector<RedisCommand> commands = {
      {.args = {"GET", "k0"}, .sink = &sink},      {.args = {"GET", "k1"}, .sink = &sink},
      {.args = {"GET", "missing"}, .sink = &sink}, {.args = {"GET", "k2"}, .sink = &sink},
      {.args = {"GET", "list"}, .sink = &sink},    {.args = {"GET", "k3"}, .sink = &sink},
      {.args = {"GET", "k4"}, .sink = &sink},      {.args = {"GET", "k3"}},
      {.args = {"GET", "k0"}, .sink = &sink},
  };
  for (int round = 0; round < 3; ++round) {  // the same connection, again and again
    sink.placed.clear();
    sink.taken.clear();
    std::vector<absl::StatusOr<RedisReply>> replies = (*client)->Execute(commands);
    EXPECT_EQ(sink.placed,
              (std::vector<std::string>{values[0], values[1], values[2], values[3], values[0]}));
    EXPECT_EQ(sink.taken, std::vector<std::string>{values[4]});  // declined: read as usual
    for (size_t i : {0, 1, 3, 5, 6, 8}) {
      ASSERT_TRUE(replies[i].ok()) << i << ": " << replies[i].status();
      EXPECT_EQ((*replies[i])->type, REDIS_REPLY_STRING) << i;
      EXPECT_EQ((*replies[i])->len, 0u) << i;
    }
    EXPECT_EQ((*replies[2])->type, REDIS_REPLY_NIL);
    EXPECT_FALSE(replies[4].ok());  // WRONGTYPE
    ASSERT_TRUE(replies[7].ok());
    EXPECT_EQ(std::string_view((*replies[7])->str, (*replies[7])->len), values[3]);
  }
}

TEST_F(RedisStoreTest, LookupReturnsTheLongestPrefixOfHits) {
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 6, kBlockBytes, 2);
  TestChain first_three = chain;
  first_three.hashes.resize(3);
  first_three.blocks.resize(3);
  first_three.Put(*store);
  // Block 4 is present too, but block 3 is not: the prefix stops at 3.
  store->Put(kSpace,
             {.hash = chain.hashes[4], .parent = chain.hashes[3], .bytes = chain.blocks[4]});
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(6, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 3);
  EXPECT_EQ(store->stats().misses, 3u);
  // A lookup starting in the middle names its parent.
  auto tail = store->Lookup(kSpace, chain.hashes[3], std::span(chain.hashes).subspan(4, 1),
                            std::span(out.spans).subspan(0, 1));
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(tail->hits, 1);
  EXPECT_EQ(out.storage[0], chain.blocks[4]);
  // The wrong parent is refused: a value only answers for the chain it was stored under.
  auto wrong_parent = store->Lookup(kSpace, chain.hashes[0], std::span(chain.hashes).subspan(4, 1),
                                    std::span(out.spans).subspan(0, 1));
  ASSERT_TRUE(wrong_parent.ok());
  EXPECT_EQ(wrong_parent->hits, 0);
}

TEST_F(RedisStoreTest, LookupRejectsMismatchedBuffers) {
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 3);
  LookupBuffers out(1, kBlockBytes);
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, chain.hashes, out.spans).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<std::span<std::byte>> empty = {out.spans[0], std::span<std::byte>()};
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, chain.hashes, empty).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->stats().lookups, 0u);  // nothing looked up, nothing counted
}

TEST_F(RedisStoreTest, TwoStoresSharingOneServerSeeEachOthersBlocks) {
  auto a = NewStore();  // daemon A
  auto b = NewStore();  // daemon B, same Redis
  const TestChain chain = MakeChain(kSpace, 16, kBlockBytes, 4);
  ASSERT_EQ(chain.Put(*a), 16);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(16, kBlockBytes);
  EXPECT_EQ(LookupAll(*b, chain, &out, kSpace), 16);
  EXPECT_EQ(out.storage, chain.blocks);
  EXPECT_EQ(b->stats().hits, 16u);
  EXPECT_EQ(a->stats().written, 16u);
}

TEST_F(RedisStoreTest, NamespacesNeverSeeEachOthersBlocks) {
  auto a = NewStore();
  auto b = NewStore();
  const BlockSpace other{.ns = NamespaceId(8), .layout_fingerprint = kSpace.layout_fingerprint};
  const TestChain mine = MakeChain(kSpace, 4, kBlockBytes, 5);
  ASSERT_EQ(mine.Put(*a), 4);
  ASSERT_TRUE(a->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(4, kBlockBytes);
  EXPECT_EQ(LookupAll(*b, mine, &out, other), 0);  // same hashes, other namespace: nothing
  // The other tenant stores different bytes under the same hashes; each reads its own.
  TestChain theirs = MakeChain(other, 4, kBlockBytes, 6);
  theirs.hashes = mine.hashes;
  ASSERT_EQ(theirs.Put(*b), 4);
  ASSERT_TRUE(b->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(LookupAll(*b, theirs, &out, other), 4);
  EXPECT_EQ(out.storage, theirs.blocks);
  EXPECT_EQ(LookupAll(*a, mine, &out, kSpace), 4);
  EXPECT_EQ(out.storage, mine.blocks);
}

TEST_F(RedisStoreTest, CorruptedValueIsAMissAndCounted) {
  if (testing::RedisCliBinary().empty()) GTEST_SKIP() << "redis-cli is not installed";
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 7);
  ASSERT_EQ(chain.Put(*store), 4);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  // Flip one payload byte of block 2 with redis-cli, as an operator or a bad disk might.
  const int64_t offset = kBlockHeaderBytes + 100;
  const char original = static_cast<char>(chain.blocks[2][100]);
  const std::string replacement(1, original == 'A' ? 'B' : 'A');
  auto out_cli =
      testing::RunProgram({testing::RedisCliBinary(), "-s", server_->socket_path(), "SETRANGE",
                           KeyOf(chain, 2), absl::StrCat(offset), replacement});
  ASSERT_TRUE(out_cli.ok()) << out_cli.status();
  LookupBuffers out(4, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 2);
  EXPECT_EQ(store->stats().corrupt, 1u);
  EXPECT_EQ(store->stats().forged, 1u);  // a damaged payload fails the MAC
  EXPECT_NE(out.storage[2], chain.blocks[2]) << "a refused block must not reach the buffer";
  // A damaged header (the magic) is refused as well.
  ASSERT_TRUE(server_->Command({"SETRANGE", KeyOf(chain, 0), "0", "X"}).ok());
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 0);
  EXPECT_EQ(store->stats().corrupt, 2u);
  EXPECT_EQ(store->stats().forged, 1u);  // refused for its magic, before the MAC
  // A truncated value too (block 1, looked up on its own under its parent).
  auto value = server_->Command({"GET", KeyOf(chain, 1)});
  ASSERT_TRUE(value.ok()) << value.status();
  const std::string truncated((*value)->str, (*value)->len - 1);
  ASSERT_TRUE(server_->Command({"SET", KeyOf(chain, 1), truncated}).ok());
  auto result = store->Lookup(kSpace, chain.hashes[0], std::span(chain.hashes).subspan(1, 1),
                              std::span(out.spans).subspan(0, 1));
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->hits, 0);
  EXPECT_EQ(store->stats().corrupt, 3u);
}

TEST_F(RedisStoreTest, ValueWithAnotherLayoutFingerprintIsAMiss) {
  auto store = NewStore();
  const TestChain chain = MakeChain(kSpace, 1, kBlockBytes, 8);
  ASSERT_EQ(chain.Put(*store), 1);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  // The same value copied under the key of another layout: its MAC binds the first key.
  const BlockSpace other_layout{.ns = kSpace.ns, .layout_fingerprint = 0xbad};
  const std::string bytes = ValueAt(KeyOf(chain, 0));
  ASSERT_FALSE(bytes.empty());
  ASSERT_TRUE(
      server_
          ->Command({"SET",
                     BlockKey(secret_, other_layout, chain.hashes[0], KeySlotting::kNamespace),
                     bytes})
          .ok());
  LookupBuffers out(1, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, chain, &out, other_layout), 0);
  EXPECT_EQ(store->stats().corrupt, 1u);
  EXPECT_EQ(store->stats().forged, 1u);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 1);  // the original still reads
}

TEST_F(RedisStoreTest, PasswordIsSentAndAWrongOneOpensTheBreaker) {
  ASSERT_TRUE(server_->Command({"CONFIG", "SET", "requirepass", "s3cret"}).ok());
  RedisTierOptions options = server_->TierOptions();
  options.password = "s3cret";
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 13);
  ASSERT_EQ(chain.Put(*store), 2);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(2, kBlockBytes);
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 2);
  EXPECT_EQ(out.storage, chain.blocks);

  options.password = "wrong";
  options.breaker_failure_threshold = 2;
  auto refused = NewStore(options);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(LookupAll(*refused, chain, &out, kSpace), 0);
  const RemoteTierStats stats = refused->stats();
  EXPECT_EQ(stats.breaker, BreakerState::kOpen);
  EXPECT_EQ(stats.lookup_errors, 2u);
  EXPECT_EQ(stats.rejected_lookups, 1u);
  EXPECT_EQ(refused->client_stats().connect_failures, 2u);
}

TEST_F(RedisStoreTest, TtlIsSetWhenConfigured) {
  RedisTierOptions options = server_->TierOptions();
  options.ttl_seconds = 600;
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 1, kBlockBytes, 12);
  ASSERT_EQ(chain.Put(*store), 1);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  auto ttl = server_->Command({"TTL", KeyOf(chain, 0)});
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_GT((*ttl)->integer, 500);
  EXPECT_LE((*ttl)->integer, 600);
}

// Wall time of `f()`, for the "never blocks beyond the timeout" checks.
template <typename F>
absl::Duration Timed(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return absl::FromChrono(std::chrono::steady_clock::now() - start);
}

TEST_F(RedisStoreTest, KilledServerOpensTheBreakerAndRestartClosesIt) {
  RedisTierOptions options = server_->TierOptions();
  options.connect_timeout = absl::Milliseconds(300);
  options.command_timeout = absl::Milliseconds(300);
  options.breaker_failure_threshold = 2;
  options.breaker_backoff = absl::Seconds(1);  // on the manual clock
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 9);
  ASSERT_EQ(chain.Put(*store), 4);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  LookupBuffers out(4, kBlockBytes);
  ASSERT_EQ(LookupAll(*store, chain, &out, kSpace), 4);

  server_->Kill();
  const absl::Duration bound = options.connect_timeout + options.command_timeout + absl::Seconds(1);
  for (int i = 0; i < 5; ++i) {  // 2 failures open the breaker; the rest miss at once
    int64_t hits = -1;
    EXPECT_LT(Timed([&] { hits = LookupAll(*store, chain, &out, kSpace); }), bound) << i;
    EXPECT_EQ(hits, 0) << i;
  }
  RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.breaker, BreakerState::kOpen);
  EXPECT_EQ(stats.breaker_opens, 1u);
  EXPECT_EQ(stats.rejected_lookups, 3u);
  EXPECT_EQ(stats.lookup_errors, 2u);
  bool queued = true;
  EXPECT_LT(Timed([&] { queued = chain.Put(*store) > 0; }), absl::Milliseconds(100));
  EXPECT_FALSE(queued);
  EXPECT_EQ(store->stats().dropped_breaker_open, 4u);

  ASSERT_TRUE(server_->Restart().ok());                  // empty: no persistence
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 0);  // still open: no probe before backoff
  clock_.Advance(absl::ToInt64Nanoseconds(absl::Seconds(1)));
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 0);  // the probe: Redis answers (nil)
  EXPECT_EQ(store->stats().breaker, BreakerState::kClosed);
  ASSERT_EQ(chain.Put(*store), 4);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  EXPECT_EQ(LookupAll(*store, chain, &out, kSpace), 4);  // hits resume
  EXPECT_EQ(out.storage, chain.blocks);
  EXPECT_TRUE(store->CheckInvariants().ok());
}

// MayHave answers for any set of blocks in one round trip (a pipelined EXISTS each): stored ones
// true, others (never stored, another namespace's) false; with the server gone, none, and no wait
// past the timeouts.
TEST_F(RedisStoreTest, MayHaveAsksForEveryBlockInOneRoundTrip) {
  RedisTierOptions options = server_->TierOptions();
  options.connect_timeout = absl::Milliseconds(300);
  options.command_timeout = absl::Milliseconds(300);
  auto store = NewStore(options);
  const TestChain stored = MakeChain(kSpace, 8, kBlockBytes, 21);
  const TestChain absent = MakeChain(kSpace, 8, kBlockBytes, 22);
  ASSERT_EQ(stored.Put(*store), 8);
  ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
  std::vector<BlockHash> asked;  // interleaved, deepest first: the order LookupCheckpoint asks in
  for (int i = 7; i >= 0; --i) {
    asked.push_back(absent.hashes[static_cast<size_t>(i)]);
    if (i % 3 == 0) asked.push_back(stored.hashes[static_cast<size_t>(i)]);
  }
  const uint64_t round_trips = store->client_stats().round_trips;
  const std::vector<bool> may_have = store->MayHave(kSpace, asked);
  EXPECT_EQ(store->client_stats().round_trips, round_trips + 1);
  ASSERT_EQ(may_have.size(), asked.size());
  for (size_t k = 0; k < asked.size(); ++k) {
    const bool is_stored =
        std::find(stored.hashes.begin(), stored.hashes.end(), asked[k]) != stored.hashes.end();
    EXPECT_EQ(may_have[k], is_stored) << k;
  }
  const BlockSpace other{.ns = NamespaceId(8), .layout_fingerprint = kSpace.layout_fingerprint};
  EXPECT_EQ(store->MayHave(other, stored.hashes), std::vector<bool>(8, false));
  EXPECT_TRUE(store->MayHave(kSpace, {}).empty());

  server_->Kill();
  const absl::Duration bound = options.connect_timeout + options.command_timeout + absl::Seconds(1);
  std::vector<bool> down;
  EXPECT_LT(Timed([&] { down = store->MayHave(kSpace, stored.hashes); }), bound);
  EXPECT_EQ(down, std::vector<bool>(8, false));
  EXPECT_GE(store->stats().lookup_errors, 1u);
}

TEST_F(RedisStoreTest, HungServerCostsALookupNoMoreThanTheTimeout) {
  RedisTierOptions options = server_->TierOptions();
  options.command_timeout = absl::Milliseconds(300);
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 10);
  LookupBuffers out(2, kBlockBytes);
  ASSERT_EQ(LookupAll(*store, chain, &out, kSpace), 0);  // connected
  server_->Pause();
  int64_t hits = -1;
  const absl::Duration took = Timed([&] { hits = LookupAll(*store, chain, &out, kSpace); });
  server_->Resume();
  EXPECT_EQ(hits, 0);
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Milliseconds(300) + absl::Seconds(1));
  EXPECT_EQ(store->stats().lookup_errors, 1u);
}

TEST_F(RedisStoreTest, FullWriteQueueDropsAndCountsWithoutBlocking) {
  RedisTierOptions options = server_->TierOptions();
  options.write_queue_blocks = 4;
  options.write_batch_blocks = 1;
  options.command_timeout = absl::Seconds(20);  // the writer waits on the paused server
  auto store = NewStore(options);
  const TestChain chain = MakeChain(kSpace, 20, kBlockBytes, 11);
  server_->Pause();
  absl::Duration slowest;
  int queued = 0;
  for (size_t i = 0; i < chain.hashes.size(); ++i) {
    bool ok = false;
    slowest =
        std::max(slowest, Timed([&] {
                   ok = store->Put(kSpace, {.hash = chain.hashes[i],
                                            .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                            .coverage = 16,
                                            .bytes = chain.blocks[i]});
                 }));
    queued += ok ? 1 : 0;
    ASSERT_TRUE(store->CheckInvariants().ok());
  }
  EXPECT_LT(slowest, absl::Milliseconds(100));
  // At most the queue's 4 plus the one batch the writer holds were taken.
  EXPECT_LE(queued, 5);
  RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.dropped_queue_full, static_cast<uint64_t>(20 - queued));
  EXPECT_LE(stats.queued_blocks, 4);
  server_->Resume();
  ASSERT_TRUE(store->Flush(absl::Seconds(60)).ok());
  stats = store->stats();
  EXPECT_EQ(stats.written, static_cast<uint64_t>(queued));
  EXPECT_EQ(stats.queued_blocks, 0);
  EXPECT_EQ(stats.queued_bytes, 0);
}

// Seeded random puts and lookups over several chains against a model of what Redis holds (no
// maxmemory, so nothing is evicted): every lookup returns exactly the model's run of stored
// blocks, byte-identical; invariants checked after every step.
TEST_F(RedisStoreTest, RandomizedAgainstReferenceModel) {
  auto store = NewStore();
  std::mt19937 rng(42);
  constexpr int kChains = 4, kLength = 12;
  constexpr int64_t kSmall = 512;
  std::vector<TestChain> chains;
  std::vector<std::vector<bool>> stored(kChains, std::vector<bool>(kLength, false));
  for (int c = 0; c < kChains; ++c) {
    chains.push_back(MakeChain({.ns = NamespaceId(100 + c % 2), .layout_fingerprint = 1}, kLength,
                               kSmall, 1000 + c));
  }
  for (int step = 0; step < 200; ++step) {
    const int c = static_cast<int>(rng() % kChains);
    const TestChain& chain = chains[c];
    const int begin = static_cast<int>(rng() % kLength);
    const int end = begin + 1 + static_cast<int>(rng() % (kLength - begin));
    const BlockHash parent = begin == 0 ? BlockHash{} : chain.hashes[begin - 1];
    if (rng() % 2 == 0) {
      for (int i = begin; i < end; ++i) {
        ASSERT_TRUE(store->Put(chain.space, {.hash = chain.hashes[i],
                                             .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                             .coverage = 16,
                                             .bytes = chain.blocks[i]}));
        stored[c][i] = true;
      }
      ASSERT_TRUE(store->Flush(absl::Seconds(30)).ok());
    } else {
      LookupBuffers out(end - begin, kSmall);
      auto result = store->Lookup(chain.space, parent,
                                  std::span(chain.hashes).subspan(begin, end - begin), out.spans);
      ASSERT_TRUE(result.ok());
      int expected = 0;
      while (begin + expected < end && stored[c][begin + expected]) ++expected;
      ASSERT_EQ(result->hits, expected) << "step " << step;
      for (int i = 0; i < expected; ++i) ASSERT_EQ(out.storage[i], chain.blocks[begin + i]);
    }
    ASSERT_TRUE(store->CheckInvariants().ok()) << "step " << step;
  }
  EXPECT_EQ(store->stats().corrupt, 0u);
}

}  // namespace
}  // namespace kvpool::tier
