// Every backend's decode kernel and WriteKv against the CPU, one case table run on each
// (backend_test_util.h): block sizes 1, 16 and 64, every dtype
// (fp8 e4m3 and int8 included, and asymmetric K/V pairs), ragged lengths and several query/KV
// head groupings. For each case the arena the device's WriteKv leaves must be the CPU WriteKv's
// byte for byte (both poisoned first), and the output must match the double-precision reference
// over what the pool holds and the query the kernel scores with (the kernel's arithmetic, per
// backend: NumericsOf) and over the f32 values written (the format's tolerance,
// kernel_test_util.h).
//
// Devices are made through the registry as kvpoold makes them; a backend that is unavailable
// here (CUDA without a GPU) has its cases skipped, saying why.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/device.h"
#include "kernels/internal/decode_tile.h"
#include "kvpool/util/status_macros.h"
#include "tests/kernels/backend_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels {
namespace {

using test_util::Download;
using test_util::NormalizedError;
using test_util::Upload;

struct Case {
  int32_t block_size;
  DType dtype;  // K's
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
  std::optional<DType> v_dtype = std::nullopt;  // V's, when not `dtype`
  // A sliding window (issue 28): the blocks no query sees are released (-1) before the decode,
  // and the references read the visible keys only.
  AttentionWindow window{};
};

constexpr int32_t kLayer = 1;

// The sequences of one case: their f32 K/V, block tables, and the pool on both sides.
struct Problem {
  PoolLayout layout;
  int32_t stride = 0;
  std::vector<int32_t> tables;                             // [num_seqs][stride]
  std::vector<std::vector<float>> original_k, original_v;  // per sequence, what was written
  std::unique_ptr<Arena> arena;                            // the device's
  std::vector<char> host;                                  // the CPU WriteKv's arena
};

// A 2-layer layout whose layer 0 K is int8, so layer 1's offsets follow another dtype.
PoolLayout LayoutOf(const Case& c, const std::vector<int32_t>& lens) {
  PoolLayout layout{.block_size = c.block_size,
                    .num_layers = 2,
                    .num_kv_heads = c.kv_heads,
                    .head_dim = c.head_dim,
                    .dtype = c.dtype};
  if (c.v_dtype) layout.SetKvDType(kLayer, KvSide::kV, *c.v_dtype);
  layout.SetKvDType(0, KvSide::kK, DType::kInt8);
  for (int32_t len : lens) layout.num_blocks += (len + c.block_size - 1) / c.block_size;
  layout.num_blocks += 3;
  return layout;
}

// Poisons both arenas, then writes every sequence's K/V through both WriteKvs into a shuffled set
// of blocks.
void WriteBoth(Device& device, const Case& c, const std::vector<int32_t>& lens, std::mt19937* rng,
               Problem* p) {
  const KvPoolView pool{p->arena->base(), p->layout}, host{p->host.data(), p->layout};
  std::vector<int32_t> ids(static_cast<size_t>(p->layout.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  ASSERT_OK_AND_MOVE(auto all_ids, Upload(device, ids));
  const FillBlocksArgs poison{.num_blocks = p->layout.num_blocks,
                              .blocks = static_cast<const int32_t*>(all_ids->data()),
                              .pattern = FillPattern::kPoison};
  ASSERT_TRUE(device.FillBlocks(StreamId::kTransfer, pool, poison).ok());
  ASSERT_TRUE(cpu::FillBlocks(host, {.num_blocks = p->layout.num_blocks,
                                     .blocks = ids.data(),
                                     .pattern = FillPattern::kPoison})
                  .ok());
  std::shuffle(ids.begin(), ids.end(), *rng);
  const int64_t row_values = static_cast<int64_t>(c.kv_heads) * c.head_dim;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  size_t next = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    const int32_t len = lens[s];
    p->original_k.push_back(test_util::RandomFloats(len * row_values, rng));
    p->original_v.push_back(test_util::RandomFloats(len * row_values, rng));
    std::vector<int64_t> slots;
    int32_t* table = &p->tables[s * p->stride];
    for (int32_t t = 0; t < len; ++t) {
      if (t % c.block_size == 0) table[t / c.block_size] = ids[next++];
      slots.push_back(int64_t{table[t / c.block_size]} * c.block_size + t % c.block_size);
    }
    ASSERT_OK_AND_MOVE(auto k, Upload(device, p->original_k.back()));
    ASSERT_OK_AND_MOVE(auto v, Upload(device, p->original_v.back()));
    ASSERT_OK_AND_MOVE(auto slot_buffer, Upload(device, slots));
    const WriteKvArgs on_device{.layer = kLayer,
                                .num_tokens = len,
                                .k = static_cast<const float*>(k->data()),
                                .v = static_cast<const float*>(v->data()),
                                .slots = static_cast<const int64_t*>(slot_buffer->data())};
    ASSERT_TRUE(device.WriteKv(StreamId::kTransfer, pool, on_device).ok());
    ASSERT_TRUE(cpu::WriteKv(host, {.layer = kLayer,
                                    .num_tokens = len,
                                    .k = p->original_k.back().data(),
                                    .v = p->original_v.back().data(),
                                    .slots = slots.data()})
                    .ok());
    keep.push_back(std::move(k));
    keep.push_back(std::move(v));
    keep.push_back(std::move(slot_buffer));
  }
  // Decode runs on the compute stream, after the writes on the transfer stream.
  ASSERT_TRUE(device.StreamWait(StreamId::kCompute, device.LastFence(StreamId::kTransfer)).ok());
  ASSERT_TRUE(device.SynchronizeAll().ok());  // before `keep` goes
}

// The double-precision decode of `q` over each sequence's (keys[s], values[s]).
std::vector<float> Reference(const Case& c, const std::vector<int32_t>& lens,
                             const std::vector<float>& q,
                             const std::vector<std::vector<float>>& keys,
                             const std::vector<std::vector<float>>& values) {
  std::vector<const void*> k, v;
  for (size_t s = 0; s < lens.size(); ++s) {
    k.push_back(keys[s].data());
    v.push_back(values[s].data());
  }
  std::vector<float> out(q.size(), -1);
  cpu::ReferenceAttentionDecode({.num_seqs = static_cast<int32_t>(lens.size()),
                                 .num_q_heads = c.q_heads,
                                 .num_kv_heads = c.kv_heads,
                                 .head_dim = c.head_dim,
                                 .dtype = DType::kF32,
                                 .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                                 .q = q.data(),
                                 .out = out.data(),
                                 .k = k.data(),
                                 .v = v.data(),
                                 .seq_lens = lens.data()});
  return out;
}

// How a backend's decode treats 8-bit KV: the query it scores K with, and the bound on its own
// arithmetic against the double-precision reference over what the pool holds and that query.
// CUDA: an int8 K against the query rounded per head to int8 (dp4a), the f32 query otherwise;
// f32 arithmetic (1e-4). The CPU on its AVX-512 VNNI path: an 8-bit K against the query rounded
// as decode_tile.h's RoundedQuery rounds it, and an 8-bit V's probabilities rounded too (fp8 V
// to bf16: kv_dtype_test.cc's KernelTolerance, 1.5e-3); elsewhere the f32 query (1e-4).
struct Numerics {
  bool round_query;
  double bound;
};

Numerics NumericsOf(const std::string& backend, const Case& c) {
  const DType v = c.v_dtype.value_or(c.dtype);
  if (backend == "cpu") {
    const bool vnni = cpu::KernelAvx512Vnni();
    return {.round_query = vnni, .bound = vnni && v == DType::kFp8E4M3 ? 1.5e-3 : 1e-4};
  }
  return {.round_query = c.dtype == DType::kInt8, .bound = 1e-4};
}

std::vector<float> ScoredQuery(const Numerics& n, const Case& c, const std::vector<float>& q) {
  if (!n.round_query) return q;
  std::vector<float> out(q.size());
  for (size_t row = 0; row < q.size() / static_cast<size_t>(c.head_dim); ++row) {
    cpu::internal::RoundedQuery(c.dtype, q.data() + row * c.head_dim, c.head_dim,
                                out.data() + row * c.head_dim);
  }
  return out;
}

// The device's decode of `q` over the problem's pool.
void Decode(Device& device, const Case& c, const std::vector<int32_t>& lens, int32_t max_seq_len,
            const Problem& p, const std::vector<float>& q, std::vector<float>* got) {
  const auto num_seqs = static_cast<int32_t>(lens.size());
  ASSERT_OK_AND_MOVE(auto q_buffer, Upload(device, q));
  ASSERT_OK_AND_MOVE(auto table_buffer, Upload(device, p.tables));
  ASSERT_OK_AND_MOVE(auto len_buffer, Upload(device, lens));
  ASSERT_OK_AND_MOVE(auto out_buffer,
                     device.AllocateBuffer(static_cast<int64_t>(q.size() * sizeof(float))));
  const int64_t workspace_bytes =
      device.DecodeWorkspaceBytes(p.layout, num_seqs, c.q_heads, max_seq_len);
  std::unique_ptr<DeviceBuffer> workspace;
  if (workspace_bytes > 0) {
    ASSERT_OK_AND_MOVE(workspace, device.AllocateBuffer(workspace_bytes));
  }
  absl::StatusOr<Fence> decoded = device.PagedAttentionDecode(
      StreamId::kCompute, {p.arena->base(), p.layout},
      {.layer = kLayer,
       .num_seqs = num_seqs,
       .num_q_heads = c.q_heads,
       .scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
       .q = static_cast<const float*>(q_buffer->data()),
       .out = static_cast<float*>(out_buffer->data()),
       .block_tables = static_cast<const int32_t*>(table_buffer->data()),
       .table_stride = p.stride,
       .seq_lens = static_cast<const int32_t*>(len_buffer->data()),
       .max_seq_len = max_seq_len,
       .window = c.window,
       .workspace = workspace ? workspace->data() : nullptr,
       .workspace_bytes = workspace_bytes});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_OK_AND_MOVE(*got, Download<float>(device, out_buffer->data(), q.size()));
  ASSERT_TRUE(device.status().ok()) << device.status();
}

// Under c.window, each sequence's last query sees its sinks and window: keeps only those rows of
// every per-sequence [len][kv_heads][head_dim] array in `rows`, sets `seen` to their counts, and
// releases (-1) every table entry whose block holds none of them.
void Window(const Case& c, std::vector<int32_t>* seen, std::vector<int32_t>* tables, int32_t stride,
            std::vector<std::vector<std::vector<float>>*> rows) {
  const int64_t row = static_cast<int64_t>(c.kv_heads) * c.head_dim;
  for (size_t s = 0; s < seen->size(); ++s) {
    const int32_t len = (*seen)[s];
    const int64_t pos = len - 1;
    std::vector<bool> keep(static_cast<size_t>(len));
    for (int64_t key = 0; key < len; ++key) keep[key] = c.window.Sees(pos, key);
    for (auto* arrays : rows) {
      std::vector<float>& a = (*arrays)[s];
      std::vector<float> kept;
      for (int64_t key = 0; key < len; ++key) {
        if (keep[key]) kept.insert(kept.end(), a.begin() + key * row, a.begin() + (key + 1) * row);
      }
      a = std::move(kept);
    }
    (*seen)[s] = static_cast<int32_t>(std::count(keep.begin(), keep.end(), true));
    for (int32_t b = 0; b * c.block_size < len; ++b) {
      bool any = false;
      for (int32_t key = b * c.block_size; key < std::min(len, (b + 1) * c.block_size); ++key) {
        any = any || keep[key];
      }
      if (!any) (*tables)[s * stride + b] = -1;
    }
  }
}

// `max_seq_len` may exceed the longest sequence (its extra splits must be ignored).
void CheckDecode(const std::string& backend, Device& device, const Case& c,
                 const std::vector<int32_t>& lens, int32_t max_seq_len) {
  std::mt19937 rng(1234);
  Problem p;
  p.layout = LayoutOf(c, lens);
  p.stride = (max_seq_len + c.block_size - 1) / c.block_size;
  p.tables.assign(lens.size() * static_cast<size_t>(p.stride), -1);
  p.host.resize(static_cast<size_t>(p.layout.arena_bytes()));
  ASSERT_OK_AND_MOVE(p.arena, device.CreateArena(p.layout.arena_bytes()));
  WriteBoth(device, c, lens, &rng, &p);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_OK_AND_MOVE(std::vector<char> written,
                     Download<char>(device, p.arena->base(), p.host.size()));
  EXPECT_TRUE(written == p.host) << "the device's WriteKv differs from the CPU's";

  std::vector<float> q(lens.size() * static_cast<size_t>(c.q_heads * c.head_dim));
  for (float& x : q) x = test_util::StandardNormal(&rng);

  // What the pool holds, read back from the device's arena through the documented layout.
  const KvPoolView written_view{written.data(), p.layout};
  std::vector<std::vector<float>> stored_k, stored_v;
  for (size_t s = 0; s < lens.size(); ++s) {
    const int32_t* table = &p.tables[s * p.stride];
    stored_k.push_back(test_util::StoredRows(written_view, table, kLayer, KvSide::kK, lens[s]));
    stored_v.push_back(test_util::StoredRows(written_view, table, kLayer, KvSide::kV, lens[s]));
  }
  std::vector<int32_t> seen = lens;
  if (c.window.window > 0)
    Window(c, &seen, &p.tables, p.stride, {&stored_k, &stored_v, &p.original_k, &p.original_v});
  std::vector<float> got;
  Decode(device, c, lens, max_seq_len, p, q, &got);
  if (::testing::Test::HasFatalFailure()) return;
  bool nan = false;
  const Numerics numerics = NumericsOf(backend, c);
  EXPECT_LT(NormalizedError(
                got, Reference(c, seen, ScoredQuery(numerics, c, q), stored_k, stored_v), &nan),
            numerics.bound);
  EXPECT_FALSE(nan);
  const double tolerance = std::max(test_util::FormatTolerance(c.dtype),
                                    test_util::FormatTolerance(c.v_dtype.value_or(c.dtype)));
  EXPECT_LT(NormalizedError(got, Reference(c, seen, q, p.original_k, p.original_v), &nan),
            std::max(tolerance, 1e-4));
}

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format(
      "bs{}_{}{}_q{}kv{}_d{}{}", c.block_size, DTypeName(c.dtype),
      c.v_dtype ? fmt::format("_v{}", DTypeName(*c.v_dtype)) : "", c.q_heads, c.kv_heads,
      c.head_dim,
      c.window.window > 0 ? fmt::format("_w{}s{}", c.window.window, c.window.sinks) : "");
}

class DecodeParityTest : public test_util::BackendTest<Case> {};

TEST_P(DecodeParityTest, MatchesTheCpuReference) {
  // Ragged: partial blocks, exact multiples of the partition sizes and one past them.
  const std::vector<int32_t> lens = {1, 17, 64, 65, 200, 513, 1000, 2049};
  CheckDecode(backend(), device(), param(), lens, 2049 + 100);
}

TEST_P(DecodeParityTest, SingleSplitMatchesTheCpuReference) {
  // max_seq_len within one partition: the kernel writes `out` without the combine pass.
  CheckDecode(backend(), device(), param(), {1, 5, 33, 64}, 64);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeParityTest,
    test_util::OnEveryBackend(::testing::Values(
        Case{1, DType::kF32, 32, 8, 128}, Case{1, DType::kF16, 32, 8, 128},
        Case{1, DType::kBF16, 32, 8, 128}, Case{16, DType::kF32, 32, 8, 128},
        Case{16, DType::kF16, 32, 8, 128}, Case{16, DType::kBF16, 32, 8, 128},
        Case{64, DType::kF32, 32, 8, 128}, Case{64, DType::kF16, 32, 8, 128},
        Case{64, DType::kBF16, 32, 8, 128}, Case{16, DType::kBF16, 32, 8, 64},
        Case{16, DType::kF16, 24, 8, 128},  // group of 3
        Case{16, DType::kBF16, 12, 1, 64},  // group of 12
        Case{16, DType::kF32, 8, 8, 256},   // no grouping
        Case{64, DType::kF16, 4, 2, 72},    // odd head_dim
        // 8-bit KV, block sizes 1, 16, 64, and asymmetric K / V.
        Case{1, DType::kFp8E4M3, 32, 8, 128}, Case{16, DType::kFp8E4M3, 32, 8, 128},
        Case{64, DType::kFp8E4M3, 32, 8, 128}, Case{1, DType::kInt8, 32, 8, 128},
        Case{16, DType::kInt8, 32, 8, 128}, Case{64, DType::kInt8, 32, 8, 128},
        Case{16, DType::kInt8, 12, 1, 64}, Case{64, DType::kFp8E4M3, 4, 2, 72},
        Case{16, DType::kBF16, 32, 8, 128, DType::kInt8},
        Case{16, DType::kBF16, 32, 8, 128, DType::kFp8E4M3},
        Case{16, DType::kFp8E4M3, 32, 8, 128, DType::kInt8},
        // Sliding windows: inside one partition, across several, with sinks past the start.
        Case{16, DType::kBF16, 32, 8, 128, std::nullopt, {.window = 100, .sinks = 4}},
        Case{1, DType::kF32, 8, 2, 64, std::nullopt, {.window = 700, .sinks = 0}},
        Case{64, DType::kInt8, 32, 8, 128, std::nullopt, {.window = 33, .sinks = 70}})),
    test_util::BackendCaseName<Case>(Name));

}  // namespace
}  // namespace kvpool::kernels
