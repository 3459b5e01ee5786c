// The CUDA prefill kernel against the double-precision reference and the CPU prefill kernel,
// through the registry's device (backend_test_util.h):
// block sizes 1, 16 and 64, every dtype, ragged query counts over reused prefixes, several
// query/KV head groupings and head_dims up to the kernel's limit, over an arena whose every
// unused byte is NaN; a block id outside the pool turns only its sequence's rows NaN; bad
// arguments enqueue nothing. Without a GPU the cases skip, saying why.
//
// The shapes table runs on CUDA only: the CPU device takes about 10 s a case of it on a 2-core
// machine (cpu_prefill_test.cc holds the CPU kernel to the same reference on smaller shapes). The
// edge cases run on every device; the out-of-pool block is refused up front by the CPU, where
// CUDA poisons only that sequence's rows, so that case says so and skips on the CPU.

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "kernels/device.h"
#include "tests/kernels/backend_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels {
namespace {

using test_util::Download;
using test_util::NormalizedError;
using test_util::PrefillProblem;
using test_util::Upload;

struct Case {
  int32_t block_size;
  DType dtype;
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format("bs{}_{}_q{}kv{}_d{}", c.block_size, DTypeName(c.dtype), c.q_heads, c.kv_heads,
                     c.head_dim);
}

// (reused, new) tokens per sequence: as the CPU test, plus a chunk longer than one CTA's keys.
const std::vector<std::pair<int32_t, int32_t>> kShapes = {
    {0, 1}, {0, 37}, {16, 1}, {200, 70}, {63, 2}, {64, 64}, {1, 130}, {500, 13}, {1000, 200}};

// The problem's arena, tables and queries on the device; Run() returns the kernel's output.
class DeviceProblem {
 public:
  DeviceProblem(Device& device, PrefillProblem& p) : device_(device), p_(p) {}

  absl::Status Upload() {
    KVPOOL_ASSIGN_OR_RETURN(arena_, device_.CreateArena(p_.layout.arena_bytes()));
    KVPOOL_ASSIGN_OR_RETURN(
        Fence f, device_.CopyToDevice(StreamId::kTransfer, arena_->base(), p_.arena.data(),
                                      p_.layout.arena_bytes()));
    KVPOOL_RETURN_IF_ERROR(device_.Synchronize(f));
    KVPOOL_ASSIGN_OR_RETURN(q_, test_util::Upload(device_, p_.q));
    KVPOOL_ASSIGN_OR_RETURN(q_starts_, test_util::Upload(device_, p_.q_starts));
    KVPOOL_ASSIGN_OR_RETURN(lens_, test_util::Upload(device_, p_.seq_lens));
    KVPOOL_ASSIGN_OR_RETURN(
        out_, device_.AllocateBuffer(static_cast<int64_t>(p_.q.size() * sizeof(float))));
    if (const int64_t bytes = device_.PrefillWorkspaceBytes(p_.layout); bytes > 0) {
      KVPOOL_ASSIGN_OR_RETURN(workspace_, device_.AllocateBuffer(bytes));
    }
    return SetTables(p_.tables);
  }

  absl::Status SetTables(const std::vector<int32_t>& tables) {
    KVPOOL_ASSIGN_OR_RETURN(tables_, test_util::Upload(device_, tables));
    return absl::OkStatus();
  }

  PrefillArgs Args() const {
    PrefillArgs a = p_.Args(static_cast<float*>(out_->data()));
    a.q = static_cast<const float*>(q_->data());
    a.q_starts = static_cast<const int32_t*>(q_starts_->data());
    a.block_tables = static_cast<const int32_t*>(tables_->data());
    a.seq_lens = static_cast<const int32_t*>(lens_->data());
    if (workspace_ != nullptr) {
      a.workspace = workspace_->data();
      a.workspace_bytes = workspace_->bytes();
    }
    return a;
  }

  absl::StatusOr<std::vector<float>> Run() {
    KVPOOL_RETURN_IF_ERROR(
        device_.PagedAttentionPrefill(StreamId::kCompute, {arena_->base(), p_.layout}, Args())
            .status());
    return Download<float>(device_, out_->data(), p_.q.size());
  }

  KvPoolView pool() const { return {arena_->base(), p_.layout}; }

 private:
  Device& device_;
  PrefillProblem& p_;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<DeviceBuffer> q_, q_starts_, lens_, tables_, out_, workspace_;
};

class PrefillParityTest : public test_util::BackendTest<Case> {};

TEST_P(PrefillParityTest, MatchesTheReferenceAndTheCpuKernel) {
  const Case& c = param();
  PrefillProblem p({.block_size = c.block_size,
                    .num_layers = 2,
                    .num_kv_heads = c.kv_heads,
                    .head_dim = c.head_dim,
                    .dtype = c.dtype},
                   c.q_heads, kShapes, /*seed=*/42);
  if (backend() == "cuda") {
    ASSERT_EQ(device().PrefillWorkspaceBytes(p.layout), 0);
  }
  DeviceProblem d(device(), p);
  ASSERT_TRUE(d.Upload().ok());
  ASSERT_OK_AND_MOVE(std::vector<float> got, d.Run());
  ASSERT_TRUE(device().status().ok()) << device().status();

  bool nan = false;
  // f32 arithmetic over the same stored values as the reference, like the CPU kernels.
  EXPECT_LT(NormalizedError(got, p.Reference(), &nan), 1e-4);
  EXPECT_FALSE(nan);
  std::vector<float> cpu(p.q.size(), -1);
  std::vector<char> workspace(static_cast<size_t>(cpu::PrefillWorkspaceBytes(p.layout, 1)));
  PrefillArgs args = p.Args(cpu.data());
  args.workspace = workspace.data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size());
  ASSERT_TRUE(cpu::PagedAttentionPrefill(p.pool(), args, nullptr).ok());
  EXPECT_LT(NormalizedError(got, cpu, &nan), 1e-4);
  EXPECT_FALSE(nan);
  EXPECT_LT(NormalizedError(got, p.ReferenceToOriginal(), &nan),
            std::max(test_util::FormatTolerance(c.dtype), 1e-4));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillParityTest,
    ::testing::Combine(
        ::testing::Values(std::string("cuda")),
        ::testing::Values(Case{1, DType::kF32, 32, 8, 128}, Case{1, DType::kBF16, 32, 8, 128},
                          Case{16, DType::kF32, 32, 8, 128}, Case{16, DType::kF16, 32, 8, 128},
                          Case{16, DType::kBF16, 32, 8, 128},
                          Case{64, DType::kF16, 32, 8, 128}, Case{64, DType::kBF16, 32, 8, 128},
                          Case{16, DType::kBF16, 8, 4, 64},
                          Case{16, DType::kF16, 24, 8, 128},  // group of 3
                          Case{16, DType::kBF16, 12, 1, 64},  // group of 12
                          Case{16, DType::kBF16, 80, 1, 32},  // group of 80 > a CTA's rows
                          Case{16, DType::kF32, 8, 8, 256},   // no grouping, largest head_dim
                          Case{64, DType::kF16, 4, 2, 72},    // odd head_dim
                          // 8-bit KV (written by the CPU's WriteKv, read by the device's kernel).
                          Case{1, DType::kFp8E4M3, 32, 8, 128},
                          Case{16, DType::kFp8E4M3, 32, 8, 128},
                          Case{64, DType::kFp8E4M3, 32, 8, 128}, Case{1, DType::kInt8, 32, 8, 128},
                          Case{16, DType::kInt8, 32, 8, 128}, Case{64, DType::kInt8, 4, 2, 72})),
    test_util::BackendCaseName<Case>(Name));

class PrefillEdgeTest : public test_util::BackendTest<> {};

TEST_P(PrefillEdgeTest, BlockOutsideThePoolPoisonsOnlyItsSequence) {
  if (backend() == "cpu") {
    GTEST_SKIP() << "the CPU's prefill refuses the whole call instead (cpu_prefill_test), an "
                    "error that would stick to the device every case here shares";
  }
  PrefillProblem p({.block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 64}, 8,
                   {{40, 20}, {0, 30}}, /*seed=*/3);
  DeviceProblem d(device(), p);
  ASSERT_TRUE(d.Upload().ok());
  std::vector<int32_t> tables = p.tables;
  tables[1] = p.layout.num_blocks + 5;  // sequence 0's second block
  ASSERT_TRUE(d.SetTables(tables).ok());
  ASSERT_OK_AND_MOVE(std::vector<float> got, d.Run());
  const std::vector<float> want = p.Reference();
  const size_t split = static_cast<size_t>(p.q_starts[1]) * 8 * 64;
  EXPECT_TRUE(std::all_of(got.begin(), got.begin() + split, [](float x) { return std::isnan(x); }));
  bool nan = false;
  EXPECT_LT(NormalizedError(std::vector<float>(got.begin() + split, got.end()),
                            std::vector<float>(want.begin() + split, want.end()), &nan),
            1e-4);
  EXPECT_FALSE(nan);
}

TEST_P(PrefillEdgeTest, BadArgumentsEnqueueNothing) {
  PrefillProblem p({.block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 64}, 8,
                   {{10, 6}}, /*seed=*/4);
  DeviceProblem d(device(), p);
  ASSERT_TRUE(d.Upload().ok());
  const Fence before = device().LastFence(StreamId::kCompute);
  PrefillArgs a = d.Args();
  a.max_q_len = 0;
  EXPECT_EQ(device().PagedAttentionPrefill(StreamId::kCompute, d.pool(), a).status().code(),
            absl::StatusCode::kInvalidArgument);
  a = d.Args();
  a.num_q_heads = 3;
  EXPECT_EQ(device().PagedAttentionPrefill(StreamId::kCompute, d.pool(), a).status().code(),
            absl::StatusCode::kInvalidArgument);
  if (backend() == "cuda") {
    PoolLayout wide = p.layout;
    wide.head_dim = 512;  // beyond the CUDA kernel
    EXPECT_EQ(device()
                  .PagedAttentionPrefill(StreamId::kCompute, {d.pool().base, wide}, d.Args())
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(device().LastFence(StreamId::kCompute).value, before.value);
}

INSTANTIATE_TEST_SUITE_P(Every, PrefillEdgeTest, ::testing::Values("cpu", "cuda"),
                         test_util::BackendName());

}  // namespace
}  // namespace kvpool::kernels
