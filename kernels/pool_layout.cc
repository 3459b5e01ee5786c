#include "kernels/pool_layout.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "fmt/format.h"
#include "xxhash.h"

namespace kvpool::kernels {

bool PoolLayout::uniform() const {
  for (int32_t l = 0; l < num_layers && l < kMaxLayers; ++l) {
    if (k_dtype(l) != k_dtype(0) || v_dtype(l) != k_dtype(0)) return false;
  }
  return true;
}

namespace {

// The K and V chunks of layers [first, last) (clamped to what a layout describes).
int64_t ChunksBytes(const PoolLayout& layout, int32_t first, int32_t last) {
  int64_t bytes = 0;
  for (int32_t l = std::max(first, 0); l < last && l < kMaxLayers; ++l) {
    bytes += layout.chunk_bytes(l, KvSide::kK) + layout.chunk_bytes(l, KvSide::kV);
  }
  return bytes;
}

}  // namespace

int64_t PoolLayout::block_bytes() const { return ChunksBytes(*this, 0, num_full_layers()); }

int64_t PoolLayout::window_block_bytes() const {
  return ChunksBytes(*this, num_full_layers(), num_layers);
}

LayerLayout PoolLayout::Layer(int32_t layer) const {
  const bool window = is_window_layer(layer);
  LayerLayout out;
  out.block_size = block_size;
  out.num_kv_heads = num_kv_heads;
  out.head_dim = head_dim;
  out.num_blocks = window ? num_window_blocks : num_blocks;
  out.block_bytes = window ? window_block_bytes() : block_bytes();
  out.k_dtype = k_dtype(layer);
  out.v_dtype = v_dtype(layer);
  out.k_offset = ChunksBytes(*this, window ? num_full_layers() : 0, layer);
  out.v_offset = out.k_offset + chunk_bytes(layer, KvSide::kK);
  out.k_row_bytes = row_bytes(layer, KvSide::kK);
  out.v_row_bytes = row_bytes(layer, KvSide::kV);
  out.k_scales_offset = out.k_offset + block_size * out.k_row_bytes;
  out.v_scales_offset = out.v_offset + block_size * out.v_row_bytes;
  return out;
}

int64_t PoolLayout::k_offset(int32_t block, int32_t layer) const {
  const LayerLayout l = Layer(layer);
  const int64_t region = is_window_layer(layer) ? window_offset() : 0;
  return region + static_cast<int64_t>(block) * l.block_bytes + l.k_offset;
}

int64_t PoolLayout::v_offset(int32_t block, int32_t layer) const {
  const LayerLayout l = Layer(layer);
  const int64_t region = is_window_layer(layer) ? window_offset() : 0;
  return region + static_cast<int64_t>(block) * l.block_bytes + l.v_offset;
}

uint64_t PoolLayout::Hash() const {
  const int64_t fields[] = {block_size, num_layers, num_kv_heads, head_dim,
                            static_cast<int64_t>(uniform() ? k_dtype(0) : dtype)};
  if (uniform() && state_slot_bytes == 0 && num_window_layers == 0) {
    return XXH3_64bits(fields, sizeof(fields));
  }
  // Mixed precision: the shape, then every layer's (K, V) dtypes; then the state slot's size;
  // then the window layers (which layers have a region of their own).
  std::vector<uint8_t> bytes(sizeof(fields));
  std::memcpy(bytes.data(), fields, sizeof(fields));
  if (!uniform()) {
    for (int32_t l = 0; l < num_layers; ++l) {
      bytes.push_back(static_cast<uint8_t>(k_dtype(l)));
      bytes.push_back(static_cast<uint8_t>(v_dtype(l)));
    }
  }
  if (state_slot_bytes != 0) {
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(state_slot_bytes) + 1);
    bytes[at] = 's';
    std::memcpy(bytes.data() + at + 1, &state_slot_bytes, sizeof(state_slot_bytes));
  }
  if (num_window_layers != 0) {
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(num_window_layers) + 1);
    bytes[at] = 'w';
    std::memcpy(bytes.data() + at + 1, &num_window_layers, sizeof(num_window_layers));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string PoolLayout::DTypesString() const {
  std::string out;
  int32_t first = 0;
  for (int32_t l = 1; l <= num_layers; ++l) {
    if (l < num_layers && k_dtype(l) == k_dtype(first) && v_dtype(l) == v_dtype(first)) continue;
    if (!out.empty()) out += ' ';
    out += first == l - 1 ? fmt::format("{}", first) : fmt::format("{}-{}", first, l - 1);
    out += fmt::format(":{}/{}", DTypeName(k_dtype(first)), DTypeName(v_dtype(first)));
    first = l;
  }
  return out;
}

std::string PoolLayout::ToString() const {
  const std::string dtypes =
      uniform() ? std::string(DTypeName(k_dtype(0))) : fmt::format("[k/v {}]", DTypesString());
  std::string out = fmt::format(
      "block_size={} layers={} kv_heads={} head_dim={} dtype={} blocks={} ({} KiB/block)",
      block_size, num_layers, num_kv_heads, head_dim, dtypes, num_blocks, block_bytes() / 1024);
  if (num_state_slots > 0 || state_slot_bytes > 0) {
    out += fmt::format(" state_slots={} ({} KiB/slot)", num_state_slots, state_slot_bytes / 1024);
  }
  if (num_window_layers > 0 || num_window_blocks > 0) {
    out += fmt::format(" window_layers={} window_blocks={} ({} KiB/block)", num_window_layers,
                       num_window_blocks, window_block_bytes() / 1024);
  }
  return out;
}

bool operator==(const PoolLayout& a, const PoolLayout& b) {
  if (a.block_size != b.block_size || a.num_layers != b.num_layers ||
      a.num_kv_heads != b.num_kv_heads || a.head_dim != b.head_dim ||
      a.num_blocks != b.num_blocks || a.num_state_slots != b.num_state_slots ||
      a.state_slot_bytes != b.state_slot_bytes || a.num_window_layers != b.num_window_layers ||
      a.num_window_blocks != b.num_window_blocks) {
    return false;
  }
  for (int32_t l = 0; l < a.num_layers && l < kMaxLayers; ++l) {
    if (a.k_dtype(l) != b.k_dtype(l) || a.v_dtype(l) != b.v_dtype(l)) return false;
  }
  return true;
}

absl::Status ValidateLayout(const PoolLayout& l) {
  auto positive = [](const char* name, int64_t v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(fmt::format("layout {} must be > 0 (got {})", name, v));
  };
  for (auto [name, value] : {std::pair<const char*, int64_t>{"block_size", l.block_size},
                             {"num_layers", l.num_layers},
                             {"num_kv_heads", l.num_kv_heads},
                             {"head_dim", l.head_dim}}) {
    if (absl::Status s = positive(name, value); !s.ok()) return s;
  }
  if (l.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        fmt::format("layout head_dim must be a multiple of 8 (got {})", l.head_dim));
  }
  if (l.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(fmt::format(
        "layout num_layers {} is above the {} a layout describes", l.num_layers, kMaxLayers));
  }
  if (static_cast<int>(l.dtype) >= kNumDTypes) {
    return absl::InvalidArgumentError(
        fmt::format("layout dtype {} is not a dtype", static_cast<int>(l.dtype)));
  }
  for (int side = 0; side < 2; ++side) {
    for (int32_t layer = 0; layer < kMaxLayers; ++layer) {
      const uint8_t o = l.overrides[static_cast<size_t>(side)][static_cast<size_t>(layer)];
      if (o == 0) continue;
      if (layer >= l.num_layers || o > kNumDTypes) {
        return absl::InvalidArgumentError(fmt::format(
            "layout override of layer {} {} ({}) is not a dtype of one of its {} layers", layer,
            side == 0 ? "K" : "V", o, l.num_layers));
      }
    }
  }
  if (l.num_blocks < 0) return absl::InvalidArgumentError("layout num_blocks must be >= 0");
  if (l.num_state_slots < 0 || l.state_slot_bytes < 0 || l.state_slot_bytes % 64 != 0 ||
      (l.num_state_slots > 0 && l.state_slot_bytes == 0)) {
    return absl::InvalidArgumentError(fmt::format(
        "layout state slots: num_state_slots must be >= 0 and state_slot_bytes a multiple of 64, "
        "positive when there are slots (got {} slots of {} bytes)",
        l.num_state_slots, l.state_slot_bytes));
  }
  if (l.num_window_layers < 0 || l.num_window_layers >= l.num_layers || l.num_window_blocks < 0 ||
      (l.num_window_layers == 0 && l.num_window_blocks != 0)) {
    return absl::InvalidArgumentError(fmt::format(
        "layout window group: num_window_layers must be in [0, num_layers = {}) (the main blocks "
        "keep at least one layer) and num_window_blocks >= 0, 0 without window layers (got {} "
        "layers, {} blocks)",
        l.num_layers, l.num_window_layers, l.num_window_blocks));
  }
  return absl::OkStatus();
}

absl::StatusOr<PoolLayout> LayoutForBudget(PoolLayout shape, int64_t capacity_bytes) {
  shape.num_blocks = 0;
  if (absl::Status s = ValidateLayout(shape); !s.ok()) return s;
  // The state slots first (they are one per running sequence: not optional), then the window
  // blocks (asked for by count, like the slots), each region from a page boundary: the main
  // blocks take whole pages up to where the next region begins.
  const auto page_down = [](int64_t bytes) {
    return bytes / PoolLayout::kStatePageBytes * PoolLayout::kStatePageBytes;
  };
  const int64_t states = int64_t{shape.num_state_slots} * shape.state_slot_bytes;
  const int64_t windows = shape.window_bytes();
  int64_t kv_budget = capacity_bytes;
  if (shape.num_state_slots > 0) kv_budget = page_down(kv_budget - states);
  if (shape.num_window_layers > 0) kv_budget = page_down(kv_budget - windows);
  const int64_t blocks = std::max<int64_t>(kv_budget, 0) / shape.block_bytes();
  if (blocks < 1) {
    std::string after;
    if (states > 0) {
      after += fmt::format(" after {} state slots of {} bytes", shape.num_state_slots,
                           shape.state_slot_bytes);
    }
    if (shape.num_window_layers > 0) {
      after += fmt::format("{} {} window blocks of {} bytes", after.empty() ? " after" : " and",
                           shape.num_window_blocks, shape.window_block_bytes());
    }
    return absl::InvalidArgumentError(
        fmt::format("a budget of {} bytes holds no block of {} bytes{}", capacity_bytes,
                    shape.block_bytes(), after));
  }
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(fmt::format("a budget of {} bytes is {} blocks, above {}",
                                                  capacity_bytes, blocks,
                                                  std::numeric_limits<int32_t>::max()));
  }
  shape.num_blocks = static_cast<int32_t>(blocks);
  return shape;
}

PoolLayout StateSlotLayout(const PoolLayout& layout) {
  // 2 (K and V) x 1 row x 1 head x head_dim f32 values = state_slot_bytes.
  return PoolLayout{.block_size = 1,
                    .num_layers = 1,
                    .num_kv_heads = 1,
                    .head_dim = static_cast<int32_t>(layout.state_slot_bytes / 8),
                    .dtype = DType::kF32,
                    .num_blocks = layout.num_state_slots};
}

PoolLayout WindowLayout(const PoolLayout& layout) {
  PoolLayout out{.block_size = layout.block_size,
                 .num_layers = layout.num_window_layers,
                 .num_kv_heads = layout.num_kv_heads,
                 .head_dim = layout.head_dim,
                 .dtype = layout.dtype,
                 .num_blocks = layout.num_window_blocks};
  const int32_t first = layout.num_full_layers();
  for (int32_t l = 0; l < layout.num_window_layers; ++l) {
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      if (layout.kv_dtype(first + l, side) != layout.dtype) {
        out.SetKvDType(l, side, layout.kv_dtype(first + l, side));
      }
    }
  }
  return out;
}

}  // namespace kvpool::kernels
