#include "kvpool/v1/runtime_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"

namespace kvpool::wire {
namespace {

// Owns one descriptor (this file depends on nothing of kvpool's).
class Fd final {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_;
};

std::string Parent(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Opens `path` as a directory without following a final symbolic link.
absl::StatusOr<Fd> OpenDir(const std::string& path) {
  Fd fd(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.valid()) return fd;
  const int err = errno;
  if (err == ENOENT) return absl::NotFoundError(absl::StrFormat("%s does not exist", path));
  if (err == ELOOP || err == ENOTDIR) {
    struct stat st {};
    const bool link = lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
    return absl::FailedPreconditionError(
        absl::StrFormat("%s is %s", path, link ? "a symbolic link" : "not a directory"));
  }
  return absl::InternalError(absl::StrFormat("open %s: %s", path, std::strerror(err)));
}

// Others may create or replace entries in a directory of this mode.
bool SharedWritable(mode_t mode) { return (mode & (S_IWGRP | S_IWOTH)) != 0; }

// A parent directory that anyone else may write to lets them replace `path` itself, unless the
// sticky bit keeps them to their own entries (/tmp).
absl::Status CheckParent(const std::string& path, const std::string& parent) {
  struct stat st {};
  if (stat(parent.c_str(), &st) != 0) {
    return absl::InternalError(absl::StrFormat("stat %s: %s", parent, std::strerror(errno)));
  }
  if (SharedWritable(st.st_mode) && (st.st_mode & S_ISVTX) == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("runtime directory %s is in %s, which others may write to (mode %o, no "
                        "sticky bit)",
                        path, parent, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

absl::Status MakeParents(const std::string& dir) {
  if (dir == "/" || dir == ".") return absl::OkStatus();
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) return absl::OkStatus();
  if (absl::Status s = MakeParents(Parent(dir)); !s.ok()) return s;
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrFormat("mkdir %s: %s", dir, std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareRuntimeDir(const std::string& path, mode_t mode) {
  const std::string parent = Parent(path);
  if (absl::Status s = MakeParents(parent); !s.ok()) return s;
  if (absl::Status s = CheckParent(path, parent); !s.ok()) return s;
  const bool created = mkdir(path.c_str(), mode) == 0;
  if (!created && errno != EEXIST) {
    return absl::InternalError(absl::StrFormat("mkdir %s: %s", path, std::strerror(errno)));
  }
  // From here on only the opened directory is looked at: whatever the path names meanwhile.
  absl::StatusOr<Fd> dir = OpenDir(path);
  if (!dir.ok()) {
    return absl::Status(dir.status().code(),
                        absl::StrFormat("runtime directory: %s", dir.status().message()));
  }
  struct stat st {};
  if (fstat(dir->get(), &st) != 0) {
    return absl::InternalError(absl::StrFormat("fstat %s: %s", path, std::strerror(errno)));
  }
  if (st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("runtime directory %s belongs to uid %d, not to kvpoold's uid %d", path,
                        st.st_uid, geteuid()));
  }
  if (created) {
    // Our own, just made: give it exactly `mode` (mkdir's was narrowed by the umask).
    if (fchmod(dir->get(), mode) != 0) {
      return absl::InternalError(absl::StrFormat("fchmod %s: %s", path, std::strerror(errno)));
    }
    st.st_mode = (st.st_mode & ~07777) | mode;
  }
  if (SharedWritable(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "runtime directory %s may be written by others (mode %o)", path, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

absl::StatusOr<uid_t> TrustedDaemonUid(const std::string& path, std::span<const uid_t> trusted) {
  absl::StatusOr<Fd> dir = OpenDir(path);
  if (absl::IsNotFound(dir.status())) {
    return absl::UnavailableError(absl::StrFormat("no kvpoold runtime directory at %s", path));
  }
  if (!dir.ok()) {
    return absl::PermissionDeniedError(
        absl::StrFormat("not trusting kvpoold's runtime directory: %s", dir.status().message()));
  }
  struct stat st {};
  if (fstat(dir->get(), &st) != 0) {
    return absl::InternalError(absl::StrFormat("fstat %s: %s", path, std::strerror(errno)));
  }
  if (SharedWritable(st.st_mode)) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "not trusting kvpoold's runtime directory %s: others may write to it (mode %o)", path,
        st.st_mode & 07777));
  }
  const uid_t me = geteuid();
  const uid_t owner = st.st_uid;
  if (owner == 0 || owner == me ||
      std::find(trusted.begin(), trusted.end(), owner) != trusted.end()) {
    return owner;
  }
  // Placed by someone trusted: its parent may be written only by root or by us.
  struct stat up {};
  if (stat(Parent(path).c_str(), &up) == 0 && (up.st_uid == 0 || up.st_uid == me) &&
      !SharedWritable(up.st_mode)) {
    return owner;
  }
  return absl::PermissionDeniedError(absl::StrFormat(
      "not trusting kvpoold's runtime directory %s: it belongs to uid %d, which is neither root, "
      "you, nor a uid you trust (ConnectOptions::trusted_daemon_uids), in a directory others may "
      "write to",
      path, owner));
}

}  // namespace kvpool::wire
