#pragma once

// The disk tier's files and buffers: a file opened with O_DIRECT where the file system allows it
// (buffered otherwise), positional reads and writes that finish or fail whole (EINTR and short
// transfers retried), and page-aligned buffers for them. Thread-compatible per object; pread and
// pwrite on one DiskFile may run on several threads at once.

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::tier::internal {

// `bytes` (a multiple of 4096) of 4096-aligned memory, zeroed.
class AlignedBuffer final {
 public:
  AlignedBuffer() = default;
  // Errors: RESOURCE_EXHAUSTED.
  static absl::StatusOr<AlignedBuffer> Create(int64_t bytes);
  std::byte* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_.get(), static_cast<size_t>(size_)}; }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  int64_t size_ = 0;
};

class DiskFile final {
 public:
  DiskFile() = default;
  // Opens (creating, mode 0600) `path` for reading and writing, with O_DIRECT when `direct` and
  // the file system takes it. Errors: the errno of open(2), as absl::ErrnoToStatus.
  static absl::StatusOr<DiskFile> Open(const std::string& path, bool direct);

  bool direct() const { return direct_; }
  int fd() const { return fd_.get(); }

  // Reads exactly the iovecs' bytes at `offset`. Errors: the errno of preadv(2); DATA_LOSS when
  // the file ends first (a truncated file).
  absl::Status ReadAt(int64_t offset, std::span<const iovec> parts) const;
  // Writes exactly the iovecs' bytes at `offset`. Errors: the errno of pwritev(2) (ENOSPC: the
  // file system is full; EROFS: it went read-only).
  absl::Status WriteAt(int64_t offset, std::span<const iovec> parts) const;
  absl::Status Sync() const;                 // fdatasync(2)
  absl::Status Resize(int64_t bytes) const;  // ftruncate(2): sparse, no space allocated
  absl::StatusOr<int64_t> Size() const;

 private:
  DiskFile(UniqueFd fd, bool direct) : fd_(std::move(fd)), direct_(direct) {}
  UniqueFd fd_;
  bool direct_ = false;
};

// Makes `path` and any missing parent (mode 0700) unless it is a directory already. Errors: the
// errno of mkdir(2); ENOTDIR when something else is there.
absl::Status MakeDirectory(const std::string& path);

}  // namespace kvpool::tier::internal
