#pragma once

// The fixture of the RedisBlockStore tests against a real redis-server (redis_store_test,
// redis_security_test): a private server on a Unix socket per test, stores built on a manual
// clock under one deployment secret, and helpers to reach the stored values directly.

#include <hiredis/hiredis.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/tier/redis_harness.h"
#include "tests/tier/test_chain.h"
#include "tier/redis_block_store.h"

namespace kvpool::tier::testing {

inline constexpr int64_t kBlockBytes = 4096;
inline constexpr BlockSpace kSpace{.ns = NamespaceId(7), .layout_fingerprint = 0x5eed};

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::RedisServerBinary().empty()) GTEST_SKIP() << "redis-server is not installed";
    auto dir = testing::TempDir::Create("kvpool-redis-test");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    auto server = RedisServer::Start(dir_->path(), ServerOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  // The private server's options (a fixture may add redis-server flags).
  virtual RedisServer::Options ServerOptions() const { return {.unix_socket = true}; }

  std::unique_ptr<RedisBlockStore> NewStore(RedisTierOptions options,
                                            const DeploymentSecret& secret) {
    auto store = RedisBlockStore::Create(options, secret, &clock_);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }
  std::unique_ptr<RedisBlockStore> NewStore(RedisTierOptions options) {
    return NewStore(options, secret_);
  }
  std::unique_ptr<RedisBlockStore> NewStore() { return NewStore(server_->TierOptions()); }

  // Looks up the whole chain; returns the hit count, the buffers in `out`.
  int64_t LookupAll(RedisBlockStore& store, const TestChain& chain, LookupBuffers* out,
                    BlockSpace space) {
    auto result = store.Lookup(space, BlockHash{}, chain.hashes, out->spans);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->hits : -1;
  }

  // The key of block i as a store with `secret` writes it.
  static std::string KeyOf(const TestChain& chain, int i, const DeploymentSecret& secret) {
    return BlockKey(secret, chain.space, chain.hashes[i], KeySlotting::kNamespace);
  }
  std::string KeyOf(const TestChain& chain, int i) const { return KeyOf(chain, i, secret_); }
  // The value stored under `key`.
  std::string ValueAt(const std::string& key) const {
    auto value = server_->Command({"GET", key});
    EXPECT_TRUE(value.ok()) << value.status();
    return value.ok() && (*value)->type == REDIS_REPLY_STRING
               ? std::string((*value)->str, (*value)->len)
               : std::string();
  }

  const DeploymentSecret secret_ =
      DeploymentSecret::FromBytes("redis store test: the deployment secret of the daemons");
  ManualClock clock_;
  std::unique_ptr<testing::TempDir> dir_;
  std::unique_ptr<RedisServer> server_;
};

}  // namespace kvpool::tier::testing
