#pragma once

// PoolLayout: the block-major memory layout of one KV pool (DESIGN.md §3), and KvPoolView, the
// plain (pointer, layout) pair every kernel takes.
//
//   block b             at base + b * block_bytes
//     layer l, K chunk  at + (2 * l + 0) * chunk_bytes   // [block_size][num_kv_heads][head_dim]
//     layer l, V chunk  at + (2 * l + 1) * chunk_bytes
//
// A block is contiguous, so offload, checksums, zero-fill, per-block IPC and copy-on-write are one
// contiguous copy each.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace kvpool::kernels {

struct PoolLayout {
  int32_t block_size = 16;  // tokens per block
  int32_t num_layers = 1;
  int32_t num_kv_heads = 1;
  int32_t head_dim = 128;
  DType dtype = DType::kBF16;
  int32_t num_blocks = 0;

  // Bytes of one layer's K (or V) for one block: [block_size][num_kv_heads][head_dim].
  KVPOOL_HOST_DEVICE constexpr int64_t chunk_bytes() const {
    return static_cast<int64_t>(block_size) * num_kv_heads * head_dim * DTypeSize(dtype);
  }
  KVPOOL_HOST_DEVICE constexpr int64_t block_bytes() const {
    return 2 * num_layers * chunk_bytes();
  }
  KVPOOL_HOST_DEVICE constexpr int64_t arena_bytes() const {
    return static_cast<int64_t>(num_blocks) * block_bytes();
  }
  // Bytes of one token's K (or V) row for one layer: [num_kv_heads][head_dim].
  KVPOOL_HOST_DEVICE constexpr int64_t row_bytes() const {
    return static_cast<int64_t>(num_kv_heads) * head_dim * DTypeSize(dtype);
  }
  KVPOOL_HOST_DEVICE constexpr int64_t k_offset(int32_t block, int32_t layer) const {
    return static_cast<int64_t>(block) * block_bytes() + (2 * layer) * chunk_bytes();
  }
  KVPOOL_HOST_DEVICE constexpr int64_t v_offset(int32_t block, int32_t layer) const {
    return k_offset(block, layer) + chunk_bytes();
  }

  // A stable 64-bit digest of every field but num_blocks: two pools whose blocks are
  // interchangeable have the same hash (it is mixed into every prefix-cache namespace).
  uint64_t Hash() const;
  std::string ToString() const;

  friend bool operator==(const PoolLayout&, const PoolLayout&) = default;
};

// Checks the shape (positive sizes, head_dim a multiple of 8 for vector loads, num_blocks >= 0).
// Errors: INVALID_ARGUMENT naming the field.
absl::Status ValidateLayout(const PoolLayout& layout);

// The layout with num_blocks = capacity_bytes / block_bytes (never guessed).
// Errors: INVALID_ARGUMENT (bad shape, or a budget below one block or above INT32_MAX blocks).
absl::StatusOr<PoolLayout> LayoutForBudget(PoolLayout shape, int64_t capacity_bytes);

// What kernels see: where the arena is (a device address) and how it is laid out.
struct KvPoolView {
  void* base = nullptr;
  PoolLayout layout;

  KVPOOL_HOST_DEVICE char* k(int32_t block, int32_t layer) const {
    return static_cast<char*>(base) + layout.k_offset(block, layer);
  }
  KVPOOL_HOST_DEVICE char* v(int32_t block, int32_t layer) const {
    return static_cast<char*>(base) + layout.v_offset(block, layer);
  }
};

}  // namespace kvpool::kernels
