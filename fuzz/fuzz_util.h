#pragma once

// Shared by the libFuzzer targets: input bytes as a file for APIs that take a path, a failed
// invariant as a crash libFuzzer records, and quiet logs.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::fuzz {

// Reports `what` and aborts: libFuzzer saves the input that got here.
[[noreturn]] inline void Fail(std::string_view what) {
  std::fprintf(stderr, "fuzz invariant broken: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

inline void Require(bool condition, std::string_view what) {
  if (!condition) Fail(what);
}

inline void RequireOk(const absl::Status& status, std::string_view what) {
  if (!status.ok()) Fail(std::string(what) + ": " + status.ToString());
}

// `bytes` in a memfd, readable through path() (/proc/self/fd/N) for as long as this lives.
class MemFile final {
 public:
  explicit MemFile(std::string_view bytes) : fd_(memfd_create("kvpool-fuzz", MFD_CLOEXEC)) {
    Require(fd_.valid(), "memfd_create");
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = write(fd_.get(), bytes.data() + done, bytes.size() - done);
      Require(n > 0, "write to memfd");
      done += static_cast<size_t>(n);
    }
  }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_.get()); }

 private:
  UniqueFd fd_;
};

// Logs at error and above only: the daemon's info lines on every input would drown the fuzzer.
inline void QuietLogs() { RequireOk(SetLogLevel("error"), "SetLogLevel"); }

}  // namespace kvpool::fuzz
