#include "kernels/pool_layout.h"

#include <limits>

#include "fmt/format.h"
#include "xxhash.h"

namespace kvpool::kernels {

uint64_t PoolLayout::Hash() const {
  const int64_t fields[] = {block_size, num_layers, num_kv_heads, head_dim,
                            static_cast<int64_t>(dtype)};
  return XXH3_64bits(fields, sizeof(fields));
}

std::string PoolLayout::ToString() const {
  return fmt::format(
      "block_size={} layers={} kv_heads={} head_dim={} dtype={} blocks={} ({} KiB/block)",
      block_size, num_layers, num_kv_heads, head_dim, DTypeName(dtype), num_blocks,
      block_bytes() / 1024);
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
  if (l.num_blocks < 0) return absl::InvalidArgumentError("layout num_blocks must be >= 0");
  return absl::OkStatus();
}

absl::StatusOr<PoolLayout> LayoutForBudget(PoolLayout shape, int64_t capacity_bytes) {
  shape.num_blocks = 0;
  if (absl::Status s = ValidateLayout(shape); !s.ok()) return s;
  const int64_t blocks = capacity_bytes / shape.block_bytes();
  if (blocks < 1) {
    return absl::InvalidArgumentError(fmt::format("a budget of {} bytes holds no block of {} bytes",
                                                  capacity_bytes, shape.block_bytes()));
  }
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(fmt::format("a budget of {} bytes is {} blocks, above {}",
                                                  capacity_bytes, blocks,
                                                  std::numeric_limits<int32_t>::max()));
  }
  shape.num_blocks = static_cast<int32_t>(blocks);
  return shape;
}

}  // namespace kvpool::kernels
