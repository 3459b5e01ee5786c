// KV dtypes on the CPU: paged decode and prefill over every dtype (and asymmetric K/V pairs)
// written through WriteKv from f32 values, for block sizes 1, 16 and 64 and ragged lengths, on
// every instruction set this processor has (AVX-512 with and without the VNNI extensions the
// 8-bit decode uses). Each result is held to two references: the double-precision attention
// over what the pool holds (read back through the documented block layout; the kernels' own
// arithmetic, KernelTolerance) and over the f32 values written (the format's rounding,
// FormatTolerance). No NaN or infinity anywhere. Then the VNNI decode over more head shapes, an
// fp8 decode that must return every e4m3 value exactly, the 8-bit conversions (scalar and
// vector), and WriteKv's scale rules (cpu_kernels.h) on 8-bit blocks.

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/convert_rows.h"
#include "kernels/internal/decode_tile.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvpool::kernels::cpu {
namespace {

using test_util::FormatTolerance;
using test_util::NormalizedError;
using test_util::PrefillProblem;

struct Case {
  DType k;
  DType v;
  int32_t block_size;
  Isa isa;
  bool vnni = false;  // AVX-512 with VNNI, VBMI and BF16 (isa is kAvx512)
};

std::string PathName(Isa isa, bool vnni) {
  std::string name(IsaName(isa));
  return name.substr(0, name.find('+')) + (vnni ? "vnni" : "");
}

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format("k{}_v{}_bs{}_{}", DTypeName(c.k), DTypeName(c.v), c.block_size,
                     PathName(c.isa, c.vnni));
}

bool AllFinite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float f) { return std::isfinite(f); });
}

// Selects the path under test (skipping what this processor lacks) and restores the default.
class KernelPath {
 public:
  static bool Lacks(Isa isa, bool vnni) {
    return isa > DetectedIsa() || (vnni && !DetectedAvx512Vnni());
  }
  KernelPath(Isa isa, bool vnni) {
    LimitKernelIsaForTesting(isa);
    SetAvx512VnniForTesting(vnni);
  }
  ~KernelPath() {
    LimitKernelIsaForTesting(Isa::kAvx512);
    SetAvx512VnniForTesting(true);
  }
};

// The query a decode scores K with: rounded as the VNNI path rounds it for an 8-bit K
// (decode_tile.h: RoundedQuery), else q itself. q: [rows][dim].
std::vector<float> ScoredQuery(const std::vector<float>& q, int32_t dim, DType k, bool vnni) {
  if (!vnni) return q;
  std::vector<float> out(q.size());
  for (size_t row = 0; row < q.size() / static_cast<size_t>(dim); ++row) {
    internal::RoundedQuery(k, q.data() + row * dim, dim, out.data() + row * dim);
  }
  return out;
}

// The normalized error of the decode's own arithmetic, against the reference over what the pool
// holds and the query the decode scores with (ScoredQuery). f32 arithmetic: 2e-5 (measured
// 1.6e-7). The VNNI path also rounds an 8-bit V side's probabilities (times the block scales):
// int8 V to 16-bit fixed point per head and chunk, fp8 V to bf16 (2^-9 relative). Worst
// measured over this file's cases: int8 V 2.3e-5, fp8 V 6.0e-4 (the formats' own errors: 4e-3
// and 3e-2); the bounds are about two and a half times those.
double KernelTolerance(DType v, bool vnni) {
  if (!vnni) return 2e-5;
  return v == DType::kFp8E4M3 ? 1.5e-3 : v == DType::kInt8 ? 6e-5 : 2e-5;
}

// What the VNNI path's rounding of the query for an 8-bit K costs (int8 K: int8 codes of step
// max |q| / 127; fp8 K: bf16), measured against the reference over the stored K/V with the f32
// query (so the V side's own rounding is in it too). Worst measured over this file's cases:
// int8 K 3.3e-3, fp8 K 1.5e-3 (the formats' own errors against the values written: up to 8e-3
// and 4e-2); the bounds are about two and a half times those.
double QueryRoundingTolerance(DType k) { return k == DType::kInt8 ? 8e-3 : 4e-3; }

class KvDTypeTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (KernelPath::Lacks(GetParam().isa, GetParam().vnni)) {
      GTEST_SKIP() << "this processor lacks " << PathName(GetParam().isa, GetParam().vnni);
    }
    path_.emplace(GetParam().isa, GetParam().vnni);
  }
  void TearDown() override { path_.reset(); }

  std::optional<KernelPath> path_;

  // A 3-layer layout whose last layer (the one written) is K `k` / V `v`; the others differ, so
  // offsets follow the layers before.
  static PoolLayout Layout(const Case& c, int32_t head_dim) {
    PoolLayout l{.block_size = c.block_size,
                 .num_layers = 3,
                 .num_kv_heads = 2,
                 .head_dim = head_dim,
                 .dtype = DType::kBF16};
    l.SetKvDType(0, KvSide::kK, DType::kInt8);
    l.SetKvDType(1, KvSide::kV, DType::kFp8E4M3);
    l.SetKvDType(2, KvSide::kK, c.k);
    l.SetKvDType(2, KvSide::kV, c.v);
    return l;
  }

  // The looser of the two sides' format bounds.
  static double Tolerance(const Case& c) {
    return std::max(FormatTolerance(c.k), FormatTolerance(c.v));
  }
};

// (reused tokens, new tokens): decode uses each sequence's full length, prefill its new tokens.
const std::vector<std::pair<int32_t, int32_t>> kShapes = {{0, 1},    {16, 1},  {63, 2},
                                                          {200, 70}, {1, 130}, {500, 13}};

TEST_P(KvDTypeTest, PagedDecodeMatchesBothReferences) {
  const Case& c = GetParam();
  // Decode is prefill with one query per sequence: the problem's last token of each sequence.
  std::vector<std::pair<int32_t, int32_t>> shapes;
  for (const auto& [reused, fresh] : kShapes) shapes.push_back({reused + fresh - 1, 1});
  PrefillProblem p(Layout(c, 64), /*q_heads=*/8, shapes, /*seed=*/7);
  std::vector<float> got(p.q.size(), -1);
  const PrefillArgs pa = p.Args(got.data());
  ThreadPool threads(2);
  ASSERT_TRUE(PagedAttentionDecode(p.pool(),
                                   {.layer = pa.layer,
                                    .num_seqs = pa.num_seqs,
                                    .num_q_heads = pa.num_q_heads,
                                    .scale = pa.scale,
                                    .q = pa.q,
                                    .out = got.data(),
                                    .block_tables = pa.block_tables,
                                    .table_stride = pa.table_stride,
                                    .seq_lens = pa.seq_lens,
                                    .max_seq_len = pa.max_seq_len},
                                   &threads)
                  .ok());
  bool nan = false;
  const double kernel_error =
      NormalizedError(got, p.Reference(ScoredQuery(p.q, 64, c.k, c.vnni)), &nan);
  EXPECT_LT(kernel_error, KernelTolerance(c.v, c.vnni));
  EXPECT_FALSE(nan);
  EXPECT_TRUE(AllFinite(got));
  const double format_error = NormalizedError(got, p.ReferenceToOriginal(), &nan);
  EXPECT_LT(format_error, Tolerance(c));
  RecordProperty("kernel_error", fmt::format("{:.3g}", kernel_error));
  RecordProperty("format_error", fmt::format("{:.3g}", format_error));
  if (c.vnni && DTypeHasScales(c.k)) {
    // What rounding the query costs on its own: against the stored K/V and the f32 query.
    const double query_error = NormalizedError(got, p.Reference(), &nan);
    EXPECT_LT(query_error, QueryRoundingTolerance(c.k));
    RecordProperty("query_rounding_error", fmt::format("{:.3g}", query_error));
  }
}

TEST_P(KvDTypeTest, PagedPrefillMatchesBothReferences) {
  const Case& c = GetParam();
  if (c.vnni) GTEST_SKIP() << "prefill runs the same code with or without the VNNI extensions";
  PrefillProblem p(Layout(c, 128), /*q_heads=*/8, kShapes, /*seed=*/11);
  ThreadPool threads(2);
  std::vector<char> workspace(static_cast<size_t>(PrefillWorkspaceBytes(p.layout, 2)));
  std::vector<float> got(p.q.size(), -1);
  PrefillArgs args = p.Args(got.data());
  args.workspace = workspace.data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size());
  ASSERT_TRUE(PagedAttentionPrefill(p.pool(), args, &threads).ok());
  bool nan = false;
  EXPECT_LT(NormalizedError(got, p.Reference(), &nan), 2e-5);
  EXPECT_FALSE(nan);
  EXPECT_TRUE(AllFinite(got));
  const double format_error = NormalizedError(got, p.ReferenceToOriginal(), &nan);
  EXPECT_LT(format_error, Tolerance(c));
  RecordProperty("format_error", fmt::format("{:.3g}", format_error));
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (auto [isa, vnni] : {std::pair{Isa::kAvx512, true},
                           {Isa::kAvx512, false},
                           {Isa::kAvx2, false},
                           {Isa::kPortable, false}}) {
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
      for (int32_t bs : {1, 16, 64}) cases.push_back({d, d, bs, isa, vnni});
    }
    // Asymmetric: K kept wider than V, and the other way round.
    for (auto [k, v] : {std::pair{DType::kBF16, DType::kInt8},
                        {DType::kBF16, DType::kFp8E4M3},
                        {DType::kFp8E4M3, DType::kInt8},
                        {DType::kInt8, DType::kFp8E4M3},
                        {DType::kInt8, DType::kF16},
                        {DType::kF32, DType::kFp8E4M3}}) {
      cases.push_back({k, v, 16, isa, vnni});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(DTypes, KvDTypeTest, ::testing::ValuesIn(Cases()), Name);

// The VNNI decode over head groupings (its chunks take 4, 2 or 1 query heads at a time) and
// head_dims that are not a multiple of its 64-code vectors.
struct ShapeCase {
  DType k;
  DType v;
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
};

class VnniDecodeShapeTest : public ::testing::TestWithParam<ShapeCase> {
 protected:
  void SetUp() override {
    if (KernelPath::Lacks(Isa::kAvx512, true)) GTEST_SKIP() << "this processor lacks AVX-512 VNNI";
  }
  KernelPath path_{Isa::kAvx512, true};
};

TEST_P(VnniDecodeShapeTest, MatchesBothReferences) {
  const ShapeCase& c = GetParam();
  PoolLayout layout{
      .block_size = 16, .num_layers = 1, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim};
  layout.SetKvDType(0, KvSide::kK, c.k);
  layout.SetKvDType(0, KvSide::kV, c.v);
  std::vector<std::pair<int32_t, int32_t>> shapes;
  for (int32_t len : {1, 2, 31, 33, 100, 517}) shapes.push_back({len - 1, 1});
  PrefillProblem p(layout, c.q_heads, shapes, /*seed=*/13);
  std::vector<float> got(p.q.size(), -1);
  const PrefillArgs pa = p.Args(got.data());
  ThreadPool threads(2);
  ASSERT_TRUE(PagedAttentionDecode(p.pool(),
                                   {.layer = 0,
                                    .num_seqs = pa.num_seqs,
                                    .num_q_heads = pa.num_q_heads,
                                    .scale = pa.scale,
                                    .q = pa.q,
                                    .out = got.data(),
                                    .block_tables = pa.block_tables,
                                    .table_stride = pa.table_stride,
                                    .seq_lens = pa.seq_lens,
                                    .max_seq_len = pa.max_seq_len},
                                   &threads)
                  .ok());
  bool nan = false;
  EXPECT_LT(NormalizedError(got, p.Reference(ScoredQuery(p.q, c.head_dim, c.k, true)), &nan),
            KernelTolerance(c.v, true));
  EXPECT_FALSE(nan);
  EXPECT_TRUE(AllFinite(got));
  EXPECT_LT(NormalizedError(got, p.ReferenceToOriginal(), &nan),
            std::max(FormatTolerance(c.k), FormatTolerance(c.v)));
}

std::vector<ShapeCase> ShapeCases() {
  std::vector<ShapeCase> cases;
  for (auto [k, v] : {std::pair{DType::kInt8, DType::kInt8},
                      {DType::kFp8E4M3, DType::kFp8E4M3},
                      {DType::kFp8E4M3, DType::kInt8}}) {
    for (auto [q_heads, kv_heads, dim] : {std::tuple{6, 1, 128},  // group of 6: pairs of heads
                                          {3, 3, 32},             // no grouping, half a vector
                                          {12, 2, 80},            // a vector and a quarter
                                          {4, 2, 144},            // groups of 2, 2.25 vectors
                                          {8, 1, 48},             // group of 8
                                          {2, 2, 16}}) {
      cases.push_back({k, v, q_heads, kv_heads, dim});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, VnniDecodeShapeTest, ::testing::ValuesIn(ShapeCases()),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           const ShapeCase& c = info.param;
                           return fmt::format("k{}_v{}_q{}kv{}_d{}", DTypeName(c.k), DTypeName(c.v),
                                              c.q_heads, c.kv_heads, c.head_dim);
                         });

// A one-token decode returns its V row: with every 8-bit value in the row (scale 1), every path's
// conversion of every code is checked exactly (fp8 subnormals included).
TEST(EightBitDecodeTest, OneTokenReturnsEveryValueExactly) {
  for (DType dtype : {DType::kFp8E4M3, DType::kInt8}) {
    PoolLayout layout{.block_size = 16,
                      .num_layers = 1,
                      .num_kv_heads = 1,
                      .head_dim = 256,
                      .dtype = dtype,
                      .num_blocks = 1};
    std::vector<char> arena(static_cast<size_t>(layout.arena_bytes()));
    const KvPoolView pool{arena.data(), layout};
    // Every finite value of the format (NaN codes and the int8 code -128 as 0); the largest
    // magnitude makes the block's scale 1.
    std::vector<float> values(256);
    for (int c = 0; c < 256; ++c) {
      values[c] = dtype == DType::kFp8E4M3 ? Fp8E4M3ToFloat(static_cast<uint8_t>(c))
                                           : static_cast<float>(static_cast<int8_t>(c));
      if (std::isnan(values[c]) || values[c] == -128.0f) values[c] = 0;
    }
    const int64_t slot = 0;
    ASSERT_TRUE(
        WriteKv(
            pool,
            {.layer = 0, .num_tokens = 1, .k = values.data(), .v = values.data(), .slots = &slot})
            .ok());
    ASSERT_EQ(ScaleFor(dtype, DTypeMaxCode(dtype)), 1.0f);
    const std::vector<float> q(256, 0.01f);
    const int32_t table = 0, len = 1;
    for (auto [isa, vnni] : {std::pair{Isa::kAvx512, true},
                             {Isa::kAvx512, false},
                             {Isa::kAvx2, false},
                             {Isa::kPortable, false}}) {
      if (KernelPath::Lacks(isa, vnni)) continue;
      KernelPath path(isa, vnni);
      std::vector<float> out(256, -1);
      ASSERT_TRUE(PagedAttentionDecode(pool,
                                       {.layer = 0,
                                        .num_seqs = 1,
                                        .num_q_heads = 1,
                                        .scale = 0.0625f,
                                        .q = q.data(),
                                        .out = out.data(),
                                        .block_tables = &table,
                                        .table_stride = 1,
                                        .seq_lens = &len,
                                        .max_seq_len = 1},
                                       nullptr)
                      .ok());
      for (int c = 0; c < 256; ++c) {
        // int8 on the VNNI path: the probability 1 as 32767 steps of 1/32767 (a float rounding).
        EXPECT_FLOAT_EQ(out[c], values[c])
            << DTypeName(dtype) << " code " << c << " on " << PathName(isa, vnni);
      }
    }
  }
}

TEST(Fp8Test, EveryCodeRoundTripsAndRoundingIsToNearestEven) {
  for (int c = 0; c < 256; ++c) {
    const float f = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_EQ(FloatToFp8E4M3(f), c);
      continue;
    }
    EXPECT_EQ(FloatToFp8E4M3(f), c) << c << " " << f;
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));      // smallest subnormal
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), FloatToFp8E4M3(1.0f));   // tie to even mantissa 000
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), FloatToFp8E4M3(1.25f));  // tie to even mantissa 010
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0);        // tie between 0 and 2^-9
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(3.0f, -10)), 2);        // tie between codes 1 and 2
  EXPECT_EQ(FloatToFp8E4M3(500.0f), 0x7E);                    // saturates, no infinity
  EXPECT_EQ(FloatToFp8E4M3(-INFINITY), 0xFE);
}

TEST(Int8Test, RoundsToNearestEvenAndSaturatesSymmetrically) {
  EXPECT_EQ(FloatToInt8(2.5f), 2);
  EXPECT_EQ(FloatToInt8(3.5f), 4);
  EXPECT_EQ(FloatToInt8(-2.5f), -2);
  EXPECT_EQ(FloatToInt8(126.6f), 127);
  EXPECT_EQ(FloatToInt8(300.0f), 127);
  EXPECT_EQ(FloatToInt8(-300.0f), -127);
  EXPECT_EQ(FloatToInt8(NAN), 0);
}

// The AVX2 row conversions WriteKv uses are the scalar ones, bit for bit.
TEST(ConvertTest, VectorRowsMatchTheScalarConversions) {
  if (DetectedIsa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  const internal::ConvertFns vec = internal::ConvertAvx2(), scalar = internal::ConvertPortable();
  std::mt19937 rng(3);
  std::vector<float> src = test_util::RandomFloats(4096, &rng);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = std::ldexp(src[i], static_cast<int>(i % 40) - 20);
  const float specials[] = {0.0f,
                            -0.0f,
                            448.0f,
                            464.0f,
                            1e9f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            std::ldexp(1.0f, -10),
                            std::ldexp(3.0f, -10),
                            2.5f,
                            -3.5f,
                            126.5f,
                            127.5f,
                            -127.5f,
                            65520.0f,
                            1e-8f,
                            3.0e38f};
  std::copy(std::begin(specials), std::end(specials), src.begin());
  for (int d = 0; d < kNumDTypes; ++d) {
    const int64_t bytes = static_cast<int64_t>(src.size()) * DTypeSize(static_cast<DType>(d));
    std::vector<char> a(static_cast<size_t>(bytes)), b(a.size());
    vec.narrow[d](src.data(), static_cast<int>(src.size()), 0.75f, a.data());
    scalar.narrow[d](src.data(), static_cast<int>(src.size()), 0.75f, b.data());
    EXPECT_EQ(a, b) << DTypeName(static_cast<DType>(d));
    if (vec.rescale[d] == nullptr) continue;
    vec.rescale[d](a.data(), static_cast<int>(src.size()), 0.3f);
    scalar.rescale[d](b.data(), static_cast<int>(src.size()), 0.3f);
    for (size_t i = 0; i < a.size(); ++i) {  // NaN codes aside (garbage in a stale slot)
      if ((b[i] & 0x7F) == 0x7F && d == static_cast<int>(DType::kFp8E4M3)) continue;
      ASSERT_EQ(a[i], b[i]) << DTypeName(static_cast<DType>(d)) << " " << i;
    }
  }
  EXPECT_TRUE(std::isnan(vec.absmax(src.data(), 64)));
  EXPECT_EQ(vec.absmax(src.data() + 32, 64), scalar.absmax(src.data() + 32, 64));
}

// A block's V scale is the factor of its codes whatever its sign (WriteKv writes none below 0, but
// the layout does not forbid one): with the scales of some blocks negated, every path returns what
// the portable one does. The VNNI path's int8 V fixed point once scaled each chunk by its largest
// probability times scale, signed: a chunk of negative scales came out 0, and one where a
// negative product outweighed the largest positive one wrapped around.
TEST(EightBitDecodeTest, NegativeVScalesMatchThePortablePath) {
  PoolLayout layout{.block_size = 16,
                    .num_layers = 1,
                    .num_kv_heads = 2,
                    .head_dim = 64,
                    .dtype = DType::kBF16,
                    .num_blocks = 5};
  layout.SetKvDType(0, KvSide::kV, DType::kInt8);
  std::vector<char> arena(static_cast<size_t>(layout.arena_bytes()));
  const KvPoolView pool{arena.data(), layout};
  std::mt19937 rng(17);
  const int32_t len = 70;
  const std::vector<float> k = test_util::RandomFloats(len * 2 * 64, &rng);
  std::vector<float> v = test_util::RandomFloats(len * 2 * 64, &rng);
  // Block 1's values a tenth of the others': its positive products are outweighed by block 0's
  // negative ones in the chunk the two share.
  for (int64_t i = 16 * 2 * 64; i < 32 * 2 * 64; ++i) v[i] *= 0.1f;
  std::vector<int64_t> slots(len);
  std::iota(slots.begin(), slots.end(), 0);
  ASSERT_TRUE(
      WriteKv(pool,
              {.layer = 0, .num_tokens = len, .k = k.data(), .v = v.data(), .slots = slots.data()})
          .ok());
  // Blocks 0, 2 and 3: the first chunk (blocks 0 and 1) mixed, the second all negative.
  for (int32_t block : {0, 2, 3}) {
    for (int h = 0; h < 2; ++h) pool.Layer(0).v_scales(block)[h] *= -1.0f;
  }
  const std::vector<int32_t> table = {0, 1, 2, 3, 4};
  const std::vector<float> q = test_util::RandomFloats(4 * 64, &rng);
  auto decode = [&](Isa isa, bool vnni) {
    KernelPath path(isa, vnni);
    std::vector<float> out(q.size(), -1);
    EXPECT_TRUE(PagedAttentionDecode(pool,
                                     {.layer = 0,
                                      .num_seqs = 1,
                                      .num_q_heads = 4,
                                      .scale = 0.125f,
                                      .q = q.data(),
                                      .out = out.data(),
                                      .block_tables = table.data(),
                                      .table_stride = 5,
                                      .seq_lens = &len,
                                      .max_seq_len = len},
                                     nullptr)
                    .ok());
    return out;
  };
  const std::vector<float> portable = decode(Isa::kPortable, false);
  for (auto [isa, vnni] :
       {std::pair{Isa::kAvx512, true}, {Isa::kAvx512, false}, {Isa::kAvx2, false}}) {
    if (KernelPath::Lacks(isa, vnni)) continue;
    bool nan = false;
    const double error = NormalizedError(decode(isa, vnni), portable, &nan);
    EXPECT_LT(error, KernelTolerance(DType::kInt8, vnni)) << PathName(isa, vnni);
    EXPECT_FALSE(nan);
    RecordProperty(PathName(isa, vnni) + "_error", fmt::format("{:.3g}", error));
  }
}

// WriteKv on an 8-bit layer, one token at a time as decode appends them.
class QuantizedWriteTest : public ::testing::TestWithParam<DType> {
 protected:
  QuantizedWriteTest() : arena_(static_cast<size_t>(layout_.arena_bytes())) {
    layout_.dtype = GetParam();
    arena_.assign(static_cast<size_t>(layout_.arena_bytes()), 0);
    pool_ = {arena_.data(), layout_};
  }
  // Writes `rows` (each [2][16]) at slots `first`, `first` + 1, ... of block 1.
  absl::Status Write(const std::vector<float>& rows, int64_t first) {
    std::vector<int64_t> slots;
    for (size_t i = 0; i < rows.size() / 32; ++i)
      slots.push_back(16 + first + static_cast<int64_t>(i));
    return WriteKv(pool_, {.layer = 0,
                           .num_tokens = static_cast<int32_t>(slots.size()),
                           .k = rows.data(),
                           .v = rows.data(),
                           .slots = slots.data()});
  }
  float Scale(int head) const {
    float s;
    std::memcpy(&s, pool_.k(1, 0) + 16 * 32 + 4 * head, 4);
    return s;
  }
  std::vector<float> Stored(int32_t len) const {
    const int32_t table[] = {1};
    return test_util::StoredRows(pool_, table, 0, KvSide::kK, len);
  }

  PoolLayout layout_{
      .block_size = 16, .num_layers = 1, .num_kv_heads = 2, .head_dim = 16, .num_blocks = 3};
  std::vector<char> arena_;
  KvPoolView pool_;
};

TEST_P(QuantizedWriteTest, AppendedTokensKeepEarlierValuesWhenTheScaleGrows) {
  std::mt19937 rng(5);
  std::vector<float> all;
  double bound[2] = {0, 0};  // each re-encoding adds at most half a step of the new scale
  for (int t = 0; t < 16; ++t) {
    std::vector<float> row = test_util::RandomFloats(32, &rng);
    for (float& x : row) x *= 1.0f + 0.5f * static_cast<float>(t);  // growing magnitudes
    ASSERT_TRUE(Write(row, t).ok());
    all.insert(all.end(), row.begin(), row.end());
    for (int h = 0; h < 2; ++h) {
      float absmax = 0;
      for (size_t i = 0; i < all.size(); ++i) {
        if (i % 32 / 16 == static_cast<size_t>(h)) absmax = std::max(absmax, std::abs(all[i]));
      }
      EXPECT_FLOAT_EQ(Scale(h), ScaleFor(GetParam(), absmax)) << "token " << t;
      bound[h] += GetParam() == DType::kInt8 ? 0.5 * Scale(h) : 0.0;
    }
  }
  const std::vector<float> stored = Stored(16);
  for (size_t i = 0; i < all.size(); ++i) {
    const int h = static_cast<int>(i % 32 / 16);
    // int8: the accumulated half steps; fp8: one encoding's 1/16 of the value (4 significant
    // bits) or half the subnormal step: re-encoding under a power-of-two scale is exact (above
    // the subnormals: one more subnormal step per doubling at most).
    const double allowed =
        GetParam() == DType::kInt8
            ? bound[h] + 1e-6
            : std::abs(all[i]) / 16 + 16 * std::ldexp(static_cast<double>(Scale(h)), -9);
    EXPECT_LE(std::abs(stored[i] - all[i]), allowed) << i;
  }
}

TEST_P(QuantizedWriteTest, SlotZeroStartsTheBlockAfresh) {
  std::mt19937 rng(6);
  std::vector<float> big = test_util::RandomFloats(32 * 16, &rng);
  for (float& x : big) x *= 100;
  ASSERT_TRUE(Write(big, 0).ok());
  std::vector<float> small = test_util::RandomFloats(32, &rng);
  ASSERT_TRUE(Write(small, 0).ok());
  float absmax = 0;
  for (int i = 0; i < 16; ++i) absmax = std::max(absmax, std::abs(small[i]));
  EXPECT_FLOAT_EQ(Scale(0), ScaleFor(GetParam(), absmax));
  const std::vector<float> stored = Stored(1);
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(stored[i], small[i], 0.07 * absmax) << i;
}

TEST_P(QuantizedWriteTest, NaNOrPoisonReadsAsNaNUntilTheBlockRestarts) {
  std::mt19937 rng(7);
  std::vector<float> rows = test_util::RandomFloats(32 * 4, &rng);
  ASSERT_TRUE(Write(rows, 0).ok());
  std::vector<float> bad = test_util::RandomFloats(32, &rng);
  bad[20] = NAN;  // head 1
  ASSERT_TRUE(Write(bad, 4).ok());
  EXPECT_TRUE(std::isfinite(Scale(0)));
  EXPECT_TRUE(std::isnan(Scale(1)));
  ASSERT_TRUE(Write(rows, 5).ok());  // appending does not clear it
  EXPECT_TRUE(std::isnan(Scale(1)));

  // Decode over the block: head 1's queries (KV head 1) come out NaN, head 0's finite.
  const std::vector<float> q(2 * 16, 0.1f);
  std::vector<float> out(q.size());
  const int32_t table[] = {1}, len[] = {6};
  const DecodeArgs args{.layer = 0,
                        .num_seqs = 1,
                        .num_q_heads = 2,
                        .scale = 0.25f,
                        .q = q.data(),
                        .out = out.data(),
                        .block_tables = table,
                        .table_stride = 1,
                        .seq_lens = len,
                        .max_seq_len = 6};
  ASSERT_TRUE(PagedAttentionDecode(pool_, args, nullptr).ok());
  for (int d = 0; d < 16; ++d) {
    EXPECT_TRUE(std::isfinite(out[d]));
    EXPECT_TRUE(std::isnan(out[16 + d]));
  }
  ASSERT_TRUE(Write(rows, 0).ok());  // restarted
  EXPECT_TRUE(std::isfinite(Scale(1)));

  const int32_t poisoned[] = {1};
  ASSERT_TRUE(
      FillBlocks(pool_, {.num_blocks = 1, .blocks = poisoned, .pattern = FillPattern::kPoison})
          .ok());
  ASSERT_TRUE(PagedAttentionDecode(pool_, args, nullptr).ok());
  for (float x : out) EXPECT_TRUE(std::isnan(x));
}

// A NaN V scale alone (K finite) reaches the output too, on every path: the VNNI path's 16-bit
// fixed point or bf16 probabilities must not lose it.
TEST_P(QuantizedWriteTest, NaNVScaleAloneReadsAsNaNOnEveryPath) {
  std::mt19937 rng(9);
  ASSERT_TRUE(Write(test_util::RandomFloats(32 * 16, &rng), 0).ok());
  // Head 1's V scale of block 1 (after the V chunk's codes).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(pool_.v(1, 0) + 16 * 32 + 4, &nan, 4);
  const std::vector<float> q = test_util::RandomFloats(2 * 16, &rng);
  const int32_t table[] = {1}, len[] = {16};
  for (auto [isa, vnni] : {std::pair{Isa::kAvx512, true},
                           {Isa::kAvx512, false},
                           {Isa::kAvx2, false},
                           {Isa::kPortable, false}}) {
    if (KernelPath::Lacks(isa, vnni)) continue;
    KernelPath path(isa, vnni);
    std::vector<float> out(q.size());
    ASSERT_TRUE(PagedAttentionDecode(pool_,
                                     {.layer = 0,
                                      .num_seqs = 1,
                                      .num_q_heads = 2,
                                      .scale = 0.25f,
                                      .q = q.data(),
                                      .out = out.data(),
                                      .block_tables = table,
                                      .table_stride = 1,
                                      .seq_lens = len,
                                      .max_seq_len = 16},
                                     nullptr)
                    .ok());
    for (int d = 0; d < 16; ++d) {
      EXPECT_TRUE(std::isfinite(out[d])) << PathName(isa, vnni);
      EXPECT_TRUE(std::isnan(out[16 + d])) << PathName(isa, vnni);
    }
  }
}

TEST_P(QuantizedWriteTest, OutOfRangeSlotChangesNothing) {
  std::mt19937 rng(8);
  ASSERT_TRUE(Write(test_util::RandomFloats(32 * 3, &rng), 0).ok());
  const std::vector<char> before = arena_;
  const std::vector<float> rows = test_util::RandomFloats(64, &rng);
  const int64_t slots[] = {17, 3 * 16};  // the second is past the pool
  EXPECT_EQ(
      WriteKv(pool_,
              {.layer = 0, .num_tokens = 2, .k = rows.data(), .v = rows.data(), .slots = slots})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_, before);
}

INSTANTIATE_TEST_SUITE_P(EightBit, QuantizedWriteTest,
                         ::testing::Values(DType::kFp8E4M3, DType::kInt8),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace kvpool::kernels::cpu
