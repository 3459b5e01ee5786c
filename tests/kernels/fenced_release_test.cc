// Fenced release (DESIGN.md §4.4) on the CPU device, through the real KvCacheManager.
//
// The scenario real engines got wrong: a block's last use (here a slow write on the transfer
// stream) is still in flight when the block is released; the pool hands it to a new sequence,
// whose fresh write on the compute stream is then overwritten by the old one. The transfer write
// is held back until the compute write has happened, so without the fence the stale overwrite is
// certain, not a matter of timing.

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "kernels/cpu_device.h"
#include "kvpool/kv_cache_manager.h"

namespace kvpool::kernels {
namespace {

constexpr SessionId kSession(1);
constexpr NamespaceId kNs(1);

// The test-only hook: claims every fence has passed, i.e. release without fencing.
class FencesIgnored final : public FenceObserver {
 public:
  bool HasPassed(Fence) const override { return true; }
};

class FencedReleaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    arena_ = *device_.CreateArena(layout_.arena_bytes());
    pool_ = KvPoolView{arena_->base(), layout_};
  }

  std::unique_ptr<KvCacheManager> Manager(const FenceObserver* fences) {
    return *KvCacheManager::Create({.block_size = layout_.block_size,
                                    .num_blocks = layout_.num_blocks,
                                    .max_blocks_per_seq = 1,
                                    .fences = fences});
  }

  SequenceId Alloc(KvCacheManager* cache, BlockId* block) {
    DevicePlan plan;
    const AllocateResult r = *cache->Allocate(kSession, {.ns = kNs, .num_tokens = 1}, &plan);
    *block = cache->Find(r.sequence)->table[0];
    return r.sequence;
  }

  // Runs `iterations` rounds; returns how many read back stale data.
  int64_t Run(KvCacheManager* cache, int64_t iterations) {
    const int64_t bytes = layout_.block_bytes();
    std::atomic<int64_t> released{-1};  // the transfer write waits for the compute write
    int64_t stale = 0;
    for (int64_t i = 0; i < iterations; ++i) {
      BlockId old_block;
      const SequenceId old_seq = Alloc(cache, &old_block);
      char* old_bytes = pool_.k(old_block.value(), 0);
      const absl::StatusOr<Fence> slow = device_.EnqueueHostTask(StreamId::kTransfer, [&, i] {
        while (released.load(std::memory_order_acquire) < i) {
        }
        std::memset(old_bytes, 0xAA, static_cast<size_t>(bytes));  // the old owner's payload
      });
      EXPECT_TRUE(cache->MarkInFlight({&old_block, 1}, *slow).ok());
      EXPECT_TRUE(cache->Free(kSession, old_seq).ok());

      BlockId new_block;
      const SequenceId new_seq = Alloc(cache, &new_block);
      char* new_bytes = pool_.k(new_block.value(), 0);
      const Fence fresh = *device_.EnqueueHostTask(StreamId::kCompute, [&, i] {
        std::memset(new_bytes, 0x55, static_cast<size_t>(bytes));  // the new owner's payload
        released.store(i, std::memory_order_release);
      });
      EXPECT_TRUE(device_.Synchronize(fresh).ok());
      EXPECT_TRUE(device_.Synchronize(*slow).ok());
      stale += new_bytes[0] != 0x55 || new_bytes[bytes - 1] != 0x55;
      EXPECT_TRUE(cache->Free(kSession, new_seq).ok());
    }
    return stale;
  }

  CpuDevice device_{1};
  PoolLayout layout_{.block_size = 4,
                     .num_layers = 1,
                     .num_kv_heads = 1,
                     .head_dim = 8,
                     .dtype = DType::kF32,
                     .num_blocks = 8};
  std::unique_ptr<Arena> arena_;
  KvPoolView pool_;
};

// The precondition the fence exists for: releasing a block does not clear it.
TEST_F(FencedReleaseTest, ReleaseDoesNotZeroContent) {
  std::unique_ptr<KvCacheManager> cache = Manager(&device_);
  BlockId block;
  const SequenceId seq = Alloc(cache.get(), &block);
  std::memset(pool_.k(block.value(), 0), 0x3C, static_cast<size_t>(layout_.block_bytes()));
  ASSERT_TRUE(cache->Free(kSession, seq).ok());
  EXPECT_EQ(cache->pool().state(block), BlockState::kFree);
  EXPECT_EQ(pool_.k(block.value(), 0)[0], 0x3C);  // stale bytes stay until overwritten
}

TEST_F(FencedReleaseTest, InFlightWriteNeverLandsOnTheNextOwner) {
  std::unique_ptr<KvCacheManager> cache = Manager(&device_);
  int64_t iterations = 100'000;
  if (const char* env = std::getenv("KVPOOL_RANDOM_OPS")) iterations = std::atoll(env) / 10;
  EXPECT_EQ(Run(cache.get(), iterations), 0);
  EXPECT_GT(cache->stats().pool.retired, 0u);
  EXPECT_TRUE(cache->CheckInvariants().ok());
}

// The same scenario with the fence disabled must catch stale data: the test can fail.
TEST_F(FencedReleaseTest, WithoutTheFenceTheStaleWriteIsCaught) {
  FencesIgnored ignored;
  std::unique_ptr<KvCacheManager> cache = Manager(&ignored);
  EXPECT_EQ(Run(cache.get(), 1000), 1000);
}

}  // namespace
}  // namespace kvpool::kernels
