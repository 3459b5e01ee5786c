#include "client/pool_mapping.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "client/internal/cuda_mapping.h"
#include "fmt/format.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::client {
namespace {

absl::Status MmapError(const char* what, int64_t bytes) {
  const int err = errno;
  std::string message =
      fmt::format("mmap of the {} ({} bytes): {}", what, bytes, std::strerror(err));
  if (err == ENOMEM) return absl::ResourceExhaustedError(std::move(message));
  return absl::InternalError(std::move(message));
}

int64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_FP8_E4M3:
    case v1::DTYPE_INT8:
      return 1;
    case v1::DTYPE_UNSPECIFIED:
    case v1::DType_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::DType_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return 0;
}

bool HasScales(v1::DType dtype) { return dtype == v1::DTYPE_FP8_E4M3 || dtype == v1::DTYPE_INT8; }

// Bytes of a chunk of `dtype` (layout.proto): values or codes, then for the 8-bit types the
// [num_kv_heads] f32 scales and padding to a multiple of 16.
int64_t ChunkBytes(const v1::PoolLayout& l, v1::DType dtype) {
  const int64_t data =
      int64_t{l.block_size()} * l.num_kv_heads() * l.head_dim() * DTypeBytes(dtype);
  if (!HasScales(dtype)) return data;
  return (data + 4 * int64_t{l.num_kv_heads()} + 15) / 16 * 16;
}

// The per-layer table (layout.proto: layers): every chunk where its predecessors end, each as
// large as its dtype needs, the block their sum. Layouts from daemons without it get one
// computed from the uniform chunk_bytes.
absl::Status CheckLayers(v1::PoolLayout* l) {
  if (l->layers_size() == 0) {
    if (l->chunk_bytes() <= 0) return absl::InvalidArgumentError("pool layout has no chunk sizes");
    for (int32_t i = 0; i < l->num_layers(); ++i) {
      v1::LayerLayout* layer = l->add_layers();
      layer->set_k_dtype(l->dtype());
      layer->set_v_dtype(l->dtype());
      layer->set_k_offset(2 * i * l->chunk_bytes());
      layer->set_v_offset((2 * i + 1) * l->chunk_bytes());
      layer->set_k_chunk_bytes(l->chunk_bytes());
      layer->set_v_chunk_bytes(l->chunk_bytes());
    }
  }
  if (l->layers_size() != l->num_layers()) {
    return absl::InvalidArgumentError(fmt::format("pool layout describes {} of its {} layers",
                                                  l->layers_size(), l->num_layers()));
  }
  // The window group's layers (the last num_window_layers) start over in a window block.
  if (l->num_window_layers() < 0 || l->num_window_layers() >= l->num_layers()) {
    return absl::InvalidArgumentError(
        fmt::format("pool layout has {} window layers of its {} layers", l->num_window_layers(),
                    l->num_layers()));
  }
  const int first_window = l->num_layers() - l->num_window_layers();
  int64_t offset = 0, main_bytes = 0;
  for (int i = 0; i < l->layers_size(); ++i) {
    if (i == first_window) {
      main_bytes = offset;
      offset = 0;
    }
    const v1::LayerLayout& layer = l->layers(i);
    const int64_t k = ChunkBytes(*l, layer.k_dtype()), v = ChunkBytes(*l, layer.v_dtype());
    const int64_t values = int64_t{l->block_size()} * l->num_kv_heads() * l->head_dim();
    if (DTypeBytes(layer.k_dtype()) == 0 || DTypeBytes(layer.v_dtype()) == 0) {
      return absl::InvalidArgumentError(
          fmt::format("pool layout layer {} has an unknown dtype", i));
    }
    if (layer.k_offset() != offset || layer.k_chunk_bytes() < k ||
        layer.v_offset() != offset + layer.k_chunk_bytes() || layer.v_chunk_bytes() < v ||
        (HasScales(layer.k_dtype()) &&
         layer.k_scales_offset() != offset + values * DTypeBytes(layer.k_dtype())) ||
        (HasScales(layer.v_dtype()) &&
         layer.v_scales_offset() != layer.v_offset() + values * DTypeBytes(layer.v_dtype()))) {
      return absl::InvalidArgumentError(
          fmt::format("pool layout layer {} is inconsistent: {}", i, layer.ShortDebugString()));
    }
    offset += layer.k_chunk_bytes() + layer.v_chunk_bytes();
  }
  if (first_window == l->num_layers()) main_bytes = offset;
  if (l->block_bytes() != main_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "pool layout block_bytes {} != the sum of its chunks {}", l->block_bytes(), main_bytes));
  }
  if (first_window < l->num_layers() && l->window_block_bytes() != offset) {
    return absl::InvalidArgumentError(
        fmt::format("pool layout window_block_bytes {} != the sum of its window layers' chunks {}",
                    l->window_block_bytes(), offset));
  }
  return absl::OkStatus();
}

// Where the KV regions end: the blocks', or the window blocks' (after them) with a window group.
int64_t KvEnd(const v1::PoolLayout& l) {
  if (l.num_window_layers() == 0) return int64_t{l.num_blocks()} * l.block_bytes();
  return l.window_offset() + int64_t{l.num_window_blocks()} * l.window_block_bytes();
}

// The window group, when there is one, lies after the blocks and fits 64-bit offsets; without
// one its fields are all 0. (CheckLayers checked the layers and window_block_bytes.)
absl::Status CheckWindowGroup(const v1::PoolLayout& l) {
  if (l.num_window_layers() == 0) {
    if (l.num_window_blocks() == 0 && l.window_block_bytes() == 0 && l.window_offset() == 0) {
      return absl::OkStatus();
    }
  } else if (l.num_window_blocks() >= 0 && l.window_block_bytes() > 0 &&
             l.window_offset() >= int64_t{l.num_blocks()} * l.block_bytes() &&
             (l.num_window_blocks() == 0 ||
              l.window_block_bytes() <= (std::numeric_limits<int64_t>::max() - l.window_offset()) /
                                            l.num_window_blocks())) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(fmt::format(
      "invalid window group in the pool layout: {} layers, {} blocks of {} bytes at {}",
      l.num_window_layers(), l.num_window_blocks(), l.window_block_bytes(), l.window_offset()));
}

// The state group, when there is one, lies after the blocks and its slots fit 64-bit offsets.
absl::Status CheckStateSlots(const v1::PoolLayout& l) {
  if (l.num_state_slots() == 0 && l.state_slot_bytes() == 0 && l.state_offset() == 0) {
    return absl::OkStatus();
  }
  const int64_t blocks_end = KvEnd(l);
  if (l.num_state_slots() <= 0 || l.state_slot_bytes() <= 0 || l.state_slot_bytes() % 4 != 0 ||
      l.state_offset() < blocks_end ||
      l.state_slot_bytes() >
          (std::numeric_limits<int64_t>::max() - l.state_offset()) / l.num_state_slots()) {
    return absl::InvalidArgumentError(
        fmt::format("invalid state slots in the pool layout: {} of {} bytes at {} (blocks end at "
                    "{})",
                    l.num_state_slots(), l.state_slot_bytes(), l.state_offset(), blocks_end));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayout(v1::PoolLayout* l) {
  if (l->block_size() <= 0 || l->num_layers() <= 0 || l->num_kv_heads() <= 0 ||
      l->head_dim() <= 0 || l->num_blocks() <= 0 || l->chunk_bytes() < 0 ||
      l->num_layers() > (1 << 16) || l->head_dim() > (1 << 20) || l->num_kv_heads() > (1 << 16) ||
      l->block_size() > (1 << 20)) {
    return absl::InvalidArgumentError(
        fmt::format("invalid pool layout: {}", l->ShortDebugString()));
  }
  if (l->layers_size() == 0 && DTypeBytes(l->dtype()) == 0) {
    return absl::InvalidArgumentError(
        fmt::format("pool layout has unknown dtype {}", static_cast<int>(l->dtype())));
  }
  if (l->chunk_bytes() > std::numeric_limits<int64_t>::max() / (2 * l->num_layers())) {
    return absl::InvalidArgumentError("pool layout overflows 64-bit byte offsets");
  }
  KVPOOL_RETURN_IF_ERROR(CheckLayers(l));
  if (l->block_bytes() > std::numeric_limits<int64_t>::max() / l->num_blocks()) {
    return absl::InvalidArgumentError("pool layout overflows 64-bit byte offsets");
  }
  KVPOOL_RETURN_IF_ERROR(CheckWindowGroup(*l));
  return CheckStateSlots(*l);
}

struct ArenaSizes {
  int64_t arena = 0;   // the blocks and the state slots (at least)
  int64_t mapped = 0;  // >= arena
};

// The arena's size and mapped size the attach response gives (0: what the layout needs), checked
// against the validated `layout`.
absl::StatusOr<ArenaSizes> SizesOf(const v1::AttachResponse& attach, const v1::PoolLayout& layout) {
  const int64_t needed =
      layout.num_state_slots() > 0
          ? layout.state_offset() + int64_t{layout.num_state_slots()} * layout.state_slot_bytes()
          : KvEnd(layout);
  const int64_t arena = attach.arena_bytes() == 0 ? needed : attach.arena_bytes();
  if (arena < needed) {
    return absl::InvalidArgumentError(
        fmt::format("arena_bytes {} < the {} bytes the blocks and state slots need",
                    attach.arena_bytes(), needed));
  }
  const int64_t mapped = attach.mapped_bytes() == 0 ? arena : attach.mapped_bytes();
  if (mapped < arena) {
    return absl::InvalidArgumentError(
        fmt::format("mapped_bytes {} < arena_bytes {}", mapped, arena));
  }
  return ArenaSizes{.arena = arena, .mapped = mapped};
}

// Fails unless `fd` is at least `bytes` long, so that touching the mapping cannot SIGBUS.
absl::Status CheckFdSize(const UniqueFd& fd, int64_t bytes, const char* what) {
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) {
    return absl::InternalError(fmt::format("fstat of the {}: {}", what, std::strerror(errno)));
  }
  if (st.st_size < bytes) {
    return absl::InvalidArgumentError(
        fmt::format("the {} descriptor holds {} bytes but the layout needs {}", what,
                    static_cast<int64_t>(st.st_size), bytes));
  }
  return absl::OkStatus();
}

}  // namespace

PoolMapping::PoolMapping(v1::PoolLayout layout, v1::ArenaKind kind, int64_t arena_bytes,
                         int64_t mapped_bytes)
    : layout_(std::move(layout)),
      kind_(kind),
      arena_bytes_(arena_bytes),
      mapped_bytes_(mapped_bytes) {}

PoolMapping::~PoolMapping() {
  cuda_.reset();
  if (kind_ == v1::ARENA_KIND_MEMFD && base_ != nullptr) {
    munmap(base_, static_cast<size_t>(mapped_bytes_));
  }
  if (generations_ != nullptr) {
    munmap(const_cast<uint32_t*>(generations_), static_cast<size_t>(generation_map_bytes_));
  }
}

absl::StatusOr<std::unique_ptr<PoolMapping>> PoolMapping::Create(const v1::AttachResponse& attach,
                                                                 std::vector<UniqueFd> fds) {
  v1::PoolLayout layout = attach.layout();
  KVPOOL_RETURN_IF_ERROR(ValidateLayout(&layout));
  KVPOOL_ASSIGN_OR_RETURN(const ArenaSizes sizes, SizesOf(attach, layout));
  const int64_t arena_bytes = sizes.arena, mapped_bytes = sizes.mapped;

  if (fds.size() != static_cast<size_t>(attach.fds_size())) {
    return absl::InvalidArgumentError(fmt::format(
        "the attach response lists {} descriptors but {} arrived", attach.fds_size(), fds.size()));
  }
  UniqueFd arena_fd;
  UniqueFd generation_fd;
  for (int i = 0; i < attach.fds_size(); ++i) {
    UniqueFd* slot = nullptr;
    if (attach.fds(i) == v1::FD_ROLE_ARENA) slot = &arena_fd;
    if (attach.fds(i) == v1::FD_ROLE_GENERATION_TABLE) slot = &generation_fd;
    if (slot == nullptr) {
      return absl::InvalidArgumentError(
          fmt::format("descriptor {} has unknown role {}", i, static_cast<int>(attach.fds(i))));
    }
    if (slot->valid()) {
      return absl::InvalidArgumentError(
          fmt::format("descriptor role {} sent twice", v1::FdRole_Name(attach.fds(i))));
    }
    *slot = std::move(fds[static_cast<size_t>(i)]);
  }
  if (!generation_fd.valid()) {
    return absl::InvalidArgumentError("no generation table descriptor in the attach response");
  }
  const bool wants_arena_fd =
      attach.arena_kind() == v1::ARENA_KIND_MEMFD || attach.arena_kind() == v1::ARENA_KIND_CUDA_VMM;
  if (wants_arena_fd && !arena_fd.valid()) {
    return absl::InvalidArgumentError("no arena descriptor in the attach response");
  }

  std::unique_ptr<PoolMapping> mapping(
      new PoolMapping(layout, attach.arena_kind(), arena_bytes, mapped_bytes));
  mapping->arena_fd_ = std::move(arena_fd);
  mapping->generation_fd_ = std::move(generation_fd);

  const int64_t table_bytes = int64_t{layout.num_blocks()} * static_cast<int64_t>(sizeof(uint32_t));
  KVPOOL_RETURN_IF_ERROR(CheckFdSize(mapping->generation_fd_, table_bytes, "generation table"));
  void* table = mmap(nullptr, static_cast<size_t>(table_bytes), PROT_READ, MAP_SHARED,
                     mapping->generation_fd_.get(), 0);
  if (table == MAP_FAILED) return MmapError("generation table", table_bytes);
  mapping->generations_ = static_cast<const uint32_t*>(table);
  mapping->generation_map_bytes_ = table_bytes;

  switch (attach.arena_kind()) {
    case v1::ARENA_KIND_MEMFD: {
      KVPOOL_RETURN_IF_ERROR(CheckFdSize(mapping->arena_fd_, mapped_bytes, "arena"));
      void* base = mmap(nullptr, static_cast<size_t>(mapped_bytes), PROT_READ | PROT_WRITE,
                        MAP_SHARED, mapping->arena_fd_.get(), 0);
      if (base == MAP_FAILED) return MmapError("arena", mapped_bytes);
      mapping->base_ = static_cast<char*>(base);
      return mapping;
    }
    case v1::ARENA_KIND_CUDA_VMM: {
      KVPOOL_ASSIGN_OR_RETURN(
          mapping->cuda_, internal::CudaMapping::ImportVmm(mapping->arena_fd_.get(), mapped_bytes,
                                                           attach.device_ordinal()));
      mapping->base_ = mapping->cuda_->base();
      return mapping;
    }
    case v1::ARENA_KIND_CUDA_IPC: {
      KVPOOL_ASSIGN_OR_RETURN(
          mapping->cuda_,
          internal::CudaMapping::OpenIpc(attach.cuda_ipc_handle(), attach.device_ordinal()));
      mapping->base_ = mapping->cuda_->base();
      return mapping;
    }
    case v1::ARENA_KIND_UNSPECIFIED:
    case v1::ArenaKind_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::ArenaKind_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return absl::InvalidArgumentError(
      fmt::format("unknown arena kind {}", static_cast<int>(attach.arena_kind())));
}

uint32_t PoolMapping::generation(int32_t block) const {
  if (block < 0 || block >= layout_.num_blocks()) return 0;
  // The daemon stores concurrently from another process; pair its release store.
  return __atomic_load_n(&generations_[block], __ATOMIC_ACQUIRE);
}

absl::Status PoolMapping::CheckCurrent(BlockRef block) const {
  if (block.id < 0) {
    return absl::InvalidArgumentError(fmt::format("negative block id {}", block.id));
  }
  if (block.id >= layout_.num_blocks()) {
    return absl::OutOfRangeError(
        fmt::format("block {} is past the pool's {} blocks", block.id, layout_.num_blocks()));
  }
  const uint32_t current = generation(block.id);
  if (current != block.generation) {
    return absl::FailedPreconditionError(fmt::format(
        "block {} was reused (generation {}, you hold {})", block.id, current, block.generation));
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> PoolMapping::State(int32_t slot) const {
  if (slot < 0 || slot >= layout_.num_state_slots()) {
    return absl::OutOfRangeError(fmt::format("state slot {} is outside the pool's [0, {})", slot,
                                             layout_.num_state_slots()));
  }
  return reinterpret_cast<float*>(base_ + layout_.state_offset() +
                                  int64_t{slot} * layout_.state_slot_bytes());
}

absl::StatusOr<char*> PoolMapping::Block(BlockRef block) const {
  KVPOOL_RETURN_IF_ERROR(CheckCurrent(block));
  return base_ + int64_t{block.id} * layout_.block_bytes();
}

absl::StatusOr<char*> PoolMapping::WindowBlock(BlockRef block) const {
  if (block.id < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "window block id {} (-1: an entry released when it left the window)", block.id));
  }
  if (block.id >= layout_.num_window_blocks()) {
    return absl::OutOfRangeError(fmt::format("window block {} is past the pool's {} window blocks",
                                             block.id, layout_.num_window_blocks()));
  }
  return base_ + layout_.window_offset() + int64_t{block.id} * layout_.window_block_bytes();
}

absl::StatusOr<char*> PoolMapping::Chunk(int32_t layer, int32_t kv, BlockRef block,
                                         bool window) const {
  if (layer < 0) return absl::InvalidArgumentError(fmt::format("negative layer {}", layer));
  if (layer >= layout_.num_layers()) {
    return absl::OutOfRangeError(
        fmt::format("layer {} is past the pool's {} layers", layer, layout_.num_layers()));
  }
  // A window layer's offsets are within a window block, a main layer's within a block: the one
  // numbering never crosses to the other region.
  const bool window_layer = layer >= layout_.num_layers() - layout_.num_window_layers();
  if (window_layer != window) {
    return absl::InvalidArgumentError(
        window_layer ? fmt::format("layer {} is in the pool's window group: address its K/V in "
                                   "window blocks (WindowK / WindowV, the window table's entry)",
                                   layer)
                     : fmt::format("layer {} is not in the pool's window group: address its K/V "
                                   "in blocks (K / V, the block table's entry)",
                                   layer));
  }
  KVPOOL_ASSIGN_OR_RETURN(char* start, window ? WindowBlock(block) : Block(block));
  const v1::LayerLayout& l = layout_.layers(layer);
  return start + (kv == 0 ? l.k_offset() : l.v_offset());
}

absl::StatusOr<float*> PoolMapping::Scales(int32_t layer, int32_t kv, BlockRef block,
                                           bool window) const {
  KVPOOL_ASSIGN_OR_RETURN(char* chunk, Chunk(layer, kv, block, window));
  const v1::LayerLayout& l = layout_.layers(layer);
  const v1::DType d = kv == 0 ? l.k_dtype() : l.v_dtype();
  if (!HasScales(d)) {
    return absl::FailedPreconditionError(fmt::format("layer {} {} is {}: it has no scales", layer,
                                                     kv == 0 ? "K" : "V", v1::DType_Name(d)));
  }
  const int64_t offset =
      kv == 0 ? l.k_scales_offset() - l.k_offset() : l.v_scales_offset() - l.v_offset();
  return reinterpret_cast<float*>(chunk + offset);
}

absl::StatusOr<float*> PoolMapping::KScales(int32_t layer, BlockRef block) const {
  return Scales(layer, 0, block, false);
}

absl::StatusOr<float*> PoolMapping::VScales(int32_t layer, BlockRef block) const {
  return Scales(layer, 1, block, false);
}

absl::StatusOr<float*> PoolMapping::WindowKScales(int32_t layer, BlockRef block) const {
  return Scales(layer, 0, block, true);
}

absl::StatusOr<float*> PoolMapping::WindowVScales(int32_t layer, BlockRef block) const {
  return Scales(layer, 1, block, true);
}

v1::DType PoolMapping::dtype(int32_t layer, int32_t kv) const {
  if (layer < 0 || layer >= layout_.layers_size()) return v1::DTYPE_UNSPECIFIED;
  return kv == 0 ? layout_.layers(layer).k_dtype() : layout_.layers(layer).v_dtype();
}

int64_t PoolMapping::row_bytes(int32_t layer, int32_t kv) const {
  return int64_t{layout_.num_kv_heads()} * layout_.head_dim() * DTypeBytes(dtype(layer, kv));
}

absl::StatusOr<char*> PoolMapping::K(int32_t layer, BlockRef block) const {
  return Chunk(layer, 0, block, false);
}

absl::StatusOr<char*> PoolMapping::V(int32_t layer, BlockRef block) const {
  return Chunk(layer, 1, block, false);
}

absl::StatusOr<char*> PoolMapping::WindowK(int32_t layer, BlockRef block) const {
  return Chunk(layer, 0, block, true);
}

absl::StatusOr<char*> PoolMapping::WindowV(int32_t layer, BlockRef block) const {
  return Chunk(layer, 1, block, true);
}

}  // namespace kvpool::client
