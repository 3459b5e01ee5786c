// Every device against the CPU's kernels and the Device contract: WriteKv, CopyBlocks and
// FillBlocks byte-exact (the poison of every dtype as the CPU's); fences, StreamWait and host
// tasks across the two streams; arena export. Decode and prefill parity, which every backend
// runs, are decode_parity_test.cc and prefill_parity_test.cc.
//
// One case table run on every backend that loads (the CPU always; CUDA where a GPU is), as the
// decode and prefill parity tests are. Where the devices' contracts differ on a caller's bug, a
// case says so: a block or slot past the pool is skipped by CUDA's kernels and refused by the
// CPU's (an error that then sticks to the device). Devices are made through the registry as
// kvpoold makes them; without a GPU the CUDA cases skip, saying why.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "kernels/device.h"
#include "kvpool/util/status_macros.h"
#include "tests/kernels/backend_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels {
namespace {

using test_util::Download;
using test_util::NormalizedError;
using test_util::RandomValues;
using test_util::Upload;

bool IsNaN(const char* element, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, element, 4);
      return std::isnan(f);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, element, 2);
      return std::isnan(F16ToFloat(h));
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, element, 2);
      return std::isnan(BF16ToFloat(h));
    }
    case DType::kFp8E4M3:
    case DType::kInt8:
      return static_cast<uint8_t>(*element) == kPoison8;
  }
  return false;
}

std::vector<int32_t> Iota(int32_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), 0);
  return out;
}

// A small pool whose every byte the tests predict on the host.
class BlockOpsTest : public test_util::BackendTest<> {
 protected:
  static constexpr PoolLayout kLayout{.block_size = 4,
                                      .num_layers = 2,
                                      .num_kv_heads = 2,
                                      .head_dim = 8,
                                      .dtype = DType::kBF16,
                                      .num_blocks = 6};

  // Sets every byte of the arena (`bytes` is its size).
  void Reset(const std::vector<char>& bytes) {
    auto fence = device().CopyToDevice(StreamId::kTransfer, arena_->base(), bytes.data(),
                                       static_cast<int64_t>(bytes.size()));
    ASSERT_TRUE(fence.ok() && device().Synchronize(*fence).ok());
  }
  // The arena once everything queued on either stream is done (Download reads on the compute
  // stream, which is not ordered after the transfer stream's copies and fills).
  std::vector<char> Read() {
    EXPECT_TRUE(device().SynchronizeAll().ok());
    auto bytes = Download<char>(device(), arena_->base(), static_cast<size_t>(arena_->bytes()));
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *bytes : std::vector<char>();
  }
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    // Room for the f32 variant of the layout (twice the bf16 size).
    ASSERT_OK_AND_MOVE(arena_, device().CreateArena(2 * kLayout.arena_bytes()));
    pool_ = {arena_->base(), kLayout};
  }

  std::unique_ptr<Arena> arena_;
  KvPoolView pool_;
};

TEST_P(BlockOpsTest, WriteKvScattersRowsAndSkipsPadding) {
  std::vector<char> expected(static_cast<size_t>(arena_->bytes()), 1);
  Reset(expected);
  const int64_t values = kLayout.num_kv_heads * kLayout.head_dim;
  const int64_t row = values * 2;
  std::mt19937 rng(7);
  // bf16-representable values, so the rows stored are exactly these.
  std::vector<float> k =
      test_util::Widen(RandomValues(3 * values, DType::kBF16, &rng), DType::kBF16);
  std::vector<float> v =
      test_util::Widen(RandomValues(3 * values, DType::kBF16, &rng), DType::kBF16);
  // block 1 offset 1, padding, block 5 offset 3. (A slot past the pool is the caller's bug, and
  // devices differ on it: the CPU's kernel refuses the call, and the error sticks to the device,
  // CUDA's skips the row; docs/backends.md.)
  const std::vector<int64_t> slots = {5, -1, 23};
  ASSERT_OK_AND_MOVE(auto k_buffer, Upload(device(), k));
  ASSERT_OK_AND_MOVE(auto v_buffer, Upload(device(), v));
  ASSERT_OK_AND_MOVE(auto slot_buffer, Upload(device(), slots));
  auto fence = device().WriteKv(StreamId::kCompute, pool_,
                                {.layer = 1,
                                 .num_tokens = 3,
                                 .k = static_cast<const float*>(k_buffer->data()),
                                 .v = static_cast<const float*>(v_buffer->data()),
                                 .slots = static_cast<const int64_t*>(slot_buffer->data())});
  ASSERT_TRUE(fence.ok()) << fence.status();
  const KvPoolView host{expected.data(), kLayout};
  auto store = [&](char* dst, const float* src) {
    for (int64_t i = 0; i < values; ++i) {
      const uint16_t h = FloatToBF16(src[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  };
  store(host.k(1, 1) + 1 * row, k.data());
  store(host.v(1, 1) + 1 * row, v.data());
  store(host.k(5, 1) + 3 * row, k.data() + 2 * values);
  store(host.v(5, 1) + 3 * row, v.data() + 2 * values);
  EXPECT_EQ(Read(), expected);
}

TEST_P(BlockOpsTest, CopyBlocksIsByteExact) {
  std::vector<char> expected(static_cast<size_t>(arena_->bytes()));
  std::mt19937 rng(11);
  for (char& b : expected) b = static_cast<char>(rng());
  Reset(expected);
  // (2 -> 4), (0 -> 5), and on CUDA a pair naming block 9, which its kernel skips (the CPU's
  // refuses such a call, as WriteKv's above).
  std::vector<int32_t> pairs = {2, 4, 0, 5};
  if (backend() == "cuda") pairs.insert(pairs.end(), {9, 1});
  ASSERT_OK_AND_MOVE(auto pair_buffer, Upload(device(), pairs));
  ASSERT_TRUE(device()
                  .CopyBlocks(StreamId::kTransfer, pool_,
                              {.num_pairs = static_cast<int32_t>(pairs.size() / 2),
                               .pairs = static_cast<const int32_t*>(pair_buffer->data())})
                  .ok());
  const int64_t bytes = kLayout.block_bytes();
  std::memcpy(expected.data() + 4 * bytes, expected.data() + 2 * bytes, static_cast<size_t>(bytes));
  std::memcpy(expected.data() + 5 * bytes, expected.data() + 0 * bytes, static_cast<size_t>(bytes));
  EXPECT_EQ(Read(), expected);
}

TEST_P(BlockOpsTest, FillBlocksZeroesOrPoisonsWholeBlocksOfEveryDType) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(dtype));
    PoolLayout layout = kLayout;
    layout.dtype = dtype;
    const int64_t bytes = layout.block_bytes();
    const KvPoolView pool{arena_->base(), layout};  // f32 blocks use more of the arena
    std::vector<char> expected(static_cast<size_t>(arena_->bytes()), 5);
    Reset(expected);
    const std::vector<int32_t> blocks = {1, 3};
    ASSERT_OK_AND_MOVE(auto block_buffer, Upload(device(), blocks));
    const auto* ids = static_cast<const int32_t*>(block_buffer->data());
    ASSERT_TRUE(device()
                    .FillBlocks(StreamId::kTransfer, pool,
                                {.num_blocks = 1, .blocks = ids, .pattern = FillPattern::kZero})
                    .ok());
    ASSERT_TRUE(
        device()
            .FillBlocks(StreamId::kTransfer, pool,
                        {.num_blocks = 1, .blocks = ids + 1, .pattern = FillPattern::kPoison})
            .ok());
    const std::vector<char> got = Read();
    ASSERT_EQ(got.size(), expected.size());
    std::memset(expected.data() + 1 * bytes, 0, static_cast<size_t>(bytes));
    // The CPU's poison of the same block is the expected bytes; every value reads NaN.
    const int32_t poisoned[] = {3};
    const KvPoolView host{expected.data(), layout};
    ASSERT_TRUE(cpu::FillBlocks(
                    host, {.num_blocks = 1, .blocks = poisoned, .pattern = FillPattern::kPoison})
                    .ok());
    const int32_t size = DTypeSize(dtype);
    const int64_t data = layout.block_size * layout.row_bytes(0, KvSide::kK);
    for (int64_t i = 0; i < data / size; ++i) {
      ASSERT_TRUE(IsNaN(got.data() + 3 * bytes + i * size, dtype)) << "element " << i;
    }
    EXPECT_EQ(got, expected);
  }
}

class DeviceFenceTest : public test_util::BackendTest<> {};

TEST_P(DeviceFenceTest, ValuesCountPerStreamAndPassAfterSynchronize) {
  Device& d = device();
  const Fence start_c = d.LastFence(StreamId::kCompute);
  const Fence start_t = d.LastFence(StreamId::kTransfer);
  EXPECT_TRUE(d.HasPassed(Fence{0, 0}));
  EXPECT_FALSE(d.HasPassed(Fence{start_c.timeline, start_c.value + 1}));
  std::vector<char> host(1 << 20, 1);
  ASSERT_OK_AND_MOVE(auto buffer, d.AllocateBuffer(1 << 20));
  ASSERT_OK_AND_MOVE(Fence a,
                     d.CopyToDevice(StreamId::kCompute, buffer->data(), host.data(), 1 << 20));
  ASSERT_OK_AND_MOVE(Fence b, d.EnqueueHostTask(StreamId::kCompute, [] {}));
  ASSERT_OK_AND_MOVE(Fence t, d.EnqueueHostTask(StreamId::kTransfer, [] {}));
  EXPECT_EQ(a.timeline, 0u);
  EXPECT_EQ(a.value, start_c.value + 1);
  EXPECT_EQ(b.value, start_c.value + 2);
  EXPECT_EQ(t.timeline, 1u);
  EXPECT_EQ(t.value, start_t.value + 1);
  EXPECT_EQ(d.LastFence(StreamId::kCompute).value, b.value);
  ASSERT_TRUE(d.Synchronize(b).ok());
  EXPECT_TRUE(d.HasPassed(a));
  EXPECT_TRUE(d.HasPassed(b));
  ASSERT_TRUE(d.SynchronizeAll().ok());
  EXPECT_TRUE(d.HasPassed(t));
  EXPECT_EQ(d.Synchronize(Fence{0, b.value + 5}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.Synchronize(Fence{7, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(d.HasPassed(Fence{7, 1}));
}

TEST_P(DeviceFenceTest, StreamWaitOrdersComputeAfterTransfer) {
  Device& d = device();
  // A large fill keeps the transfer stream busy long after the compute stream's copy would
  // have run without the wait.
  const PoolLayout layout{.block_size = 64,
                          .num_layers = 32,
                          .num_kv_heads = 8,
                          .head_dim = 128,
                          .dtype = DType::kBF16,
                          .num_blocks = 128};  // 4 MiB blocks, 512 MiB
  ASSERT_OK_AND_MOVE(auto arena, d.CreateArena(layout.arena_bytes()));
  const KvPoolView pool{arena->base(), layout};
  ASSERT_OK_AND_MOVE(auto ids, Upload(d, Iota(layout.num_blocks)));
  const auto* blocks = static_cast<const int32_t*>(ids->data());
  ASSERT_TRUE(
      d.FillBlocks(StreamId::kTransfer, pool, {.num_blocks = layout.num_blocks, .blocks = blocks})
          .ok());
  ASSERT_TRUE(d.SynchronizeAll().ok());

  for (int round = 0; round < 3; ++round) {
    const FillPattern pattern = round % 2 == 0 ? FillPattern::kPoison : FillPattern::kZero;
    ASSERT_OK_AND_MOVE(
        Fence filled,
        d.FillBlocks(StreamId::kTransfer, pool,
                     {.num_blocks = layout.num_blocks, .blocks = blocks, .pattern = pattern}));
    ASSERT_TRUE(d.StreamWait(StreamId::kCompute, filled).ok());
    std::vector<uint16_t> tail(256);
    const char* last = pool.v(layout.num_blocks - 1, layout.num_layers - 1) +
                       layout.chunk_bytes(layout.num_layers - 1, KvSide::kV) - 512;
    ASSERT_OK_AND_MOVE(Fence copied, d.CopyToHost(StreamId::kCompute, tail.data(), last, 512));
    ASSERT_TRUE(d.Synchronize(copied).ok());
    EXPECT_TRUE(d.HasPassed(filled));  // ordered before `copied`, on the other stream
    for (uint16_t h : tail) {
      ASSERT_EQ(h, pattern == FillPattern::kPoison ? kPoisonBF16 : 0) << "round " << round;
    }
  }
}

TEST_P(DeviceFenceTest, HostTasksRunInStreamOrderAndMayNotCallCuda) {
  Device& d = device();
  std::mutex mu;
  std::vector<int> order;
  bool earlier_passed = false;
  absl::Status sync_inside, enqueue_inside;
  const uint64_t first = d.LastFence(StreamId::kCompute).value + 1;
  ASSERT_TRUE(d.EnqueueHostTask(StreamId::kCompute, [&] {
                 std::lock_guard<std::mutex> lock(mu);
                 order.push_back(1);
               }).ok());
  ASSERT_OK_AND_MOVE(Fence second, d.EnqueueHostTask(StreamId::kCompute, [&] {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(2);
    earlier_passed = d.HasPassed(Fence{0, first});
    sync_inside = d.Synchronize(Fence{0, first + 1});  // its own fence: would deadlock
    enqueue_inside = d.EnqueueHostTask(StreamId::kTransfer, [] {}).status();
  }));
  ASSERT_TRUE(d.Synchronize(second).ok());
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_TRUE(earlier_passed);
  EXPECT_EQ(sync_inside.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(enqueue_inside.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(d.status().ok());
}

TEST_P(DeviceFenceTest, BadArgumentsEnqueueNothing) {
  Device& d = device();
  const PoolLayout layout{.block_size = 16, .num_kv_heads = 8, .head_dim = 128, .num_blocks = 4};
  ASSERT_OK_AND_MOVE(auto arena, d.CreateArena(layout.arena_bytes()));
  const KvPoolView pool{arena->base(), layout};
  const Fence before = d.LastFence(StreamId::kCompute);
  EXPECT_EQ(d.WriteKv(StreamId::kCompute, pool, {.layer = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_MOVE(auto scratch, d.AllocateBuffer(4096));
  const auto* ints = static_cast<const int32_t*>(scratch->data());
  auto* floats = static_cast<float*>(scratch->data());
  // 2048 tokens span several partitions on a device that splits keys (split-K needs workspace;
  // none is given). The CPU's decode needs none.
  if (d.DecodeWorkspaceBytes(layout, 8, 32, 2048) > 0) {
    EXPECT_EQ(d.PagedAttentionDecode(StreamId::kCompute, pool,
                                     {.num_seqs = 8,
                                      .num_q_heads = 32,
                                      .scale = 1,
                                      .q = floats,
                                      .out = floats,
                                      .block_tables = ints,
                                      .table_stride = 128,
                                      .seq_lens = ints,
                                      .max_seq_len = 2048})
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(d.LastFence(StreamId::kCompute).value, before.value);
}

TEST_P(DeviceFenceTest, ArenaExportsAMappableHandle) {
  ASSERT_OK_AND_MOVE(auto arena, device().CreateArena(3 << 20));
  ASSERT_OK_AND_MOVE(ArenaExport exported, arena->Export());
  EXPECT_EQ(exported.bytes, 3 << 20);
  EXPECT_GE(exported.mapped_bytes, exported.bytes);
  EXPECT_EQ(exported.device_ordinal, 0);
  if (exported.kind == ArenaExport::Kind::kMemfd) {  // the CPU's: the arena's own pages
    ASSERT_TRUE(exported.fd.valid());
    void* p = mmap(nullptr, static_cast<size_t>(exported.mapped_bytes), PROT_READ, MAP_SHARED,
                   exported.fd.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    munmap(p, static_cast<size_t>(exported.mapped_bytes));
  } else if (exported.kind == ArenaExport::Kind::kCudaVmm) {
    ASSERT_TRUE(exported.fd.valid());
    EXPECT_NE(fcntl(exported.fd.get(), F_GETFD), -1);
  } else {
    EXPECT_EQ(exported.kind, ArenaExport::Kind::kCudaIpc);
    EXPECT_EQ(exported.ipc_handle.size(), 64u);  // sizeof(cudaIpcMemHandle_t)
  }
}

// A fresh arena reads as zeros, even where the driver hands back a freed arena's memory: the
// pool never scrubs a block's first hand-out (its last owner is "nobody"), so stale bytes of an
// earlier arena (another tenant's, another process's) must not survive into a new one.
TEST_P(DeviceFenceTest, ANewArenaIsZeroedWhateverItsMemoryHeldBefore) {
  constexpr int64_t kBytes = 8 << 20;
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK_AND_MOVE(auto arena, device().CreateArena(kBytes));
    ASSERT_OK_AND_MOVE(std::vector<char> bytes,
                       Download<char>(device(), arena->base(), static_cast<size_t>(kBytes)));
    const auto nonzero = std::count_if(bytes.begin(), bytes.end(), [](char c) { return c != 0; });
    EXPECT_EQ(nonzero, 0) << "round " << round;
    const std::vector<char> garbage(static_cast<size_t>(kBytes), static_cast<char>(0xab));
    auto fence = device().CopyToDevice(StreamId::kTransfer, arena->base(), garbage.data(), kBytes);
    ASSERT_TRUE(fence.ok() && device().Synchronize(*fence).ok());
  }  // the second round's arena is likely the first one's memory again
}

INSTANTIATE_TEST_SUITE_P(Every, BlockOpsTest, ::testing::Values("cpu", "cuda"),
                         test_util::BackendName());
INSTANTIATE_TEST_SUITE_P(Every, DeviceFenceTest, ::testing::Values("cpu", "cuda"),
                         test_util::BackendName());

}  // namespace
}  // namespace kvpool::kernels
