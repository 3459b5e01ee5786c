#pragma once

// Test harness for real daemon processes: starts kvpoold (the built binary) in a private runtime
// directory with a given config, and spawns helper processes whose stdout the test reads.
// Processes are spawned with posix_spawn, so a test that already uses gRPC never forks it.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvpool::testing {

// Paths of the built programs (set by CMake; $KVPOOL_TEST_DAEMON replaces kvpoold's).
std::string DaemonBinary();
std::string IntegrationClientBinary();
std::string KvpoolctlBinary();
std::string TrustClientBinary();

class DaemonProcess final {
 public:
  // Starts kvpoold with `config` (textproto; runtime_dir is set to `dir`, a fresh temporary
  // directory when empty) and waits until its sockets accept connections. `binary`: another
  // build's kvpoold (a benchmark's baseline); empty for DaemonBinary().
  // Errors: INTERNAL when it does not come up within 10 s (its exit status in the message).
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Start(const std::string& config,
                                                              std::string dir = "",
                                                              std::string binary = "");
  ~DaemonProcess();  // stops it (SIGTERM) if still running

  // SIGTERM and wait; returns the exit code (-signal when killed).
  int Stop();
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

 private:
  DaemonProcess(std::string dir, pid_t pid) : dir_(std::move(dir)), pid_(pid) {}
  std::string dir_;
  pid_t pid_;
};

struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of its stdout
};

// Spawns `argv` with stdout into a pipe. Errors: INTERNAL.
absl::StatusOr<Child> Spawn(const std::vector<std::string>& argv);
// The next line the child prints (without the newline), waiting at most `timeout`.
// Errors: DEADLINE_EXCEEDED, UNAVAILABLE (it closed stdout first).
absl::StatusOr<std::string> ReadLine(const Child& child, absl::Duration timeout);
// Waits for the child; returns its exit code (-signal when killed). Closes its pipe.
int Wait(Child* child);
// Runs `argv` to completion; returns (exit code, everything it printed on stdout).
std::pair<int, std::string> RunToEnd(const std::vector<std::string>& argv);

// `n` token ids of the tiny models' vocabulary ([0, 8192)), the same for the same seed.
std::vector<int32_t> Prompt(size_t n, uint32_t seed);

}  // namespace kvpool::testing
