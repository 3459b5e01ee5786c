#pragma once

// CudaDevice: the device layer on one NVIDIA GPU (DESIGN.md §6), the product of the backend
// library libkvpool_cuda.so.
//
// Streams: two non-blocking CUDA streams, kCompute and kTransfer. Fences: every enqueued
// operation takes the stream's next value and records a CUDA event (from a per-stream pool of
// reused events) behind it; HasPassed queries those events oldest first and caches the newest
// completed value, so an answer costs an atomic load when the fence is known to have passed and
// a few cudaEventQuery calls otherwise. StreamWait is cudaStreamWaitEvent on the fence's event,
// so it takes no fence value of its own (the CPU device's does).
//
// Host tasks run on a CUDA runtime thread, where CUDA calls are forbidden: from inside one,
// HasPassed answers from what the device already knows (every fence before the task's own has
// passed), and enqueues, StreamWait and Synchronize fail with FAILED_PRECONDITION.
//
// Device-memory arguments (slots, block ids, sequence lengths) are checked by the kernels as
// described in kernels/cuda/cuda_kernels.h: a bad one is skipped or yields NaN, never a read or
// write outside the arena.
//
// Thread-safe: any thread may enqueue; each stream's submissions are serialized so fence values
// follow stream order. Arenas and buffers it returns are owned by the caller and may outlive it.

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "kernels/device.h"

namespace kvpool::kernels::cuda {

class CudaDevice final : public Device {
 public:
  // Errors: INVALID_ARGUMENT for an ordinal the runtime does not list; UNAVAILABLE without a
  // driver; INTERNAL when CUDA fails to set the device up (nothing is left allocated).
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int ordinal);

  ~CudaDevice() override;  // waits for both streams, then destroys events and streams

  std::string name() const override { return name_; }
  int ordinal() const { return ordinal_; }
  int num_sms() const { return num_sms_; }
  bool host_visible() const override { return false; }
  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(int64_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(int64_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateHostBuffer(int64_t bytes) override;
  // `src` (CopyToDevice) and `dst` (CopyToHost) are host memory; pinned memory makes the copy
  // asynchronous, pageable memory makes the call return only once the copy is staged (to the
  // device) or done (to the host).
  absl::StatusOr<Fence> CopyToDevice(StreamId stream, void* dst, const void* src,
                                     int64_t bytes) override;
  absl::StatusOr<Fence> CopyToHost(StreamId stream, void* dst, const void* src,
                                   int64_t bytes) override;
  absl::StatusOr<Fence> CopyBlocks(StreamId stream, const KvPoolView& pool,
                                   const CopyBlocksArgs& args) override;
  absl::StatusOr<Fence> FillBlocks(StreamId stream, const KvPoolView& pool,
                                   const FillBlocksArgs& args) override;
  absl::StatusOr<Fence> WriteKv(StreamId stream, const KvPoolView& pool,
                                const WriteKvArgs& args) override;
  // Errors beyond validate.h: INVALID_ARGUMENT for head_dim > 256, a pool base not 16-byte
  // aligned, a workspace smaller than DecodeWorkspaceBytes(), or a shape beyond the grid limits.
  absl::StatusOr<Fence> PagedAttentionDecode(StreamId stream, const KvPoolView& pool,
                                             const DecodeArgs& args) override;
  // As decode: INVALID_ARGUMENT (nothing enqueued) for a head_dim above kMaxDecodeHeadDim, an
  // unaligned pool base, or more sequences or KV-head slices than the grid holds.
  absl::StatusOr<Fence> PagedAttentionPrefill(StreamId stream, const KvPoolView& pool,
                                              const PrefillArgs& args) override;
  // `task` must not call CUDA (it runs in a CUDA host function); see the class comment.
  absl::StatusOr<Fence> EnqueueHostTask(StreamId stream, std::function<void()> task) override;
  // f32 partial results of the split-K decode (0 when one split suffices or the shape is bad).
  int64_t DecodeWorkspaceBytes(const PoolLayout& layout, int32_t num_seqs, int32_t num_q_heads,
                               int32_t max_seq_len) const override;
  // The prefill kernel needs none.
  int64_t PrefillWorkspaceBytes(const PoolLayout& layout) const override { return 0; }
  absl::Status StreamWait(StreamId waiter, Fence fence) override;
  absl::Status Synchronize(Fence fence) override;
  absl::Status SynchronizeAll() override;
  absl::Status status() const override;
  Fence LastFence(StreamId stream) const override;
  // A fence on a timeline this device does not have passes only when its value is 0.
  bool HasPassed(Fence fence) const override;

 private:
  struct Pending {
    uint64_t value;
    cudaEvent_t event;
  };
  // An event a Synchronize() is blocked on. It is not reused until the last such waiter returns:
  // re-recorded for later work, it would make the waiter wait for that work too.
  struct Waited {
    cudaEvent_t event;
    int waiters;
    bool retired;  // completed while waited on; goes to the free pool after the last waiter
  };
  struct Stream {
    cudaStream_t handle = nullptr;
    // Held across a submission (launch + event record): fence values must follow stream order.
    mutable absl::Mutex mu;
    // The newest value handed out. Written under `mu`, read without it (LastFence, and checks
    // that must not take `mu` inside a host task: a submission holding it may be waiting for
    // that very task, e.g. a copy to pageable host memory).
    std::atomic<uint64_t> submitted{0};
    // Events of submitted values not yet seen complete, oldest first (consecutive values).
    std::deque<Pending> pending ABSL_GUARDED_BY(mu);
    std::vector<cudaEvent_t> free_events ABSL_GUARDED_BY(mu);
    std::vector<Waited> waited ABSL_GUARDED_BY(mu);
    // The newest value known complete; only grows. Read without the lock.
    std::atomic<uint64_t> completed{0};
  };
  // What a submission enqueues, given the stream and the fence value it will get.
  using Submit = absl::FunctionRef<cudaError_t(cudaStream_t, uint64_t)>;

  CudaDevice(int ordinal, std::string name, int num_sms,
             const std::array<cudaStream_t, kNumStreams>& streams);

  absl::StatusOr<Stream*> GetStream(StreamId stream) const;
  // Runs `submit` on the stream and records the fence's event behind it. Errors: INTERNAL from
  // CUDA (not recorded in status(): the caller gets it), FAILED_PRECONDITION from a host task.
  absl::StatusOr<Fence> Enqueue(StreamId stream, const char* what, Submit submit);
  // The event recorded for `value`. REQUIRES: completed < value <= submitted.
  static cudaEvent_t EventOf(const Stream& s, uint64_t value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Retires completed events from the front of `s.pending`; records a query error.
  void Reap(Stream& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void RecordError(absl::Status status) const;

  const int ordinal_;
  const std::string name_;
  const int num_sms_;
  mutable std::array<Stream, kNumStreams> streams_;
  mutable absl::Mutex error_mu_;
  mutable absl::Status first_error_ ABSL_GUARDED_BY(error_mu_);
};

}  // namespace kvpool::kernels::cuda
