#include "daemon/engine/invalidations.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "fmt/format.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::daemon {
namespace {

constexpr std::string_view kHeader = "kvpool invalidations v1";

absl::Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::ErrnoToStatus(n < 0 ? errno : EIO, absl::StrCat("write ", path));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Generations> LoadGenerations(const std::string& path, uint64_t secret_fingerprint) {
  if (access(path.c_str(), F_OK) != 0 && errno == ENOENT) return Generations{};
  std::ifstream in(path);
  if (!in) return absl::DataLossError(absl::StrCat(path, " cannot be read"));
  std::string line;
  std::getline(in, line);
  if (line == fmt::format("{} {:016x}", kHeader, secret_fingerprint)) {
    Generations out;
    uint64_t tag = 0, generation = 0;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      if (!(fields >> std::hex >> tag >> std::dec >> generation)) {
        return absl::DataLossError(absl::StrCat(path, ": a malformed line: ", line));
      }
      out[tag] = generation;
    }
    return out;
  }
  if (line.starts_with(kHeader)) return Generations{};  // another secret's tags
  return absl::DataLossError(absl::StrCat(path, " is not a file of invalidations"));
}

absl::Status SaveGenerations(const std::string& path, uint64_t secret_fingerprint,
                             const Generations& generations) {
  std::string text = fmt::format("{} {:016x}\n", kHeader, secret_fingerprint);
  for (const auto& [tag, generation] : generations) {
    text += fmt::format("{:016x} {}\n", tag, generation);
  }
  const std::string temporary = path + ".tmp";
  {
    UniqueFd fd(
        open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd.valid()) return absl::ErrnoToStatus(errno, absl::StrCat("open ", temporary));
    if (absl::Status s = WriteAll(fd.get(), text, temporary); !s.ok()) return s;
    if (fsync(fd.get()) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", temporary));
  }
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("rename ", temporary));
  }
  // The rename itself survives a crash once the directory is synced.
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  UniqueFd dir_fd(open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.valid()) fsync(dir_fd.get());
  return absl::OkStatus();
}

}  // namespace kvpool::daemon
