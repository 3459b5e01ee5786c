#pragma once

// PoolLayout: the block-major memory layout of one KV pool (DESIGN.md §3), and KvPoolView, the
// plain (pointer, layout) pair every kernel takes.
//
// Every layer has its own K dtype and V dtype (`dtype` unless overridden per layer and side), and
// every chunk is as large as its own dtype needs: a block is exactly the sum of its chunks.
//
//   block b             at base + b * block_bytes
//     layer 0, K chunk  at + 0
//     layer 0, V chunk  at + chunk_bytes(0, K)
//     layer 1, K chunk  at + chunk_bytes(0, K) + chunk_bytes(0, V)
//     ...               (K then V, layer after layer)
//
//   a chunk of f32 / f16 / bf16:  [block_size][num_kv_heads][head_dim] values
//   a chunk of fp8 e4m3 / int8:   [block_size][num_kv_heads][head_dim] codes (1 byte each),
//                                 then [num_kv_heads] f32 scales (head h's value = code * scale),
//                                 then zero padding up to a multiple of 16 bytes
//
// Every chunk size is a multiple of 16 bytes (head_dim is a multiple of 8), so every chunk
// starts 16-byte aligned in a 16-byte aligned arena. A block, scales included, is contiguous and
// self-contained: offload, checksums, zero-fill, per-block IPC, copy-on-write and remote tiers
// stay one contiguous copy each.
//
// The window group (docs/hybrid-groups.md §2): the last num_window_layers layers (a model's
// sliding-window layers) live in a region of their own, num_window_blocks blocks laid out as
// above but holding only those layers' chunks, from the next 4096-byte boundary after the
// blocks above (the main region, which then holds the other layers only). The state slots, if
// any, follow the last region, again from a 4096-byte boundary:
//
//   [0, kv_bytes())                         num_blocks main blocks (layers [0, num_full_layers))
//   [window_offset(), + window_bytes())     num_window_blocks window blocks (the other layers)
//   [state_offset(), arena_bytes())         num_state_slots state slots
//
// Layers keep one numbering (per-layer dtypes, Layer(), KvPoolView::Layer()): a kernel given a
// window layer finds its chunks in the window region, by window block id.

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace kvpool::kernels {

// The most layers a layout describes (per-layer dtypes are a fixed array).
inline constexpr int32_t kMaxLayers = 256;

enum class KvSide : uint8_t { kK = 0, kV = 1 };

// Bytes of one chunk: `rows` token rows of `row_values` values each, in `dtype` (scales and
// padding included for the 8-bit formats).
KVPOOL_HOST_DEVICE constexpr int64_t ChunkBytes(DType dtype, int64_t rows, int64_t heads,
                                                int64_t head_dim) {
  const int64_t data = rows * heads * head_dim * DTypeSize(dtype);
  if (!DTypeHasScales(dtype)) return data;
  return (data + 4 * heads + 15) / 16 * 16;
}

// One layer's part of every block: what a kernel working on that layer needs, computed once per
// call by PoolLayout::Layer (the layer's offsets depend on every layer before it).
struct LayerLayout {
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t num_blocks = 0;
  int64_t block_bytes = 0;
  DType k_dtype = DType::kBF16;
  DType v_dtype = DType::kBF16;
  int64_t k_offset = 0;     // the K chunk, from the block's start
  int64_t v_offset = 0;     // the V chunk, from the block's start
  int64_t k_row_bytes = 0;  // one token's K: [num_kv_heads][head_dim]
  int64_t v_row_bytes = 0;
  // The scales ([num_kv_heads] f32) of an 8-bit side, from the block's start (after the
  // side's codes); meaningless for the other dtypes.
  int64_t k_scales_offset = 0;
  int64_t v_scales_offset = 0;
};

// One layer's K and V dtypes (overrides of PoolLayout::dtype, for building layouts).
struct LayerDTypes {
  int32_t layer = 0;
  DType k = DType::kBF16;
  DType v = DType::kBF16;
};

struct PoolLayout {
  int32_t block_size = 16;  // tokens per block
  int32_t num_layers = 1;
  int32_t num_kv_heads = 1;
  int32_t head_dim = 128;
  DType dtype = DType::kBF16;  // K and V of every layer and side without an override
  int32_t num_blocks = 0;
  // The state group (docs/hybrid-groups.md §2, §3): num_state_slots slots of state_slot_bytes
  // each (a multiple of 64), in the arena after the KV blocks at state_offset(). A slot holds one
  // sequence's state-space state (f32, the model's layout). 0 and 0: no state group.
  int32_t num_state_slots = 0;
  int64_t state_slot_bytes = 0;
  // The window group (docs/hybrid-groups.md §2): layers [num_layers - num_window_layers,
  // num_layers) are stored in num_window_blocks blocks of their own at window_offset(). 0 and 0:
  // no window group (every layer in the main blocks, exactly the layout before window groups).
  int32_t num_window_layers = 0;
  int32_t num_window_blocks = 0;
  // Per-layer precision: overrides[side][layer] is 0 (the layer's side is `dtype`) or 1 + the
  // DType it is stored in instead. Entries past num_layers stay 0 (ValidateLayout).
  std::array<std::array<uint8_t, kMaxLayers>, 2> overrides{};

  // The dtype of layer `layer`'s K or V. REQUIRES: 0 <= layer < kMaxLayers.
  DType kv_dtype(int32_t layer, KvSide side) const {
    const uint8_t o = overrides[static_cast<int>(side)][static_cast<size_t>(layer)];
    return o == 0 ? dtype : static_cast<DType>(o - 1);
  }
  DType k_dtype(int32_t layer) const { return kv_dtype(layer, KvSide::kK); }
  DType v_dtype(int32_t layer) const { return kv_dtype(layer, KvSide::kV); }
  // Stores layer `layer`'s K or V in `d`. REQUIRES: 0 <= layer < kMaxLayers.
  void SetKvDType(int32_t layer, KvSide side, DType d) {
    overrides[static_cast<int>(side)][static_cast<size_t>(layer)] = static_cast<uint8_t>(d) + 1;
  }
  // True when every layer's K and V have one dtype (k_dtype(0)).
  bool uniform() const;

  // Bytes of one token's K (or V) row of a layer: [num_kv_heads][head_dim].
  int64_t row_bytes(int32_t layer, KvSide side) const {
    return static_cast<int64_t>(num_kv_heads) * head_dim * DTypeSize(kv_dtype(layer, side));
  }
  // Bytes of a layer's K (or V) chunk of one block, scales and padding included.
  int64_t chunk_bytes(int32_t layer, KvSide side) const {
    return ChunkBytes(kv_dtype(layer, side), block_size, num_kv_heads, head_dim);
  }
  // The chunk size of a uniform layout (every chunk's). REQUIRES: uniform().
  int64_t chunk_bytes() const { return chunk_bytes(0, KvSide::kK); }
  // The layers of the main blocks: [0, num_full_layers()); the rest are the window group's.
  int32_t num_full_layers() const { return num_layers - num_window_layers; }
  bool is_window_layer(int32_t layer) const { return layer >= num_full_layers(); }
  // A main block: the sum of the main layers' K and V chunks.
  int64_t block_bytes() const;
  // A window block: the sum of the window layers' K and V chunks (0 without a window group).
  int64_t window_block_bytes() const;
  // The main blocks' bytes, from the arena's start.
  int64_t kv_bytes() const { return static_cast<int64_t>(num_blocks) * block_bytes(); }
  // Where the window blocks begin: the main blocks' end, rounded up to a 4096-byte page.
  int64_t window_offset() const { return PageUp(kv_bytes()); }
  int64_t window_bytes() const {
    return static_cast<int64_t>(num_window_blocks) * window_block_bytes();
  }
  // The KV regions' end: the main blocks', or the window blocks' with a window group.
  int64_t kv_end() const {
    return num_window_layers == 0 ? kv_bytes() : window_offset() + window_bytes();
  }
  // Where the state slots begin: the KV regions' end, rounded up to a 4096-byte page.
  int64_t state_offset() const { return PageUp(kv_end()); }
  // The whole arena: the KV blocks, the window blocks (if any), then the state slots (if any).
  int64_t arena_bytes() const {
    return num_state_slots == 0 ? kv_end() : state_offset() + num_state_slots * state_slot_bytes;
  }
  static constexpr int64_t kStatePageBytes = 4096;
  static constexpr int64_t PageUp(int64_t bytes) {
    return (bytes + kStatePageBytes - 1) / kStatePageBytes * kStatePageBytes;
  }
  // Bytes a token takes in layer `layer` (K and V, scales and padding shared out):
  // (chunk_bytes(K) + chunk_bytes(V)) / block_size.
  double bytes_per_token(int32_t layer) const {
    return static_cast<double>(chunk_bytes(layer, KvSide::kK) + chunk_bytes(layer, KvSide::kV)) /
           block_size;
  }
  // Where layer `layer`'s chunks are within a block of its region (a window layer: within a
  // window block; block_bytes and num_blocks are then the window region's).
  // REQUIRES: 0 <= layer < num_layers.
  LayerLayout Layer(int32_t layer) const;
  // From the arena's start: block `block` of layer `layer`'s region (a window block id for a
  // window layer).
  int64_t k_offset(int32_t block, int32_t layer) const;
  int64_t v_offset(int32_t block, int32_t layer) const;

  // A stable 64-bit digest of every field but num_blocks, num_window_blocks and num_state_slots,
  // per-layer dtypes, the window layers and the state slot size included: two pools whose blocks
  // (and states) are interchangeable have the same hash (it is mixed into every prefix-cache
  // namespace), whether their dtypes are spelled as `dtype` or as overrides. A layout without a
  // state or window group hashes as it did before those groups, and a uniform one as before
  // per-layer dtypes existed.
  uint64_t Hash() const;
  std::string ToString() const;
  // The dtypes of every layer as runs, e.g. "0-1:bf16/bf16 2-29:fp8/int8 30-31:bf16/bf16".
  std::string DTypesString() const;

  // Equal shapes, equal num_blocks and equal dtypes for every layer (however they are spelled:
  // an override equal to `dtype` is no override).
  friend bool operator==(const PoolLayout& a, const PoolLayout& b);
};

// Checks the shape (positive sizes, head_dim a multiple of 8 for vector loads, num_layers at
// most kMaxLayers, valid dtypes and no override past num_layers, num_blocks >= 0; state slots
// either none or num_state_slots >= 0 of a positive state_slot_bytes that is a multiple of 64;
// window layers in [0, num_layers) (the main blocks keep at least one layer: they are the
// primary group), num_window_blocks >= 0 and 0 without window layers).
// Errors: INVALID_ARGUMENT naming the field.
absl::Status ValidateLayout(const PoolLayout& layout);

// The layout with num_blocks = what capacity_bytes holds after the shape's state slots and
// window blocks (both asked for by count, paid for first; never guessed): the arena_bytes() of
// the result is at most capacity_bytes.
// Errors: INVALID_ARGUMENT (bad shape, or a budget below the state slots, the window blocks and
// one block, or above INT32_MAX blocks).
absl::StatusOr<PoolLayout> LayoutForBudget(PoolLayout shape, int64_t capacity_bytes);

// The state slots of `layout` as a pool kernels can copy and fill by slot id (CopyBlocks,
// FillBlocks): one f32 layer of one token row per block, state_slot_bytes a block, based at
// state_offset(). REQUIRES: layout.num_state_slots > 0.
PoolLayout StateSlotLayout(const PoolLayout& layout);

// The window region of `layout` as a pool of its own, by window block id (CopyBlocks,
// FillBlocks and their CUDA equivalents copy, zero and poison window blocks through it): the
// window layers (renumbered from 0, their dtypes kept), num_window_blocks blocks, based at
// window_offset(). REQUIRES: layout.num_window_layers > 0.
PoolLayout WindowLayout(const PoolLayout& layout);

// One layer of the arena, for a kernel: the chunks and scales of a block by id.
struct KvLayerView {
  char* base = nullptr;
  LayerLayout l;

  KVPOOL_HOST_DEVICE char* k(int64_t block) const {
    return base + block * l.block_bytes + l.k_offset;
  }
  KVPOOL_HOST_DEVICE char* v(int64_t block) const {
    return base + block * l.block_bytes + l.v_offset;
  }
  KVPOOL_HOST_DEVICE float* k_scales(int64_t block) const {
    return reinterpret_cast<float*>(base + block * l.block_bytes + l.k_scales_offset);
  }
  KVPOOL_HOST_DEVICE float* v_scales(int64_t block) const {
    return reinterpret_cast<float*>(base + block * l.block_bytes + l.v_scales_offset);
  }
};

// What kernels see: where the arena is (a device address) and how it is laid out.
struct KvPoolView {
  void* base = nullptr;
  PoolLayout layout;

  // REQUIRES: 0 <= layer < layout.num_layers. A window layer's view is based at the window
  // region and takes window block ids.
  KvLayerView Layer(int32_t layer) const {
    char* region = static_cast<char*>(base);
    if (layout.is_window_layer(layer)) region += layout.window_offset();
    return {region, layout.Layer(layer)};
  }
  // The window blocks (WindowLayout). REQUIRES: layout.num_window_layers > 0.
  KvPoolView Window() const {
    return {static_cast<char*>(base) + layout.window_offset(), WindowLayout(layout)};
  }
  // The state slots (StateSlotLayout). REQUIRES: layout.num_state_slots > 0.
  KvPoolView StateSlots() const {
    return {static_cast<char*>(base) + layout.state_offset(), StateSlotLayout(layout)};
  }
  // Slot `slot`'s state. REQUIRES: 0 <= slot < layout.num_state_slots.
  char* state(int32_t slot) const {
    return static_cast<char*>(base) + layout.state_offset() + slot * layout.state_slot_bytes;
  }
  char* k(int32_t block, int32_t layer) const {
    return static_cast<char*>(base) + layout.k_offset(block, layer);
  }
  char* v(int32_t block, int32_t layer) const {
    return static_cast<char*>(base) + layout.v_offset(block, layer);
  }
};

}  // namespace kvpool::kernels
