#include "kernels/cpu_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/stream_copy.h"
#include "kernels/plan_executor.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels {
namespace {

TEST(CpuDeviceTest, ArenaIsASealedSharedMemfd) {
  CpuDevice device(1);
  absl::StatusOr<std::unique_ptr<Arena>> arena = device.CreateArena(1 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  static_cast<char*>((*arena)->base())[100] = 42;
  absl::StatusOr<ArenaExport> exported = (*arena)->Export();
  ASSERT_TRUE(exported.ok());
  EXPECT_EQ(exported->kind, ArenaExport::Kind::kMemfd);
  EXPECT_EQ(exported->bytes, 1 << 20);
  // What another process does with the descriptor: map it and see the same bytes.
  char* view = static_cast<char*>(
      mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, exported->fd.get(), 0));
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(view[100], 42);
  view[200] = 7;
  EXPECT_EQ(static_cast<char*>((*arena)->base())[200], 7);
  EXPECT_NE(ftruncate(exported->fd.get(), 4096), 0);  // sealed: cannot shrink under a mapping
  munmap(view, 1 << 20);
  EXPECT_EQ(device.CreateArena(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuDeviceTest, StreamsRunInOrderAndFencesCountUp) {
  CpuDevice device(1);
  std::vector<int> order;
  Fence last;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<Fence> f =
        device.EnqueueHostTask(StreamId::kTransfer, [&order, i] { order.push_back(i); });
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->timeline, 1u);
    EXPECT_EQ(f->value, static_cast<uint64_t>(i + 1));
    last = *f;
  }
  ASSERT_TRUE(device.Synchronize(last).ok());
  EXPECT_TRUE(device.HasPassed(last));
  std::vector<int> expected(100);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  EXPECT_EQ(device.LastFence(StreamId::kTransfer).value, 100u);
  EXPECT_TRUE(device.HasPassed(Fence{0, 0}));
  EXPECT_EQ(device.Synchronize(Fence{1, 500}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuDeviceTest, StreamWaitOrdersOneStreamAfterAnother) {
  CpuDevice device(1);
  absl::Notification gate;
  std::atomic<int> step{0};
  const Fence compute = *device.EnqueueHostTask(StreamId::kCompute, [&] {
    gate.WaitForNotification();
    step.store(1);
  });
  ASSERT_TRUE(device.StreamWait(StreamId::kTransfer, compute).ok());
  int seen = -1;
  const Fence transfer = *device.EnqueueHostTask(StreamId::kTransfer, [&] { seen = step.load(); });
  EXPECT_FALSE(device.HasPassed(transfer));  // held behind the compute stream
  gate.Notify();
  ASSERT_TRUE(device.Synchronize(transfer).ok());
  EXPECT_EQ(seen, 1);
  EXPECT_TRUE(device.HasPassed(compute));
}

// Destroying the device while one stream's worker waits on another (a StreamWait in flight):
// every queue drains before any stream is freed. The streams used to go one by one, so the
// compute stream was freed while the transfer stream's worker was still returning from its
// wait on it (ASan: a heap-use-after-free in WaitFor, seen once in CI from tiers_test).
TEST(CpuDeviceTest, DestroyingTheDeviceWhileOneStreamWaitsOnAnotherFreesNoStreamInUse) {
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(round);
    std::atomic<bool> ran{false};
    auto device = std::make_unique<CpuDevice>(1);
    const Fence compute =
        *device->EnqueueHostTask(StreamId::kCompute, [] { absl::SleepFor(absl::Milliseconds(2)); });
    ASSERT_TRUE(device->StreamWait(StreamId::kTransfer, compute).ok());
    ASSERT_TRUE(device->EnqueueHostTask(StreamId::kTransfer, [&] { ran = true; }).ok());
    device.reset();  // drains both queues
    EXPECT_TRUE(ran);
  }
}

// A thread waiting for a copy runs it itself when the stream is idle (no wake-up of the stream's
// worker to start it, nor of the waiter when it ends), but never ahead of what the stream runs
// first, and never a host task.
TEST(CpuDeviceTest, AWaiterRunsTheCopyItWaitsForOnlyInItsTurn) {
  CpuDevice device(1);
  const std::vector<int32_t> src(4096, 2);
  std::vector<int32_t> dst(4096, 0);
  const int64_t bytes = static_cast<int64_t>(src.size() * sizeof(int32_t));
  // Behind a host task that has not run yet: the waiter waits, then the copy lands after it.
  absl::Notification gate;
  ASSERT_TRUE(device
                  .EnqueueHostTask(StreamId::kTransfer,
                                   [&] {
                                     gate.WaitForNotification();
                                     std::fill(dst.begin(), dst.end(), 1);
                                   })
                  .ok());
  const Fence copied = *device.CopyToDevice(StreamId::kTransfer, dst.data(), src.data(), bytes);
  std::thread waiter([&] { EXPECT_TRUE(device.Synchronize(copied).ok()); });
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(device.HasPassed(copied));
  EXPECT_EQ(dst[0], 0);
  gate.Notify();
  waiter.join();
  EXPECT_EQ(dst, src);  // the copy ran after the host task's fill

  // An idle stream: the copy does not wake the worker, so the waiter always takes it.
  const uint64_t before = device.tasks_run_by_waiters();
  for (int i = 0; i < 200; ++i) {
    const Fence f = *device.CopyToDevice(StreamId::kTransfer, dst.data(), src.data(), bytes);
    ASSERT_TRUE(device.Synchronize(f).ok());
  }
  EXPECT_EQ(device.tasks_run_by_waiters(), before + 200);
  // Host tasks are never run by a waiter.
  const uint64_t copies = device.tasks_run_by_waiters();
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(device.Synchronize(*device.EnqueueHostTask(StreamId::kTransfer, [] {})).ok());
  }
  EXPECT_EQ(device.tasks_run_by_waiters(), copies);
}

// Copies and fills queued on an idle stream wake nobody (lazy submission, cpu_device.h), yet every
// way of learning that one has run gets it run: a wait (it runs on the waiter's thread), a poll
// of its fence, a task of another kind behind it, another stream's StreamWait, the device's end.
TEST(CpuDeviceTest, LazyCopiesRunForWhoeverWaitsPollsOrQueuesBehindThem) {
  const std::vector<int32_t> src(4096, 3);
  const int64_t bytes = static_cast<int64_t>(src.size() * sizeof(int32_t));
  // Polled: no thread waits, yet HasPassed turns true (the worker runs it).
  {
    CpuDevice device(1);
    std::vector<int32_t> dst(src.size(), 0);
    const Fence f = *device.CopyToDevice(StreamId::kTransfer, dst.data(), src.data(), bytes);
    absl::SleepFor(absl::Milliseconds(20));  // the worker had time, and was not woken
    EXPECT_EQ(dst[0], 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!device.HasPassed(f) && absl::Now() < deadline) absl::SleepFor(absl::Microseconds(50));
    EXPECT_TRUE(device.HasPassed(f));
    EXPECT_EQ(dst, src);
    EXPECT_EQ(device.tasks_run_by_waiters(), 0u);
  }
  // A host task behind it on its stream, or on another stream after a StreamWait for it: the
  // copy, then the task, run with nobody waiting or polling.
  for (const bool other_stream : {false, true}) {
    SCOPED_TRACE(other_stream);
    CpuDevice device(1);
    std::vector<int32_t> dst(src.size(), 0);
    const Fence f = *device.CopyToDevice(StreamId::kTransfer, dst.data(), src.data(), bytes);
    if (other_stream) {
      ASSERT_TRUE(device.StreamWait(StreamId::kCompute, f).ok());
    }
    absl::Notification ran;
    int32_t seen = 0;
    ASSERT_TRUE(device
                    .EnqueueHostTask(other_stream ? StreamId::kCompute : StreamId::kTransfer,
                                     [&] {
                                       seen = dst.back();
                                       ran.Notify();
                                     })
                    .ok());
    ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_EQ(seen, 3);
  }
  // The device's end runs what nobody asked for.
  {
    std::vector<int32_t> dst(src.size(), 0);
    {
      CpuDevice device(1);
      ASSERT_TRUE(device.CopyToDevice(StreamId::kTransfer, dst.data(), src.data(), bytes).ok());
    }
    EXPECT_EQ(dst, src);
  }
}

// Copies and host tasks interleaved on one stream, waited for by several threads at random
// fences: every task runs once, in order, one at a time. Copy k fills region k of a log (64 KiB,
// long enough for another task to start beside it if one could); host task k checks that every
// region before it is filled, to its last word, and every one after still empty.
TEST(CpuDeviceTest, WaitersRunningCopiesKeepTheStreamsOrder) {
  CpuDevice device(1);
  constexpr int kTasks = 600;
  constexpr size_t kWords = 16384;
  const std::vector<int32_t> src(kWords, 7);
  std::vector<int32_t> log(kTasks * kWords, 0);
  auto region = [&](int k) { return log.data() + static_cast<size_t>(k) * kWords; };
  std::atomic<int> disorder{0};
  std::atomic<uint64_t> last{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> waiters;
  for (int t = 0; t < 3; ++t) {
    waiters.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(t));
      while (!done.load()) {
        const uint64_t upto = last.load();
        if (upto == 0) continue;
        const uint64_t value = std::uniform_int_distribution<uint64_t>(1, upto)(rng);
        EXPECT_TRUE(device.Synchronize(Fence{1, value}).ok());
      }
    });
  }
  for (int k = 0; k < kTasks; ++k) {
    absl::StatusOr<Fence> f;
    if (k % 3 == 2) {
      f = device.EnqueueHostTask(StreamId::kTransfer, [&, k] {
        for (int j = 0; j < kTasks; ++j) {
          if (j % 3 == 2) continue;
          const bool filled = region(j)[0] == 7 && region(j)[kWords - 1] == 7;
          const bool empty = region(j)[0] == 0 && region(j)[kWords - 1] == 0;
          if (j < k ? !filled : !empty) ++disorder;
        }
      });
    } else {
      f = device.CopyToDevice(StreamId::kTransfer, region(k), src.data(),
                              static_cast<int64_t>(kWords * sizeof(int32_t)));
    }
    ASSERT_TRUE(f.ok());
    last.store(f->value);
  }
  ASSERT_TRUE(device.Synchronize(Fence{1, last.load()}).ok());
  done.store(true);
  for (std::thread& w : waiters) w.join();
  EXPECT_EQ(disorder.load(), 0);
  for (int k = 0; k < kTasks; ++k) {
    if (k % 3 != 2) {
      EXPECT_EQ(region(k)[kWords - 1], 7) << k;
    }
  }
}

// Copies at and past the streaming threshold (kernels/internal/stream_copy.h) take another path
// than memcpy: an unaligned head, 64-byte chunks of streaming stores, a tail. Every byte of each
// size and alignment around those edges lands, and nothing outside the destination is touched.
TEST(CpuDeviceTest, LargeCopiesLandExactlyAtEveryAlignment) {
  CpuDevice device(1);
  constexpr size_t kMin = internal::kStreamCopyMinBytes;
  constexpr size_t kSlack = 128;
  std::vector<uint8_t> src(kMin + 4 * kSlack);
  std::iota(src.begin(), src.end(), uint8_t{7});
  for (const size_t bytes : {kMin - 1, kMin, kMin + 1, kMin + 63, kMin + 64, kMin + 65}) {
    for (const size_t dst_offset : {0, 1, 8, 15, 16, 33, 63}) {
      for (const size_t src_offset : {0, 3, 16}) {
        std::vector<uint8_t> dst(bytes + 2 * kSlack, 0xee);
        const Fence f = *device.CopyToDevice(StreamId::kTransfer, dst.data() + dst_offset,
                                             src.data() + src_offset, static_cast<int64_t>(bytes));
        ASSERT_TRUE(device.Synchronize(f).ok());
        SCOPED_TRACE(testing::Message()
                     << bytes << " bytes to +" << dst_offset << " from +" << src_offset);
        ASSERT_TRUE(std::all_of(dst.begin(), dst.begin() + static_cast<ptrdiff_t>(dst_offset),
                                [](uint8_t b) { return b == 0xee; }));
        ASSERT_TRUE(std::equal(src.begin() + static_cast<ptrdiff_t>(src_offset),
                               src.begin() + static_cast<ptrdiff_t>(src_offset + bytes),
                               dst.begin() + static_cast<ptrdiff_t>(dst_offset)));
        ASSERT_TRUE(std::all_of(dst.begin() + static_cast<ptrdiff_t>(dst_offset + bytes), dst.end(),
                                [](uint8_t b) { return b == 0xee; }));
      }
    }
  }
}

TEST(CpuDeviceTest, BadArgumentsEnqueueNothingAndKernelErrorsAreReported) {
  CpuDevice device(1);
  const PoolLayout layout{.block_size = 4,
                          .num_layers = 1,
                          .num_kv_heads = 1,
                          .head_dim = 8,
                          .dtype = DType::kF32,
                          .num_blocks = 4};
  std::unique_ptr<Arena> arena = *device.CreateArena(layout.arena_bytes());
  const KvPoolView pool{arena->base(), layout};
  const Fence before = device.LastFence(StreamId::kTransfer);
  EXPECT_EQ(device.FillBlocks(StreamId::kTransfer, pool, {.num_blocks = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device.LastFence(StreamId::kTransfer).value, before.value);
  // An out-of-range block is only found when the kernel runs: reported, not fatal.
  const std::vector<int32_t> blocks = {9};
  const Fence f =
      *device.FillBlocks(StreamId::kTransfer, pool, {.num_blocks = 1, .blocks = blocks.data()});
  EXPECT_EQ(device.Synchronize(f).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(device.status().ok());
}

TEST(CpuDeviceTest, PlanExecutorScrubsFillsAndCopies) {
  CpuDevice device(1);
  const PoolLayout layout{.block_size = 4,
                          .num_layers = 1,
                          .num_kv_heads = 1,
                          .head_dim = 8,
                          .dtype = DType::kBF16,
                          .num_blocks = 6};
  std::unique_ptr<Arena> arena = *device.CreateArena(layout.arena_bytes());
  char* base = static_cast<char*>(arena->base());
  for (int64_t i = 0; i < layout.arena_bytes(); ++i) base[i] = static_cast<char>(1 + i % 100);
  const KvPoolView pool{base, layout};
  PlanExecutor executor(&device, StreamId::kTransfer, pool, FillPolicy::kPoison);
  DevicePlan plan;
  plan.fills = {{BlockId(1), /*scrub=*/true}, {BlockId(2), /*scrub=*/false}};
  plan.copies = {{BlockId(3), BlockId(4)}};
  const absl::StatusOr<Fence> fence = executor.Execute(plan);
  ASSERT_TRUE(fence.ok()) << fence.status();
  ASSERT_TRUE(device.Synchronize(*fence).ok());
  const int64_t bytes = layout.block_bytes();
  for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(pool.k(1, 0)[i], 0);  // another tenant's: zeroed
  uint16_t h;
  std::memcpy(&h, pool.k(2, 0), 2);
  EXPECT_TRUE(std::isnan(BF16ToFloat(h)));  // policy fill
  EXPECT_EQ(std::memcmp(pool.k(3, 0), pool.k(4, 0), static_cast<size_t>(bytes)), 0);
  EXPECT_EQ(PlanExecutor::TouchedBlocks(plan).size(), 4u);
  EXPECT_EQ(executor.Execute(DevicePlan{})->value, 0u);
}

// A small pool and a PlanExecutor on its transfer stream.
struct ExecutorFixture {
  explicit ExecutorFixture(int32_t num_blocks)
      : layout{.block_size = 4,
               .num_layers = 1,
               .num_kv_heads = 1,
               .head_dim = 8,
               .dtype = DType::kBF16,
               .num_blocks = num_blocks},
        arena(*device.CreateArena(layout.arena_bytes())),
        executor(&device, StreamId::kTransfer, KvPoolView{arena->base(), layout},
                 FillPolicy::kZero) {}
  CpuDevice device{1};
  PoolLayout layout;
  std::unique_ptr<Arena> arena;
  PlanExecutor executor;
};

TEST(CpuDeviceTest, PlanExecutorRefusesOverlappingFillsAndCopies) {
  ExecutorFixture f(6);
  PlanExecutor& executor = f.executor;
  const DevicePlan overlapping[] = {
      {.copies = {{BlockId(1), BlockId(2)}}, .fills = {{BlockId(1), false}}},  // source filled
      {.copies = {{BlockId(3), BlockId(4)}}, .fills = {{BlockId(4), false}}},  // target filled
      {.copies = {{BlockId(3), BlockId(4)}, {BlockId(5), BlockId(4)}}},        // target twice
      {.fills = {{BlockId(1), true}, {BlockId(1), false}}},                    // filled twice
      {.copies = {{BlockId(3), BlockId(4)}, {BlockId(4), BlockId(5)}}},        // a target read
  };
  for (const DevicePlan& plan : overlapping) {
    EXPECT_EQ(executor.Execute(plan).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(executor.pending().value, 0u);  // nothing was enqueued
  // One source copied twice is fine (two forks of one shared block).
  const DevicePlan shared{.copies = {{BlockId(3), BlockId(4)}, {BlockId(3), BlockId(5)}}};
  const absl::StatusOr<Fence> fence = executor.Execute(shared);
  ASSERT_TRUE(fence.ok()) << fence.status();
  EXPECT_TRUE(f.device.Synchronize(*fence).ok());
}

TEST(CpuDeviceTest, PlanExecutorNeverWaitsForEarlierPlans) {
  ExecutorFixture f(8);
  CpuDevice& device = f.device;
  PlanExecutor& executor = f.executor;
  // The transfer stream is held up; plans queue behind it, each with its own staging.
  absl::Notification release;
  ASSERT_TRUE(
      device.EnqueueHostTask(StreamId::kTransfer, [&] { release.WaitForNotification(); }).ok());
  std::vector<Fence> fences;
  for (int32_t b = 0; b < 4; ++b) {
    const absl::StatusOr<Fence> fence = executor.Execute({.fills = {{BlockId(b), false}}});
    ASSERT_TRUE(fence.ok()) << fence.status();
    EXPECT_FALSE(device.HasPassed(*fence));
    fences.push_back(*fence);
  }
  release.Notify();
  for (const Fence& f : fences) EXPECT_TRUE(device.Synchronize(f).ok());
}

TEST(CpuDeviceTest, PrefillRunsOnTheComputeStreamWithItsWorkspace) {
  CpuDevice device(2);
  test_util::PrefillProblem p(
      {.block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 32}, 4, {{30, 20}, {0, 9}},
      /*seed=*/8);
  // A slice per kernel thread: what the kernel itself asks of a 2-thread pool.
  ASSERT_EQ(device.PrefillWorkspaceBytes(p.layout), cpu::PrefillWorkspaceBytes(p.layout, 2));
  std::vector<char> workspace(static_cast<size_t>(device.PrefillWorkspaceBytes(p.layout)));
  std::vector<float> out(p.q.size(), -1);
  PrefillArgs args = p.Args(out.data());
  args.workspace = workspace.data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size()) - 1;
  const Fence before = device.LastFence(StreamId::kCompute);
  EXPECT_EQ(device.PagedAttentionPrefill(StreamId::kCompute, p.pool(), args).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device.LastFence(StreamId::kCompute).value, before.value);
  args.workspace_bytes += 1;
  absl::StatusOr<Fence> done = device.PagedAttentionPrefill(StreamId::kCompute, p.pool(), args);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(device.Synchronize(*done).ok());
  bool nan = false;
  EXPECT_LT(test_util::NormalizedError(out, p.Reference(), &nan), 2e-5);
  EXPECT_FALSE(nan);
}

TEST(BackendTest, CpuAlwaysWorksAndCudaSaysWhyNot) {
  absl::StatusOr<std::unique_ptr<Device>> cpu = CreateDevice({.kind = BackendKind::kCpu});
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE((*cpu)->host_visible());
  absl::StatusOr<std::unique_ptr<Device>> any = CreateDevice({.kind = BackendKind::kAuto});
  ASSERT_TRUE(any.ok());
  absl::StatusOr<std::unique_ptr<Device>> cuda = CreateDevice({.kind = BackendKind::kCuda});
  if (!cuda.ok()) {  // no GPU here: the reason is spelled out
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(DescribeCudaBackend().empty());
  }
  EXPECT_FALSE(ParseBackend("tpu").ok());
}

}  // namespace
}  // namespace kvpool::kernels
