// The attach layout a client receives (daemon/edge/convert.cc): the window group's region
// (docs/hybrid-groups.md §2) is in it when the pool has one, and absent, as before window groups,
// when it has none.

#include "daemon/edge/convert.h"
#include "gtest/gtest.h"
#include "kernels/pool_layout.h"

namespace kvpool::daemon {
namespace {

// 2 full layers, 2 window layers (f32, block_size 4, 2 KV heads of 8: 256-byte chunks), 5 main
// blocks, 3 window blocks, 2 state slots.
kernels::PoolLayout Windowed() {
  return {.block_size = 4,
          .num_layers = 4,
          .num_kv_heads = 2,
          .head_dim = 8,
          .dtype = kernels::DType::kF32,
          .num_blocks = 5,
          .num_state_slots = 2,
          .state_slot_bytes = 640,
          .num_window_layers = 2,
          .num_window_blocks = 3};
}

TEST(LayoutConvertTest, TheWindowRegionReachesTheClient) {
  v1::PoolLayout p;
  ToProto(Windowed(), &p);
  EXPECT_EQ(p.num_window_layers(), 2);
  EXPECT_EQ(p.num_window_blocks(), 3);
  EXPECT_EQ(p.window_block_bytes(), 4 * 256);
  EXPECT_EQ(p.window_offset(), 8192);   // after 5 main blocks of 1024 bytes, page-aligned
  EXPECT_EQ(p.block_bytes(), 4 * 256);  // the full layers only
  EXPECT_EQ(p.state_offset(), 12288);   // after the window blocks, page-aligned
  ASSERT_EQ(p.layers_size(), 4);
  EXPECT_EQ(p.layers(1).k_offset(), 512);  // within a main block
  EXPECT_EQ(p.layers(3).k_offset(), 512);  // within a window block
  EXPECT_EQ(p.layout_hash(), Windowed().Hash());
}

TEST(LayoutConvertTest, NoWindowGroupNoWindowFields) {
  kernels::PoolLayout l = Windowed();
  l.num_window_layers = l.num_window_blocks = 0;
  v1::PoolLayout p;
  ToProto(l, &p);
  EXPECT_EQ(p.num_window_layers(), 0);
  EXPECT_EQ(p.num_window_blocks(), 0);
  EXPECT_EQ(p.window_block_bytes(), 0);
  EXPECT_EQ(p.window_offset(), 0);
  EXPECT_EQ(p.block_bytes(), 4 * 2 * 256);
  EXPECT_EQ(p.state_offset(), 12288);  // after 5 blocks of 2048 bytes, page-aligned
}

}  // namespace
}  // namespace kvpool::daemon
