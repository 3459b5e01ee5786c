#include "kernels/cuda/cuda_device.h"

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_memory.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/validate.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::kernels::cuda {
namespace {

// True on a CUDA runtime thread while it runs one of our host tasks (CUDA calls are forbidden
// there, and a blocking wait could deadlock the stream that runs the task).
thread_local bool t_in_host_task = false;

absl::Status FromHostTask(const char* what) {
  return absl::FailedPreconditionError(
      fmt::format("{} called from a host task (no CUDA calls are allowed there)", what));
}

void RaiseCompleted(std::atomic<uint64_t>& completed, uint64_t value) {
  uint64_t seen = completed.load(std::memory_order_relaxed);
  while (seen < value && !completed.compare_exchange_weak(seen, value, std::memory_order_release,
                                                          std::memory_order_relaxed)) {
  }
}

struct HostTask {
  std::function<void()> fn;
  std::atomic<uint64_t>* completed;  // the stream's
  uint64_t value;                    // the task's fence value
};

void CUDART_CB RunHostTask(void* data) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(data));
  // CUDA starts a host function only after everything before it on the stream has completed.
  RaiseCompleted(*task->completed, task->value - 1);
  t_in_host_task = true;
  task->fn();
  t_in_host_task = false;
  RaiseCompleted(*task->completed, task->value);
}

absl::Status NoStream(uint32_t timeline) {
  return absl::InvalidArgumentError(fmt::format("no stream {}", timeline));
}

absl::Status NeverIssued(Fence fence) {
  return absl::InvalidArgumentError(
      fmt::format("fence {} on stream {} was never issued", fence.value, fence.timeline));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int ordinal) {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        fmt::format("no usable CUDA driver or device: {}", cudaGetErrorString(err)));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        fmt::format("CUDA device {} requested, {} present", ordinal, count));
  }
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  cudaDeviceProp prop;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties"));
  int num_sms = 0;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, ordinal),
                 "cudaDeviceGetAttribute(MultiProcessorCount)"));
  std::array<cudaStream_t, kNumStreams> streams{};
  for (uint32_t i = 0; i < kNumStreams; ++i) {
    // Non-blocking: never implicitly ordered after the legacy default stream (DESIGN.md §4.4).
    const cudaError_t err = cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (uint32_t j = 0; j < i; ++j) cudaStreamDestroy(streams[j]);
      return CudaStatus(err, "cudaStreamCreateWithFlags");
    }
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(
      ordinal, fmt::format("cuda:{} ({})", ordinal, prop.name), std::max(num_sms, 1), streams));
}

CudaDevice::CudaDevice(int ordinal, std::string name, int num_sms,
                       const std::array<cudaStream_t, kNumStreams>& streams)
    : ordinal_(ordinal), name_(std::move(name)), num_sms_(num_sms) {
  for (uint32_t i = 0; i < kNumStreams; ++i) streams_[i].handle = streams[i];
}

CudaDevice::~CudaDevice() {
  cudaSetDevice(ordinal_);
  for (Stream& s : streams_) cudaStreamSynchronize(s.handle);
  for (Stream& s : streams_) {
    absl::MutexLock lock(&s.mu);
    for (const Pending& p : s.pending) cudaEventDestroy(p.event);
    for (cudaEvent_t event : s.free_events) cudaEventDestroy(event);
    for (const Waited& w : s.waited) {
      if (w.retired) cudaEventDestroy(w.event);  // the others are still in `pending`
    }
    cudaStreamDestroy(s.handle);
  }
}

absl::StatusOr<std::unique_ptr<Arena>> CudaDevice::CreateArena(int64_t bytes) {
  return CreateCudaArena(ordinal_, bytes);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CudaDevice::AllocateBuffer(int64_t bytes) {
  return AllocateCudaBuffer(ordinal_, bytes);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CudaDevice::AllocateHostBuffer(int64_t bytes) {
  return AllocatePinnedBuffer(ordinal_, bytes);
}

absl::StatusOr<CudaDevice::Stream*> CudaDevice::GetStream(StreamId stream) const {
  const auto s = static_cast<uint32_t>(stream);
  if (s >= kNumStreams) return NoStream(s);
  return &streams_[s];
}

void CudaDevice::RecordError(absl::Status status) const {
  absl::MutexLock lock(&error_mu_);
  if (first_error_.ok()) first_error_ = std::move(status);
}

absl::Status CudaDevice::status() const {
  absl::MutexLock lock(&error_mu_);
  return first_error_;
}

cudaEvent_t CudaDevice::EventOf(const Stream& s, uint64_t value) {
  return s.pending[value - s.pending.front().value].event;
}

void CudaDevice::Reap(Stream& s) const {
  while (!s.pending.empty()) {
    const Pending front = s.pending.front();
    const cudaError_t err = cudaEventQuery(front.event);
    if (err == cudaErrorNotReady) return;
    if (err != cudaSuccess) {
      RecordError(CudaStatus(err, fmt::format("stream {} failed", &s - streams_.data())));
      return;
    }
    RaiseCompleted(s.completed, front.value);
    s.pending.pop_front();
    auto waited = std::find_if(s.waited.begin(), s.waited.end(),
                               [&](const Waited& w) { return w.event == front.event; });
    if (waited != s.waited.end()) {
      waited->retired = true;
    } else {
      s.free_events.push_back(front.event);
    }
  }
}

absl::StatusOr<Fence> CudaDevice::Enqueue(StreamId stream, const char* what, Submit submit) {
  if (t_in_host_task) return FromHostTask(what);
  KVPOOL_ASSIGN_OR_RETURN(Stream * s, GetStream(stream));
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
  absl::MutexLock lock(&s->mu);
  Reap(*s);
  cudaEvent_t event = nullptr;
  if (!s->free_events.empty()) {
    event = s->free_events.back();
    s->free_events.pop_back();
  } else {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                      "cudaEventCreateWithFlags"));
  }
  // Launchers report through cudaGetLastError: drop an error that an earlier call on this thread
  // already returned to its caller.
  cudaGetLastError();
  const uint64_t value = s->submitted.load(std::memory_order_relaxed) + 1;
  cudaError_t err = submit(s->handle, value);
  if (err == cudaSuccess) err = cudaEventRecord(event, s->handle);
  if (err != cudaSuccess) {
    cudaGetLastError();
    s->free_events.push_back(event);
    return CudaStatus(err, what);
  }
  s->submitted.store(value, std::memory_order_release);
  s->pending.push_back(Pending{value, event});
  return Fence{static_cast<uint32_t>(stream), value};
}

absl::StatusOr<Fence> CudaDevice::CopyToDevice(StreamId stream, void* dst, const void* src,
                                               int64_t bytes) {
  if (bytes < 0 || (bytes > 0 && (dst == nullptr || src == nullptr))) {
    return absl::InvalidArgumentError("copy: bad pointers or size");
  }
  // cudaMemcpyDefault: unified addressing tells pinned, pageable and device memory apart.
  return Enqueue(stream, "cudaMemcpyAsync", [&](cudaStream_t h, uint64_t) {
    return bytes == 0 ? cudaSuccess
                      : cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, h);
  });
}

absl::StatusOr<Fence> CudaDevice::CopyToHost(StreamId stream, void* dst, const void* src,
                                             int64_t bytes) {
  return CopyToDevice(stream, dst, src, bytes);
}

absl::StatusOr<Fence> CudaDevice::CopyBlocks(StreamId stream, const KvPoolView& pool,
                                             const CopyBlocksArgs& args) {
  KVPOOL_RETURN_IF_ERROR(ValidateCopyBlocks(pool, args));
  return Enqueue(stream, "CopyBlocks launch",
                 [&](cudaStream_t h, uint64_t) { return LaunchCopyBlocks(pool, args, h); });
}

absl::StatusOr<Fence> CudaDevice::FillBlocks(StreamId stream, const KvPoolView& pool,
                                             const FillBlocksArgs& args) {
  KVPOOL_RETURN_IF_ERROR(ValidateFillBlocks(pool, args));
  return Enqueue(stream, "FillBlocks launch",
                 [&](cudaStream_t h, uint64_t) { return LaunchFillBlocks(pool, args, h); });
}

absl::StatusOr<Fence> CudaDevice::WriteKv(StreamId stream, const KvPoolView& pool,
                                          const WriteKvArgs& args) {
  KVPOOL_RETURN_IF_ERROR(ValidateWriteKv(pool, args));
  return Enqueue(stream, "WriteKv launch",
                 [&](cudaStream_t h, uint64_t) { return LaunchWriteKv(pool, args, h); });
}

absl::StatusOr<Fence> CudaDevice::PagedAttentionDecode(StreamId stream, const KvPoolView& pool,
                                                       const DecodeArgs& args) {
  KVPOOL_RETURN_IF_ERROR(ValidateDecode(pool, args));
  const PoolLayout& layout = pool.layout;
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError("PagedAttentionDecode: " + why);
  };
  if (layout.head_dim > kMaxDecodeHeadDim) {
    return bad(
        fmt::format("head_dim {} > {} (CUDA kernel limit)", layout.head_dim, kMaxDecodeHeadDim));
  }
  if (reinterpret_cast<uintptr_t>(pool.base) % 16 != 0) {
    return bad("pool base is not 16-byte aligned");
  }
  DecodePlan plan;
  if (args.num_seqs > 0) {
    plan = PlanDecode(layout, args.num_seqs, args.num_q_heads, args.max_seq_len, num_sms_);
    if (plan.num_splits > kMaxGridYZ || args.num_q_heads > kMaxGridYZ ||
        static_cast<int64_t>(layout.num_kv_heads) * plan.head_chunks > kMaxGridYZ) {
      return bad(fmt::format("{} query heads, max_seq_len {}: beyond the grid limits",
                             args.num_q_heads, args.max_seq_len));
    }
    if (args.workspace_bytes < plan.workspace_bytes) {
      return bad(fmt::format("workspace of {} bytes, {} needed (DecodeWorkspaceBytes)",
                             args.workspace_bytes, plan.workspace_bytes));
    }
    if (plan.workspace_bytes > 0 && reinterpret_cast<uintptr_t>(args.workspace) % 4 != 0) {
      return bad("workspace is not 4-byte aligned");
    }
  }
  return Enqueue(stream, "PagedAttentionDecode launch", [&](cudaStream_t h, uint64_t) {
    return LaunchPagedAttentionDecode(pool, args, plan, h);
  });
}

absl::StatusOr<Fence> CudaDevice::PagedAttentionPrefill(StreamId stream, const KvPoolView& pool,
                                                        const PrefillArgs& args) {
  KVPOOL_RETURN_IF_ERROR(ValidatePrefill(pool, args, 0));
  const PoolLayout& layout = pool.layout;
  auto bad = [](const std::string& why) {
    return absl::InvalidArgumentError("PagedAttentionPrefill: " + why);
  };
  if (layout.head_dim > kMaxDecodeHeadDim) {
    return bad(
        fmt::format("head_dim {} > {} (CUDA kernel limit)", layout.head_dim, kMaxDecodeHeadDim));
  }
  if (reinterpret_cast<uintptr_t>(pool.base) % 16 != 0) {
    return bad("pool base is not 16-byte aligned");
  }
  PrefillPlan plan;
  if (args.num_seqs > 0) {
    plan = PlanPrefill(layout, args.num_q_heads, args.max_q_len);
    if (args.num_seqs > kMaxGridYZ ||
        static_cast<int64_t>(layout.num_kv_heads) * plan.slices > kMaxGridYZ) {
      return bad(fmt::format("{} sequences, {} query heads: beyond the grid limits", args.num_seqs,
                             args.num_q_heads));
    }
  }
  return Enqueue(stream, "PagedAttentionPrefill launch", [&](cudaStream_t h, uint64_t) {
    return LaunchPagedAttentionPrefill(pool, args, plan, h);
  });
}

absl::StatusOr<Fence> CudaDevice::EnqueueHostTask(StreamId stream, std::function<void()> task) {
  if (!task) return absl::InvalidArgumentError("empty host task");
  return Enqueue(stream, "cudaLaunchHostFunc", [&](cudaStream_t h, uint64_t value) {
    auto* payload =
        new HostTask{std::move(task), &streams_[static_cast<uint32_t>(stream)].completed, value};
    const cudaError_t err = cudaLaunchHostFunc(h, &RunHostTask, payload);
    if (err != cudaSuccess) delete payload;
    return err;
  });
}

int64_t CudaDevice::DecodeWorkspaceBytes(const PoolLayout& layout, int32_t num_seqs,
                                         int32_t num_q_heads, int32_t max_seq_len) const {
  if (!ValidateLayout(layout).ok() || layout.head_dim > kMaxDecodeHeadDim || num_seqs <= 0 ||
      num_q_heads <= 0 || num_q_heads % layout.num_kv_heads != 0 || max_seq_len <= 0) {
    return 0;
  }
  return PlanDecode(layout, num_seqs, num_q_heads, max_seq_len, num_sms_).workspace_bytes;
}

absl::Status CudaDevice::StreamWait(StreamId waiter, Fence fence) {
  KVPOOL_ASSIGN_OR_RETURN(Stream * w, GetStream(waiter));
  if (fence.timeline >= kNumStreams) return NoStream(fence.timeline);
  Stream& s = streams_[fence.timeline];
  if (fence.value <= s.completed.load(std::memory_order_acquire)) return absl::OkStatus();
  if (fence.value > s.submitted.load(std::memory_order_acquire)) return NeverIssued(fence);
  if (w == &s) return absl::OkStatus();  // stream order already holds
  if (t_in_host_task) return FromHostTask("StreamWait");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
  // The source lock keeps the fence's event from being reused while the wait is enqueued.
  absl::MutexLock lock(&s.mu);
  if (fence.value <= s.completed.load(std::memory_order_acquire)) return absl::OkStatus();
  return CudaStatus(cudaStreamWaitEvent(w->handle, EventOf(s, fence.value), 0),
                    "cudaStreamWaitEvent");
}

absl::Status CudaDevice::Synchronize(Fence fence) {
  if (fence.timeline >= kNumStreams) return NoStream(fence.timeline);
  Stream& s = streams_[fence.timeline];
  if (fence.value <= s.completed.load(std::memory_order_acquire)) return status();
  if (fence.value > s.submitted.load(std::memory_order_acquire)) return NeverIssued(fence);
  if (t_in_host_task) return FromHostTask("Synchronize");
  cudaEvent_t event = nullptr;
  {
    absl::MutexLock lock(&s.mu);
    if (fence.value > s.completed.load(std::memory_order_acquire)) {
      event = EventOf(s, fence.value);
      auto waited = std::find_if(s.waited.begin(), s.waited.end(),
                                 [&](const Waited& w) { return w.event == event; });
      if (waited != s.waited.end()) {
        ++waited->waiters;
      } else {
        s.waited.push_back(Waited{event, 1, false});
      }
    }
  }
  if (event == nullptr) return status();
  if (const cudaError_t err = cudaEventSynchronize(event); err != cudaSuccess) {
    RecordError(CudaStatus(err, fmt::format("stream {} failed", fence.timeline)));
  }
  {
    absl::MutexLock lock(&s.mu);
    auto waited = std::find_if(s.waited.begin(), s.waited.end(),
                               [&](const Waited& w) { return w.event == event; });
    if (--waited->waiters == 0) {
      if (waited->retired) s.free_events.push_back(event);
      s.waited.erase(waited);
    }
    Reap(s);
  }
  return status();
}

absl::Status CudaDevice::SynchronizeAll() {
  if (t_in_host_task) return FromHostTask("SynchronizeAll");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
  for (uint32_t i = 0; i < kNumStreams; ++i) {
    Stream& s = streams_[i];
    if (const cudaError_t err = cudaStreamSynchronize(s.handle); err != cudaSuccess) {
      RecordError(CudaStatus(err, fmt::format("stream {} failed", i)));
    }
    absl::MutexLock lock(&s.mu);
    Reap(s);
  }
  return status();
}

Fence CudaDevice::LastFence(StreamId stream) const {
  const auto timeline = static_cast<uint32_t>(stream);
  if (timeline >= kNumStreams) return Fence{timeline, 0};
  return Fence{timeline, streams_[timeline].submitted.load(std::memory_order_acquire)};
}

bool CudaDevice::HasPassed(Fence fence) const {
  if (fence.value == 0) return true;
  if (fence.timeline >= kNumStreams) return false;
  Stream& s = streams_[fence.timeline];
  if (s.completed.load(std::memory_order_acquire) >= fence.value) return true;
  if (t_in_host_task) return false;
  // Never block: while a submission holds the lock, answer from what is known.
  if (!s.mu.TryLock()) return false;
  Reap(s);
  s.mu.Unlock();
  return s.completed.load(std::memory_order_acquire) >= fence.value;
}

}  // namespace kvpool::kernels::cuda
