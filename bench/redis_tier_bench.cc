// Redis tier load throughput: RedisBlockStore::Lookup of a 32-block prefix beside a bare hiredis
// pipelined GET of the same 32 keys (same value size, same redis-server, same transport), in one
// run. The ratio is the tier's cost over the wire protocol itself: building the keyed keys, the
// header check and the value's MAC (Poly1305 under a one-time key, block_codec.h), the copy into
// caller buffers (made from hiredis's read buffer: the bare GET copies each value once too, into
// its reply), the breaker and the connection pool. BM_LookupVsBareGet runs the two alternately.
//
//   build/release/bench/redis_tier_bench --benchmark_repetitions=5
//
// Before and after a change to any of those (OLD: the binary built before it), one command:
//
//   python3 bench/ab_compare.py --old=OLD --new=build/release/bench/redis_tier_bench
//       --rounds=10 -- --benchmark_filter=BM_StoreLookup --benchmark_repetitions=3
//
// Block size 256 KiB: one 16-token block of Llama-3.2-1B in bf16, 16 layers x 2 (K, V) x 8 KV
// heads x 64 head_dim x 2 bytes x 16 tokens = 262144 bytes. Llama-3-8B's is 2 MiB, small models'
// far less; 256 KiB is a real model at the top of the 64-256 KiB range where the per-block work
// (checksum, copy) matters against the network. 32 blocks is a 512-token shared prefix, 8 MiB
// per lookup. The server is started by the benchmark on a private Unix socket and a loopback
// port (both transports are measured), and killed at exit. Needs redis-server.

#include <hiredis/hiredis.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "kvpool/util/check.h"
#include "tests/tier/redis_harness.h"
#include "tests/tier/test_chain.h"
#include "tier/redis_block_store.h"
#include "xxhash.h"

namespace kvpool::tier {
namespace {

constexpr int64_t kBlockBytes = 256 * 1024;
constexpr int kBlocks = 32;
constexpr BlockSpace kSpace{.ns = NamespaceId(1), .layout_fingerprint = 0x11a3a};

const DeploymentSecret& Secret() {
  static const DeploymentSecret* secret =
      new DeploymentSecret(DeploymentSecret::FromBytes("redis_tier_bench: a fixed test secret"));
  return *secret;
}

// One server, loaded once, shared by every benchmark of the run.
struct Env {
  std::unique_ptr<testing::TempDir> dir;
  std::unique_ptr<testing::RedisServer> server;
  int tcp_port = 0;
  testing::TestChain chain;
  std::vector<std::string> keys;

  static Env& Get() {
    static Env* env = Make();
    return *env;
  }

 private:
  static Env* Make() {
    auto* env = new Env;
    auto dir = testing::TempDir::Create("kvpool-redis-bench");
    KVPOOL_CHECK_OK(dir.status());
    env->dir = std::move(*dir);
    auto port = testing::PickFreePort();
    KVPOOL_CHECK_OK(port.status());
    env->tcp_port = *port;
    auto server = testing::RedisServer::Start(
        env->dir->path(), {.unix_socket = true, .extra_args = {"--port", absl::StrCat(*port)}});
    KVPOOL_CHECK_OK(server.status());
    env->server = std::move(*server);
    env->chain = testing::MakeChain(kSpace, kBlocks, kBlockBytes, 1);
    auto store = RedisBlockStore::Create(env->server->TierOptions(), Secret());
    KVPOOL_CHECK_OK(store.status());
    KVPOOL_CHECK(env->chain.Put(**store) == kBlocks);
    KVPOOL_CHECK_OK((*store)->Flush(absl::Seconds(60)));
    for (const BlockHash& h : env->chain.hashes) {
      env->keys.push_back(BlockKey(Secret(), kSpace, h, KeySlotting::kNamespace));
    }
    return env;
  }
};

RedisTierOptions Options(bool tcp) {
  Env& env = Env::Get();
  RedisTierOptions options = env.server->TierOptions();
  if (tcp) {
    options.unix_socket.clear();
    options.host = "127.0.0.1";
    options.port = env.tcp_port;
  }
  options.command_timeout = absl::Seconds(10);
  return options;
}

void BM_StoreLookup(benchmark::State& state) {
  const bool tcp = state.range(0) != 0;
  Env& env = Env::Get();
  auto store = RedisBlockStore::Create(Options(tcp), Secret());
  KVPOOL_CHECK_OK(store.status());
  testing::LookupBuffers out(kBlocks, kBlockBytes);
  for (auto _ : state) {
    auto result = (*store)->Lookup(kSpace, BlockHash{}, env.chain.hashes, out.spans);
    if (!result.ok() || result->hits != kBlocks) {
      state.SkipWithError("lookup missed");
      break;
    }
    benchmark::DoNotOptimize(out.storage[kBlocks - 1].data());
  }
  state.SetBytesProcessed(state.iterations() * kBlocks * kBlockBytes);
}
BENCHMARK(BM_StoreLookup)->Arg(0)->Arg(1)->ArgName("tcp")->UseRealTime();

// The baseline: what a redis-benchmark-style client does for the same data, nothing more.
// hiredis, the same keys, GETs appended then replies read; each reply's length checked. With
// copy=1 each payload is also copied into a caller buffer, the least any loader must do (the
// store's remaining cost over that is the header check, the checksum and its bookkeeping).
void BM_HiredisPipelinedGet(benchmark::State& state) {
  const bool tcp = state.range(0) != 0;
  const bool copy = state.range(1) != 0;
  Env& env = Env::Get();
  redisContext* c = tcp ? redisConnect("127.0.0.1", env.tcp_port)
                        : redisConnectUnix(env.server->socket_path().c_str());
  KVPOOL_CHECK(c != nullptr && c->err == 0);
  testing::LookupBuffers out(kBlocks, kBlockBytes);
  for (auto _ : state) {
    for (const std::string& key : env.keys) {
      const char* argv[] = {"GET", key.c_str()};
      const size_t lens[] = {3, key.size()};
      redisAppendCommandArgv(c, 2, argv, lens);
    }
    bool ok = true;
    for (int i = 0; i < kBlocks; ++i) {
      void* reply = nullptr;
      ok = redisGetReply(c, &reply) == REDIS_OK && ok;
      auto* r = static_cast<redisReply*>(reply);
      ok = ok && r->type == REDIS_REPLY_STRING &&
           r->len == static_cast<size_t>(kBlockHeaderBytes + kBlockBytes);
      if (ok && copy) std::memcpy(out.spans[i].data(), r->str + kBlockHeaderBytes, kBlockBytes);
      benchmark::DoNotOptimize(r->str);
      freeReplyObject(r);
    }
    if (!ok) {
      state.SkipWithError("GET failed");
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * kBlocks * kBlockBytes);
  redisFree(c);
}
BENCHMARK(BM_HiredisPipelinedGet)
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->ArgNames({"tcp", "copy"})
    ->UseRealTime();

// A GET of every key, pipelined; `take(i, value)` sees the i-th value whole (header included).
// Returns whether every block came back whole.
template <typename Take>
bool PipelinedGets(redisContext* c, Take take) {
  for (const std::string& key : Env::Get().keys) {
    const char* argv[] = {"GET", key.c_str()};
    const size_t lens[] = {3, key.size()};
    redisAppendCommandArgv(c, 2, argv, lens);
  }
  bool ok = true;
  for (int i = 0; i < kBlocks; ++i) {
    void* reply = nullptr;
    ok = redisGetReply(c, &reply) == REDIS_OK && ok;
    auto* r = static_cast<redisReply*>(reply);
    ok = ok && r->type == REDIS_REPLY_STRING &&
         r->len == static_cast<size_t>(kBlockHeaderBytes + kBlockBytes);
    if (ok) take(i, r->str);
    freeReplyObject(r);
  }
  return ok;
}

// What a lookup cost before values carried a MAC, as far as one can rebuild it beside the store:
// the bare pipelined GETs, each payload's xxh3-64 (format 1's checksum) and its copy into the
// caller's buffer. Returns whether every block came back.
bool UnauthenticatedLookup(redisContext* c, testing::LookupBuffers& out) {
  return PipelinedGets(c, [&out](int i, const char* value) {
    benchmark::DoNotOptimize(XXH3_64bits(value + kBlockHeaderBytes, kBlockBytes));
    std::memcpy(out.spans[i].data(), value + kBlockHeaderBytes, kBlockBytes);
  });
}

// The bare pipelined GETs of BM_HiredisPipelinedGet (copy=0). Returns whether every block came
// back whole.
bool BareGets(redisContext* c) {
  return PipelinedGets(c, [](int, const char* value) { benchmark::DoNotOptimize(value); });
}

// Issue 31's pair, alternating call by call so both sides see the same moment of this shared
// machine: the store's Lookup (keys, checks, the payload copied into the caller's buffers) against
// the bare pipelined GETs of the same values.
void BM_LookupVsBareGet(benchmark::State& state) {
  const bool tcp = state.range(0) != 0;
  Env& env = Env::Get();
  auto store = RedisBlockStore::Create(Options(tcp), Secret());
  KVPOOL_CHECK_OK(store.status());
  redisContext* c = tcp ? redisConnect("127.0.0.1", env.tcp_port)
                        : redisConnectUnix(env.server->socket_path().c_str());
  KVPOOL_CHECK(c != nullptr && c->err == 0);
  testing::LookupBuffers out(kBlocks, kBlockBytes);
  bool ok = true;
  bench::Interleave(
      state,
      [&] {
        auto result = (*store)->Lookup(kSpace, BlockHash{}, env.chain.hashes, out.spans);
        ok = ok && result.ok() && result->hits == kBlocks;
      },
      "lookup_ns", [&] { ok = BareGets(c) && ok; }, "get_ns");
  if (!ok) state.SkipWithError("a lookup missed");
  redisFree(c);
}
BENCHMARK(BM_LookupVsBareGet)->Arg(0)->Arg(1)->ArgName("tcp")->UseRealTime();

// The store's Lookup (keyed keys, every value's Poly1305 tag checked) against
// UnauthenticatedLookup, alternating call by call in one benchmark so both see the same moment of
// this shared machine: the ratio bounds what the MAC costs a promotion (it also charges the
// store's own bookkeeping, which format 1 paid too, to the MAC).
void BM_LookupVsUnauthenticated(benchmark::State& state) {
  const bool tcp = state.range(0) != 0;
  Env& env = Env::Get();
  auto store = RedisBlockStore::Create(Options(tcp), Secret());
  KVPOOL_CHECK_OK(store.status());
  redisContext* c = tcp ? redisConnect("127.0.0.1", env.tcp_port)
                        : redisConnectUnix(env.server->socket_path().c_str());
  KVPOOL_CHECK(c != nullptr && c->err == 0);
  testing::LookupBuffers ours(kBlocks, kBlockBytes), theirs(kBlocks, kBlockBytes);
  bool ok = true;
  bench::Interleave(
      state,
      [&] {
        auto result = (*store)->Lookup(kSpace, BlockHash{}, env.chain.hashes, ours.spans);
        ok = ok && result.ok() && result->hits == kBlocks;
      },
      "mac_ns", [&] { ok = UnauthenticatedLookup(c, theirs) && ok; }, "xxh3_ns");
  if (!ok) state.SkipWithError("a lookup missed");
  redisFree(c);
}
BENCHMARK(BM_LookupVsUnauthenticated)->Arg(0)->Arg(1)->ArgName("tcp")->UseRealTime();

// The checks alone, no I/O, on the 32 stored values held in memory: the store's (each key
// derived, each value's tag checked) against format 1's (an xxh3-64 of each payload),
// alternating call by call. mac_ns - xxh3_ns is what the MAC adds to one lookup's CPU time;
// beside BM_StoreLookup's time per lookup it is the MAC's share, free of the network's noise.
void BM_ChecksVsXxh3(benchmark::State& state) {
  Env& env = Env::Get();
  std::vector<std::string> values;
  for (const std::string& key : env.keys) {
    auto value = env.server->Command({"GET", key});
    KVPOOL_CHECK_OK(value.status());
    values.emplace_back((*value)->str, (*value)->len);
  }
  bool ok = true;
  bench::Interleave(
      state,
      [&] {
        const SpaceKeys keys(Secret(), kSpace, KeySlotting::kNamespace);
        for (int i = 0; i < kBlocks; ++i) {
          const BlockExpectation expect{.layout_fingerprint = kSpace.layout_fingerprint,
                                        .hash = env.chain.hashes[i],
                                        .parent = nullptr,
                                        .payload_bytes = kBlockBytes};
          BlockHeader header;
          std::span<const std::byte> payload;
          ok = ok && CheckBlockValue(Secret(), keys.Key(env.chain.hashes[i]), values[i], expect,
                                     &header, &payload) == BlockCheck::kOk;
        }
      },
      "mac_ns",
      [&] {
        for (const std::string& value : values) {
          benchmark::DoNotOptimize(
              XXH3_64bits(value.data() + kBlockHeaderBytes, value.size() - kBlockHeaderBytes));
        }
      },
      "xxh3_ns");
  if (!ok) state.SkipWithError("a stored value failed its check");
}
BENCHMARK(BM_ChecksVsXxh3)->UseRealTime();

}  // namespace
}  // namespace kvpool::tier

int main(int argc, char** argv) {
  if (kvpool::tier::testing::RedisServerBinary().empty()) {
    std::fprintf(stderr, "redis_tier_bench: redis-server is not installed; nothing to measure\n");
    return 0;
  }
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {
          {"Lookup 32 x 256 KiB, Unix socket / bare hiredis GET", "BM_StoreLookup/tcp:0/real_time",
           "BM_HiredisPipelinedGet/tcp:0/copy:0/real_time"},
          {"Lookup 32 x 256 KiB, TCP loopback / bare hiredis GET", "BM_StoreLookup/tcp:1/real_time",
           "BM_HiredisPipelinedGet/tcp:1/copy:0/real_time"},
          {"Lookup 32 x 256 KiB, Unix socket / bare GET + memcpy", "BM_StoreLookup/tcp:0/real_time",
           "BM_HiredisPipelinedGet/tcp:0/copy:1/real_time"},
          {"Lookup 32 x 256 KiB, TCP loopback / bare GET + memcpy",
           "BM_StoreLookup/tcp:1/real_time", "BM_HiredisPipelinedGet/tcp:1/copy:1/real_time"},
          // Issue 31: a load at 0.9 of bare pipelined GETs of the same values, interleaved.
          {.label = "Lookup / bare hiredis GET, Unix socket (interleaved)",
           .ours = "BM_LookupVsBareGet/tcp:0/real_time",
           .baseline = "BM_LookupVsBareGet/tcp:0/real_time",
           .target = 0.9,
           .ours_counter = "lookup_ns",
           .baseline_counter = "get_ns"},
          {.label = "Lookup / bare hiredis GET, TCP loopback (interleaved)",
           .ours = "BM_LookupVsBareGet/tcp:1/real_time",
           .baseline = "BM_LookupVsBareGet/tcp:1/real_time",
           .target = 0.9,
           .ours_counter = "lookup_ns",
           .baseline_counter = "get_ns"},
          // The MAC's cost to a promotion (issue 27: at most 10 %), in one run, interleaved.
          {.label = "Lookup with MAC / GET + xxh3 + memcpy, Unix socket (interleaved)",
           .ours = "BM_LookupVsUnauthenticated/tcp:0/real_time",
           .baseline = "BM_LookupVsUnauthenticated/tcp:0/real_time",
           .target = 0.9,
           .ours_counter = "mac_ns",
           .baseline_counter = "xxh3_ns"},
          {.label = "Lookup with MAC / GET + xxh3 + memcpy, TCP loopback (interleaved)",
           .ours = "BM_LookupVsUnauthenticated/tcp:1/real_time",
           .baseline = "BM_LookupVsUnauthenticated/tcp:1/real_time",
           .target = 0.9,
           .ours_counter = "mac_ns",
           .baseline_counter = "xxh3_ns"},
          {.label = "checks of 32 values in memory: keys + tags / xxh3 (interleaved)",
           .ours = "BM_ChecksVsXxh3/real_time",
           .baseline = "BM_ChecksVsXxh3/real_time",
           .ours_counter = "mac_ns",
           .baseline_counter = "xxh3_ns"},
      });
}
