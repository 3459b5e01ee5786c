#pragma once

// Device: where a pool's memory lives and where its kernels run, with ordered streams and fences
// (DESIGN.md §6). Two implementations: CpuDevice (always built; each stream a worker thread with
// an ordered queue) and the CUDA backend (kernels/cuda, a library loaded at run time).
//
// A Device is also the core's FenceObserver: stream s is timeline s, and every operation
// enqueued on it returns the Fence{s, n} of that operation. Work on one stream runs in order;
// StreamWait orders one stream after another's fence.
//
// Errors from asynchronous work (a kernel that failed on the device) are reported by the next
// Synchronize() and by status(); the device never aborts the process for them.
//
// Thread-safe: operations may be enqueued from any thread; each stream keeps its own order.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernel_args.h"
#include "kernels/pool_layout.h"
#include "kvpool/fence.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::kernels {

// Streams are fixed per device; the value is the fence timeline.
enum class StreamId : uint32_t {
  kCompute = 0,   // decode/prefill kernels and the block tables they read
  kTransfer = 1,  // copy-on-write, fills, tier moves
};
inline constexpr uint32_t kNumStreams = 2;

// How another process maps the arena.
struct ArenaExport {
  enum class Kind : uint8_t {
    kMemfd,    // CPU: one memfd; mmap(MAP_SHARED) it
    kCudaVmm,  // CUDA: a POSIX fd from cuMemExportToShareableHandle; cuMemImport + cuMemMap
    kCudaIpc,  // CUDA (no VMM): handle bytes for cudaIpcOpenMemHandle
  };
  Kind kind = Kind::kMemfd;
  UniqueFd fd;               // kMemfd / kCudaVmm: a new descriptor, the caller's
  std::string ipc_handle;    // kCudaIpc: the raw cudaIpcMemHandle_t
  int64_t bytes = 0;         // the arena's size
  int64_t mapped_bytes = 0;  // the size to map (a multiple of the VMM granularity)
  int device_ordinal = 0;
};

// The pool arena: one allocation of layout.arena_bytes(). Freed when destroyed.
class Arena {
 public:
  virtual ~Arena() = default;
  virtual void* base() const = 0;  // device address (host address on the CPU device)
  virtual int64_t bytes() const = 0;
  // A handle another process can map. Errors: INTERNAL when the driver refuses.
  virtual absl::StatusOr<ArenaExport> Export() const = 0;
};

// Scratch memory kernels read or write (device memory). Freed when destroyed.
class DeviceBuffer {
 public:
  virtual ~DeviceBuffer() = default;
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
};

class Device : public FenceObserver {
 public:
  ~Device() override = default;

  // "cpu (8 threads, avx2+fma+f16c)", "cuda:0 (NVIDIA H200)": its backend's registry name
  // (backend_api.h), then anything that is not a letter or digit.
  virtual std::string name() const = 0;
  // True when device memory is host memory (pointers from base()/data() can be dereferenced).
  virtual bool host_visible() const = 0;

  // Errors: RESOURCE_EXHAUSTED when the device cannot provide the memory; INTERNAL otherwise.
  virtual absl::StatusOr<std::unique_ptr<Arena>> CreateArena(int64_t bytes) = 0;
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(int64_t bytes) = 0;
  // Host memory the device copies to and from asynchronously at full speed: page-locked on CUDA
  // (a copy to pageable memory would block the caller until the stream got there), plain on the
  // CPU. data() is a host pointer. Errors as AllocateBuffer.
  virtual absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateHostBuffer(int64_t bytes) = 0;

  // Enqueued operations: each runs after everything enqueued before it on `stream` and returns
  // its fence. Pointers must stay valid until that fence has passed. Argument errors are
  // INVALID_ARGUMENT and enqueue nothing.
  virtual absl::StatusOr<Fence> CopyToDevice(StreamId stream, void* dst, const void* src,
                                             int64_t bytes) = 0;
  virtual absl::StatusOr<Fence> CopyToHost(StreamId stream, void* dst, const void* src,
                                           int64_t bytes) = 0;
  virtual absl::StatusOr<Fence> CopyBlocks(StreamId stream, const KvPoolView& pool,
                                           const CopyBlocksArgs& args) = 0;
  virtual absl::StatusOr<Fence> FillBlocks(StreamId stream, const KvPoolView& pool,
                                           const FillBlocksArgs& args) = 0;
  virtual absl::StatusOr<Fence> WriteKv(StreamId stream, const KvPoolView& pool,
                                        const WriteKvArgs& args) = 0;
  virtual absl::StatusOr<Fence> PagedAttentionDecode(StreamId stream, const KvPoolView& pool,
                                                     const DecodeArgs& args) = 0;
  // Several new tokens per sequence, causal (kernel_args.h: PrefillArgs).
  virtual absl::StatusOr<Fence> PagedAttentionPrefill(StreamId stream, const KvPoolView& pool,
                                                      const PrefillArgs& args) = 0;
  // Runs `task` on the host once everything before it on `stream` is done (a completion
  // callback; on the CPU device, arbitrary host work in stream order).
  virtual absl::StatusOr<Fence> EnqueueHostTask(StreamId stream, std::function<void()> task) = 0;

  // Workspace PagedAttentionDecode needs for this shape.
  virtual int64_t DecodeWorkspaceBytes(const PoolLayout& layout, int32_t num_seqs,
                                       int32_t num_q_heads, int32_t max_seq_len) const = 0;
  // Workspace PagedAttentionPrefill needs over pools of this layout (any stream, any shape).
  virtual int64_t PrefillWorkspaceBytes(const PoolLayout& layout) const = 0;

  // Later work on `waiter` starts only after `fence` has passed.
  virtual absl::Status StreamWait(StreamId waiter, Fence fence) = 0;
  // Blocks until `fence` has passed; returns the first asynchronous error, if any.
  virtual absl::Status Synchronize(Fence fence) = 0;
  // Blocks until every stream is idle.
  virtual absl::Status SynchronizeAll() = 0;
  // The first asynchronous error seen so far (OK when none).
  virtual absl::Status status() const = 0;

  // The fence of the newest operation enqueued on `stream` (value 0 before any).
  virtual Fence LastFence(StreamId stream) const = 0;
};

}  // namespace kvpool::kernels
