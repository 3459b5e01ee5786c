#include "tests/integration/harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>

#include "fmt/format.h"

extern char** environ;

namespace kvpool::testing {
namespace {

bool Accepts(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

int ExitCode(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status); }

}  // namespace

std::string DaemonBinary() {
  // Another build's kvpoold (an older main, say: does a test fail there?).
  if (const char* other = std::getenv("KVPOOL_TEST_DAEMON"); other != nullptr && other[0] != 0) {
    return other;
  }
  return KVPOOL_DAEMON_BINARY;
}
std::string IntegrationClientBinary() { return KVPOOL_INTEGRATION_CLIENT_BINARY; }
std::string KvpoolctlBinary() { return KVPOOL_KVPOOLCTL_BINARY; }
std::string TrustClientBinary() { return KVPOOL_TRUST_CLIENT_BINARY; }

absl::StatusOr<Child> Spawn(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (err != 0) {
    close(fds[0]);
    return absl::InternalError(fmt::format("spawn {}: {}", argv[0], std::strerror(err)));
  }
  return Child{pid, fds[0]};
}

absl::StatusOr<std::string> ReadLine(const Child& child, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string line;
  for (;;) {
    pollfd p{child.out, POLLIN, 0};
    const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left <= 0) return absl::DeadlineExceededError("no line in time: " + line);
    if (poll(&p, 1, left) <= 0) continue;
    char c;
    const ssize_t n = read(child.out, &c, 1);
    if (n <= 0) return absl::UnavailableError("stdout closed: " + line);
    if (c == '\n') return line;
    line += c;
  }
}

int Wait(Child* child) {
  int status = 0;
  waitpid(child->pid, &status, 0);
  if (child->out >= 0) close(child->out);
  child->out = -1;
  return ExitCode(status);
}

std::pair<int, std::string> RunToEnd(const std::vector<std::string>& argv) {
  absl::StatusOr<Child> child = Spawn(argv);
  if (!child.ok()) return {-1, child.status().ToString()};
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = read(child->out, buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  return {Wait(&*child), out};
}

namespace {

// Paths the harness made, removed when the test program exits: not when their DaemonProcess goes,
// since a test may start another daemon on the same directory (a restart), and every daemon is
// stopped by then.
void RemoveAtExit(std::string path) {
  static std::mutex mu;
  static std::vector<std::string>* paths = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (paths == nullptr) {
    paths = new std::vector<std::string>();
    std::atexit([] {
      std::error_code ignored;
      for (const std::string& p : *paths) std::filesystem::remove_all(p, ignored);
    });
  }
  paths->push_back(std::move(path));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Start(const std::string& config,
                                                                    std::string dir,
                                                                    std::string binary) {
  if (dir.empty()) {
    char tmpl[] = "/tmp/kvpool-test-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp");
    dir = tmpl;
    RemoveAtExit(dir);
  }
  const std::string config_path = dir + ".textproto";
  RemoveAtExit(config_path);
  std::ofstream(config_path) << config << "\nruntime_dir: \"" << dir << "\"\n";
  absl::StatusOr<Child> child = Spawn(
      {binary.empty() ? DaemonBinary() : binary, "--config=" + config_path, "--log_level=warn"});
  if (!child.ok()) return child.status();
  close(child->out);  // its stdout is not needed (logs go to stderr)
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!Accepts(dir + "/attach.sock") || !Accepts(dir + "/kvpoold.sock")) {
    int status = 0;
    if (waitpid(child->pid, &status, WNOHANG) == child->pid) {
      return absl::InternalError(fmt::format("kvpoold exited with {}", ExitCode(status)));
    }
    if (absl::Now() > deadline) {
      kill(child->pid, SIGKILL);
      waitpid(child->pid, nullptr, 0);
      return absl::InternalError("kvpoold did not come up in 10 s");
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return std::unique_ptr<DaemonProcess>(new DaemonProcess(dir, child->pid));
}

int DaemonProcess::Stop() {
  if (pid_ < 0) return 0;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return ExitCode(status);
}

DaemonProcess::~DaemonProcess() { Stop(); }

std::vector<int32_t> Prompt(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 8192);
  return out;
}

}  // namespace kvpool::testing
