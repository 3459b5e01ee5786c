#pragma once

// CpuDevice: the device layer on the host, always built and the default without a GPU.
//
// The arena is a memfd, sealed against shrinking and mapped shared, so a client process maps the
// very same pages (ArenaExport::Kind::kMemfd). Each stream is a worker thread draining an ordered
// queue; its completion counter is the fence timeline, so stream ordering, StreamWait and fenced
// release behave (and are tested) as they do on a GPU. Kernels on the compute stream spread over
// a ThreadPool.
//
// Copies and fills are submitted lazily, as a driver batches work until it is flushed: queued on
// an idle stream they do not wake its worker. The first of these to happen starts them: a thread
// waits for one (Synchronize, or another stream's StreamWait: the waiter runs them itself), a
// fence of theirs is polled (HasPassed), or a task of another kind is queued behind them. Every
// user of a copy's result learns it has run through one of the first two, so none waits longer;
// a caller that enqueues a copy and then waits for it, the common case, runs it on its own thread
// and no thread is woken at all.
//
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/device.h"
#include "kernels/thread_pool.h"

namespace kvpool::kernels {

class CpuDevice final : public Device {
 public:
  // `threads`: kernel threads (0 = hardware concurrency).
  explicit CpuDevice(int threads);
  ~CpuDevice() override;  // drains every stream

  std::string name() const override;
  bool host_visible() const override { return true; }
  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(int64_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateBuffer(int64_t bytes) override;
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateHostBuffer(int64_t bytes) override {
    return AllocateBuffer(bytes);  // device memory is host memory
  }
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
  absl::StatusOr<Fence> PagedAttentionDecode(StreamId stream, const KvPoolView& pool,
                                             const DecodeArgs& args) override;
  absl::StatusOr<Fence> PagedAttentionPrefill(StreamId stream, const KvPoolView& pool,
                                              const PrefillArgs& args) override;
  absl::StatusOr<Fence> EnqueueHostTask(StreamId stream, std::function<void()> task) override;
  int64_t DecodeWorkspaceBytes(const PoolLayout& layout, int32_t num_seqs, int32_t num_q_heads,
                               int32_t max_seq_len) const override {
    return 0;
  }
  // A slice per kernel thread (cpu::PrefillWorkspaceBytes).
  int64_t PrefillWorkspaceBytes(const PoolLayout& layout) const override;
  absl::Status StreamWait(StreamId waiter, Fence fence) override;
  absl::Status Synchronize(Fence fence) override;
  absl::Status SynchronizeAll() override;
  absl::Status status() const override;
  Fence LastFence(StreamId stream) const override;
  bool HasPassed(Fence fence) const override;
  // Tasks that a thread waiting for them ran itself (Stream::WaitFor), over all streams.
  uint64_t tasks_run_by_waiters() const;

 private:
  // Whether a thread waiting for a stream may run a task itself (Stream::WaitFor): plain copies
  // and fills may; kernels (the compute stream's thread pool), host tasks (they may take locks
  // the waiter holds) and cross-stream waits may not.
  enum class Helpable : bool { kNo, kYes };
  struct Task {
    uint64_t value;
    std::function<absl::Status()> run;
    Helpable helpable = Helpable::kNo;
  };
  class Stream {
   public:
    Stream(CpuDevice* device, uint32_t timeline);
    ~Stream();  // Drain()s
    // Runs what is queued, then ends the worker. Idempotent. A task of another stream may wait
    // on this one (StreamWait) until then, so ~CpuDevice drains every stream before freeing any.
    void Drain();
    Fence Enqueue(std::function<absl::Status()> run, Helpable helpable = Helpable::kNo);
    // Returns once task `value` has run. While the stream's next task is a helpable one and
    // nothing of the stream runs, the waiter runs it on its own thread, in order: the copy it
    // waits for starts without waking the worker, and ends without waking the waiter.
    void WaitFor(uint64_t value);
    uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
    uint64_t submitted() const;
    uint64_t run_by_waiters() const { return run_by_waiters_.load(std::memory_order_relaxed); }
    // Wakes the worker for the helpable tasks queued without waking it, if any (HasPassed's
    // poll of a fence that has not passed: whoever polls expects the stream to move on).
    void Kick();

   private:
    void Loop();
    // Pops the queue's head (the caller has moved it out).
    void TakeHead() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
    // Runs `task` (taken off the queue with running_ set) on this thread, then completes it.
    void Run(Task task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

    CpuDevice* const device_;
    const uint32_t timeline_;
    mutable absl::Mutex mu_;
    std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
    uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
    bool stop_ ABSL_GUARDED_BY(mu_) = false;
    bool running_ ABSL_GUARDED_BY(mu_) = false;  // a task runs (on the worker or a waiter)
    // The worker may take the queue's head: set by a task that is not helpable and by Kick,
    // cleared when the queue runs empty. Helpable tasks queued while it is clear wait for a
    // waiter, a Kick or a task of another kind (the lazy submission above).
    bool kicked_ ABSL_GUARDED_BY(mu_) = false;
    // Mirrors "the queue is not empty and kicked_ is clear" for Kick's check without the lock.
    std::atomic<bool> lazy_{false};
    std::atomic<uint64_t> completed_{0};
    std::atomic<uint64_t> run_by_waiters_{0};
    std::thread worker_;
  };

  absl::StatusOr<Stream*> GetStream(StreamId stream);
  void RecordError(absl::Status status);

  ThreadPool threads_;  // used from the compute stream's worker only
  mutable absl::Mutex error_mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(error_mu_);
  std::unique_ptr<Stream> streams_[kNumStreams];
};

}  // namespace kvpool::kernels
