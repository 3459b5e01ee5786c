#include "tier/internal/disk_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvpool::tier::internal {
namespace {

constexpr size_t kAlign = 4096;

// Advances `parts` (copied into `scratch`) past `done` bytes.
std::span<const iovec> Skip(std::span<const iovec> parts, size_t done,
                            std::vector<iovec>* scratch) {
  scratch->assign(parts.begin(), parts.end());
  size_t i = 0;
  while (i < scratch->size() && done >= (*scratch)[i].iov_len) done -= (*scratch)[i++].iov_len;
  if (i < scratch->size()) {
    (*scratch)[i].iov_base = static_cast<char*>((*scratch)[i].iov_base) + done;
    (*scratch)[i].iov_len -= done;
  }
  return std::span<const iovec>(*scratch).subspan(i);
}

size_t Total(std::span<const iovec> parts) {
  size_t n = 0;
  for (const iovec& v : parts) n += v.iov_len;
  return n;
}

}  // namespace

void AlignedBuffer::Free::operator()(std::byte* p) const { std::free(p); }

absl::StatusOr<AlignedBuffer> AlignedBuffer::Create(int64_t bytes) {
  AlignedBuffer buffer;
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(bytes));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("disk tier: no memory for ", bytes, " bytes"));
  }
  std::memset(p, 0, static_cast<size_t>(bytes));
  buffer.data_.reset(static_cast<std::byte*>(p));
  buffer.size_ = bytes;
  return buffer;
}

absl::StatusOr<DiskFile> DiskFile::Open(const std::string& path, bool direct) {
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW;
  if (direct) {
    UniqueFd fd(open(path.c_str(), flags | O_DIRECT, 0600));
    if (fd.valid()) return DiskFile(std::move(fd), true);
    if (errno != EINVAL) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
    // EINVAL: this file system does not do O_DIRECT (tmpfs); buffered I/O then.
  }
  UniqueFd fd(open(path.c_str(), flags, 0600));
  if (!fd.valid()) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  return DiskFile(std::move(fd), false);
}

absl::Status DiskFile::ReadAt(int64_t offset, std::span<const iovec> parts) const {
  const size_t want = Total(parts);
  size_t done = 0;
  std::vector<iovec> scratch;
  while (done < want) {
    const std::span<const iovec> rest = Skip(parts, done, &scratch);
    const ssize_t n = preadv(fd_.get(), rest.data(), static_cast<int>(rest.size()),
                             offset + static_cast<int64_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "disk tier: read");
    if (n == 0) return absl::DataLossError("disk tier: read past the end of the file");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status DiskFile::WriteAt(int64_t offset, std::span<const iovec> parts) const {
  const size_t want = Total(parts);
  size_t done = 0;
  std::vector<iovec> scratch;
  while (done < want) {
    const std::span<const iovec> rest = Skip(parts, done, &scratch);
    const ssize_t n = pwritev(fd_.get(), rest.data(), static_cast<int>(rest.size()),
                              offset + static_cast<int64_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::ErrnoToStatus(n < 0 ? errno : EIO, "disk tier: write");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status DiskFile::Sync() const {
  if (fdatasync(fd_.get()) != 0) return absl::ErrnoToStatus(errno, "disk tier: fdatasync");
  return absl::OkStatus();
}

absl::Status DiskFile::Resize(int64_t bytes) const {
  if (ftruncate(fd_.get(), bytes) != 0) return absl::ErrnoToStatus(errno, "disk tier: ftruncate");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> DiskFile::Size() const {
  struct stat st {};
  if (fstat(fd_.get(), &st) != 0) return absl::ErrnoToStatus(errno, "disk tier: fstat");
  return static_cast<int64_t>(st.st_size);
}

absl::Status MakeDirectory(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::ErrnoToStatus(ENOTDIR, absl::StrCat("mkdir ", path));
  }
  if (const size_t slash = path.find_last_of('/'); slash != std::string::npos && slash > 0) {
    if (absl::Status s = MakeDirectory(path.substr(0, slash)); !s.ok()) return s;
  }
  if (mkdir(path.c_str(), 0700) == 0 || errno == EEXIST) return absl::OkStatus();
  return absl::ErrnoToStatus(errno, absl::StrCat("mkdir ", path));
}

}  // namespace kvpool::tier::internal
