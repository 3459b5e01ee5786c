// PoolLayout with per-layer, per-side dtypes: chunk sizes and offsets by the arithmetic
// pool_layout.h documents, the fingerprint, validation, FillBlocks per chunk, and the capacity
// of the daemon's default 256 MiB pool in each precision; the window group's region.

#include "kernels/pool_layout.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "xxhash.h"

namespace kvpool::kernels {
namespace {

// Layer 0: K fp8, V bf16; layer 1: K f32, V int8; block_size 4, 2 KV heads of 8. The client's
// tests/client/pool_mapping_test.cc holds its mapping to the same numbers.
PoolLayout Mixed() {
  PoolLayout l{.block_size = 4,
               .num_layers = 2,
               .num_kv_heads = 2,
               .head_dim = 8,
               .dtype = DType::kF32,
               .num_blocks = 16};
  l.SetKvDType(0, KvSide::kK, DType::kFp8E4M3);
  l.SetKvDType(0, KvSide::kV, DType::kBF16);
  l.SetKvDType(1, KvSide::kV, DType::kInt8);
  return l;
}

TEST(PoolLayoutTest, EachChunkHasItsOwnDTypesSize) {
  const PoolLayout l = Mixed();
  // 8-bit: 4 * 2 * 8 codes + 2 f32 scales = 72, padded to 80. bf16: 128. f32: 256.
  EXPECT_EQ(l.chunk_bytes(0, KvSide::kK), 80);
  EXPECT_EQ(l.chunk_bytes(0, KvSide::kV), 128);
  EXPECT_EQ(l.chunk_bytes(1, KvSide::kK), 256);
  EXPECT_EQ(l.chunk_bytes(1, KvSide::kV), 80);
  EXPECT_EQ(l.block_bytes(), 80 + 128 + 256 + 80);  // the sum, not 2 * 2 * 256
  EXPECT_FALSE(l.uniform());
  const LayerLayout l0 = l.Layer(0), l1 = l.Layer(1);
  EXPECT_EQ(l0.k_offset, 0);
  EXPECT_EQ(l0.v_offset, 80);
  EXPECT_EQ(l0.k_scales_offset, 64);
  EXPECT_EQ(l1.k_offset, 208);
  EXPECT_EQ(l1.v_offset, 464);
  EXPECT_EQ(l1.v_scales_offset, 528);
  EXPECT_EQ(l1.k_row_bytes, 64);
  EXPECT_EQ(l1.v_row_bytes, 16);
  EXPECT_EQ(l.k_offset(3, 1), 3 * 544 + 208);
  EXPECT_EQ(l.v_offset(3, 0), 3 * 544 + 80);
  EXPECT_DOUBLE_EQ(l.bytes_per_token(0), (80.0 + 128.0) / 4);
  EXPECT_EQ(l.DTypesString(), "0:fp8/bf16 1:f32/int8");
  for (int32_t layer = 0; layer < 2; ++layer) {
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      EXPECT_EQ(l.chunk_bytes(layer, side) % 16, 0);  // every chunk starts 16-byte aligned
    }
  }
}

TEST(PoolLayoutTest, FingerprintCoversEveryLayersDTypes) {
  const PoolLayout base{.block_size = 16, .num_layers = 4, .num_kv_heads = 4, .head_dim = 64};
  PoolLayout v_int8 = base;
  v_int8.SetKvDType(3, KvSide::kV, DType::kInt8);
  PoolLayout k_int8 = base;
  k_int8.SetKvDType(3, KvSide::kK, DType::kInt8);
  EXPECT_NE(base.Hash(), v_int8.Hash());
  EXPECT_NE(v_int8.Hash(), k_int8.Hash());  // K and V apart
  EXPECT_FALSE(base == v_int8);
  // Spelling does not matter: every layer overridden to fp8 is the fp8 layout.
  PoolLayout fp8 = base;
  fp8.dtype = DType::kFp8E4M3;
  PoolLayout spelled = base;
  for (int32_t l = 0; l < 4; ++l) {
    spelled.SetKvDType(l, KvSide::kK, DType::kFp8E4M3);
    spelled.SetKvDType(l, KvSide::kV, DType::kFp8E4M3);
  }
  EXPECT_EQ(fp8.Hash(), spelled.Hash());
  EXPECT_TRUE(fp8 == spelled);
  EXPECT_TRUE(spelled.uniform());
  EXPECT_NE(fp8.Hash(), base.Hash());
  PoolLayout same = base;
  same.SetKvDType(2, KvSide::kK, DType::kBF16);  // an override equal to the default
  EXPECT_EQ(same.Hash(), base.Hash());
}

TEST(PoolLayoutTest, ValidationNamesTheProblem) {
  PoolLayout l{.block_size = 16, .num_layers = 4, .num_kv_heads = 4, .head_dim = 64};
  EXPECT_TRUE(ValidateLayout(l).ok());
  PoolLayout past = l;
  past.SetKvDType(4, KvSide::kV, DType::kInt8);  // layer 4 of 4
  EXPECT_EQ(ValidateLayout(past).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ValidateLayout(past).message().find("layer 4"), std::string_view::npos);
  PoolLayout many = l;
  many.num_layers = kMaxLayers + 1;
  EXPECT_EQ(ValidateLayout(many).code(), absl::StatusCode::kInvalidArgument);
  PoolLayout code = l;
  code.overrides[0][1] = kNumDTypes + 1;
  EXPECT_EQ(ValidateLayout(code).code(), absl::StatusCode::kInvalidArgument);
}

// The state group (docs/hybrid-groups.md §2): slots after the blocks, from the next page, paid
// for first out of the budget; copied and zeroed by slot id through StateSlotLayout.
TEST(PoolLayoutTest, StateSlotsFollowTheBlocksAndComeOutOfTheBudgetFirst) {
  const PoolLayout shape{.block_size = 16, .num_layers = 1, .num_kv_heads = 4, .head_dim = 64};
  PoolLayout with = shape;
  with.num_state_slots = 3;
  with.state_slot_bytes = 6400;
  const int64_t budget = 1 << 20;
  absl::StatusOr<PoolLayout> sized = LayoutForBudget(with, budget);
  ASSERT_TRUE(sized.ok()) << sized.status();
  EXPECT_EQ(sized->state_offset() % PoolLayout::kStatePageBytes, 0);
  EXPECT_GE(sized->state_offset(), sized->kv_bytes());
  EXPECT_EQ(sized->arena_bytes(), sized->state_offset() + 3 * 6400);
  EXPECT_LE(sized->arena_bytes(), budget);
  // One block more would not fit beside the slots.
  PoolLayout more = *sized;
  ++more.num_blocks;
  EXPECT_GT(more.arena_bytes(), budget);
  // Without slots the layout, its size and its hash are exactly as before state groups.
  absl::StatusOr<PoolLayout> plain = LayoutForBudget(shape, budget);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->arena_bytes(), plain->kv_bytes());
  EXPECT_EQ(plain->num_blocks, budget / shape.block_bytes());
  EXPECT_NE(sized->Hash(), plain->Hash());  // states of another size are not interchangeable
  PoolLayout fewer = *sized;
  fewer.num_state_slots = 1;
  EXPECT_EQ(fewer.Hash(), sized->Hash());  // the count, like num_blocks, is not in it
  EXPECT_FALSE(fewer == *sized);
  // Too many slots for the budget, and bad slot shapes.
  PoolLayout crowded = with;
  crowded.num_state_slots = 200;
  EXPECT_EQ(LayoutForBudget(crowded, budget).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(LayoutForBudget(crowded, budget).status().message().find("after 200 state slots"),
            std::string_view::npos);
  PoolLayout odd = with;
  odd.state_slot_bytes = 100;  // not a multiple of 64
  EXPECT_EQ(ValidateLayout(odd).code(), absl::StatusCode::kInvalidArgument);
  PoolLayout empty = with;
  empty.state_slot_bytes = 0;
  EXPECT_EQ(ValidateLayout(empty).code(), absl::StatusCode::kInvalidArgument);

  // Copy and zero slots by id, through the slots' own view, leaving the blocks alone.
  std::vector<char> arena(static_cast<size_t>(sized->arena_bytes()), 7);
  const KvPoolView view{arena.data(), *sized};
  const KvPoolView slots = view.StateSlots();
  EXPECT_EQ(slots.layout.block_bytes(), 6400);
  EXPECT_EQ(slots.layout.num_blocks, 3);
  std::memset(view.state(1), 9, 6400);
  const int32_t pairs[] = {1, 2};
  ASSERT_TRUE(cpu::CopyBlocks(slots, {.num_pairs = 1, .pairs = pairs}).ok());
  const int32_t zero[] = {0};
  ASSERT_TRUE(cpu::FillBlocks(slots, {.num_blocks = 1, .blocks = zero}).ok());
  for (int64_t i = 0; i < 6400; ++i) {
    ASSERT_EQ(view.state(0)[i], 0);
    ASSERT_EQ(view.state(2)[i], 9);
  }
  for (int64_t i = 0; i < sized->state_offset(); ++i) ASSERT_EQ(arena[static_cast<size_t>(i)], 7);
  const int32_t past[] = {3};
  EXPECT_FALSE(cpu::FillBlocks(slots, {.num_blocks = 1, .blocks = past}).ok());
}

// Layers 0-1 full (f32), layers 2-3 the window group (layer 3's V int8); block_size 4, 2 KV heads
// of 8: a chunk is 256 bytes in f32, 80 in int8. 5 main blocks, 3 window blocks.
PoolLayout Windowed() {
  PoolLayout l{.block_size = 4,
               .num_layers = 4,
               .num_kv_heads = 2,
               .head_dim = 8,
               .dtype = DType::kF32,
               .num_blocks = 5,
               .num_window_layers = 2,
               .num_window_blocks = 3};
  l.SetKvDType(3, KvSide::kV, DType::kInt8);
  return l;
}

// docs/hybrid-groups.md §2: the window layers' chunks in window blocks of their own, from the
// page after the main blocks; the main blocks hold the full layers only; state slots after both.
TEST(PoolLayoutTest, TheWindowLayersLiveInTheirOwnRegion) {
  PoolLayout l = Windowed();
  ASSERT_TRUE(ValidateLayout(l).ok()) << ValidateLayout(l);
  EXPECT_EQ(l.num_full_layers(), 2);
  EXPECT_EQ(l.block_bytes(), 4 * 256);                      // layers 0 and 1
  EXPECT_EQ(l.window_block_bytes(), 256 + 256 + 256 + 80);  // layers 2 and 3
  EXPECT_EQ(l.kv_bytes(), 5 * 1024);
  EXPECT_EQ(l.window_offset(), 8192);  // 5120 rounded up to the page
  EXPECT_EQ(l.arena_bytes(), 8192 + 3 * 848);
  const LayerLayout l1 = l.Layer(1), l2 = l.Layer(2), l3 = l.Layer(3);
  EXPECT_EQ(l1.k_offset, 512);
  EXPECT_EQ(l1.block_bytes, 1024);
  EXPECT_EQ(l1.num_blocks, 5);
  EXPECT_EQ(l2.k_offset, 0);  // within a window block
  EXPECT_EQ(l2.v_offset, 256);
  EXPECT_EQ(l3.k_offset, 512);
  EXPECT_EQ(l3.v_offset, 768);
  EXPECT_EQ(l3.v_scales_offset, 768 + 64);
  for (const LayerLayout& w : {l2, l3}) {
    EXPECT_EQ(w.block_bytes, 848);
    EXPECT_EQ(w.num_blocks, 3);
  }
  EXPECT_EQ(l.k_offset(4, 1), 4 * 1024 + 512);
  EXPECT_EQ(l.k_offset(2, 3), 8192 + 2 * 848 + 512);
  EXPECT_EQ(l.v_offset(1, 2), 8192 + 848 + 256);
  std::vector<char> arena(static_cast<size_t>(l.arena_bytes()));
  const KvPoolView view{arena.data(), l};
  EXPECT_EQ(view.Layer(3).k(2), arena.data() + 8192 + 2 * 848 + 512);
  EXPECT_EQ(view.Layer(3).v_scales(1), reinterpret_cast<float*>(arena.data() + 8192 + 848 + 832));
  EXPECT_EQ(view.Layer(1).v(4), arena.data() + 4 * 1024 + 768);
  EXPECT_EQ(view.k(2, 3), view.Layer(3).k(2));
  EXPECT_EQ(view.v(4, 0), view.Layer(0).v(4));
  // State slots follow the window blocks.
  l.num_state_slots = 2;
  l.state_slot_bytes = 640;
  EXPECT_EQ(l.state_offset(), 12288);  // 8192 + 2544 rounded up
  EXPECT_EQ(l.arena_bytes(), 12288 + 2 * 640);
  EXPECT_NE(l.ToString().find("window_layers=2 window_blocks=3"), std::string::npos);
}

// Without a window group, offsets and hashes are exactly the ones before window groups: the
// hash of a uniform layout is still XXH3 of its five shape fields.
TEST(PoolLayoutTest, TheWindowGroupIsInTheHashOnlyWhenThereIsOne) {
  const PoolLayout plain{.block_size = 16, .num_layers = 4, .num_kv_heads = 4, .head_dim = 64};
  const int64_t fields[] = {16, 4, 4, 64, static_cast<int64_t>(DType::kBF16)};
  EXPECT_EQ(plain.Hash(), XXH3_64bits(fields, sizeof(fields)));
  EXPECT_EQ(plain.Layer(3).k_offset, 3 * 2 * 2 * 16 * 4 * 64);
  EXPECT_EQ(plain.window_block_bytes(), 0);
  EXPECT_EQ(plain.arena_bytes(), plain.kv_bytes());
  PoolLayout two = plain;
  two.num_window_layers = 2;
  two.num_window_blocks = 10;
  PoolLayout one = plain;
  one.num_window_layers = 1;
  one.num_window_blocks = 10;
  EXPECT_NE(two.Hash(), plain.Hash());
  EXPECT_NE(two.Hash(), one.Hash());
  PoolLayout fewer = two;
  fewer.num_window_blocks = 3;  // the count, like num_blocks, is not in it
  EXPECT_EQ(fewer.Hash(), two.Hash());
  EXPECT_FALSE(fewer == two);
  EXPECT_TRUE(two == two);
  EXPECT_FALSE(one == two);
  PoolLayout states = plain, both = two;
  states.state_slot_bytes = both.state_slot_bytes = 64;
  EXPECT_NE(states.Hash(), both.Hash());
  EXPECT_NE(both.Hash(), two.Hash());
}

TEST(PoolLayoutTest, ValidationRefusesABadWindowGroup) {
  const PoolLayout good = Windowed();
  EXPECT_TRUE(ValidateLayout(good).ok());
  auto refused = [](PoolLayout l) {
    const absl::Status s = ValidateLayout(l);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return s.message().find("window") != std::string_view::npos;
  };
  PoolLayout all = good;
  all.num_window_layers = 4;  // the main blocks must keep a layer
  EXPECT_TRUE(refused(all));
  PoolLayout negative = good;
  negative.num_window_layers = -1;
  EXPECT_TRUE(refused(negative));
  PoolLayout blocks = good;
  blocks.num_window_blocks = -2;
  EXPECT_TRUE(refused(blocks));
  PoolLayout orphan = good;
  orphan.num_window_layers = 0;  // window blocks without window layers
  EXPECT_TRUE(refused(orphan));
}

// The window blocks are asked for by count and paid for before the main blocks (after the state
// slots): the main blocks get whole pages up to the window region.
TEST(PoolLayoutTest, WindowBlocksComeOutOfTheBudgetBeforeTheMainBlocks) {
  PoolLayout shape = Windowed();
  shape.num_window_blocks = 7;
  shape.num_state_slots = 2;
  shape.state_slot_bytes = 640;
  for (const int64_t budget : {int64_t{40000}, int64_t{65536}, int64_t{1} << 20}) {
    absl::StatusOr<PoolLayout> sized = LayoutForBudget(shape, budget);
    ASSERT_TRUE(sized.ok()) << sized.status();
    EXPECT_EQ(sized->num_window_blocks, 7);
    EXPECT_EQ(sized->window_offset() % PoolLayout::kStatePageBytes, 0);
    EXPECT_EQ(sized->state_offset() % PoolLayout::kStatePageBytes, 0);
    EXPECT_GE(sized->state_offset(), sized->window_offset() + 7 * 848);
    EXPECT_LE(sized->arena_bytes(), budget);
    PoolLayout more = *sized;
    ++more.num_blocks;
    EXPECT_GT(more.arena_bytes(), budget) << budget;
    // The same budget without the window region holds more main blocks.
    PoolLayout plain = shape;
    plain.num_window_layers = plain.num_window_blocks = 0;
    plain.num_layers = 2;
    plain.overrides = {};
    absl::StatusOr<PoolLayout> alone = LayoutForBudget(plain, budget);
    ASSERT_TRUE(alone.ok());
    EXPECT_GT(alone->num_blocks, sized->num_blocks);
  }
  // The window blocks alone overflow a small budget: the error says what was paid for.
  shape.num_window_blocks = 60;
  const absl::Status crowded = LayoutForBudget(shape, 40000).status();
  EXPECT_EQ(crowded.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(crowded.message().find("and 60 window blocks of 848 bytes"), std::string_view::npos)
      << crowded;
}

// CopyBlocks and FillBlocks through WindowLayout touch the window blocks named and nothing else;
// through the pool itself, the main blocks named (the window layers' chunks are not theirs).
TEST(PoolLayoutTest, WindowLayoutCopiesAndFillsWindowBlocksOnly) {
  const PoolLayout l = Windowed();
  const PoolLayout w = WindowLayout(l);
  EXPECT_EQ(w.num_layers, 2);
  EXPECT_EQ(w.num_blocks, 3);
  EXPECT_EQ(w.block_bytes(), l.window_block_bytes());
  EXPECT_EQ(w.v_dtype(1), DType::kInt8);
  EXPECT_EQ(w.k_dtype(1), DType::kF32);
  std::vector<char> arena(static_cast<size_t>(l.arena_bytes()), 7);
  std::vector<char> want = arena;
  const KvPoolView pool{arena.data(), l};
  const KvPoolView window = pool.Window();
  EXPECT_EQ(static_cast<char*>(window.base), arena.data() + l.window_offset());
  const int64_t wbb = l.window_block_bytes();
  std::memset(window.k(1, 0), 9, static_cast<size_t>(wbb));  // window block 1
  const int32_t pairs[] = {1, 2};
  ASSERT_TRUE(cpu::CopyBlocks(window, {.num_pairs = 1, .pairs = pairs}).ok());
  const int32_t zero[] = {0};
  ASSERT_TRUE(cpu::FillBlocks(window, {.num_blocks = 1, .blocks = zero}).ok());
  const auto at = [&](int64_t offset) { return want.begin() + offset; };
  std::fill(at(l.window_offset()), at(l.window_offset() + wbb), 0);
  std::fill(at(l.window_offset() + wbb), at(l.window_offset() + 3 * wbb), 9);
  EXPECT_TRUE(arena == want);
  // Poison of window block 2 reaches its last chunk's scales and stops at the region's end;
  // poison of main block 4 (the last) stops at its full layers' chunks.
  const int32_t two[] = {2};
  ASSERT_TRUE(
      cpu::FillBlocks(window, {.num_blocks = 1, .blocks = two, .pattern = FillPattern::kPoison})
          .ok());
  EXPECT_TRUE(std::isnan(window.Layer(1).v_scales(2)[1]));
  EXPECT_TRUE(std::isnan(LoadAsFloat(pool.Layer(2).k(2), DType::kF32)));
  const int32_t four[] = {4};
  ASSERT_TRUE(
      cpu::FillBlocks(pool, {.num_blocks = 1, .blocks = four, .pattern = FillPattern::kPoison})
          .ok());
  EXPECT_TRUE(std::isnan(LoadAsFloat(pool.Layer(1).v(4) + 252, DType::kF32)));
  for (int64_t i = l.kv_bytes(); i < l.window_offset(); ++i) {
    ASSERT_EQ(arena[static_cast<size_t>(i)], 7) << i;  // the padding before the window region
  }
  EXPECT_EQ(*window.Layer(0).k(1), 9);  // window block 1 untouched by both
  const int32_t past[] = {3};
  EXPECT_FALSE(cpu::FillBlocks(window, {.num_blocks = 1, .blocks = past}).ok());
}

// The KV kernels find a window layer's chunks by window block id, and check ids against the
// window region's blocks, not the main region's.
TEST(PoolLayoutTest, KernelsAddressAWindowLayerByWindowBlock) {
  const PoolLayout l = Windowed();
  std::vector<char> arena(static_cast<size_t>(l.arena_bytes()), 0);
  const KvPoolView pool{arena.data(), l};
  std::vector<float> k(16), v(16);
  for (int i = 0; i < 16; ++i) k[i] = static_cast<float>(i + 1), v[i] = -k[i];
  const int64_t slot[] = {2 * 4 + 1};  // window block 2, row 1
  ASSERT_TRUE(
      cpu::WriteKv(pool, {.layer = 2, .num_tokens = 1, .k = k.data(), .v = v.data(), .slots = slot})
          .ok());
  float got = 0;
  std::memcpy(&got, arena.data() + l.window_offset() + 2 * 848 + 64 + 4 * 5, 4);
  EXPECT_EQ(got, 6.0f);
  const int64_t main_only[] = {4 * 4};  // block 4 exists in the main region, not the window's
  EXPECT_EQ(
      cpu::WriteKv(pool,
                   {.layer = 3, .num_tokens = 1, .k = k.data(), .v = v.data(), .slots = main_only})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      cpu::WriteKv(pool,
                   {.layer = 1, .num_tokens = 1, .k = k.data(), .v = v.data(), .slots = main_only})
          .ok());
  std::vector<float> q(4 * 8), out(4 * 8);
  const int32_t len[] = {3};
  for (const int32_t block : {2, 4}) {
    const int32_t table[] = {block};
    const absl::Status s = cpu::PagedAttentionDecode(pool,
                                                     {.layer = 2,
                                                      .num_seqs = 1,
                                                      .num_q_heads = 4,
                                                      .scale = 1,
                                                      .q = q.data(),
                                                      .out = out.data(),
                                                      .block_tables = table,
                                                      .table_stride = 1,
                                                      .seq_lens = len,
                                                      .max_seq_len = 3},
                                                     nullptr);
    EXPECT_EQ(s.ok(), block == 2) << s;
  }
}

TEST(PoolLayoutTest, PoisonMakesEveryChunkReadAsNaN) {
  const PoolLayout l = Mixed();
  std::vector<char> arena(static_cast<size_t>(l.arena_bytes()), 0);
  const KvPoolView pool{arena.data(), l};
  const int32_t blocks[] = {2};
  ASSERT_TRUE(
      cpu::FillBlocks(pool, {.num_blocks = 1, .blocks = blocks, .pattern = FillPattern::kPoison})
          .ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      const DType d = l.kv_dtype(layer, side);
      const char* chunk = side == KvSide::kK ? pool.k(2, layer) : pool.v(2, layer);
      const int64_t data = l.block_size * l.row_bytes(layer, side);
      for (int64_t i = 0; i < data; i += DTypeSize(d)) {
        float scale = 1.0f;
        if (DTypeHasScales(d)) std::memcpy(&scale, chunk + data + 4 * (i / 8 % 2), 4);
        ASSERT_TRUE(std::isnan(LoadAsFloat(chunk + i, d) * scale)) << layer << " " << i;
      }
    }
  }
  EXPECT_EQ(arena[static_cast<size_t>(l.block_bytes()) - 1], 0);  // block 1 untouched
  EXPECT_EQ(arena[static_cast<size_t>(3 * l.block_bytes())], 0);  // block 3 untouched
}

// The daemon's default pool: 256 MiB of the tiny model's KV (config.proto: 4 layers, 4 KV heads
// of 64, 16 tokens a block). Blocks per layout, from the documented chunk arithmetic written out
// here independently of PoolLayout's.
TEST(PoolLayoutTest, CapacityOfTheDefaultBudgetPerPrecision) {
  constexpr int64_t kBudget = int64_t{256} << 20;
  constexpr int64_t kValues = 16 * 4 * 64;  // per chunk
  const int64_t bf16 = 2 * kValues, f32 = 4 * kValues;
  const int64_t scaled = (kValues + 4 * 4 + 15) / 16 * 16;  // 8-bit codes + 4 scales, padded
  struct Row {
    const char* name;
    PoolLayout layout;
    int64_t block_bytes;
  };
  const PoolLayout base{.block_size = 16, .num_layers = 4, .num_kv_heads = 4, .head_dim = 64};
  auto with = [&](DType d) {
    PoolLayout l = base;
    l.dtype = d;
    return l;
  };
  PoolLayout asym = base;                    // K bf16 / V int8
  PoolLayout mixed = with(DType::kFp8E4M3);  // fp8, first and last layer bf16
  for (int32_t l = 0; l < 4; ++l) asym.SetKvDType(l, KvSide::kV, DType::kInt8);
  for (int32_t l : {0, 3}) {
    mixed.SetKvDType(l, KvSide::kK, DType::kBF16);
    mixed.SetKvDType(l, KvSide::kV, DType::kBF16);
  }
  const std::vector<Row> rows = {
      {"f32", with(DType::kF32), 8 * f32},
      {"bf16", with(DType::kBF16), 8 * bf16},
      {"f16", with(DType::kF16), 8 * bf16},
      {"fp8", with(DType::kFp8E4M3), 8 * scaled},
      {"int8", with(DType::kInt8), 8 * scaled},
      {"K bf16 / V int8", asym, 4 * (bf16 + scaled)},
      {"fp8, layers 0 and 3 bf16", mixed, 4 * bf16 + 4 * scaled},
  };
  const int64_t bf16_blocks = kBudget / (8 * bf16);
  for (const Row& r : rows) {
    const absl::StatusOr<PoolLayout> sized = LayoutForBudget(r.layout, kBudget);
    ASSERT_TRUE(sized.ok()) << sized.status();
    EXPECT_EQ(sized->block_bytes(), r.block_bytes) << r.name;
    EXPECT_EQ(sized->num_blocks, kBudget / r.block_bytes) << r.name;
    std::cout << fmt::format("{:<26} {:>6} bytes/block {:>6} blocks  {:.3f}x bf16\n", r.name,
                             sized->block_bytes(), sized->num_blocks,
                             static_cast<double>(sized->num_blocks) / bf16_blocks);
  }
  const auto ratio = [&](size_t i) {
    return static_cast<double>(kBudget / rows[i].block_bytes) / bf16_blocks;
  };
  EXPECT_GT(ratio(3), 1.98);  // fp8: 2x less the scales (16 bytes a 4 KiB chunk)
  EXPECT_LE(ratio(3), 2.0);
  EXPECT_EQ(ratio(3), ratio(4));
  EXPECT_GT(ratio(5), 1.32);  // K bf16 / V int8: 4/3 less the scales
  EXPECT_LE(ratio(5), 4.0 / 3);
}

}  // namespace
}  // namespace kvpool::kernels
