#pragma once

// PoolMapping: this process's view of kvpoold's pool arena and of its block generation table,
// built from the descriptors received at attach (attach.proto).
//
// For ARENA_KIND_MEMFD (the CPU backend) the arena is mapped MAP_SHARED read-write into this
// process: K() and V() return host pointers to the very pages the daemon and every other client
// see. For ARENA_KIND_CUDA_VMM / ARENA_KIND_CUDA_IPC the arena is imported through the CUDA driver
// (loaded at run time; nothing links libcuda) and K() / V() return DEVICE pointers, valid in
// kernels and cuMemcpy* on the daemon's device only, never dereferenced on the host
// (host_accessible() is false). The generation table is always a host mapping, read-only.
//
// Generations: the daemon bumps a block's entry in the generation table every time it hands the
// block out again. K()/V()/Block() compare the caller's BlockRef against the current entry, so a
// client that kept a block past its free (or lost it to its session being reclaimed) gets
// FAILED_PRECONDITION instead of another sequence's KV. The check is a snapshot: it cannot stop a
// reuse that happens after it returns; a sequence the caller still holds is never reused.
//
// Thread-safety: immutable after Create(); every method is thread-safe. The KV bytes themselves
// are shared with other processes; ordering writes against the daemon is the caller's business
// (the RPC protocol: write only blocks of sequences you hold).
// Ownership: owns the mappings and the descriptors (released by the destructor). Pointers it
// returns stay valid until the PoolMapping is destroyed.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/block_ref.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/layout.pb.h"

namespace kvpool::client {

namespace internal {
class CudaMapping;
}  // namespace internal

class PoolMapping final {
 public:
  // Maps the pool described by the accepted `attach` response; `fds` are the descriptors that
  // came with it, in the order of attach.fds(). Takes ownership of `fds` whether or not it
  // succeeds.
  // Errors: INVALID_ARGUMENT (inconsistent layout or sizes, descriptors missing, duplicated or
  // smaller than the layout needs, unknown arena kind); UNAVAILABLE (CUDA arena but no CUDA
  // driver can be loaded); UNIMPLEMENTED (CUDA arena and this library was built without
  // <cuda.h>); RESOURCE_EXHAUSTED (no address space); INTERNAL (mmap or driver failure).
  static absl::StatusOr<std::unique_ptr<PoolMapping>> Create(const v1::AttachResponse& attach,
                                                             std::vector<UniqueFd> fds);

  PoolMapping(const PoolMapping&) = delete;
  PoolMapping& operator=(const PoolMapping&) = delete;
  ~PoolMapping();

  // The daemon's layout; `layers` is always filled in (computed for daemons that send only the
  // uniform chunk_bytes).
  const v1::PoolLayout& layout() const { return layout_; }
  v1::ArenaKind kind() const { return kind_; }
  // True when base() and the pointers below may be dereferenced on the host (memfd arena).
  bool host_accessible() const { return kind_ == v1::ARENA_KIND_MEMFD; }
  // First byte of block 0 (a device pointer unless host_accessible()).
  char* base() const { return base_; }
  int64_t arena_bytes() const { return arena_bytes_; }    // the blocks, window blocks, state slots
  int64_t mapped_bytes() const { return mapped_bytes_; }  // >= arena_bytes
  int32_t num_blocks() const { return layout_.num_blocks(); }

  // The block's first byte: every layer's K then V chunk, each in its own dtype (layout.proto).
  // Errors: INVALID_ARGUMENT (negative id), OUT_OF_RANGE (id >= num_blocks),
  // FAILED_PRECONDITION "block N was reused (generation X, you hold Y)".
  absl::StatusOr<char*> Block(BlockRef block) const;
  // Layer `layer`'s K (or V) chunk of the block: [block_size][num_kv_heads][head_dim] values of
  // dtype(layer, 0) (or 1); row_bytes() a token. Errors: as Block(), plus INVALID_ARGUMENT
  // (negative layer, or a layer of the pool's window group: its K/V are in window blocks, see
  // WindowK) and OUT_OF_RANGE (layer >= num_layers).
  absl::StatusOr<char*> K(int32_t layer, BlockRef block) const;
  absl::StatusOr<char*> V(int32_t layer, BlockRef block) const;

  // The window group (layout.proto: num_window_layers > 0). `block` is an entry of a sequence's
  // window table (ToWindowRefs): window block ids are their own numbering, [0,
  // num_window_blocks), each block window_block_bytes at window_offset + id * window_block_bytes
  // holding only the window layers' chunks. No shared table publishes window generations, so
  // these check the id, not the generation: a caller keeps only entries of sequences it holds
  // and applies each reply's released run (ApplyWindowGrow) before using its window table.
  // Errors: INVALID_ARGUMENT (negative id: -1 is a released entry), OUT_OF_RANGE (id >=
  // num_window_blocks; every id without a window group).
  absl::StatusOr<char*> WindowBlock(BlockRef block) const;
  // A window layer's K (or V) chunk of window block `block`, laid out as K()'s. Errors: as
  // WindowBlock(), plus INVALID_ARGUMENT (negative layer, or a layer not in the window group:
  // its K/V are in the main blocks, see K) and OUT_OF_RANGE (layer >= num_layers).
  absl::StatusOr<char*> WindowK(int32_t layer, BlockRef block) const;
  absl::StatusOr<char*> WindowV(int32_t layer, BlockRef block) const;
  // KScales / VScales for a window layer's chunk in window block `block`. Errors: as WindowK(),
  // plus FAILED_PRECONDITION when that side is not an 8-bit dtype.
  absl::StatusOr<float*> WindowKScales(int32_t layer, BlockRef block) const;
  absl::StatusOr<float*> WindowVScales(int32_t layer, BlockRef block) const;
  int32_t num_window_blocks() const { return layout_.num_window_blocks(); }
  // The block's [num_kv_heads] f32 scales of an 8-bit K (or V): head h's value is code * scale.
  // A writer keeps them as kvpoold's WriteKv does (kernels/cpu_kernels.h): a block restarted at
  // slot 0 takes its rows' absmax / 448 (fp8) or / 127 (int8); later rows that need a larger
  // scale re-encode the earlier ones. Errors: as K(), plus FAILED_PRECONDITION when that side is
  // not an 8-bit dtype.
  absl::StatusOr<float*> KScales(int32_t layer, BlockRef block) const;
  absl::StatusOr<float*> VScales(int32_t layer, BlockRef block) const;

  // A state slot of the pool's state group (SequenceInfo.state_slot): one sequence's
  // state-space state, f32, state_slot_bytes of them (layout.proto). The daemon's model steps
  // advance it in place; a client must not write it while a step of its sequence runs.
  // Errors: OUT_OF_RANGE (no such slot; every slot without a state group).
  absl::StatusOr<float*> State(int32_t slot) const;

  // Layer `layer`'s K (kv 0) or V (kv 1) dtype; DTYPE_UNSPECIFIED for a layer out of range.
  v1::DType dtype(int32_t layer, int32_t kv) const;
  // Bytes of one token's K (kv 0) or V (kv 1) row of a layer: [num_kv_heads][head_dim].
  int64_t row_bytes(int32_t layer, int32_t kv) const;

  // OK when `block` is in range and still has the generation the caller holds; errors as Block().
  absl::Status CheckCurrent(BlockRef block) const;

  // The block's current generation in the shared table (an acquire load).
  // REQUIRES: 0 <= block < num_blocks() (returns 0 otherwise).
  uint32_t generation(int32_t block) const;

 private:
  PoolMapping(v1::PoolLayout layout, v1::ArenaKind kind, int64_t arena_bytes, int64_t mapped_bytes);

  // `window`: `block` is a window block and `layer` must be a window layer (else a main one).
  absl::StatusOr<char*> Chunk(int32_t layer, int32_t kv, BlockRef block, bool window) const;
  absl::StatusOr<float*> Scales(int32_t layer, int32_t kv, BlockRef block, bool window) const;

  const v1::PoolLayout layout_;
  const v1::ArenaKind kind_;
  const int64_t arena_bytes_;
  const int64_t mapped_bytes_;
  UniqueFd arena_fd_;
  UniqueFd generation_fd_;
  char* base_ = nullptr;                   // host mmap or device address
  const uint32_t* generations_ = nullptr;  // [num_blocks], PROT_READ host mapping
  int64_t generation_map_bytes_ = 0;
  std::unique_ptr<internal::CudaMapping> cuda_;  // CUDA arenas only
};

}  // namespace kvpool::client
