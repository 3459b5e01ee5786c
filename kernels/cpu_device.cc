#include "kernels/cpu_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "fmt/format.h"
#include "kernels/cpu_kernels.h"
#include "kernels/internal/stream_copy.h"
#include "kernels/validate.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::kernels {
namespace {

absl::Status Errno(std::string_view what) {
  const int err = errno;
  const std::string message = fmt::format("{}: {}", what, std::strerror(err));
  return err == ENOMEM ? absl::ResourceExhaustedError(message) : absl::InternalError(message);
}

// The pool arena: a memfd mapped shared. Sealed against shrinking so a client's mapping can
// never be cut under it.
class MemfdArena final : public Arena {
 public:
  static absl::StatusOr<std::unique_ptr<Arena>> Create(int64_t bytes) {
    if (bytes <= 0) return absl::InvalidArgumentError("arena size must be > 0");
    const int fd = memfd_create("kvpool-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return Errno("memfd_create");
    if (ftruncate(fd, bytes) != 0) {
      const absl::Status s = Errno("ftruncate(arena)");
      close(fd);
      return s;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      const absl::Status s = Errno("seal arena");
      close(fd);
      return s;
    }
    void* base =
        mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const absl::Status s = Errno("mmap(arena)");
      close(fd);
      return s;
    }
    // Decode walks the arena block by block: huge pages spare it most TLB misses. Honoured where
    // shmem THP is enabled ("advise" or "always"); elsewhere a harmless no-op.
    (void)madvise(base, static_cast<size_t>(bytes), MADV_HUGEPAGE);
    return std::unique_ptr<Arena>(new MemfdArena(fd, base, bytes));
  }

  ~MemfdArena() override {
    munmap(base_, static_cast<size_t>(bytes_));
    close(fd_);
  }

  void* base() const override { return base_; }
  int64_t bytes() const override { return bytes_; }
  absl::StatusOr<ArenaExport> Export() const override {
    const int fd = fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return Errno("dup(arena)");
    return ArenaExport{.kind = ArenaExport::Kind::kMemfd,
                       .fd = UniqueFd(fd),
                       .bytes = bytes_,
                       .mapped_bytes = bytes_};
  }

 private:
  MemfdArena(int fd, void* base, int64_t bytes) : fd_(fd), base_(base), bytes_(bytes) {}

  const int fd_;
  void* const base_;
  const int64_t bytes_;
};

class HostBuffer final : public DeviceBuffer {
 public:
  // Page-aligned: the disk tier reads into lookup buffers with O_DIRECT, which needs it.
  explicit HostBuffer(int64_t bytes)
      : data_(std::aligned_alloc(4096, static_cast<size_t>((bytes + 4095) / 4096 * 4096))),
        bytes_(bytes) {}
  ~HostBuffer() override { std::free(data_); }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* const data_;
  const int64_t bytes_;
};

}  // namespace

CpuDevice::Stream::Stream(CpuDevice* device, uint32_t timeline)
    : device_(device), timeline_(timeline), worker_([this] { Loop(); }) {}

CpuDevice::Stream::~Stream() { Drain(); }

void CpuDevice::Stream::Drain() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (worker_.joinable()) worker_.join();
}

Fence CpuDevice::Stream::Enqueue(std::function<absl::Status()> run, Helpable helpable) {
  absl::MutexLock lock(&mu_);
  const uint64_t value = ++submitted_;
  queue_.push_back(Task{value, std::move(run), helpable});
  if (helpable == Helpable::kNo) kicked_ = true;  // the worker must run it: wake it (on unlock)
  lazy_.store(!kicked_, std::memory_order_relaxed);
  return Fence{timeline_, value};
}

void CpuDevice::Stream::Kick() {
  if (!lazy_.load(std::memory_order_relaxed)) return;
  absl::MutexLock lock(&mu_);
  if (!queue_.empty()) kicked_ = true;
  lazy_.store(false, std::memory_order_relaxed);
}

void CpuDevice::Stream::TakeHead() {
  queue_.pop_front();
  if (queue_.empty()) {
    kicked_ = false;
    lazy_.store(false, std::memory_order_relaxed);
  }
}

uint64_t CpuDevice::Stream::submitted() const {
  absl::MutexLock lock(&mu_);
  return submitted_;
}

namespace {
// The device whose stream task this thread is running, if any: a host task may not call its
// device (Device::EnqueueHostTask), as on CUDA; on the CPU one that synchronized its own stream
// would wait for itself.
thread_local const CpuDevice* running_task_of = nullptr;

absl::Status RefuseInsideTask(const CpuDevice* device, std::string_view call) {
  if (running_task_of != device) return absl::OkStatus();
  return absl::FailedPreconditionError(
      fmt::format("{} from inside a host task of the same device", call));
}
}  // namespace

void CpuDevice::Stream::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    // One task at a time, in order, whichever thread runs it.
    mu_.Await(absl::Condition(
        +[](Stream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
          return !s->running_ && (s->stop_ || (s->kicked_ && !s->queue_.empty()));
        },
        this));
    if (queue_.empty()) return;  // stopping, and drained
    Task task = std::move(queue_.front());
    TakeHead();
    Run(std::move(task));
  }
}

void CpuDevice::Stream::Run(Task task) {
  running_ = true;
  mu_.Unlock();
  const CpuDevice* outer = running_task_of;
  running_task_of = device_;
  absl::Status status = task.run();
  running_task_of = outer;
  if (!status.ok()) device_->RecordError(std::move(status));
  mu_.Lock();  // waiters Await under mu_
  completed_.store(task.value, std::memory_order_release);
  running_ = false;
}

void CpuDevice::Stream::WaitFor(uint64_t value) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    std::pair<Stream*, uint64_t> target(this, value);
    mu_.Await(absl::Condition(
        +[](std::pair<Stream*, uint64_t>* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->first->mu_) {
          return t->first->completed() >= t->second ||
                 (!t->first->running_ && !t->first->queue_.empty() &&
                  t->first->queue_.front().helpable == Helpable::kYes);
        },
        &target));
    if (completed() >= value) return;
    // (The head is at or before `value`: tasks complete in order and `value` has not.)
    run_by_waiters_.fetch_add(1, std::memory_order_relaxed);
    Task task = std::move(queue_.front());
    TakeHead();
    Run(std::move(task));
  }
}

CpuDevice::CpuDevice(int threads) : threads_(threads) {
  for (uint32_t s = 0; s < kNumStreams; ++s) streams_[s] = std::make_unique<Stream>(this, s);
}

CpuDevice::~CpuDevice() {
  // Every queue drains while every stream still exists: a task of one (StreamWait) may be
  // waiting on another, inside that one's lock, until the other's last task has run.
  for (auto& stream : streams_) stream->Drain();
  for (auto& stream : streams_) stream.reset();
}

std::string CpuDevice::name() const {
  return fmt::format("cpu ({} threads, {})", threads_.threads(),
                     cpu::UsingAvx2() ? "avx2+fma+f16c" : "portable");
}

absl::StatusOr<std::unique_ptr<Arena>> CpuDevice::CreateArena(int64_t bytes) {
  return MemfdArena::Create(bytes);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> CpuDevice::AllocateBuffer(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("buffer size must be > 0");
  auto buffer = std::make_unique<HostBuffer>(bytes);
  if (buffer->data() == nullptr) {
    return absl::ResourceExhaustedError(fmt::format("cannot allocate {} bytes", bytes));
  }
  return buffer;
}

absl::StatusOr<CpuDevice::Stream*> CpuDevice::GetStream(StreamId stream) {
  const auto s = static_cast<uint32_t>(stream);
  if (s >= kNumStreams) return absl::InvalidArgumentError(fmt::format("no stream {}", s));
  return streams_[s].get();
}

void CpuDevice::RecordError(absl::Status status) {
  absl::MutexLock lock(&error_mu_);
  if (first_error_.ok()) first_error_ = std::move(status);
}

absl::StatusOr<Fence> CpuDevice::CopyToDevice(StreamId stream, void* dst, const void* src,
                                              int64_t bytes) {
  if (bytes < 0 || (bytes > 0 && (dst == nullptr || src == nullptr))) {
    return absl::InvalidArgumentError("copy: bad pointers or size");
  }
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  return (*s)->Enqueue(
      [=] {
        internal::StreamCopy(dst, src, static_cast<size_t>(bytes));
        return absl::OkStatus();
      },
      Helpable::kYes);
}

absl::StatusOr<Fence> CpuDevice::CopyToHost(StreamId stream, void* dst, const void* src,
                                            int64_t bytes) {
  return CopyToDevice(stream, dst, src, bytes);  // one address space
}

absl::StatusOr<Fence> CpuDevice::CopyBlocks(StreamId stream, const KvPoolView& pool,
                                            const CopyBlocksArgs& args) {
  if (absl::Status v = ValidateCopyBlocks(pool, args); !v.ok()) return v;
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  return (*s)->Enqueue([=] { return cpu::CopyBlocks(pool, args); }, Helpable::kYes);
}

absl::StatusOr<Fence> CpuDevice::FillBlocks(StreamId stream, const KvPoolView& pool,
                                            const FillBlocksArgs& args) {
  if (absl::Status v = ValidateFillBlocks(pool, args); !v.ok()) return v;
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  return (*s)->Enqueue([=] { return cpu::FillBlocks(pool, args); }, Helpable::kYes);
}

absl::StatusOr<Fence> CpuDevice::WriteKv(StreamId stream, const KvPoolView& pool,
                                         const WriteKvArgs& args) {
  if (absl::Status v = ValidateWriteKv(pool, args); !v.ok()) return v;
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  return (*s)->Enqueue([=] { return cpu::WriteKv(pool, args); });
}

absl::StatusOr<Fence> CpuDevice::PagedAttentionDecode(StreamId stream, const KvPoolView& pool,
                                                      const DecodeArgs& args) {
  if (absl::Status v = ValidateDecode(pool, args); !v.ok()) return v;
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  // Only the compute stream may use the thread pool (one ParallelFor at a time).
  ThreadPool* threads = stream == StreamId::kCompute ? &threads_ : nullptr;
  return (*s)->Enqueue([=] { return cpu::PagedAttentionDecode(pool, args, threads); });
}

absl::StatusOr<Fence> CpuDevice::PagedAttentionPrefill(StreamId stream, const KvPoolView& pool,
                                                       const PrefillArgs& args) {
  if (absl::Status v = ValidatePrefill(pool, args, PrefillWorkspaceBytes(pool.layout)); !v.ok()) {
    return v;
  }
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  ThreadPool* threads = stream == StreamId::kCompute ? &threads_ : nullptr;
  return (*s)->Enqueue([=] { return cpu::PagedAttentionPrefill(pool, args, threads); });
}

int64_t CpuDevice::PrefillWorkspaceBytes(const PoolLayout& layout) const {
  return cpu::PrefillWorkspaceBytes(layout, threads_.threads());
}

absl::StatusOr<Fence> CpuDevice::EnqueueHostTask(StreamId stream, std::function<void()> task) {
  if (!task) return absl::InvalidArgumentError("empty host task");
  KVPOOL_RETURN_IF_ERROR(RefuseInsideTask(this, "EnqueueHostTask"));
  absl::StatusOr<Stream*> s = GetStream(stream);
  if (!s.ok()) return s.status();
  return (*s)->Enqueue([task = std::move(task)] {
    task();
    return absl::OkStatus();
  });
}

absl::Status CpuDevice::StreamWait(StreamId waiter, Fence fence) {
  absl::StatusOr<Stream*> s = GetStream(waiter);
  if (!s.ok()) return s.status();
  if (fence.timeline >= kNumStreams) {
    return absl::InvalidArgumentError(fmt::format("no stream {}", fence.timeline));
  }
  if (fence.value == 0 || fence.timeline == static_cast<uint32_t>(waiter)) {
    return absl::OkStatus();  // nothing to wait for, or already ordered
  }
  Stream* other = streams_[fence.timeline].get();
  (*s)->Enqueue([other, value = fence.value] {
    other->WaitFor(value);
    return absl::OkStatus();
  });
  return absl::OkStatus();
}

absl::Status CpuDevice::Synchronize(Fence fence) {
  KVPOOL_RETURN_IF_ERROR(RefuseInsideTask(this, "Synchronize"));
  if (fence.timeline >= kNumStreams) {
    return absl::InvalidArgumentError(fmt::format("no stream {}", fence.timeline));
  }
  Stream* stream = streams_[fence.timeline].get();
  if (fence.value > stream->submitted()) {
    return absl::InvalidArgumentError(
        fmt::format("fence {} on stream {} was never issued", fence.value, fence.timeline));
  }
  stream->WaitFor(fence.value);
  return status();
}

absl::Status CpuDevice::SynchronizeAll() {
  KVPOOL_RETURN_IF_ERROR(RefuseInsideTask(this, "SynchronizeAll"));
  for (uint32_t s = 0; s < kNumStreams; ++s) streams_[s]->WaitFor(streams_[s]->submitted());
  return status();
}

absl::Status CpuDevice::status() const {
  absl::MutexLock lock(&error_mu_);
  return first_error_;
}

Fence CpuDevice::LastFence(StreamId stream) const {
  const auto s = static_cast<uint32_t>(stream);
  return s < kNumStreams ? Fence{s, streams_[s]->submitted()} : Fence{};
}

uint64_t CpuDevice::tasks_run_by_waiters() const {
  uint64_t n = 0;
  for (const auto& stream : streams_) n += stream->run_by_waiters();
  return n;
}

bool CpuDevice::HasPassed(Fence fence) const {
  if (fence.value == 0) return true;
  if (fence.timeline >= kNumStreams) return false;
  Stream& stream = *streams_[fence.timeline];
  if (stream.completed() >= fence.value) return true;
  stream.Kick();  // the poller expects the stream to move on without waiting for it
  return false;
}

}  // namespace kvpool::kernels
