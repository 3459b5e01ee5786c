#include "client/pool_mapping.h"

#include <fcntl.h>

#include <cstring>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_daemon.h"

namespace kvpool::client {
namespace {

using testing::FakePool;
using ::testing::HasSubstr;
using testing::SmallLayout;

class PoolMappingTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::unique_ptr<PoolMapping>> Map() {
    return PoolMapping::Create(pool_.Response(), pool_.DupFds());
  }
  FakePool pool_{SmallLayout()};
};

TEST_F(PoolMappingTest, WritesThroughKAndVLandInTheBlockMajorLayout) {
  auto mapping = Map();
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  const PoolMapping& m = **mapping;
  EXPECT_TRUE(m.host_accessible());
  EXPECT_EQ(m.num_blocks(), 16);
  EXPECT_EQ(m.arena_bytes(), pool_.arena_bytes());
  EXPECT_EQ(m.generation(5), 1u);

  const BlockRef block{5, 1};
  auto k = m.K(1, block);
  auto v = m.V(1, block);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE(v.ok()) << v.status();
  const int64_t chunk = pool_.layout().chunk_bytes();
  std::memset(*k, 0xAB, static_cast<size_t>(chunk));
  std::memset(*v, 0xCD, static_cast<size_t>(chunk));

  // The daemon's own mapping sees the bytes at block*block_bytes + (2*layer + kv)*chunk_bytes.
  const char* block_start = pool_.arena() + 5 * pool_.layout().block_bytes();
  EXPECT_EQ(static_cast<unsigned char>(block_start[2 * chunk]), 0xAB);
  EXPECT_EQ(static_cast<unsigned char>(block_start[3 * chunk - 1]), 0xAB);
  EXPECT_EQ(static_cast<unsigned char>(block_start[3 * chunk]), 0xCD);
  EXPECT_EQ(static_cast<unsigned char>(block_start[4 * chunk - 1]), 0xCD);
  EXPECT_EQ(block_start[2 * chunk - 1], 0);  // layer 0's V untouched
  auto whole = m.Block(block);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(*whole, *k - 2 * chunk);
}

TEST_F(PoolMappingTest, DetectsReuseAfterTheGenerationMoves) {
  auto mapping = Map();
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  const BlockRef held{3, 1};
  ASSERT_TRUE((*mapping)->K(0, held).ok());

  pool_.generations()[3] = 8;  // the daemon handed block 3 out again
  EXPECT_EQ((*mapping)->generation(3), 8u);
  auto k = (*mapping)->K(0, held);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(k.status().message()),
              HasSubstr("block 3 was reused (generation 8, you hold 1)"));
  EXPECT_EQ((*mapping)->V(0, held).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*mapping)->CheckCurrent(held).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*mapping)->K(0, BlockRef{3, 8}).ok());
  EXPECT_TRUE((*mapping)->K(0, BlockRef{4, 1}).ok());  // other blocks unaffected
}

TEST_F(PoolMappingTest, RejectsLayersAndBlocksOutOfRange) {
  auto mapping = Map();
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  const PoolMapping& m = **mapping;
  EXPECT_EQ(m.K(-1, BlockRef{0, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.K(2, BlockRef{0, 1}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.V(2, BlockRef{0, 1}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.K(0, BlockRef{-1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.K(0, BlockRef{16, 1}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.Block(BlockRef{16, 1}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.generation(16), 0u);
  EXPECT_EQ(m.generation(-1), 0u);
  EXPECT_TRUE(m.K(1, BlockRef{15, 1}).ok());
}

TEST_F(PoolMappingTest, AcceptsDescriptorsInAnyListedOrder) {
  v1::AttachResponse response = pool_.Response();
  response.clear_fds();
  response.add_fds(v1::FD_ROLE_GENERATION_TABLE);
  response.add_fds(v1::FD_ROLE_ARENA);
  std::vector<UniqueFd> fds = pool_.DupFds();
  std::swap(fds[0], fds[1]);
  auto mapping = PoolMapping::Create(response, std::move(fds));
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  pool_.generations()[2] = 5;
  EXPECT_EQ((*mapping)->generation(2), 5u);
}

TEST_F(PoolMappingTest, RejectsAnArenaSmallerThanTheLayout) {
  v1::AttachResponse response = pool_.Response();
  response.mutable_layout()->set_num_blocks(32);  // the memfd holds only 16 blocks
  response.set_arena_bytes(32 * response.layout().block_bytes());
  response.set_mapped_bytes(response.arena_bytes());
  auto mapping = PoolMapping::Create(response, pool_.DupFds());
  EXPECT_EQ(mapping.status().code(), absl::StatusCode::kInvalidArgument);
}

// A pool with a state group (docs/hybrid-groups.md): the slots after the blocks, mapped too.
v1::PoolLayout WithStates(int32_t slots, int64_t slot_bytes, int64_t offset) {
  v1::PoolLayout l = SmallLayout();
  l.set_num_state_slots(slots);
  l.set_state_slot_bytes(slot_bytes);
  l.set_state_offset(offset);
  return l;
}

TEST(PoolMappingStatesTest, StateSlotsAreMappedAfterTheBlocks) {
  const int64_t blocks_end = int64_t{16} * 1024;  // SmallLayout: 16 blocks of 1 KiB
  testing::FakePool pool(WithStates(3, 128, blocks_end + 4096));
  absl::StatusOr<std::unique_ptr<PoolMapping>> m =
      PoolMapping::Create(pool.Response(), pool.DupFds());
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<float*> state = (*m)->State(2);
  ASSERT_TRUE(state.ok()) << state.status();
  (*state)[31] = 2.5f;  // the slot's last value
  float seen = 0;
  std::memcpy(&seen, pool.arena() + blocks_end + 4096 + 2 * 128 + 31 * 4, sizeof(seen));
  EXPECT_EQ(seen, 2.5f);
  EXPECT_EQ((*m)->State(3).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*m)->State(-1).status().code(), absl::StatusCode::kOutOfRange);

  // No state group: every slot is out of range.
  testing::FakePool plain(SmallLayout());
  absl::StatusOr<std::unique_ptr<PoolMapping>> p =
      PoolMapping::Create(plain.Response(), plain.DupFds());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->State(0).status().code(), absl::StatusCode::kOutOfRange);
}

// A pool with a window group (layout.proto): SmallLayout's geometry, layer 0 in the 16 blocks
// of 512 bytes, layers 1 and 2 in 4 window blocks of 1 KiB from byte 8192, each window layer's
// offsets within a window block, as the daemon sends them.
v1::PoolLayout WithWindow() {
  v1::PoolLayout l = SmallLayout();
  l.set_num_layers(3);
  l.set_block_bytes(512);
  l.set_num_window_layers(2);
  l.set_num_window_blocks(4);
  l.set_window_block_bytes(1024);
  l.set_window_offset(8192);
  for (int64_t k : {0, 0, 512}) {
    v1::LayerLayout* layer = l.add_layers();
    layer->set_k_dtype(v1::DTYPE_F32);
    layer->set_v_dtype(v1::DTYPE_F32);
    layer->set_k_offset(k);
    layer->set_v_offset(k + 256);
    layer->set_k_chunk_bytes(256);
    layer->set_v_chunk_bytes(256);
  }
  return l;
}

TEST(PoolMappingWindowTest, AWindowGroupIsMappedAndItsLayersAreNotReadAsMainBlocks) {
  testing::FakePool pool(WithWindow());
  absl::StatusOr<std::unique_ptr<PoolMapping>> m =
      PoolMapping::Create(pool.Response(), pool.DupFds());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->arena_bytes(), 8192 + 4 * 1024);
  absl::StatusOr<char*> v0 = (*m)->V(0, {3, 1});
  ASSERT_TRUE(v0.ok()) << v0.status();
  **v0 = 0x5A;  // the daemon's own mapping sees it at block 3's layer-0 V chunk
  EXPECT_EQ(pool.arena()[3 * 512 + 256], 0x5A);
  // A window layer through a block table's entry, a main layer through a window table's: each
  // would address the other region's bytes.
  EXPECT_EQ((*m)->K(1, {3, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->VScales(2, {3, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->WindowK(0, {3, 0}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolMappingWindowTest, WindowLayersLandInTheirWindowBlocks) {
  testing::FakePool pool(WithWindow());
  absl::StatusOr<std::unique_ptr<PoolMapping>> m =
      PoolMapping::Create(pool.Response(), pool.DupFds());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->num_window_blocks(), 4);
  // Window block 2 starts at 8192 + 2 * 1024; layer 1's K at 0 of it, layer 2's V at 512 + 256.
  for (auto [layer, kv, at] : {std::tuple{1, 0, 8192 + 2048},
                               {1, 1, 8192 + 2048 + 256},
                               {2, 0, 8192 + 2048 + 512},
                               {2, 1, 8192 + 2048 + 768}}) {
    absl::StatusOr<char*> chunk =
        kv == 0 ? (*m)->WindowK(layer, {2, 5}) : (*m)->WindowV(layer, {2, 5});
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    **chunk = static_cast<char>(0x10 + layer * 2 + kv);
    EXPECT_EQ(pool.arena()[at], 0x10 + layer * 2 + kv) << layer << " " << kv;
  }
  absl::StatusOr<char*> whole = (*m)->WindowBlock({3, 0});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole - (*m)->base(), 8192 + 3 * 1024);
  // A released entry, a negative id, one past the region, a layer past the pool; f32 has no
  // scales.
  EXPECT_EQ((*m)->WindowK(1, {-1, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->WindowBlock({-7, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->WindowV(2, {4, 0}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*m)->WindowK(3, {0, 0}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*m)->WindowKScales(1, {0, 0}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PoolMappingWindowTest, APoolWithoutAWindowGroupHasNoWindowBlocks) {
  testing::FakePool pool(testing::SmallLayout());
  absl::StatusOr<std::unique_ptr<PoolMapping>> m =
      PoolMapping::Create(pool.Response(), pool.DupFds());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->WindowBlock({0, 0}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*m)->WindowK(0, {0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolMappingWindowTest, RejectsAnInconsistentWindowGroup) {
  std::vector<v1::PoolLayout> bad(6, WithWindow());
  bad[0].set_window_block_bytes(512);           // not its layers' chunks
  bad[1].set_window_offset(4096);               // inside the blocks
  bad[2].set_num_window_layers(3);              // every layer
  bad[3].set_num_window_blocks(-1);             // a negative count
  bad[4].mutable_layers(1)->set_k_offset(512);  // the window layers do not start a block
  bad[5].set_num_window_layers(0);  // window fields without a window group (layers contiguous)
  bad[5].set_block_bytes(1536);
  for (int i : {1, 2}) {
    bad[5].mutable_layers(i)->set_k_offset(512 * i);
    bad[5].mutable_layers(i)->set_v_offset(512 * i + 256);
  }
  for (const v1::PoolLayout& l : bad) {
    testing::FakePool pool(WithWindow());
    v1::AttachResponse response = pool.Response();
    *response.mutable_layout() = l;
    EXPECT_EQ(PoolMapping::Create(response, pool.DupFds()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << l.ShortDebugString();
  }
}

TEST(PoolMappingStatesTest, RejectsStateSlotsThatOverlapOrOverflow) {
  const int64_t blocks_end = int64_t{16} * 1024;
  for (const v1::PoolLayout& bad :
       {WithStates(2, 128, blocks_end - 64),                   // inside the blocks
        WithStates(0, 128, blocks_end),                        // slots of nothing
        WithStates(2, 0, blocks_end),                          // empty slots
        WithStates(2, 130, blocks_end),                        // not whole floats
        WithStates(1 << 30, int64_t{1} << 40, blocks_end)}) {  // past 64-bit offsets
    testing::FakePool pool(SmallLayout());                     // a memfd of the blocks alone
    v1::AttachResponse response = pool.Response();
    *response.mutable_layout() = bad;
    response.set_arena_bytes(0);
    response.set_mapped_bytes(0);
    EXPECT_EQ(PoolMapping::Create(response, pool.DupFds()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad.ShortDebugString();
  }
  // Slots past the end of the arena the daemon sent.
  testing::FakePool pool(SmallLayout());
  v1::AttachResponse response = pool.Response();
  *response.mutable_layout() = WithStates(2, 128, blocks_end);
  EXPECT_EQ(PoolMapping::Create(response, pool.DupFds()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PoolMappingTest, RejectsAnInconsistentLayout) {
  v1::AttachResponse response = pool_.Response();
  response.mutable_layout()->set_block_bytes(response.layout().block_bytes() + 1);
  EXPECT_EQ(PoolMapping::Create(response, pool_.DupFds()).status().code(),
            absl::StatusCode::kInvalidArgument);

  response = pool_.Response();
  response.mutable_layout()->set_chunk_bytes(8);
  response.mutable_layout()->set_block_bytes(2 * 2 * 8);
  EXPECT_EQ(PoolMapping::Create(response, pool_.DupFds()).status().code(),
            absl::StatusCode::kInvalidArgument);

  response = pool_.Response();
  response.set_arena_kind(v1::ARENA_KIND_UNSPECIFIED);
  EXPECT_EQ(PoolMapping::Create(response, pool_.DupFds()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PoolMappingTest, RejectsMissingOrDuplicatedDescriptors) {
  v1::AttachResponse response = pool_.Response();
  std::vector<UniqueFd> fds = pool_.DupFds();
  fds.pop_back();
  EXPECT_EQ(PoolMapping::Create(response, std::move(fds)).status().code(),
            absl::StatusCode::kInvalidArgument);

  response.set_fds(1, v1::FD_ROLE_ARENA);
  EXPECT_EQ(PoolMapping::Create(response, pool_.DupFds()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PoolMappingTest, ClosesItsDescriptorsWhenDestroyed) {
  std::vector<UniqueFd> fds = pool_.DupFds();
  const int arena = fds[0].get();
  const int generations = fds[1].get();
  auto mapping = PoolMapping::Create(pool_.Response(), std::move(fds));
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  EXPECT_NE(fcntl(arena, F_GETFD), -1);
  mapping->reset();
  EXPECT_EQ(fcntl(arena, F_GETFD), -1);
  EXPECT_EQ(fcntl(generations, F_GETFD), -1);
}

TEST_F(PoolMappingTest, ClosesItsDescriptorsWhenCreationFails) {
  std::vector<UniqueFd> fds = pool_.DupFds();
  const int arena = fds[0].get();
  v1::AttachResponse response = pool_.Response();
  response.mutable_layout()->set_num_blocks(0);
  EXPECT_FALSE(PoolMapping::Create(response, std::move(fds)).ok());
  EXPECT_EQ(fcntl(arena, F_GETFD), -1);
}

// No GPU or driver here: a CUDA arena must fail cleanly, never crash. With a driver present the
// import of a memfd fails inside the driver instead (INTERNAL).
TEST_F(PoolMappingTest, CudaArenaWithoutADriverFailsCleanly) {
  v1::AttachResponse response = pool_.Response();
  response.set_arena_kind(v1::ARENA_KIND_CUDA_VMM);
  auto vmm = PoolMapping::Create(response, pool_.DupFds());
  ASSERT_FALSE(vmm.ok());
  EXPECT_THAT(vmm.status().code(),
              ::testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kUnimplemented,
                               absl::StatusCode::kInternal));

  response.set_arena_kind(v1::ARENA_KIND_CUDA_IPC);
  response.clear_fds();
  response.add_fds(v1::FD_ROLE_GENERATION_TABLE);
  response.set_cuda_ipc_handle("short");
  std::vector<UniqueFd> fds = pool_.DupFds();
  fds.erase(fds.begin());
  auto ipc = PoolMapping::Create(response, std::move(fds));
  ASSERT_FALSE(ipc.ok());
  EXPECT_THAT(ipc.status().code(), ::testing::AnyOf(absl::StatusCode::kInvalidArgument,
                                                    absl::StatusCode::kUnimplemented));
}

// Layer 0: K fp8, V bf16; layer 1: K f32, V int8 (block_size 4, 2 KV heads of 8). By the
// arithmetic layout.proto documents: an 8-bit chunk is 4 * 2 * 8 codes + 2 f32 scales = 72
// bytes, padded to 80; bf16 128, f32 256. The same layout is checked against the daemon's
// PoolLayout in tests/kernels/pool_layout_test.cc.
v1::PoolLayout MixedLayout() {
  v1::PoolLayout l = SmallLayout();
  l.set_chunk_bytes(0);
  l.set_block_bytes(80 + 128 + 256 + 80);
  auto add = [&](v1::DType k, v1::DType v, int64_t k_offset, int64_t k_bytes, int64_t v_bytes) {
    v1::LayerLayout* layer = l.add_layers();
    layer->set_k_dtype(k);
    layer->set_v_dtype(v);
    layer->set_k_offset(k_offset);
    layer->set_v_offset(k_offset + k_bytes);
    layer->set_k_chunk_bytes(k_bytes);
    layer->set_v_chunk_bytes(v_bytes);
    if (k == v1::DTYPE_FP8_E4M3) layer->set_k_scales_offset(k_offset + 64);
    if (v == v1::DTYPE_INT8) layer->set_v_scales_offset(k_offset + k_bytes + 64);
    layer->set_bytes_per_token(static_cast<double>(k_bytes + v_bytes) / 4);
  };
  add(v1::DTYPE_FP8_E4M3, v1::DTYPE_BF16, 0, 80, 128);
  add(v1::DTYPE_F32, v1::DTYPE_INT8, 208, 256, 80);
  return l;
}

TEST(PoolMappingMixedTest, AccessorsFollowEachLayersDTypes) {
  FakePool pool(MixedLayout());
  auto mapping = PoolMapping::Create(pool.Response(), pool.DupFds());
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  const PoolMapping& m = **mapping;
  const BlockRef block{3, 1};
  // Offsets from the start of this process's mapping.
  auto at = [&](absl::StatusOr<char*> p) { return p.ok() ? *p - m.base() : int64_t{-1}; };
  auto scales_at = [&](absl::StatusOr<float*> p) {
    return p.ok() ? reinterpret_cast<char*>(*p) - m.base() : int64_t{-1};
  };
  const int64_t start = 3 * 544;
  EXPECT_EQ(at(m.K(0, block)), start);
  EXPECT_EQ(at(m.V(0, block)), start + 80);
  EXPECT_EQ(at(m.K(1, block)), start + 208);
  EXPECT_EQ(at(m.V(1, block)), start + 464);
  EXPECT_EQ(scales_at(m.KScales(0, block)), start + 64);
  EXPECT_EQ(scales_at(m.VScales(1, block)), start + 528);
  EXPECT_EQ(m.KScales(1, block).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.VScales(0, block).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.VScales(2, block).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.dtype(0, 0), v1::DTYPE_FP8_E4M3);
  EXPECT_EQ(m.dtype(1, 1), v1::DTYPE_INT8);
  EXPECT_EQ(m.dtype(2, 0), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(m.row_bytes(0, 0), 16);
  EXPECT_EQ(m.row_bytes(0, 1), 32);
  EXPECT_EQ(m.row_bytes(1, 0), 64);
  // The last layer's V (scales included) ends where the next block starts.
  EXPECT_EQ(at(m.V(1, block)) + 80, at(m.K(0, BlockRef{4, 1})));
  // A scale written through the mapping is where the daemon's mapping has it.
  **m.VScales(1, block) = 0.5f;
  float seen;
  std::memcpy(&seen, pool.arena() + start + 528, 4);
  EXPECT_EQ(seen, 0.5f);
}

TEST(PoolMappingMixedTest, RejectsLayersThatDisagreeWithTheirDTypes) {
  FakePool pool(MixedLayout());
  auto expect_rejected = [&](const v1::PoolLayout& layout) {
    v1::AttachResponse response = pool.Response();
    *response.mutable_layout() = layout;
    auto mapping = PoolMapping::Create(response, pool.DupFds());
    EXPECT_EQ(mapping.status().code(), absl::StatusCode::kInvalidArgument) << mapping.status();
  };
  v1::PoolLayout bad = MixedLayout();
  bad.mutable_layers(1)->set_k_offset(200);  // not where layer 0 ends
  expect_rejected(bad);
  bad = MixedLayout();
  bad.mutable_layers(0)->set_k_chunk_bytes(64);  // no room for the scales
  bad.mutable_layers(0)->set_v_offset(64);
  expect_rejected(bad);
  bad = MixedLayout();
  bad.mutable_layers(0)->set_k_scales_offset(0);  // scales over the codes
  expect_rejected(bad);
  bad = MixedLayout();
  bad.set_block_bytes(2 * 2 * 256);  // a maximum times the layer count, not the chunks' sum
  expect_rejected(bad);
  bad = MixedLayout();
  bad.mutable_layers()->RemoveLast();
  expect_rejected(bad);
  bad = MixedLayout();
  bad.mutable_layers(1)->set_v_dtype(v1::DTYPE_UNSPECIFIED);
  expect_rejected(bad);
}

TEST(BlockRefTest, ToBlockRefsPairsIdsWithGenerations) {
  v1::SequenceInfo info;
  info.add_block_ids(4);
  info.add_generations(2);
  info.add_block_ids(9);
  info.add_generations(7);
  EXPECT_EQ(ToBlockRefs(info), (std::vector<BlockRef>{{4, 2}, {9, 7}}));
  EXPECT_TRUE(ValidateSequenceInfo(info).ok());
  info.add_block_ids(1);
  EXPECT_EQ(ValidateSequenceInfo(info).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockRefTest, ApplyGrowAppendsAndReplacesTheTail) {
  std::vector<BlockRef> table = {{4, 2}, {9, 7}};
  v1::SequenceInfo tail;
  tail.set_table_offset(1);  // copy-on-write replaced entry 1, then one more block
  tail.add_block_ids(11);
  tail.add_generations(3);
  tail.add_block_ids(12);
  tail.add_generations(1);
  ASSERT_TRUE(ApplyGrow(tail, &table).ok());
  EXPECT_EQ(table, (std::vector<BlockRef>{{4, 2}, {11, 3}, {12, 1}}));
}

TEST(BlockRefTest, ApplyGrowOfAnEmptyTailKeepsTheTable) {
  std::vector<BlockRef> table = {{4, 2}, {9, 7}};
  v1::SequenceInfo none;  // a no-op grow: table_offset 0, nothing changed
  ASSERT_TRUE(ApplyGrow(none, &table).ok());
  EXPECT_EQ(table.size(), 2u);
}

TEST(BlockRefTest, ApplyGrowRejectsATailPastTheHeldTable) {
  std::vector<BlockRef> table = {{4, 2}};
  v1::SequenceInfo tail;
  tail.set_table_offset(3);
  tail.add_block_ids(1);
  tail.add_generations(1);
  EXPECT_EQ(ApplyGrow(tail, &table).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table, (std::vector<BlockRef>{{4, 2}}));
}

}  // namespace
}  // namespace kvpool::client
