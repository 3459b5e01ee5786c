#include "tests/tier/redis_harness.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tier/internal/redis_connection.h"

namespace kvpool::tier::testing {
namespace {

std::string FindProgram(const char* name) {
  for (const char* dir : {"/usr/bin", "/usr/sbin", "/usr/local/bin"}) {
    std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

// fork + exec with the child killed when this process dies. `out_fd` (or /dev/null when -1)
// becomes its stdout and stderr.
pid_t SpawnChild(const std::vector<std::string>& argv, int out_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: async-signal-safe calls only until exec.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  const int null_fd = open("/dev/null", O_RDWR);
  dup2(null_fd, STDIN_FILENO);
  const int out = out_fd >= 0 ? out_fd : null_fd;
  dup2(out, STDOUT_FILENO);
  dup2(out, STDERR_FILENO);
  execv(args[0], args.data());
  _exit(127);
}

void SleepBriefly() { std::this_thread::sleep_for(std::chrono::milliseconds(10)); }

}  // namespace

std::string RedisServerBinary() { return FindProgram("redis-server"); }
std::string RedisCliBinary() { return FindProgram("redis-cli"); }

absl::StatusOr<std::unique_ptr<TempDir>> TempDir::Create(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl =
      absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp", "/", prefix, "-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  return absl::WrapUnique(new TempDir(tmpl));
}

TempDir::~TempDir() {
  std::error_code ignored;  // best effort: a leftover temp dir is not worth failing a test for
  std::filesystem::remove_all(path_, ignored);
}

absl::StatusOr<int> PickFreePort() {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> dist(20000, 54999);
  auto bindable = [](int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    return ok;
  };
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = dist(rng);
    if (bindable(port) && bindable(port + 10000)) return port;
  }
  return absl::InternalError("no free port pair found");
}

absl::StatusOr<std::unique_ptr<RedisServer>> RedisServer::Start(const std::string& dir,
                                                                const Options& options) {
  int port = 0;
  if (!options.unix_socket) {
    absl::StatusOr<int> picked = PickFreePort();
    if (!picked.ok()) return picked.status();
    port = *picked;
  }
  auto server = absl::WrapUnique(new RedisServer(dir, options, port));
  if (options.unix_socket) server->socket_path_ = absl::StrCat(dir, "/redis.sock");
  absl::Status status = server->Launch();
  if (!status.ok()) return status;
  return server;
}

absl::Status RedisServer::Launch() {
  std::vector<std::string> argv = {RedisServerBinary(),
                                   "--port",
                                   absl::StrCat(port_),
                                   "--bind",
                                   "127.0.0.1",
                                   "--dir",
                                   dir_,
                                   "--logfile",
                                   absl::StrCat(dir_, "/redis.log"),
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--daemonize",
                                   "no",
                                   "--protected-mode",
                                   "no"};
  if (options_.unix_socket) {
    argv.insert(argv.end(), {"--unixsocket", socket_path_, "--unixsocketperm", "700"});
  }
  if (options_.cluster) {
    argv.insert(argv.end(), {"--cluster-enabled", "yes", "--cluster-config-file",
                             absl::StrCat(dir_, "/nodes.conf"), "--cluster-node-timeout", "5000"});
  }
  argv.insert(argv.end(), options_.extra_args.begin(), options_.extra_args.end());
  pid_ = SpawnChild(argv, -1);
  if (pid_ < 0) return absl::InternalError("fork failed");
  for (int attempt = 0; attempt < 1000; ++attempt) {
    absl::StatusOr<RedisReply> pong = Command({"PING"});
    if (pong.ok()) return absl::OkStatus();
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("redis-server exited; see ", dir_, "/redis.log"));
    }
    SleepBriefly();
  }
  return absl::InternalError(absl::StrCat("redis-server did not answer PING; see ", dir_));
}

RedisServer::~RedisServer() { Kill(); }

void RedisServer::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

void RedisServer::Pause() {
  if (pid_ > 0) kill(pid_, SIGSTOP);
}

void RedisServer::Resume() {
  if (pid_ > 0) kill(pid_, SIGCONT);
}

absl::Status RedisServer::Restart() {
  Kill();
  return Launch();
}

std::string RedisServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

RedisTierOptions RedisServer::TierOptions() const {
  RedisTierOptions options;
  options.enabled = true;
  if (options_.unix_socket) {
    options.unix_socket = socket_path_;
  } else {
    options.host = "127.0.0.1";
    options.port = port_;
  }
  return options;
}

absl::StatusOr<RedisReply> RedisServer::Command(const std::vector<std::string>& args) const {
  const int64_t deadline = internal::CallDeadline(absl::Seconds(10));
  auto connection =
      options_.unix_socket
          ? internal::RedisConnection::ConnectUnix(socket_path_, absl::Seconds(1), deadline)
          : internal::RedisConnection::ConnectTcp("127.0.0.1", port_, absl::Seconds(1), deadline);
  if (!connection.ok()) return connection.status();
  RedisCommand command{.key_index = -1};
  for (const std::string& a : args) command.args.push_back(a);
  return (*connection)->Call(command, deadline);
}

absl::StatusOr<std::string> RunProgram(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  const pid_t pid = SpawnChild(argv, fds[1]);
  close(fds[1]);
  std::string output;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) output.append(buffer, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(
        absl::StrCat(absl::StrJoin(argv, " "), " failed (status ", status, "): ", output));
  }
  return output;
}

std::vector<std::string> RedisCluster::Seeds() const {
  std::vector<std::string> seeds;
  for (const auto& node : nodes) seeds.push_back(node->address());
  return seeds;
}

absl::Status WaitClusterOk(const RedisCluster& cluster) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    bool all_ok = true;
    for (const auto& node : cluster.nodes) {
      absl::StatusOr<RedisReply> info = node->Command({"CLUSTER", "INFO"});
      all_ok = all_ok && info.ok() &&
               absl::StrContains(absl::string_view((*info)->str, (*info)->len), "cluster_state:ok");
    }
    if (all_ok) return absl::OkStatus();
    SleepBriefly();
  }
  return absl::InternalError("cluster did not reach cluster_state:ok");
}

namespace {

absl::StatusOr<RedisCluster> StartRedisClusterOnce(const std::string& dir, int n) {
  RedisCluster cluster;
  std::vector<std::string> create = {RedisCliBinary(), "--cluster", "create"};
  for (int i = 0; i < n; ++i) {
    const std::string node_dir = absl::StrCat(dir, "/node", i);
    std::filesystem::create_directories(node_dir);
    absl::StatusOr<std::unique_ptr<RedisServer>> node =
        RedisServer::Start(node_dir, {.cluster = true});
    if (!node.ok()) return node.status();
    create.push_back((*node)->address());
    cluster.nodes.push_back(std::move(*node));
  }
  create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
  absl::StatusOr<std::string> out = RunProgram(create);
  if (!out.ok()) return out.status();
  absl::Status ok = WaitClusterOk(cluster);
  if (!ok.ok()) return ok;
  return cluster;
}

}  // namespace

absl::StatusOr<RedisCluster> StartRedisCluster(const std::string& dir, int n) {
  // A port PickFreePort found free can be taken by another test's server before a node binds it
  // (ctest runs tests side by side): the node exits, and the PING that saw it up may have been
  // the other server's. Such a start fails at --cluster create; a fresh set of ports (and
  // directories, clean of the failed nodes' files) is tried again.
  absl::StatusOr<RedisCluster> cluster;
  for (int attempt = 0; attempt < 3; ++attempt) {
    cluster = StartRedisClusterOnce(absl::StrCat(dir, "/try", attempt), n);
    if (cluster.ok()) break;
  }
  return cluster;
}

}  // namespace kvpool::tier::testing
